"""Train a model from a config file: one process (CPU or one GPU) or torchrun (DDP or FSDP2, any world size).

    python train.py configs/tiny_delta_block.py                            # CPU or one GPU
    python train.py configs/tiny_delta_block.py --max_steps=50 --residual=delta
    python train.py configs/tiny_delta_block.py --resume                   # continue from out_dir exactly
    torchrun --nproc_per_node=8 train.py configs/1044m_delta_block.py      # 8 GPUs, DDP
    torchrun --nproc_per_node=8 train.py configs/qwen3_8b_delta_block.py --parallel=fsdp --activation_checkpointing

A config file assigns fields of ModelConfig (model.py) or TrainConfig (infra/config.py), checked before
anything is built. The global batch (`batch_size` sequences per optimizer step) is fixed by the config; each
rank runs micro-batches of `micro_batch_size` (by default batch_size / world size), and gradient accumulation
is batch_size / (micro_batch_size x world size).

A run is never lost silently: a step whose loss or gradient norm is not finite is skipped and logged, and
`max_bad_steps` of them in a row stop the run, naming its newest checkpoint (only finite weights are ever
saved); Ctrl-C or SIGTERM saves a checkpoint at the end of the current step, on every rank at the same step,
and stops; checkpoints are also written every `ckpt_interval` steps and every `ckpt_minutes`; the run holds a
lock on out_dir; `--resume` continues from the newest intact checkpoint. infra/distributed.py holds the
process group and parallel wrapping, infra/checkpoint.py the checkpoint formats.

The run is `training_loop`, one function to read top to bottom, nanoGPT's way: set-up, then one `while` loop
that checks for the end (final evaluation, or a checkpoint on a stop signal), saves, takes an optimizer step,
logs and evaluates.
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
from infra.config import ConfigError, TrainConfig, command_line
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
    """Weight decay on matrices only (weight_decay_on="matrices": norms and router queries, norms, gates and null
    sources are 1-D), or on every parameter ("all", the authors' code), which pulls norms and routers to 0."""
    decays = (lambda p: True) if cfg.weight_decay_on == "all" else (lambda p: p.dim() >= 2)
    groups = [{"params": [p for p in model.parameters() if decays(p)], "weight_decay": cfg.weight_decay},
              {"params": [p for p in model.parameters() if not decays(p)], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)                                                     # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def forward_backward(model: nn.Module, loader: shards.ShardLoader, grad_accum: int, device: torch.device,
                     precision: str) -> torch.Tensor:
    """An optimizer step's gradients: grad_accum micro-batches forward and backward, the gradients reduced over
    ranks at the last one. Returns the micro-batches' mean loss, a device tensor (read without waiting)."""
    loss_sum = torch.zeros((), device=device)
    for micro_step in range(grad_accum):
        x, y = (t.to(device, non_blocking=True) for t in loader.next_batch())  # (micro, T) each
        with distributed.gradient_sync(model, micro_step == grad_accum - 1):
            with distributed.autocast(device, precision):
                loss = loss_fn(model, x, y)
            (loss / grad_accum).backward()
        loss_sum += loss.detach() / grad_accum
    return loss_sum


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
        raise ConfigError("parallel='fsdp' on a single process shards nothing: launch with "
                          "`torchrun --nproc_per_node=N train.py ...` (N >= 2) or set parallel='ddp'")
    if not cfg.micro_batch_size:
        if cfg.batch_size % world_size:
            raise ConfigError(f"batch_size={cfg.batch_size} does not split over {world_size} processes: launch a "
                              f"number of processes that divides it, or set micro_batch_size")
        return cfg.batch_size // world_size, 1
    per_micro_step = cfg.micro_batch_size * world_size
    if cfg.batch_size % per_micro_step:
        raise ConfigError(f"batch_size={cfg.batch_size} is not a multiple of micro_batch_size={cfg.micro_batch_size} "
                          f"x world_size={world_size} = {per_micro_step}: change micro_batch_size or the number of "
                          f"processes so that it divides the global batch")
    return cfg.micro_batch_size, cfg.batch_size // per_micro_step


class NonFiniteError(cli.UserError, FloatingPointError):
    """The run stopped on non-finite numbers (too high an lr, most often): the message names the checkpoint to
    resume from."""


class RankTimeoutError(cli.RankFailureError, TimeoutError):
    """Under torchrun: a collective waited more than dist_timeout_s for a rank that hung or died."""


class RankLostError(cli.RankFailureError, ConnectionError):
    """Under torchrun: another rank ended while this one waited for it."""


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
            return training_loop(model_cfg, cfg, ctx, model, groups, held)
    except RuntimeError as e:  # what a collective raises when another rank never comes, or has ended
        # torch gives these failures no type of their own: its message is the only way to tell them apart
        reason = str(e).splitlines()[0]
        if ctx.world_size > 1 and "timed out" in reason.lower():
            raise RankTimeoutError(f"rank {ctx.rank} waited more than dist_timeout_s={cfg.dist_timeout_s:g}s for "
                                   f"the other ranks: one of them hung or died ({reason})") from e
        if ctx.world_size > 1 and "closed by peer" in reason.lower():
            raise RankLostError(f"rank {ctx.rank} lost another rank, which has ended ({reason})") from e
        raise
    finally:
        distributed.teardown(ctx)


def training_loop(model_cfg: ModelConfig, cfg: TrainConfig, ctx: distributed.Context, model: Model | None,
                  groups: list[dict] | None, held: contextlib.ExitStack) -> dict:
    """The whole run on this process, top to bottom: set-up, then one `while` loop of optimizer steps with
    logging, evaluation and checkpoints, ending in a final evaluation or, on a stop signal, a checkpoint."""
    device = ctx.device
    micro, grad_accum = batch_split(cfg, ctx.world_size)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    distributed.on_main(ctx, lambda: held.enter_context(files.locked(
        os.path.join(cfg.out_dir, OUT_DIR_LOCK), wait=False, holder_of=f"out_dir {cfg.out_dir}")))
    resume_path, resume = _resume_point(model_cfg, cfg, ctx)
    train_loader, val_loader = _open_data(model_cfg, cfg, ctx, micro, resume)
    raw, model, optimizer = _build(model_cfg, cfg, ctx, model, groups)
    step, saved_at, last_saved = 0, None, None  # last_saved: the newest checkpoint written or resumed (all finite)
    if resume is not None:
        checkpoint.restore(model, optimizer, resume_path)
        train_loader.load_state_dict(resume["loader"])
        step, saved_at, last_saved = resume["step"], resume["step"], resume_path
    log = runlog.Logger(cfg, ctx.is_main, {"model": asdict(model_cfg), "train": asdict(cfg)})
    if ctx.is_main:
        print(f"model: {json.dumps(asdict(model_cfg))}\ntrain: {json.dumps(asdict(cfg))}")
        print(f"{raw.num_params() / 1e6:.2f}M parameters, {len(raw.routers)} routers, {ctx.world_size} x {device} "
              f"({cfg.parallel if ctx.world_size > 1 else 'single process'}), micro-batch {micro}, "
              f"grad accumulation {grad_accum}"
              + (f", resumed at step {step} from {last_saved}" if resume else ""), flush=True)

    losses: list[float] = []                   # the mean loss over ranks of every step this run takes
    bad_in_a_row = skipped = steps_since_log = 0  # non-finite steps: in a row now, and in all this run
    out_of_time = signalled = save_due = False   # the last step's flags, the same on every rank
    val_loss = None                              # the final evaluation's
    gpu_busy = runlog.GpuBusy(device)            # a logged step's GPU time, beside the wall time per step
    t0 = t_log = t_saved = time.time()
    with distributed.StopRequest(announce=ctx.is_main) as stop:
        while True:
            # ---- the end: max_steps or the time budget reached (the final evaluation, then save), or a stop
            # signal on any rank (save, then report); before the first step too, for a run resumed at its end
            finished = out_of_time or step >= cfg.max_steps
            if out_of_time and ctx.is_main:
                print(f"time budget of {cfg.time_budget_s:.0f}s reached at step {step}")
            if finished and not signalled:
                val_loss = evaluate(model, val_loader, cfg.eval_batches * grad_accum, device, cfg.precision)
                elapsed = time.time() - t0
                log({"step": step, "val_loss": val_loss, "val_ppl": math.exp(val_loss), "final": True,
                     "wall_s": elapsed}, f"final | step {step} | val loss {val_loss:.4f} | val ppl "
                                         f"{math.exp(val_loss):.2f} | {elapsed:.0f}s")

            # ---- save: every ckpt_interval steps and ckpt_minutes (save_due), but never in a streak of skipped
            # steps (its weights are those before the streak); and at the end, unless this step is saved already
            interval = bool(losses) and ((cfg.ckpt_interval and step % cfg.ckpt_interval == 0) or save_due)
            if saved_at != step and (finished or signalled or (interval and not bad_in_a_row)):
                t_pause = time.time()  # saving does not count against tokens/s
                meta = {"loader": train_loader.state_dict(), "step": step, "model_config": asdict(model_cfg),
                        "train_config": asdict(cfg), "data": train_loader.info}
                try:  # collective; refused (on every rank) if any weight or optimizer value is not finite
                    last_saved = checkpoint.save(ctx, model, optimizer, os.path.join(cfg.out_dir, f"ckpt_{step:07d}"),
                                                 meta)
                except FloatingPointError as e:
                    raise NonFiniteError(f"step {step}: {e}; the newest finite checkpoint is "
                                         f"{last_saved or 'none (this run saved none)'}") from None
                if ctx.is_main:  # keep the newest keep_checkpoints
                    for old in checkpoint.checkpoint_paths(cfg.out_dir)[:-cfg.keep_checkpoints]:
                        checkpoint.remove(old)
                distributed.barrier(ctx)
                saved_at, t_saved = step, time.time()
                t_log += t_saved - t_pause
            if signalled:
                # a rank that got no signal itself stops because another rank did: SIGTERM is what torchrun sends
                name = signal.Signals(stop.signal or signal.SIGTERM).name
                log({"step": step, "stopped_by": name, "checkpoint": last_saved},
                    f"step {step:5d} | stopped by {name}: saved {last_saved}; continue with --resume")
            if finished or signalled:
                break

            # ---- one optimizer step: grad_accum micro-batches, gradients reduced over ranks at the last one
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            gpu_busy.start(measured=(step + 1) % cfg.log_interval == 0)   # the step that is logged, on a GPU
            loss_sum = forward_backward(model, train_loader, grad_accum, device, cfg.precision)
            grad_norm = distributed.clip_grad_norm(model, cfg.grad_clip)      # the global norm, on the device
            # One collective per step: the mean loss over ranks and the flags that any one rank may raise, so that
            # every rank stops or saves at the same step (clocks and signals differ between processes); then one
            # read from the device, with the norm: the NaN guard below needs both before the optimizer steps.
            now = time.time()
            flags = [cfg.time_budget_s > 0 and now - t0 >= cfg.time_budget_s, stop.signal is not None,
                     cfg.ckpt_minutes > 0 and now - t_saved >= 60 * cfg.ckpt_minutes]
            stats = distributed.all_reduce(torch.cat([loss_sum[None], torch.tensor(flags, device=device).float()]))
            loss_total, *raised, grad_norm = torch.cat([stats, grad_norm.float()[None]]).tolist()
            mean_loss = loss_total / ctx.world_size
            out_of_time, signalled, save_due = (v > 0 for v in raised)
            if math.isfinite(mean_loss) and math.isfinite(grad_norm):
                optimizer.step()
                bad_in_a_row = 0
            else:  # skipped: the weights stay those of the last finite step
                bad_in_a_row += 1
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            gpu_busy.stop()
            step += 1
            steps_since_log += 1
            losses.append(mean_loss)

            # ---- log: a skipped step at once (max_bad_steps in a row stop the run), the others every log_interval
            if bad_in_a_row:
                log({"step": step, "skipped": True, "loss": mean_loss, "grad_norm": grad_norm},
                    f"step {step:5d} | skipped: loss {mean_loss:.4f}, grad norm {grad_norm:.3f} "
                    f"({bad_in_a_row} in a row, {skipped} in all)")
            if bad_in_a_row >= cfg.max_bad_steps:
                raise NonFiniteError(
                    f"{bad_in_a_row} steps in a row, up to step {step}, had a non-finite loss or gradient norm (the "
                    f"last: loss {mean_loss}, grad norm {grad_norm}) and were skipped, so the run stopped. The "
                    f"newest finite checkpoint is {last_saved or 'none (this run saved none)'}: continue from it "
                    "with --resume and a lower lr or grad_clip")
            if step % cfg.log_interval == 0 or step == cfg.max_steps or signalled or out_of_time:
                peak = distributed.all_reduce(torch.tensor(runlog.peak_memory_gb(device), device=device), "max").item()
                dt = time.time() - t_log
                tok_per_s = steps_since_log * cfg.batch_size * cfg.seq_len / dt
                mfu = tok_per_s * runlog.flops_per_token(model_cfg, cfg.seq_len) / (cfg.peak_flops * ctx.world_size)
                ms = f"{1000 * dt / steps_since_log:.0f} ms/step" + ("" if gpu_busy.ms is None else
                                                                     f" (GPU busy {gpu_busy.ms:.0f})")
                eta = runlog.duration((cfg.max_steps - step) * dt / steps_since_log)   # at this interval's pace
                log({"step": step, "loss": mean_loss, "lr": lr, "grad_norm": grad_norm, "tok_per_s": tok_per_s,
                     "mfu": mfu, "step_time_s": dt / steps_since_log, "gpu_busy_s": gpu_busy.ms and gpu_busy.ms / 1e3,
                     "peak_mem_gb": peak, "skipped_steps": skipped},
                    f"step {step:5d}/{cfg.max_steps} | loss {mean_loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f}"
                    f" | {tok_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}% | {ms} | peak mem {peak:.2f} GB | ETA {eta}"
                    + (f" | {skipped} skipped" if skipped else ""))
                t_log, steps_since_log = time.time(), 0

            # ---- evaluate every eval_interval steps (the end has its own evaluation)
            if step % cfg.eval_interval == 0 and step < cfg.max_steps and not (signalled or out_of_time):
                t_pause = time.time()  # evaluation does not count against tokens/s
                val = evaluate(model, val_loader, cfg.eval_batches * grad_accum, device, cfg.precision)
                log({"step": step, "val_loss": val, "val_ppl": math.exp(val)},
                    f"step {step:5d} | val loss {val:.4f} | val ppl {math.exp(val):.2f}")
                t_log += time.time() - t_pause
    log.close()
    stopped_by = (stop.signal or signal.SIGTERM) if signalled else None
    return {"losses": losses, "val_loss": val_loss, "val_ppl": None if val_loss is None else math.exp(val_loss),
            "step": step, "skipped_steps": skipped, "stopped_by": stopped_by}


# ------------------------------------------------------------------------------------------- set-up

def _resume_point(model_cfg: ModelConfig, cfg: TrainConfig,
                  ctx: distributed.Context) -> tuple[str | None, dict | None]:
    """With --resume: the newest intact checkpoint's path and metadata; else (None, None), refusing an out_dir
    that holds another run's checkpoints."""
    if not cfg.resume:
        existing = checkpoint.checkpoint_paths(cfg.out_dir)
        if existing:
            raise cli.InUseError(f"{cfg.out_dir} already holds checkpoints of another run "
                                 f"({os.path.basename(existing[-1])}): pass --resume to continue it, or "
                                 "choose another --out_dir")
        return None, None
    path, meta = distributed.on_main(ctx, lambda: checkpoint.newest_intact(cfg.out_dir, set_aside=True))
    saved, current = meta["model_config"], asdict(model_cfg)
    if saved != current:
        diff = {k for k in saved.keys() | current.keys() if saved.get(k, "(none)") != current.get(k, "(none)")}
        raise ConfigError(f"--resume: the model config differs from the checkpoint's in {sorted(diff)}")
    return path, meta


def _open_data(model_cfg: ModelConfig, cfg: TrainConfig, ctx: distributed.Context, micro: int,
               resume: dict | None) -> tuple[shards.ShardLoader, shards.ShardLoader]:
    """The train and val loaders of this rank, checked against the model and the checkpoint resumed from."""
    directory = distributed.on_main(ctx, lambda: corpus.data_dir(cfg.data))  # rank 0 prepares the embedded corpus
    shards.load_meta(directory, model_cfg.vocab_size)  # an unprepared folder fails here, with how to prepare it
    train_loader = shards.ShardLoader(directory, "train", micro, cfg.seq_len, rank=ctx.rank,
                                      world_size=ctx.world_size, seed=cfg.seed, step_batch=cfg.batch_size)
    # Validation reads the first eval_batches x batch_size windows in order, whatever the world size.
    val_loader = shards.ShardLoader(directory, "val", micro, cfg.seq_len, rank=ctx.rank,
                                    world_size=ctx.world_size, shuffle=False, step_batch=cfg.batch_size)
    if val_loader.info != train_loader.info:
        raise shards.DataError(f"{directory}: the train shards hold {train_loader.info} tokens but the val shards "
                               f"{val_loader.info}")
    shards.check_vocab(train_loader.info, model_cfg.vocab_size)
    if resume is not None and resume.get("data", train_loader.info) != train_loader.info:
        raise shards.DataError(f"--resume: the checkpoint was trained on {resume['data']} tokens but data={cfg.data} "
                               f"holds {train_loader.info} tokens: resume on the data the run started with")
    return train_loader, val_loader


def _build(model_cfg: ModelConfig, cfg: TrainConfig, ctx: distributed.Context, model: Model | None,
           groups: list[dict] | None) -> tuple[Model, nn.Module, torch.optim.Optimizer]:
    """(the model, the module to call: it wrapped for DDP / FSDP, the optimizer). Every rank builds the same
    full model from the same seed; FSDP then keeps only its shard."""
    torch.manual_seed(cfg.seed)
    if model is None:
        with torch.device(ctx.device):
            model = Model(model_cfg)
    raw = model.to(ctx.device)
    names = {id(p): n for n, p in raw.named_parameters()}
    group_spec = groups or param_groups(raw, cfg)
    wrapped = distributed.parallelize(raw, cfg.parallel, ctx, compile=cfg.compile, compile_backend=cfg.compile_backend,
                                      compile_regions=cfg.compile_regions, compile_mode=cfg.compile_mode,
                                      precision=cfg.precision,
                                      activation_checkpointing=cfg.activation_checkpointing)
    optimizer = torch.optim.AdamW(_rebind(group_spec, names, raw), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  fused=ctx.device.type == "cuda" and cfg.parallel == "ddp")
    return raw, wrapped, optimizer


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


def main(argv: list[str]) -> dict:
    model_cfg, train_cfg = command_line(argv, "train.py")
    return train(model_cfg, train_cfg)


def exit_status(result: dict) -> int:
    """A finished run exits with 0; one stopped by a signal with 128 + the signal's number, as shells do."""
    return 128 + result["stopped_by"] if result.get("stopped_by") else 0


if __name__ == "__main__":
    cli.run(lambda argv: exit_status(main(argv)))
