"""533M (d=1024, L=24; head_dim 64, d_ff = 4d)."""
from configs.paper import *  # noqa: F401,F403

d_model = 1024
n_layers = 24
n_heads = 16
n_kv_heads = 8
head_dim = 64
d_ff = 4096
