from configs.size_220m import *  # noqa: F401,F403

residual = "baseline"
