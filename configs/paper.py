"""The paper's from-scratch recipe (Sec. 3.1), shared by every paper size: Qwen3 tokenizer, FineWeb-Edu,
AdamW (0.9, 0.95), weight decay 0.1, 500 warmup steps then cosine, 10K steps, 32 x 1024 tokens per step."""
vocab_size = 151936          # Qwen3's vocabulary; shards from `python data.py fineweb --tokenizer=qwen3`
data = "data/fineweb_edu_qwen3"
batch_size = 32
micro_batch_size = 4         # per GPU on 8 GPUs: no gradient accumulation
seq_len = 1024
lr = 6e-4
warmup_steps = 500
max_steps = 10_000
eval_interval = 500
eval_batches = 50
log_interval = 10
ckpt_interval = 1000
compile = True               # per-sublayer graphs: 3 forward + 3 backward for any depth (docs/training.md)
n_blocks = 4                 # attnres / delta_block: the authors' scripts' default (each method's config says
                             # where its own count comes from)
block_split = "ceil"         # the authors' blocks of ceil(L / K) layers; in every paper config K divides L, so
                             # these are also the "even" blocks
