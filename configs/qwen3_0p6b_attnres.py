from configs.size_qwen3_0p6b import *  # noqa: F401,F403

residual = "attnres"
n_blocks = 4                 # the paper does not say; the authors' scripts default to 4 blocks (7 layers each)
