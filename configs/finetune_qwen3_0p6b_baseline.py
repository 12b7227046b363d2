"""Table 5's "Baseline FT": the released Qwen3-0.6B fine-tuned with its ordinary residual stream, lr 5e-5.

    python finetune.py configs/finetune_qwen3_0p6b_baseline.py --init_from=checkpoints/Qwen3-0.6B
    python finetune.py export out/ft_qwen3_0p6b_baseline/ckpt_0020000.pt out/qwen3_0p6b_ft_hf \
        --source=checkpoints/Qwen3-0.6B                                  # back to a Hugging Face folder
"""
from configs.finetune_qwen3_0p6b import *  # noqa: F401,F403

residual = "baseline"
out_dir = "out/ft_qwen3_0p6b_baseline"
