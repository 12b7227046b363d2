from configs.size_tiny import *  # noqa: F401,F403

residual = "baseline"
out_dir = "out/tiny_baseline"
