from configs.size_533m import *  # noqa: F401,F403

residual = "attnres"
n_blocks = 4                 # the paper does not say; the authors' scripts default to 4 blocks (6 layers each)
