from configs.size_1044m import *  # noqa: F401,F403

residual = "delta"
