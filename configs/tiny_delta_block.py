from configs.size_tiny import *  # noqa: F401,F403

residual = "delta_block"
out_dir = "out/tiny_delta_block"
