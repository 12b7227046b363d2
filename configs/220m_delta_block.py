from configs.size_220m import *  # noqa: F401,F403

residual = "delta_block"
n_blocks = 2                 # inferred, not stated: Table 1's Delta Block at 220M (37.08) matches Table 4's
                             # B = 2 (blocks of 6 layers), a perplexity of another table's run
