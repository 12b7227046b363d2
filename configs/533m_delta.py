from configs.size_533m import *  # noqa: F401,F403

residual = "delta"
