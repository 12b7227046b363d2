from configs.size_qwen3_8b import *  # noqa: F401,F403

residual = "delta_block"
n_blocks = 4                 # the authors' 8B Delta Block script: --num_blocks 4 (9 layers each)
