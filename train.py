"""Train a model from a config file: one process (CPU or one GPU) or torchrun (DDP or FSDP2, any world size).

    python train.py configs/tiny_delta_block.py                            # CPU or one GPU
    python train.py configs/tiny_delta_block.py --max_steps=50 --residual=delta
    python train.py configs/tiny_delta_block.py --resume                   # continue from out_dir exactly
    torchrun --nproc_per_node=8 train.py configs/1044m_delta_block.py      # 8 GPUs, DDP
    torchrun --nproc_per_node=8 train.py configs/qwen3_8b_delta_block.py --parallel=fsdp --activation_checkpointing

A config file is plain Python that assigns fields of ModelConfig (model.py) or TrainConfig (below); every
other field keeps its default. `--key=value` overrides are type-checked, and an unknown key is an error.
The global batch (`batch_size` sequences per optimizer step) is fixed by the config; each rank runs
micro-batches of `micro_batch_size`, and gradient accumulation is batch_size / (micro_batch_size x world size).
distributed.py holds the process group, DDP/FSDP2 wrapping, compilation and checkpoint formats.
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
import torch.nn as nn
import torch.nn.functional as F

import data
import distributed
from distributed import checkpoint_paths, load_checkpoint, save_checkpoint  # noqa: F401  (public API)
from model import Model, ModelConfig


@dataclass
class TrainConfig:
    data: str = "shakespeare"       # "shakespeare" (embedded corpus, prepared on first use) or a shard directory
    out_dir: str = "out/run"
    seed: int = 0
    batch_size: int = 16            # sequences per optimizer step, over all ranks
    micro_batch_size: int = 16      # sequences per forward on one rank
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
    eval_batches: int = 20          # validation batches of batch_size sequences: the same windows every time
    log_interval: int = 20
    ckpt_interval: int = 0          # 0: save only at the end
    keep_checkpoints: int = 2       # keep the newest K checkpoints in out_dir
    time_budget_s: float = 0.0      # > 0: stop at this wall-clock budget (all ranks at the same step), then evaluate
    device: str = "auto"            # "auto" | "cpu" | "cuda"
    resume: bool = False            # continue from the newest checkpoint in out_dir
    parallel: str = "ddp"           # "ddp" (replicas) | "fsdp" (FSDP2, sharded checkpoints); one process: plain
    compile: bool = False           # torch.compile each sublayer (distributed.compile_sublayers)
    activation_checkpointing: bool = False  # recompute each sublayer in backward
    peak_flops: float = 989e12      # per device, for MFU: H100 SXM dense bf16
    wandb: bool = False             # also log to Weights & Biases (needs `pip install wandb`)
    wandb_project: str = "delta-attnres"


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


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)                                                     # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model: nn.Module, loader: data.ShardLoader, n_batches: int, autocast, device) -> float:
    """Mean token loss over the first n_batches of the held-out split (the same batches every time),
    averaged over ranks when a process group is running (every rank must call it)."""
    model.eval()
    loader.reset()
    n_batches = max(1, min(n_batches, loader.batches_per_epoch))
    total = torch.zeros((), device=device)
    for _ in range(n_batches):
        x, y = (t.to(device) for t in loader.next_batch())
        with autocast:
            total += loss_fn(model, x, y).detach()
    model.train()
    total = distributed.all_reduce(total) / (loader.world_size * n_batches)
    return total.item()


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


def check_config(cfg: TrainConfig, world_size: int) -> int:
    """Clear errors for settings that cannot work; returns the gradient accumulation steps."""
    if cfg.keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints={cfg.keep_checkpoints}: at least 1 is needed to resume")
    if cfg.parallel not in distributed.PARALLEL:
        raise ValueError(f"parallel={cfg.parallel!r}: allowed values are {', '.join(distributed.PARALLEL)}")
    if cfg.parallel == "fsdp" and world_size == 1:
        raise ValueError("parallel='fsdp' on a single process shards nothing: launch with "
                         "`torchrun --nproc_per_node=N train.py ...` (N >= 2) or set parallel='ddp'")
    per_micro_step = cfg.micro_batch_size * world_size
    if cfg.micro_batch_size < 1 or cfg.batch_size % per_micro_step:
        raise ValueError(f"batch_size={cfg.batch_size} is not a multiple of micro_batch_size={cfg.micro_batch_size} "
                         f"x world_size={world_size} = {per_micro_step}: change micro_batch_size or the number of "
                         f"processes so that it divides the global batch")
    return cfg.batch_size // per_micro_step


def _rebind(groups: list[dict], names: dict[int, str], model: nn.Module) -> list[dict]:
    """Optimizer groups over `model`'s current parameters: FSDP replaces parameter objects by sharded ones,
    so groups are carried by parameter name."""
    params = dict(model.named_parameters())
    out = []
    for group in groups:
        if any(id(p) not in names for p in group["params"]):
            raise ValueError("an optimizer group holds a tensor that is not a parameter of the model")
        out.append({**group, "params": [params[names[id(p)]] for p in group["params"]]})
    return out


class _Logger:
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
                raise ImportError("wandb=True but wandb is not installed: pip install wandb, or drop --wandb") from None
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


def train(model_cfg: ModelConfig, cfg: TrainConfig, model: Model | None = None,
          groups: list[dict] | None = None) -> dict:
    """Run training on this process's share; returns {"losses": [...], "val_loss", "val_ppl", "step"} on
    every rank (losses averaged over ranks).

    model: start from this model (e.g. a converted pretrained one) instead of a fresh Model(model_cfg).
    groups: optimizer parameter groups; a group's "lr_scale" multiplies the scheduled learning rate.
    """
    ctx = distributed.setup(cfg.device)
    try:
        return _train(model_cfg, cfg, ctx, model, groups)
    finally:
        distributed.teardown(ctx)


def _train(model_cfg: ModelConfig, cfg: TrainConfig, ctx: distributed.Context, model: Model | None,
           groups: list[dict] | None) -> dict:
    grad_accum = check_config(cfg, ctx.world_size)
    device, world = ctx.device, ctx.world_size
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    resume_from, meta = None, None
    if not cfg.resume and checkpoint_paths(cfg.out_dir):
        raise FileExistsError(f"{cfg.out_dir} already holds checkpoints of another run "
                              f"({os.path.basename(checkpoint_paths(cfg.out_dir)[-1])}): pass --resume to continue "
                              "it, or choose another --out_dir")
    if cfg.resume:
        if not checkpoint_paths(cfg.out_dir):
            raise FileNotFoundError(f"--resume: no checkpoint (ckpt_*.pt or ckpt_*/) in {cfg.out_dir}")
        resume_from = checkpoint_paths(cfg.out_dir)[-1]
        meta = distributed.read_meta(resume_from)
        if meta["model_config"] != asdict(model_cfg):
            diff = {k for k, v in asdict(model_cfg).items() if meta["model_config"].get(k) != v}
            raise ValueError(f"--resume: the model config differs from the checkpoint's in {sorted(diff)}")

    # Rank 0 prepares the embedded corpus; the others wait rather than write the same files at once.
    if ctx.is_main:
        data_dir(cfg)
    distributed.barrier(ctx)
    directory = data_dir(cfg)
    data.check_vocab(data.load_meta(directory), model_cfg.vocab_size)
    train_loader = data.ShardLoader(directory, "train", cfg.micro_batch_size, cfg.seq_len, rank=ctx.rank,
                                    world_size=world, seed=cfg.seed, step_batch=cfg.batch_size)
    # Validation reads the first eval_batches x batch_size windows in order, whatever the world size.
    val_loader = data.ShardLoader(directory, "val", cfg.micro_batch_size, cfg.seq_len, rank=ctx.rank,
                                  world_size=world, shuffle=False, step_batch=cfg.batch_size)
    val_batches = cfg.eval_batches * grad_accum

    # Every rank builds the same full model from the same seed; FSDP then keeps only its shard.
    torch.manual_seed(cfg.seed)
    if model is None:
        with torch.device(device):
            model = Model(model_cfg)
    raw = model.to(device)
    names = {id(p): n for n, p in raw.named_parameters()}
    group_spec = groups or param_groups(raw, cfg)
    model = distributed.parallelize(raw, cfg.parallel, ctx, activation_checkpointing=cfg.activation_checkpointing,
                                    compile=cfg.compile)
    optimizer = torch.optim.AdamW(_rebind(group_spec, names, raw), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  fused=device.type == "cuda" and cfg.parallel == "ddp")
    step, saved_at = 0, None
    if resume_from is not None:
        distributed.load(model, optimizer, resume_from)
        train_loader.load_state_dict(meta["loader"])
        step = saved_at = meta["step"]

    log = _Logger(cfg, ctx.is_main, {"model": asdict(model_cfg), "train": asdict(cfg)})
    if ctx.is_main:
        print(f"model: {json.dumps(asdict(model_cfg))}\ntrain: {json.dumps(asdict(cfg))}")
        print(f"{raw.num_params() / 1e6:.2f}M parameters, {len(raw.routers)} routers, {world} x {device} "
              f"({cfg.parallel if world > 1 else 'single process'}), grad accumulation {grad_accum}"
              + (f", resumed at step {step} from {resume_from}" if resume_from else ""), flush=True)

    def checkpoint() -> None:
        meta = {"loader": train_loader.state_dict(), "step": step, "model_config": asdict(model_cfg),
                "train_config": asdict(cfg)}
        distributed.save(ctx, model, optimizer, os.path.join(cfg.out_dir, f"ckpt_{step:07d}"), meta)
        if ctx.is_main:
            for old in checkpoint_paths(cfg.out_dir)[:-cfg.keep_checkpoints]:
                distributed.remove(old)
        distributed.barrier(ctx)

    step_tokens = cfg.batch_size * cfg.seq_len
    mfu_flops = flops_per_token(model_cfg, cfg.seq_len) / (cfg.peak_flops * world)
    losses, t0, t_log, steps_since_log = [], time.time(), time.time(), 0
    while step < cfg.max_steps:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            x, y = (t.to(device, non_blocking=True) for t in train_loader.next_batch())
            with distributed.gradient_sync(model, micro == grad_accum - 1):
                with autocast:
                    loss = loss_fn(model, x, y)
                (loss / grad_accum).backward()
            loss_sum += loss.detach() / grad_accum
        # One collective per step: the mean loss over ranks, and whether any rank is out of time, so that
        # every rank stops at the same step (clocks differ between processes).
        out_of_time = cfg.time_budget_s > 0 and time.time() - t0 >= cfg.time_budget_s
        stats = distributed.all_reduce(torch.stack([loss_sum, torch.tensor(float(out_of_time), device=device)]))
        mean_loss, out_of_time = stats[0].item() / world, stats[1].item() > 0
        if not math.isfinite(mean_loss):
            optimizer.zero_grad(set_to_none=True)
            last = (checkpoint_paths(cfg.out_dir) or ["none"])[-1]
            raise FloatingPointError(f"loss is {mean_loss} at step {step + 1}; the update was not applied and "
                                     f"no checkpoint was written; the last good checkpoint: {last}")
        grad_norm = distributed.clip_grad_norm(model, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        steps_since_log += 1
        losses.append(mean_loss)

        if step % cfg.log_interval == 0 or step == cfg.max_steps or out_of_time:
            peak = distributed.all_reduce(torch.tensor(peak_memory_gb(device), device=device), "max").item()
            dt = time.time() - t_log
            tok_per_s = steps_since_log * step_tokens / dt
            entry = {"step": step, "loss": mean_loss, "lr": lr, "grad_norm": grad_norm.item(),
                     "tok_per_s": tok_per_s, "mfu": tok_per_s * mfu_flops, "step_time_s": dt / steps_since_log,
                     "peak_mem_gb": peak}
            log(entry, f"step {step:5d} | loss {mean_loss:.4f} | lr {lr:.2e} | grad norm {entry['grad_norm']:.3f} | "
                       f"{tok_per_s:,.0f} tok/s | MFU {100 * entry['mfu']:.1f}% | "
                       f"{1000 * entry['step_time_s']:.0f} ms/step | peak mem {peak:.2f} GB")
            t_log, steps_since_log = time.time(), 0
        t_pause = time.time()  # evaluation and saving do not count against tokens/s
        if step % cfg.eval_interval == 0 and step < cfg.max_steps and not out_of_time:
            val = evaluate(model, val_loader, val_batches, autocast, device)
            log({"step": step, "val_loss": val, "val_ppl": math.exp(val)},
                f"step {step:5d} | val loss {val:.4f} | val ppl {math.exp(val):.2f}")
        if cfg.ckpt_interval and step % cfg.ckpt_interval == 0:
            checkpoint()
            saved_at = step
        t_log += time.time() - t_pause
        if out_of_time:
            if ctx.is_main:
                print(f"time budget of {cfg.time_budget_s:.0f}s reached at step {step}")
            break

    val = evaluate(model, val_loader, val_batches, autocast, device)
    elapsed = time.time() - t0
    log({"step": step, "val_loss": val, "val_ppl": math.exp(val), "final": True, "wall_s": elapsed},
        f"final | step {step} | val loss {val:.4f} | val ppl {math.exp(val):.2f} | {elapsed:.0f}s")
    if saved_at != step:
        checkpoint()
    log.close()
    return {"losses": losses, "val_loss": val, "val_ppl": math.exp(val), "step": step}


def main(argv: list[str]) -> dict:
    model_cfg, train_cfg = load_config(argv)
    return train(model_cfg, train_cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
