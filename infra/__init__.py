"""What a run needs besides the method: configs, checkpoints, distributed plumbing, data shards and
tokenizers, logging, the Hugging Face and lm-eval bridges. Skip it to learn the method (router.py,
model.py, depth_kernels/); nothing here imports a top-level script."""
