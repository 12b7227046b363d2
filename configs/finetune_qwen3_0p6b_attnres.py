"""Table 5's AttnRes fine-tune of the released Qwen3-0.6B: replacement routing (Kimi's Block AttnRes) over e,
one sum per finished block and the current partial, a block per layer, router lr 5e-3.

    python finetune.py configs/finetune_qwen3_0p6b_attnres.py --init_from=checkpoints/Qwen3-0.6B
"""
from configs.finetune_qwen3_0p6b import *  # noqa: F401,F403

residual = "attnres"
n_layers = 28                # must match the checkpoint; set so that n_blocks = 28 validates
n_blocks = 28                # Table 2's N = 28 for AttnRes at the Qwen3-0.6B architecture, as
                             # configs/qwen3_0p6b_attnres.py (the authors' run names: block-N28-...): one
                             # reading; the authors' fine-tuning script defaults to 4 blocks (--n_blocks=4)
# router_lr_scale = 100 (configs/finetune_qwen3_0p6b.py): routers at 5e-5 x 100 = 5e-3, Table 5's router lr.
# Zero queries, as the paper states: the replacement read starts uniform (docs/method.md, "Correction 2"). The
# authors' fine-tuning script draws them at N(0, 0.02) instead: --query_init_std=0.02.
out_dir = "out/ft_qwen3_0p6b_attnres"
