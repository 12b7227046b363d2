from configs.size_220m import *  # noqa: F401,F403

residual = "attnres"
n_blocks = 4                 # the authors' 220M AttnRes run is named block-B4 (blocks of 3 layers)
