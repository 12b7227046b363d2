"""What a training run reports: rank 0's console line, its JSONL log (`out_dir/log.jsonl`) and an optional
Weights & Biases run, and the figures they carry besides the loss (MFU, peak memory)."""
from __future__ import annotations

import json
import os
import resource

import torch

from infra import cli
from infra.config import TrainConfig
from model import ModelConfig


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token for MFU, the PaLM / nanoGPT convention: 6 per weight of every matmul
    (forward 2, backward 4; the embedding lookup is free, the LM head is not) plus 12 * L * H * hd * T for
    attention scores and values. Norms and depth routing (O(N d) per sublayer) are not counted."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)   # q, o; k, v
    mlp = 3 * cfg.d_model * cfg.d_ff
    matmul_weights = cfg.n_layers * (attn + mlp) + cfg.d_model * cfg.vocab_size
    return 6 * matmul_weights + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux -> GB


class Logger:
    """Rank 0's console line, JSONL log and optional wandb run; other ranks log nothing."""

    def __init__(self, cfg: TrainConfig, enabled: bool, config: dict):
        self.enabled, self.wandb = enabled, None
        if not enabled:
            return
        os.makedirs(cfg.out_dir, exist_ok=True)
        self.file = open(os.path.join(cfg.out_dir, "log.jsonl"), "a")
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                raise cli.MissingPackageError("wandb=True but wandb is not installed: pip install wandb, or drop "
                                              "--wandb") from None
            self.wandb = wandb.init(project=cfg.wandb_project, config=config, dir=cfg.out_dir)

    def __call__(self, entry: dict, line: str | None = None) -> None:
        if not self.enabled:
            return
        if line:
            print(line, flush=True)
        self.file.write(json.dumps(entry) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(entry, step=entry["step"])

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()
