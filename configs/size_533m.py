"""533M (d=1024, L=24; head_dim 64, d_ff = 4d)."""
from configs.paper import *  # noqa: F401,F403

# The paper gives d and L (and the Qwen3 architectures' own head layout); n_heads, n_kv_heads and d_ff here
# are inferred: chosen so the parameter count matches the paper's label (tests/test_model.py checks it).
d_model = 1024
n_layers = 24
n_heads = 16
n_kv_heads = 8
head_dim = 64
d_ff = 4096
