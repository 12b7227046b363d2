from configs.size_qwen3_0p6b import *  # noqa: F401,F403

residual = "attnres"
n_blocks = 28                # Table 2: AttnRes at N = 28 for the Qwen3-0.6B architecture, a block per layer
                             # (the authors' run names say the same: block-N28-...)
