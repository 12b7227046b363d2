"""Train a model from a config file.

    python train.py configs/tiny_delta_block.py                 # CPU or one GPU
    python train.py configs/tiny_delta_block.py --max_steps=50 --residual=delta
    python train.py configs/tiny_delta_block.py --resume        # continue from out_dir/ckpt.pt exactly

A config file is plain Python that assigns fields of ModelConfig (model.py) or TrainConfig (below); every
other field keeps its default. `--key=value` overrides are type-checked, and an unknown key is an error.
"""
from __future__ import annotations

import ast
import difflib
import json
import math
import os
import resource
import runpy
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F

import data
from model import Model, ModelConfig


@dataclass
class TrainConfig:
    data: str = "shakespeare"       # "shakespeare" (embedded corpus, prepared on first use) or a shard directory
    out_dir: str = "out/run"
    seed: int = 0
    batch_size: int = 16            # sequences per optimizer step
    micro_batch_size: int = 16      # sequences per forward; gradient accumulation = batch_size / this
    seq_len: int = 128
    max_steps: int = 1000
    lr: float = 6e-4
    min_lr_ratio: float = 0.1       # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1       # on matrices only (embedding included), never on norms or routers
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0          # 0 disables clipping
    eval_interval: int = 200
    eval_batches: int = 20
    log_interval: int = 20
    ckpt_interval: int = 0          # 0: save only at the end
    keep_checkpoints: int = 2       # keep the newest K checkpoints in out_dir
    time_budget_s: float = 0.0      # > 0: stop at this wall-clock budget, then evaluate
    device: str = "auto"            # "auto" | "cpu" | "cuda"
    resume: bool = False            # continue from the newest checkpoint in out_dir


# ----------------------------------------------------------------------------------------------- config

def _parse_value(key: str, text: str, typ: type):
    if typ is bool:
        if text.lower() in ("1", "true", "yes", ""):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"--{key}={text}: expected a bool (true/false)")
    if typ is str:
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"--{key}={text}: expected {typ.__name__}") from None
    return value


def _check_type(key: str, value, typ: type):
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise TypeError(f"config key {key!r} = {value!r}: expected {typ.__name__}, got {type(value).__name__}")
    return value


def load_config(argv: list[str], classes: tuple = (ModelConfig, None)) -> tuple:
    """argv: [CONFIG.py] [--key=value ...] -> one instance per dataclass in `classes` (default: ModelConfig,
    TrainConfig), each field type-checked; a key that belongs to none of them is an error."""
    classes = tuple(TrainConfig if c is None else c for c in classes)
    owner = {f.name: cls for cls in classes for f in fields(cls)}
    names = {"int": int, "float": float, "bool": bool, "str": str}
    types = {f.name: names.get(f.type, f.type) for cls in classes for f in fields(cls)}
    values: dict[str, object] = {}
    args = list(argv)
    if args and not args[0].startswith("--"):
        path = args.pop(0)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {path}")
        namespace = runpy.run_path(path)
        values.update({k: v for k, v in namespace.items()
                       if not k.startswith("_") and not callable(v) and not isinstance(v, type(os))})
    for arg in args:
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}: use --key=value")
        key, _, text = arg[2:].partition("=")
        if key not in types:
            raise _unknown(key, types)
        values[key] = _parse_value(key, text, types[key])
    for key in values:
        if key not in types:
            raise _unknown(key, types)
    values = {k: _check_type(k, v, types[k]) for k, v in values.items()}
    return tuple(cls(**{k: v for k, v in values.items() if owner[k] is cls}) for cls in classes)


