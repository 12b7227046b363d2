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

The run is `training_loop`, one screen to read top to bottom, nanoGPT's way: set-up, then one `while` loop that
checks for the end (final evaluation, or a checkpoint on a stop signal), saves, takes an optimizer step, logs and
evaluates; each of those is a named function below it (Run holds where the loop stands).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from infra import adamw
from infra import checkpoint
from infra import cli
from infra import corpus
from infra import distributed
from infra import files
from infra import runlog
from infra import shards
from infra.config import TrainConfig, batch_split, command_line
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
    """Weight decay on the backbone's matrices only (weight_decay_on="matrices": never norms nor routers, whose
    stacked rows are 2-D), or on every parameter ("all", the authors' code), which pulls norms and routers to 0."""
    backbone = {id(p) for n, p in model.named_parameters() if not n.startswith("routers.")}
    decays = (lambda p: True) if cfg.weight_decay_on == "all" else (lambda p: p.dim() >= 2 and id(p) in backbone)
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


class NonFiniteError(cli.UserError, FloatingPointError):
    """The run stopped on non-finite numbers (too high an lr, most often): the message names the checkpoint to
    resume from."""


def train(model_cfg: ModelConfig, cfg: TrainConfig, model: Model | None = None,
          groups: list[dict] | None = None) -> dict:
    """Run training on this process's share; returns {"losses": [...], "val_loss", "val_ppl", "step",
    "skipped_steps", "stopped_by"} on every rank (losses averaged over ranks; stopped_by: the signal number
    when SIGINT/SIGTERM stopped the run, which then saves and skips the final evaluation, else None).

    model: start from this model (e.g. a converted pretrained one) instead of a fresh Model(model_cfg).
    groups: optimizer parameter groups; a group's "lr_scale" multiplies the scheduled learning rate."""
    ctx = distributed.setup(cfg.device, cfg.dist_timeout_s)
    try:  # a rank that hangs or dies ends the job with a message (distributed.rank_failures)
        with distributed.rank_failures(ctx, cfg.dist_timeout_s), contextlib.ExitStack() as held:   # held: the lock
            return training_loop(model_cfg, cfg, ctx, model, groups, held)
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
    resume_path, resume = checkpoint.resume_point(model_cfg, cfg, ctx)
    train_loader, val_loader = corpus.open_loaders(model_cfg, cfg, ctx, micro, resume)
    raw, model, optimizer = _build(model_cfg, cfg, ctx, model, groups)
    run = Run.starting(device, optimizer)
    if resume is not None:
        checkpoint.restore(model, optimizer, resume_path)
        train_loader.load_state_dict(resume["loader"])
        run.step, run.saved_at, run.last_saved = resume["step"], resume["step"], resume_path
    log = runlog.Logger(cfg, ctx.is_main, {"model": asdict(model_cfg), "train": asdict(cfg)})
    if ctx.is_main:
        _print_setup(model_cfg, cfg, ctx, raw, micro, grad_accum, run if resume else None)
    evaluation = lambda: evaluate(model, val_loader, cfg.eval_batches * grad_accum, device, cfg.precision)  # noqa
    val_loss = None                              # the final evaluation's
    run.t0 = run.t_log = run.t_saved = time.time()
    with distributed.StopRequest(announce=ctx.is_main) as stop:
        while True:
            # ---- the end: max_steps or the time budget reached (the final evaluation, then save), or a stop
            # signal on any rank (save, then report); before the first step too, for a run resumed at its end
            finished = run.out_of_time or run.step >= cfg.max_steps
            if finished and not run.signalled:
                val_loss = _final_evaluation(run, cfg, ctx, log, evaluation)
            # ---- save: every ckpt_interval steps and ckpt_minutes, never in a streak of skipped steps (its
            # weights are those before the streak); and at the end, unless this step is saved already
            if run.saved_at != run.step and (finished or run.signalled or run.save_due(cfg)):
                with run.paused():
                    _save(run, model_cfg, cfg, ctx, model, optimizer, train_loader)
            if run.signalled:
                _report_stop(run, log, stop)
            if finished or run.signalled:
                break

            # ---- one optimizer step: grad_accum micro-batches, gradients reduced over ranks at the last one
            _optimizer_step(run, cfg, ctx, model, optimizer, train_loader, grad_accum)
            runlog.freeze_heap(held)                # once, after the first step: its compiles are done
            if not run.read_due(cfg):
                continue                            # the device keeps the figures until a step that reads them
            # ---- read and log: skipped steps as read (max_bad_steps in a row stop the run), the rest every
            # log_interval; the flags (time budget, signal, ckpt_minutes) act from here
            mean_loss, grad_norm = _read_figures(run, cfg, ctx, log, stop)
            if run.step % cfg.log_interval == 0 or run.step == cfg.max_steps or run.signalled or run.out_of_time:
                _log_progress(run, model_cfg, cfg, ctx, log, mean_loss, grad_norm, run.lr)

            # ---- evaluate every eval_interval steps (the end has its own evaluation)
            if run.step % cfg.eval_interval == 0 and run.step < cfg.max_steps and not (run.signalled or
                                                                                        run.out_of_time):
                with run.paused():                  # evaluation does not count against tokens/s
                    val = evaluation()
                log({"step": run.step, "val_loss": val, "val_ppl": math.exp(val)},
                    f"step {run.step:5d} | val loss {val:.4f} | val ppl {math.exp(val):.2f}")
    log.close()
    stopped_by = (stop.signal or signal.SIGTERM) if run.signalled else None
    return {"losses": run.losses, "val_loss": val_loss, "val_ppl": None if val_loss is None else math.exp(val_loss),
            "step": run.step, "skipped_steps": run.skipped, "stopped_by": stopped_by}


