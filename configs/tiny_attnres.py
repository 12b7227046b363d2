from configs.size_tiny import *  # noqa: F401,F403

residual = "attnres"
out_dir = "out/tiny_attnres"
