"""Train a model from a config file: one process (CPU or one GPU) or torchrun (DDP or FSDP2, any world size).

    python train.py configs/tiny_delta_block.py                            # CPU or one GPU
    python train.py configs/tiny_delta_block.py --max_steps=50 --residual=delta
    python train.py configs/tiny_delta_block.py --resume                   # continue from out_dir exactly
    torchrun --nproc_per_node=8 train.py configs/1044m_delta_block.py      # 8 GPUs, DDP
    torchrun --nproc_per_node=8 train.py configs/qwen3_8b_delta_block.py --parallel=fsdp --activation_checkpointing

A config file assigns fields of ModelConfig (model.py) or TrainConfig (config.py), checked before anything
is built. The global batch (`batch_size` sequences per optimizer step) is fixed by the config; each rank runs
micro-batches of `micro_batch_size` (by default batch_size / world size), and gradient accumulation is
batch_size / (micro_batch_size x world size).

A run is never lost silently: a step whose loss or gradient norm is not finite is skipped and logged, and
`max_bad_steps` of them in a row stop the run, naming its newest checkpoint (only finite weights are ever
saved); Ctrl-C or SIGTERM saves a checkpoint at the end of the current step, on every rank at the same step,
and stops; checkpoints are also written every `ckpt_interval` steps and every `ckpt_minutes`; the run holds a
lock on out_dir; `--resume` continues from the newest intact checkpoint. distributed.py holds the process
group and parallel wrapping, checkpoint.py the checkpoint formats.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from dataclasses import asdict

import torch
import torch.nn as nn
import torch.nn.functional as F

from infra import checkpoint
from infra import cli
from infra import corpus
from infra import distributed
from infra import files
from infra import runlog
from infra import shards
from infra.config import TrainConfig, load_config
from model import Model, ModelConfig

OUT_DIR_LOCK = "run.lock"


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


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)                                                     # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model: nn.Module, loader: shards.ShardLoader, n_batches: int, device: torch.device,
             precision: str = "auto") -> float:
    """Mean token loss over the first n_batches of the held-out split (the same batches every time),
    averaged over ranks when a process group is running (every rank must call it)."""
    model.eval()
    loader.reset()
    n_batches = max(1, min(n_batches, loader.batches_per_epoch))
    total = torch.zeros((), device=device)
    for _ in range(n_batches):
        x, y = (t.to(device) for t in loader.next_batch())
        with distributed.autocast(device, precision):
            total += loss_fn(model, x, y).detach()
    model.train()
    total = distributed.all_reduce(total) / (loader.world_size * n_batches)
    return total.item()


def batch_split(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """(micro-batch per rank, gradient accumulation steps) on world_size processes, or a clear error."""
    if cfg.parallel == "fsdp" and world_size == 1:
        raise ValueError("parallel='fsdp' on a single process shards nothing: launch with "
                         "`torchrun --nproc_per_node=N train.py ...` (N >= 2) or set parallel='ddp'")
    if not cfg.micro_batch_size:
        if cfg.batch_size % world_size:
            raise ValueError(f"batch_size={cfg.batch_size} does not split over {world_size} processes: launch a "
                             f"number of processes that divides it, or set micro_batch_size")
        return cfg.batch_size // world_size, 1
    per_micro_step = cfg.micro_batch_size * world_size
    if cfg.batch_size % per_micro_step:
        raise ValueError(f"batch_size={cfg.batch_size} is not a multiple of micro_batch_size={cfg.micro_batch_size} "
                         f"x world_size={world_size} = {per_micro_step}: change micro_batch_size or the number of "
                         f"processes so that it divides the global batch")
    return cfg.micro_batch_size, cfg.batch_size // per_micro_step


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


def train(model_cfg: ModelConfig, cfg: TrainConfig, model: Model | None = None,
          groups: list[dict] | None = None) -> dict:
    """Run training on this process's share; returns {"losses": [...], "val_loss", "val_ppl", "step",
    "skipped_steps", "stopped_by"} on every rank (losses averaged over ranks; stopped_by: the signal number
    when SIGINT/SIGTERM stopped the run, which then saves and skips the final evaluation, else None).

    model: start from this model (e.g. a converted pretrained one) instead of a fresh Model(model_cfg).
    groups: optimizer parameter groups; a group's "lr_scale" multiplies the scheduled learning rate.
    """
    ctx = distributed.setup(cfg.device, cfg.dist_timeout_s)
    try:
        with contextlib.ExitStack() as held:  # the out_dir lock, released however the run ends
            return _Run(model_cfg, cfg, ctx, model, groups, held).run()
    except RuntimeError as e:  # what a collective raises when another rank never comes, or has ended
        reason = str(e).splitlines()[0]
        if ctx.world_size > 1 and "timed out" in reason.lower():
            raise TimeoutError(f"rank {ctx.rank} waited more than dist_timeout_s={cfg.dist_timeout_s:g}s for the "
                               f"other ranks: one of them hung or died ({reason})") from e
        if ctx.world_size > 1 and "closed by peer" in reason.lower():
            raise ConnectionError(f"rank {ctx.rank} lost another rank, which has ended ({reason})") from e
        raise
    finally:
        distributed.teardown(ctx)


class _Run:
    """One training run on this process: __init__ builds it (lock, resume point, data, model), run() runs
    the steps and the final evaluation."""

    def __init__(self, model_cfg: ModelConfig, cfg: TrainConfig, ctx: distributed.Context, model: Model | None,
                 groups: list[dict] | None, held: contextlib.ExitStack):
        self.model_cfg, self.cfg, self.ctx, self.device = model_cfg, cfg, ctx, ctx.device
        self.micro, self.grad_accum = batch_split(cfg, ctx.world_size)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        distributed.on_main(ctx, lambda: held.enter_context(files.locked(
            os.path.join(cfg.out_dir, OUT_DIR_LOCK), wait=False, holder_of=f"out_dir {cfg.out_dir}")))
        resume = self._resume_point()
        self.train_loader, self.val_loader = self._open_data(resume)
        self.model, self.optimizer, n_params, n_routers = self._build(model, groups)
        self.step, self.saved_at = 0, None
        self.last_saved: str | None = None  # the newest checkpoint this run wrote (all finite) or resumed from
        if resume is not None:
            checkpoint.restore(self.model, self.optimizer, resume["path"])
            self.train_loader.load_state_dict(resume["loader"])
            self.step = self.saved_at = resume["step"]
            self.last_saved = resume["path"]
        self.losses: list[float] = []
        self.bad_in_a_row = self.skipped = 0
        self.log = runlog.Logger(cfg, ctx.is_main, {"model": asdict(model_cfg), "train": asdict(cfg)})
        if ctx.is_main:
            print(f"model: {json.dumps(asdict(model_cfg))}\ntrain: {json.dumps(asdict(cfg))}")
            print(f"{n_params / 1e6:.2f}M parameters, {n_routers} routers, {ctx.world_size} x {self.device} "
                  f"({cfg.parallel if ctx.world_size > 1 else 'single process'}), micro-batch {self.micro}, "
                  f"grad accumulation {self.grad_accum}"
                  + (f", resumed at step {self.step} from {self.last_saved}" if resume else ""), flush=True)

    def _resume_point(self) -> dict | None:
        """The newest intact checkpoint's metadata and path with --resume; a fresh run refuses an out_dir that
        holds another run's checkpoints."""
        cfg = self.cfg
        if not cfg.resume:
            existing = checkpoint.checkpoint_paths(cfg.out_dir)
            if existing:
                raise FileExistsError(f"{cfg.out_dir} already holds checkpoints of another run "
                                      f"({os.path.basename(existing[-1])}): pass --resume to continue it, or "
                                      "choose another --out_dir")
            return None
        path, meta = distributed.on_main(self.ctx, lambda: checkpoint.newest_intact(cfg.out_dir, set_aside=True))
        if meta["model_config"] != asdict(self.model_cfg):
            diff = {k for k, v in asdict(self.model_cfg).items() if meta["model_config"].get(k) != v}
            raise ValueError(f"--resume: the model config differs from the checkpoint's in {sorted(diff)}")
        return {**meta, "path": path}

    def _open_data(self, resume: dict | None) -> tuple[shards.ShardLoader, shards.ShardLoader]:
        cfg, ctx = self.cfg, self.ctx
        directory = distributed.on_main(ctx, lambda: corpus.data_dir(cfg.data))  # rank 0 prepares the embedded corpus
        shards.load_meta(directory)  # an unprepared folder fails here, with how to prepare it
        train_loader = shards.ShardLoader(directory, "train", self.micro, cfg.seq_len, rank=ctx.rank,
                                          world_size=ctx.world_size, seed=cfg.seed, step_batch=cfg.batch_size)
        # Validation reads the first eval_batches x batch_size windows in order, whatever the world size.
        val_loader = shards.ShardLoader(directory, "val", self.micro, cfg.seq_len, rank=ctx.rank,
                                        world_size=ctx.world_size, shuffle=False, step_batch=cfg.batch_size)
        if val_loader.info != train_loader.info:
            raise ValueError(f"{directory}: the train shards hold {train_loader.info} tokens but the val shards "
                             f"{val_loader.info}")
        shards.check_vocab(train_loader.info, self.model_cfg.vocab_size)
        if resume is not None and resume.get("data", train_loader.info) != train_loader.info:
            raise ValueError(f"--resume: the checkpoint was trained on {resume['data']} tokens but data={cfg.data} "
                             f"holds {train_loader.info} tokens: resume on the data the run started with")
        return train_loader, val_loader

    def _build(self, model: Model | None, groups: list[dict] | None) -> tuple:
        """Every rank builds the same full model from the same seed; FSDP then keeps only its shard."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        if model is None:
            with torch.device(self.device):
                model = Model(self.model_cfg)
        raw = model.to(self.device)
        names = {id(p): n for n, p in raw.named_parameters()}
        group_spec = groups or param_groups(raw, cfg)
        wrapped = distributed.parallelize(raw, cfg.parallel, self.ctx, compile=cfg.compile,
                                          compile_backend=cfg.compile_backend, precision=cfg.precision,
                                          activation_checkpointing=cfg.activation_checkpointing)
        optimizer = torch.optim.AdamW(_rebind(group_spec, names, raw), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                      fused=self.device.type == "cuda" and cfg.parallel == "ddp")
        return wrapped, optimizer, raw.num_params(), len(raw.routers)

    def run(self) -> dict:
        self.t0 = self.t_log = self.t_saved = time.time()
        self.steps_since_log = 0
        result = {"stop": False, "out_of_time": False}
        with distributed.StopRequest(announce=self.ctx.is_main) as stop:
            while self.step < self.cfg.max_steps and not (result["stop"] or result["out_of_time"]):
                result = self._step(stop)
                self._after_step(result)
            # a rank that got no signal itself stops because another rank did: SIGTERM is what torchrun sends
            return self._finish((stop.signal or signal.SIGTERM) if result["stop"] else None)

    def _step(self, stop: distributed.StopRequest) -> dict:
        """One optimizer step over grad_accum micro-batches, taken only if the loss and the gradient norm are
        finite -> its loss, gradient norm and lr (the same on every rank) and the flags all ranks agree on."""
        cfg, device = self.cfg, self.device
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        loss_sum = torch.zeros((), device=device)
        for micro in range(self.grad_accum):
            x, y = (t.to(device, non_blocking=True) for t in self.train_loader.next_batch())
            with distributed.gradient_sync(self.model, micro == self.grad_accum - 1):
                with distributed.autocast(device, cfg.precision):
                    loss = loss_fn(self.model, x, y)
                (loss / self.grad_accum).backward()
            loss_sum += loss.detach() / self.grad_accum
        # One collective per step: the mean loss over ranks and flags that any one rank may raise, so that
        # every rank stops or saves at the same step (clocks and signals differ between processes).
        now = time.time()
        local = [cfg.time_budget_s > 0 and now - self.t0 >= cfg.time_budget_s, stop.signal is not None,
                 cfg.ckpt_minutes > 0 and now - self.t_saved >= 60 * cfg.ckpt_minutes]
        stats = distributed.all_reduce(torch.cat([loss_sum[None], torch.tensor(local, device=device).float()]))
        mean_loss = stats[0].item() / self.ctx.world_size
        result = dict(zip(("out_of_time", "stop", "save_due"), (v > 0 for v in stats[1:].tolist())))
        grad_norm = distributed.clip_grad_norm(self.model, cfg.grad_clip).item()
        if math.isfinite(mean_loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            self.bad_in_a_row = 0
        else:
            self.bad_in_a_row += 1
            self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.steps_since_log += 1
        self.losses.append(mean_loss)
        return {**result, "loss": mean_loss, "grad_norm": grad_norm, "lr": lr}

    def _after_step(self, r: dict) -> None:
        """Log, evaluate and save as the intervals say; stop after max_bad_steps non-finite steps in a row."""
        cfg, step = self.cfg, self.step
        stopping = r["stop"] or r["out_of_time"]
        if self.bad_in_a_row:
            self._skipped_step(r)
        if step % cfg.log_interval == 0 or step == cfg.max_steps or stopping:
            self._log_step(r)
        t_pause = time.time()  # evaluation and saving do not count against tokens/s
        if step % cfg.eval_interval == 0 and step < cfg.max_steps and not stopping:
            val = evaluate(self.model, self.val_loader, cfg.eval_batches * self.grad_accum, self.device,
                           cfg.precision)
            self.log({"step": step, "val_loss": val, "val_ppl": math.exp(val)},
                     f"step {step:5d} | val loss {val:.4f} | val ppl {math.exp(val):.2f}")
        due = (cfg.ckpt_interval and step % cfg.ckpt_interval == 0) or r["save_due"]
        if due and not stopping and not self.bad_in_a_row:  # mid-streak weights are those before the streak
            self._save()
        self.t_log += time.time() - t_pause
        if r["out_of_time"] and self.ctx.is_main:
            print(f"time budget of {cfg.time_budget_s:.0f}s reached at step {step}")

    def _skipped_step(self, r: dict) -> None:
        self.log({"step": self.step, "skipped": True, "loss": r["loss"], "grad_norm": r["grad_norm"]},
                 f"step {self.step:5d} | skipped: loss {r['loss']:.4f}, grad norm {r['grad_norm']:.3f} "
                 f"({self.bad_in_a_row} in a row, {self.skipped} in all)")
        if self.bad_in_a_row >= self.cfg.max_bad_steps:
            raise FloatingPointError(
                f"{self.bad_in_a_row} steps in a row, up to step {self.step}, had a non-finite loss or gradient "
                f"norm (the last: loss {r['loss']}, grad norm {r['grad_norm']}) and were skipped, so the run "
                f"stopped. The newest finite checkpoint is {self.last_saved or 'none (this run saved none)'}: "
                "continue from it with --resume and a lower lr or grad_clip")

    def _log_step(self, r: dict) -> None:
        cfg, device = self.cfg, self.device
        peak = distributed.all_reduce(torch.tensor(runlog.peak_memory_gb(device), device=device), "max").item()
        dt = time.time() - self.t_log
        tok_per_s = self.steps_since_log * cfg.batch_size * cfg.seq_len / dt
        mfu = tok_per_s * runlog.flops_per_token(self.model_cfg, cfg.seq_len) / (cfg.peak_flops * self.ctx.world_size)
        entry = {"step": self.step, "loss": r["loss"], "lr": r["lr"], "grad_norm": r["grad_norm"],
                 "tok_per_s": tok_per_s, "mfu": mfu, "step_time_s": dt / self.steps_since_log, "peak_mem_gb": peak,
                 "skipped_steps": self.skipped}
        self.log(entry, f"step {self.step:5d} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | grad norm "
                        f"{r['grad_norm']:.3f} | {tok_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}% | "
                        f"{1000 * entry['step_time_s']:.0f} ms/step | peak mem {peak:.2f} GB"
                        + (f" | {self.skipped} skipped" if self.skipped else ""))
        self.t_log, self.steps_since_log = time.time(), 0

    def _save(self) -> None:
        """Collective: a checkpoint of this step (refused if anything is non-finite), then the rotation."""
        cfg = self.cfg
        meta = {"loader": self.train_loader.state_dict(), "step": self.step, "model_config": asdict(self.model_cfg),
                "train_config": asdict(cfg), "data": self.train_loader.info}
        try:
            self.last_saved = checkpoint.save(self.ctx, self.model, self.optimizer,
                                              os.path.join(cfg.out_dir, f"ckpt_{self.step:07d}"), meta)
        except FloatingPointError as e:
            raise FloatingPointError(f"step {self.step}: {e}; the newest finite checkpoint is "
                                     f"{self.last_saved or 'none (this run saved none)'}") from None
        if self.ctx.is_main:
            for old in checkpoint.checkpoint_paths(cfg.out_dir)[:-cfg.keep_checkpoints]:
                checkpoint.remove(old)
        distributed.barrier(self.ctx)
        self.saved_at, self.t_saved = self.step, time.time()

    def _finish(self, stopped_by: int | None) -> dict:
        """Stopped by a signal: save and report. Otherwise: the final evaluation, then save."""
        val = None
        if stopped_by is not None:
            if self.saved_at != self.step:
                self._save()
            self.log({"step": self.step, "stopped_by": signal.Signals(stopped_by).name, "checkpoint": self.last_saved},
                     f"step {self.step:5d} | stopped by {signal.Signals(stopped_by).name}: saved {self.last_saved}; "
                     "continue with --resume")
        else:
            val = evaluate(self.model, self.val_loader, self.cfg.eval_batches * self.grad_accum, self.device,
                           self.cfg.precision)
            elapsed = time.time() - self.t0
            self.log({"step": self.step, "val_loss": val, "val_ppl": math.exp(val), "final": True, "wall_s": elapsed},
                     f"final | step {self.step} | val loss {val:.4f} | val ppl {math.exp(val):.2f} | {elapsed:.0f}s")
            if self.saved_at != self.step:
                self._save()
        self.log.close()
        return {"losses": self.losses, "val_loss": val, "val_ppl": None if val is None else math.exp(val),
                "step": self.step, "skipped_steps": self.skipped, "stopped_by": stopped_by}


def main(argv: list[str]) -> dict:
    model_cfg, train_cfg = load_config(argv)
    return train(model_cfg, train_cfg)


def exit_status(result: dict) -> int:
    """A finished run exits with 0; one stopped by a signal with 128 + the signal's number, as shells do."""
    return 128 + result["stopped_by"] if result.get("stopped_by") else 0


if __name__ == "__main__":
    cli.run(lambda argv: exit_status(main(argv)))