# --------------------------------------------------------------------------------------- the loop's parts

@dataclass
class Run:
    """Where the loop stands: the step, saves, non-finite steps, clocks and the last read's flags (every rank's)."""
    step: int = 0
    saved_at: int | None = None             # the step of the newest checkpoint written or resumed
    last_saved: str | None = None           # its path (every value in it finite)
    losses: list[float] = field(default_factory=list)   # the mean loss over ranks of every step this run takes
    bad_in_a_row: int = 0                   # non-finite steps: in a row now, and in all this run
    skipped: int = 0
    steps_since_log: int = 0
    out_of_time: bool = False
    signalled: bool = False
    save_now: bool = False                  # ckpt_minutes have passed since the last save
    t0: float = 0.0                         # the clocks, set as the loop starts: its start,
    t_log: float = 0.0                      # where the interval of the next log line starts,
    t_saved: float = 0.0                    # and the last save
    gpu_busy: runlog.GpuBusy | None = None  # a logged step's GPU time, beside the wall time per step
    guard_on_device: bool = False           # the NaN guard decided on the device (a fused AdamW's found_inf)
    pending: list[torch.Tensor] = field(default_factory=list)   # the (2,) figures of the steps not yet read
    lr: float = 0.0                         # the last step's

    @classmethod
    def starting(cls, device: torch.device, optimizer: torch.optim.Optimizer) -> Run:
        """A run at step 0 with this optimizer: a fused AdamW has the guard on the device."""
        return cls(gpu_busy=runlog.GpuBusy(device), guard_on_device=bool(optimizer.defaults.get("fused")))

    def read_due(self, cfg: TrainConfig) -> bool:
        """Every step where the guard needs the host, else steps that log, evaluate, save by interval or end the
        run: the flags act from a read, so a signal, the time budget or ckpt_minutes wait for the next one."""
        s = self.step
        return (not self.guard_on_device or s % cfg.log_interval == 0 or s % cfg.eval_interval == 0
                or s >= cfg.max_steps or bool(cfg.ckpt_interval and s % cfg.ckpt_interval == 0))

    def save_due(self, cfg: TrainConfig) -> bool:
        interval = bool(self.losses) and ((cfg.ckpt_interval and self.step % cfg.ckpt_interval == 0) or self.save_now)
        return bool(interval) and not self.bad_in_a_row

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (saving, evaluating) does not count against the next log line's tokens/s."""
        start = time.time()
        yield
        self.t_log += time.time() - start


def _print_setup(model_cfg: ModelConfig, cfg: TrainConfig, ctx: distributed.Context, raw: Model, micro: int,
                 grad_accum: int, resumed: Run | None) -> None:
    print(f"model: {json.dumps(asdict(model_cfg))}\ntrain: {json.dumps(asdict(cfg))}")
    print(f"{raw.num_params() / 1e6:.2f}M parameters, {len(raw.routers)} routers, {ctx.world_size} x {ctx.device} "
          f"({cfg.parallel if ctx.world_size > 1 else 'single process'}), micro-batch {micro}, "
          f"grad accumulation {grad_accum}"
          + (f", resumed at step {resumed.step} from {resumed.last_saved}" if resumed else ""), flush=True)


