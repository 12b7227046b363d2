from configs.size_qwen3_0p6b import *  # noqa: F401,F403

residual = "delta_block"
n_blocks = 28                # Table 2: Delta Block with N = 28, a block per layer
