"""220M (d=768, L=12; head_dim 64, d_ff = 4d)."""
from configs.paper import *  # noqa: F401,F403

d_model = 768
n_layers = 12
n_heads = 12
n_kv_heads = 4
head_dim = 64
d_ff = 3072
n_blocks = 2                 # Table 1's Delta Block at 220M (37.08) is Table 4's B = 2
