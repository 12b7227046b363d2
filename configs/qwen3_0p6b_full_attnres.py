from configs.size_qwen3_0p6b import *  # noqa: F401,F403

residual = "full_attnres"