def _unknown(key: str, types: dict) -> KeyError:
    close = difflib.get_close_matches(key, types, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return KeyError(f"unknown config key {key!r}{hint}")


# ------------------------------------------------------------------------------------------- training

def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def param_groups(model: Model, cfg: TrainConfig) -> list[dict]:
    """Weight decay on matrices only; norms, router queries/norms/gates are 1-D or scalar."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def data_dir(cfg: TrainConfig) -> str:
    if cfg.data == "shakespeare":
        path = os.path.join("data", "shakespeare")
        data.prepare_shakespeare(path)
        return path
    return cfg.data


def loss_fn(model: Model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)                                                     # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model: Model, loader: data.ShardLoader, n_batches: int, autocast, device) -> float:
    """Mean token loss over the first n_batches of the held-out split (the same batches every time)."""
    model.eval()
    loader.reset()
    n_batches = max(1, min(n_batches, loader.batches_per_epoch))
    total = 0.0
    for _ in range(n_batches):
        x, y = (t.to(device) for t in loader.next_batch())
        with autocast:
            total += loss_fn(model, x, y).item()
    model.train()
    return total / n_batches


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux -> GB


def save_checkpoint(path: str, state: dict) -> None:
    """Write to a temporary file, then rename: a crash mid-write never corrupts the previous checkpoint."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def checkpoint_paths(out_dir: str) -> list[str]:
    """The checkpoints in out_dir, oldest first (names carry the zero-padded step)."""
    if not os.path.isdir(out_dir):
        return []
    names = sorted(n for n in os.listdir(out_dir) if n.startswith("ckpt_") and n.endswith(".pt"))
    return [os.path.join(out_dir, n) for n in names]


def load_checkpoint(path: str, map_location="cpu") -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    return torch.load(path, map_location=map_location, weights_only=False)


def train(model_cfg: ModelConfig, cfg: TrainConfig, model: Model | None = None,
          groups: list[dict] | None = None) -> dict:
    """Run training; returns {"losses": [...], "val_loss", "val_ppl", "step"}.

    model: start from this model (e.g. a converted pretrained one) instead of a fresh Model(model_cfg).
    groups: optimizer parameter groups; a group's "lr_scale" multiplies the scheduled learning rate.
    """
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    if cfg.keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints={cfg.keep_checkpoints}: at least 1 is needed to resume")
    if cfg.batch_size % cfg.micro_batch_size:
        raise ValueError(f"batch_size={cfg.batch_size} is not a multiple of micro_batch_size={cfg.micro_batch_size}")
    grad_accum = cfg.batch_size // cfg.micro_batch_size
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    ckpt = None
    if cfg.resume:
        if not checkpoint_paths(cfg.out_dir):
            raise FileNotFoundError(f"--resume: no checkpoint (ckpt_*.pt) in {cfg.out_dir}")
        ckpt = load_checkpoint(checkpoint_paths(cfg.out_dir)[-1])
    if ckpt is not None and ckpt["model_config"] != asdict(model_cfg):
        diff = {k for k, v in asdict(model_cfg).items() if ckpt["model_config"].get(k) != v}
        raise ValueError(f"--resume: the model config differs from the checkpoint's in {sorted(diff)}")

    directory = data_dir(cfg)
    data.check_vocab(data.load_meta(directory), model_cfg.vocab_size)
    train_loader = data.ShardLoader(directory, "train", cfg.micro_batch_size, cfg.seq_len, seed=cfg.seed)
    val_loader = data.ShardLoader(directory, "val", cfg.micro_batch_size, cfg.seq_len, shuffle=False)

    torch.manual_seed(cfg.seed)
    model = (model or Model(model_cfg)).to(device)
    optimizer = torch.optim.AdamW(groups or param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  fused=device.type == "cuda")
    step = 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        train_loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]

    print(f"model: {json.dumps(asdict(model_cfg))}\ntrain: {json.dumps(asdict(cfg))}")
    print(f"{model.num_params() / 1e6:.2f}M parameters, {len(model.routers)} routers, device {device}, "
          f"grad accumulation {grad_accum}" + (f", resumed at step {step}" if ckpt else ""))
    os.makedirs(cfg.out_dir, exist_ok=True)
    log = open(os.path.join(cfg.out_dir, "log.jsonl"), "a")

    def record(entry: dict) -> None:
        log.write(json.dumps(entry) + "\n")
        log.flush()

    def checkpoint() -> None:
        save_checkpoint(os.path.join(cfg.out_dir, f"ckpt_{step:07d}.pt"), {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                    "loader": train_loader.state_dict(), "step": step,
                                    "model_config": asdict(model_cfg), "train_config": asdict(cfg)})
        for old in checkpoint_paths(cfg.out_dir)[:-cfg.keep_checkpoints]:
            os.remove(old)

    losses, t0, t_log, tokens = [], time.time(), time.time(), 0
    while step < cfg.max_steps:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        loss_sum = 0.0
        for _ in range(grad_accum):
            x, y = (t.to(device) for t in train_loader.next_batch())
            with autocast:
                loss = loss_fn(model, x, y)
            (loss / grad_accum).backward()
            loss_sum += loss.item() / grad_accum
            tokens += x.numel()
        if not math.isfinite(loss_sum):
            last = (checkpoint_paths(cfg.out_dir) or ["none"])[-1]
            raise FloatingPointError(f"loss is {loss_sum} at step {step}; the last good checkpoint: {last}")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf")).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        losses.append(loss_sum)

        if step % cfg.log_interval == 0 or step == cfg.max_steps:
            dt = time.time() - t_log
            entry = {"step": step, "loss": loss_sum, "lr": lr, "grad_norm": grad_norm,
                     "tok_per_s": tokens / dt, "peak_mem_gb": peak_memory_gb(device)}
            print(f"step {step:5d} | loss {loss_sum:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
                  f"{entry['tok_per_s']:,.0f} tok/s | peak mem {entry['peak_mem_gb']:.2f} GB")
            record(entry)
            t_log, tokens = time.time(), 0
        out_of_time = cfg.time_budget_s > 0 and time.time() - t0 >= cfg.time_budget_s
        if step % cfg.eval_interval == 0 and step < cfg.max_steps and not out_of_time:
            val = evaluate(model, val_loader, cfg.eval_batches, autocast, device)
            print(f"step {step:5d} | val loss {val:.4f} | val ppl {math.exp(val):.2f}")
            record({"step": step, "val_loss": val, "val_ppl": math.exp(val)})
        if cfg.ckpt_interval and step % cfg.ckpt_interval == 0:
            checkpoint()
        if out_of_time:
            print(f"time budget of {cfg.time_budget_s:.0f}s reached at step {step}")
            break

    val = evaluate(model, val_loader, cfg.eval_batches, autocast, device)
    elapsed = time.time() - t0
    print(f"final | step {step} | val loss {val:.4f} | val ppl {math.exp(val):.2f} | {elapsed:.0f}s")
    record({"step": step, "val_loss": val, "val_ppl": math.exp(val), "final": True, "wall_s": elapsed})
    checkpoint()
    log.close()
    return {"losses": losses, "val_loss": val, "val_ppl": math.exp(val), "step": step}


def main(argv: list[str]) -> dict:
    model_cfg, train_cfg = load_config(argv)
    return train(model_cfg, train_cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