def _final_evaluation(run: Run, cfg: TrainConfig, ctx: distributed.Context, log: runlog.Logger, evaluation) -> float:
    if run.out_of_time and ctx.is_main:
        print(f"time budget of {cfg.time_budget_s:.0f}s reached at step {run.step}")
    val_loss = evaluation()
    elapsed = time.time() - run.t0
    log({"step": run.step, "val_loss": val_loss, "val_ppl": math.exp(val_loss), "final": True, "wall_s": elapsed},
        f"final | step {run.step} | val loss {val_loss:.4f} | val ppl {math.exp(val_loss):.2f} | {elapsed:.0f}s")
    return val_loss


def _save(run: Run, model_cfg: ModelConfig, cfg: TrainConfig, ctx: distributed.Context, model: nn.Module,
          optimizer: torch.optim.Optimizer, loader: shards.ShardLoader) -> None:
    """A checkpoint of this step (collective; refused on every rank if any weight or optimizer value is not
    finite), keeping the newest keep_checkpoints."""
    meta = {"loader": loader.state_dict(), "step": run.step, "model_config": asdict(model_cfg),
            "train_config": asdict(cfg), "data": loader.info}
    try:
        run.last_saved = checkpoint.save(ctx, model, optimizer, os.path.join(cfg.out_dir, f"ckpt_{run.step:07d}"),
                                         meta)
    except FloatingPointError as e:
        raise NonFiniteError(f"step {run.step}: {e}; the newest finite checkpoint is "
                             f"{run.last_saved or 'none (this run saved none)'}") from None
    if ctx.is_main:
        for old in checkpoint.checkpoint_paths(cfg.out_dir)[:-cfg.keep_checkpoints]:
            checkpoint.remove(old)
    distributed.barrier(ctx)
    run.saved_at, run.t_saved = run.step, time.time()


def _report_stop(run: Run, log: runlog.Logger, stop: distributed.StopRequest) -> None:
    # a rank that got no signal itself stops because another rank did: SIGTERM is what torchrun sends
    name = signal.Signals(stop.signal or signal.SIGTERM).name
    log({"step": run.step, "stopped_by": name, "checkpoint": run.last_saved},
        f"step {run.step:5d} | stopped by {name}: saved {run.last_saved}; continue with --resume")


