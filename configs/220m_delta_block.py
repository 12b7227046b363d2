from configs.size_220m import *  # noqa: F401,F403

residual = "delta_block"
n_blocks = 2                 # Table 1's Delta Block at 220M (37.08) is Table 4's B = 2 (blocks of 6 layers)
