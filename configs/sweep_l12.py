"""The sweep's model (experiments/plan.py): 12 layers, so Table 4's block counts 1, 2, 4, 6, 12 are the paper's (its
220M model has L = 12), at a width that trains several hundred steps a minute on one CPU core. Byte-level
Shakespeare; every run of the sweep overrides only the method and its routing options, the seed and the out_dir."""
vocab_size = 257             # data.ByteTokenizer: 256 bytes + end of text
d_model = 64
n_layers = 12
n_heads = 4
n_kv_heads = 2
head_dim = 16
d_ff = 192
n_blocks = 4                 # attnres and Table 1's delta_block: blocks of 3 layers
block_split = "even"         # the same blocks as the authors' ceil(L / K) split whenever K divides 12
data = "shakespeare"
batch_size = 16
micro_batch_size = 16
seq_len = 64
lr = 3e-3
warmup_steps = 50
max_steps = 800
eval_interval = 100          # 8 validation points per run
eval_batches = 16            # the same 16 x 16 x 64 = 16K held-out tokens every time
log_interval = 25
keep_checkpoints = 1