def _optimizer_step(run: Run, cfg: TrainConfig, ctx: distributed.Context, model: nn.Module,
                    optimizer: torch.optim.Optimizer, loader: shards.ShardLoader, grad_accum: int) -> None:
    """One step: the gradients, clipped, then the update, which the NaN guard skips when the mean loss over ranks
    or the gradient norm is not finite. A fused AdamW's guard is decided on the device (its found_inf skips the
    update and the step count), so the step only queues work; other optimizers need the verdict on the host, a
    read per step (free on a CPU). The step's (loss, norm) wait in run.pending for _read_figures."""
    run.lr = lr_at(run.step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = run.lr * group.get("lr_scale", 1.0)
    run.gpu_busy.start(measured=(run.step + 1) % cfg.log_interval == 0)   # the step that is logged, on a GPU
    loss_sum = forward_backward(model, loader, grad_accum, ctx.device, cfg.precision)
    grad_norm = distributed.clip_grad_norm(optimizer, cfg.grad_clip)      # the global norm, on the device
    figures = torch.stack([distributed.all_reduce(loss_sum) / ctx.world_size, grad_norm.float()])  # (2,)
    finite = torch.isfinite(figures).all()
    if run.guard_on_device:
        optimizer.found_inf, optimizer.grad_scale = (~finite).float(), None
    if run.guard_on_device or finite.item():
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    run.gpu_busy.stop()
    run.step += 1
    run.steps_since_log += 1
    run.pending.append(figures)


def _read_figures(run: Run, cfg: TrainConfig, ctx: distributed.Context, log: runlog.Logger,
                  stop: distributed.StopRequest) -> tuple[float, float]:
    """One read from the device: the (loss, norm) of the steps since the last read and one collective for the
    flags any rank may raise, so that every rank stops or saves at the same step (clocks and signals differ
    between processes). Skipped steps are logged as read; max_bad_steps in a row stop the run. Returns the last
    step's (mean loss, gradient norm)."""
    now = time.time()
    flags = [cfg.time_budget_s > 0 and now - run.t0 >= cfg.time_budget_s, stop.signal is not None,
             cfg.ckpt_minutes > 0 and now - run.t_saved >= 60 * cfg.ckpt_minutes]
    raised = distributed.all_reduce(torch.tensor(flags, device=ctx.device).float())
    values = torch.cat([raised, torch.stack(run.pending).flatten()]).tolist()
    run.out_of_time, run.signalled, run.save_now = (v > 0 for v in values[:3])
    for step, loss, norm in zip(range(run.step - len(run.pending) + 1, run.step + 1), values[3::2], values[4::2]):
        run.losses.append(loss)
        if math.isfinite(loss) and math.isfinite(norm):
            run.bad_in_a_row = 0
            continue
        run.bad_in_a_row += 1                   # skipped: the weights stay those of the last finite step
        run.skipped += 1
        log({"step": step, "skipped": True, "loss": loss, "grad_norm": norm},
            f"step {step:5d} | skipped: loss {loss:.4f}, grad norm {norm:.3f} "
            f"({run.bad_in_a_row} in a row, {run.skipped} in all)")
        if run.bad_in_a_row >= cfg.max_bad_steps:
            raise NonFiniteError(
                f"{run.bad_in_a_row} steps in a row, up to step {step}, had a non-finite loss or gradient norm (the "
                f"last: loss {loss}, grad norm {norm}) and were skipped, so the run stopped. The newest finite "
                f"checkpoint is {run.last_saved or 'none (this run saved none)'}: continue from it with --resume "
                "and a lower lr or grad_clip")
    run.pending.clear()
    return loss, norm


def _log_progress(run: Run, model_cfg: ModelConfig, cfg: TrainConfig, ctx: distributed.Context,
                  log: runlog.Logger, mean_loss: float, grad_norm: float, lr: float) -> None:
    """The log line of the steps since the last one: loss, speed, MFU, the GPU's busy time, memory, time left."""
    device = ctx.device
    peak = distributed.all_reduce(torch.tensor(runlog.peak_memory_gb(device), device=device), "max").item()
    dt = time.time() - run.t_log
    per_step = dt / run.steps_since_log
    tok_per_s = cfg.batch_size * cfg.seq_len / per_step
    mfu = tok_per_s * runlog.flops_per_token(model_cfg, cfg.seq_len) / (cfg.peak_flops * ctx.world_size)
    busy = run.gpu_busy.ms
    ms = f"{1000 * per_step:.0f} ms/step" + ("" if busy is None else f" (GPU busy {busy:.0f})")
    eta = runlog.duration((cfg.max_steps - run.step) * per_step)      # at this interval's pace
    log({"step": run.step, "loss": mean_loss, "lr": lr, "grad_norm": grad_norm, "tok_per_s": tok_per_s, "mfu": mfu,
         "step_time_s": per_step, "gpu_busy_s": busy and busy / 1e3, "peak_mem_gb": peak,
         "skipped_steps": run.skipped},
        f"step {run.step:5d}/{cfg.max_steps} | loss {mean_loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
        f"{tok_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}% | {ms} | peak mem {peak:.2f} GB | ETA {eta}"
        + (f" | {run.skipped} skipped" if run.skipped else ""))
    run.t_log, run.steps_since_log = time.time(), 0


# ------------------------------------------------------------------------------------------- set-up

def _build(model_cfg: ModelConfig, cfg: TrainConfig, ctx: distributed.Context, model: Model | None,
           groups: list[dict] | None) -> tuple[Model, nn.Module, torch.optim.Optimizer]:
    """(the model, the module to call: it wrapped for DDP / FSDP, the optimizer). Every rank builds the same
    full model from the same seed; FSDP then keeps only its shard."""
    torch.manual_seed(cfg.seed)
    if model is None:
        with torch.device(ctx.device):
            model = Model(model_cfg)
    raw = model.to(ctx.device)
    names, group_spec = {id(p): n for n, p in raw.named_parameters()}, groups or param_groups(raw, cfg)
    wrapped = distributed.parallelize(raw, cfg.parallel, ctx, compile=cfg.compile, compile_backend=cfg.compile_backend,
                                      compile_regions=cfg.compile_regions, compile_mode=cfg.compile_mode,
                                      precision=cfg.precision, activation_checkpointing=cfg.activation_checkpointing)
    fused = cfg.adamw == "fused" or (cfg.adamw == "auto" and ctx.device.type == "cuda")   # under FSDP2 too
    optimizer = adamw.AdamW(distributed.rebind(group_spec, names, raw), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            fused=fused)
    return raw, wrapped, optimizer


def main(argv: list[str]) -> dict:
    model_cfg, train_cfg = command_line(argv, "train.py")
    return train(model_cfg, train_cfg)


def exit_status(result: dict) -> int:
    """A finished run exits with 0; one stopped by a signal with 128 + the signal's number, as shells do."""
    return 128 + result["stopped_by"] if result.get("stopped_by") else 0


if __name__ == "__main__":
    cli.run(lambda argv: exit_status(main(argv)))
