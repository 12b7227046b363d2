from configs.size_tiny import *  # noqa: F401,F403

residual = "delta"
out_dir = "out/tiny_delta"
