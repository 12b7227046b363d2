from configs.size_tiny import *  # noqa: F401,F403

residual = "full_attnres"
out_dir = "out/tiny_full_attnres"
