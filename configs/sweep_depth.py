"""The depth sweep's model (python -m experiments.sweep --depth): the sweep's miniature model
(configs/sweep_l12.py) at the depth of the paper's 1044M model, 36 layers, narrowed to d = 32 so that baseline,
attnres, delta_block and delta at 36 and 12 layers train in minutes a run on one CPU core (the reference path's
fine-grained delta stacks up to 73 sources per sublayer: 1.5 s a step at 36 layers, 15-40 minutes a run;
experiments/plan.py sets the seeds). The 12-layer runs override n_layers only."""
from configs.sweep_l12 import *  # noqa: F401,F403

d_model = 32
n_layers = 36
head_dim = 8                 # 4 heads of 8, 2 KV heads
d_ff = 96
n_blocks = 4                 # attnres and delta_block: the authors' default; blocks of 9 layers (3 at L = 12)
block_split = "even"         # the same blocks as the authors' ceil(L / K) split, since 4 divides 36 and 12
max_steps = 600
eval_interval = 75           # 8 validation points per run
