"""The Qwen3-0.6B architecture as the paper trained it ("508M"): head_dim = d / heads = 64. The released
Qwen3-0.6B has head_dim 128 (596M); finetune.py reads that from the checkpoint instead."""
from configs.paper import *  # noqa: F401,F403

d_model = 1024
n_layers = 28
n_heads = 16
n_kv_heads = 8
head_dim = 64
d_ff = 3072
batch_size = 64
micro_batch_size = 8
seq_len = 2048
