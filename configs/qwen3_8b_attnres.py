from configs.size_qwen3_8b import *  # noqa: F401,F403

residual = "attnres"
