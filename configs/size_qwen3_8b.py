"""The Qwen3-8B architecture (7.57B with tied embeddings): 64 x 2048 tokens per step, lr 3e-4."""
from configs.paper import *  # noqa: F401,F403

d_model = 4096
n_layers = 36
n_heads = 32
n_kv_heads = 8
head_dim = 128
d_ff = 12288
batch_size = 64
micro_batch_size = 2         # gradient accumulation 4 on 8 GPUs
seq_len = 2048
lr = 3e-4
parallel = "fsdp"            # FSDP2 per layer, bf16 params / fp32 reduce
activation_checkpointing = True
