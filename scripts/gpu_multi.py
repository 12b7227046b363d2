"""The GPU check's multi-GPU phases (scripts/gpu_check.py runs them with --multi-gpu on 2+ devices): train.py under
torchrun, DDP or FSDP2, on random token shards, its log lines saved as they come."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI_GPU_CONFIG = "configs/1044m_delta_block.py"
MICRO_BATCH = 4                # sequences of 1024 tokens per GPU and step, as meters.bench.TOKENS


def random_shards(folder: str, vocab_size: int, windows: int, seq_len: int = 1024) -> str:
    """A data folder train.py reads: `windows` windows of random tokens per split (uint32 shards for Qwen3's
    151,936-token vocabulary: shards.write_shard takes the width the vocabulary needs) and its meta.json."""
    import numpy as np
    from infra import shards
    from infra.files import write_json
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        tokens = rng.integers(0, vocab_size, windows * seq_len + 1, dtype=np.int64)
        shards.write_shard(os.path.join(folder, f"{split}_000000.bin"), tokens, vocab_size, "random")
    write_json(os.path.join(folder, "meta.json"), {"tokenizer": "random", "vocab_size": vocab_size})
    return folder


def multi_gpu_command(mode: str, n: int, data: str, out_dir: str, steps: int) -> list[str]:
    """train.py on n GPUs for `steps` steps of MICRO_BATCH sequences per GPU, logging every step."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "train.py",
            MULTI_GPU_CONFIG, f"--parallel={mode}", f"--data={data}", f"--out_dir={out_dir}",
            f"--max_steps={steps}", "--log_interval=1", "--eval_interval=1000", "--eval_batches=1",
            f"--batch_size={MICRO_BATCH * n}", f"--micro_batch_size={MICRO_BATCH}", "--ckpt_minutes=0",
            "--keep_checkpoints=1"]


def multi_gpu(mode: str, args: argparse.Namespace, save) -> dict:
    """torchrun train.py in `mode` on every GPU; its log.jsonl entries saved as they come."""
    import torch
    from infra.config import load_config
    n = torch.cuda.device_count()
    folder = os.path.join(args.work, f"multi_gpu_{mode}")
    vocab = load_config([os.path.join(ROOT, MULTI_GPU_CONFIG)])[0].vocab_size
    data = random_shards(os.path.join(folder, "data"), vocab, windows=2 * MICRO_BATCH * n)
    cmd = multi_gpu_command(mode, n, data, os.path.join(folder, "out"), args.multi_steps)
    proc = subprocess.Popen(cmd, cwd=ROOT)          # in this phase's process group: killed with it
    result, log = {"command": " ".join(cmd[2:]), "gpus": n}, os.path.join(folder, "out", "log.jsonl")
    while True:
        rc = proc.poll()
        with open(log if os.path.exists(log) else os.devnull) as f:   # a half-written last line is left out
            result["log"] = [json.loads(line) for line in f if line.endswith("}\n")]
        steps = [e for e in result["log"] if "tok_per_s" in e]
        if steps:
            result |= {"tokens_per_s": steps[-1]["tok_per_s"], "peak_memory_gb": max(e["peak_mem_gb"] for e in steps)}
        save(result | {"returncode": rc})
        if rc is not None:
            break
        time.sleep(5)
    if rc != 0:
        raise SystemExit(f"torchrun train.py --parallel={mode} exited with status {rc}")
    return result | {"returncode": rc}
