"""Table 5's fine-tuning recipe, shared by the baseline and Delta Block fine-tunes: the released Qwen3-0.6B,
FineWeb-Edu, 20K steps of batch 32, 500 warmup steps then cosine, backbone lr 5e-5, routers at 100x.
The architecture is read from the checkpoint's config.json (finetune.py), not from here."""
router_lr_scale = 100.0      # router lr = 5e-5 x 100 = 5e-3 (only routed models have routers)
text = "fineweb"             # FineWeb-Edu sample-10BT, streamed and tokenised with the checkpoint's tokenizer.json
text_max_tokens = 20_100 * 32 * 2048  # the tokens of 20K steps with slack for windows lost at shard ends
text_val_docs = 1000
data = "data/finetune_fineweb_edu_qwen3"

lr = 5e-5
min_lr_ratio = 0.1
warmup_steps = 500
max_steps = 20_000
batch_size = 32
micro_batch_size = 8         # 4 GPUs as in the paper: no accumulation; one GPU accumulates 4 micro-batches
seq_len = 2048               # not stated for the fine-tune; 2048 as in the paper's Qwen3-0.6B-architecture runs
weight_decay = 0.1           # backbone matrices only; routers never decay
eval_interval = 500
eval_batches = 50
log_interval = 10
ckpt_interval = 1000
