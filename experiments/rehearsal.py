"""The training loop rehearsed through the kernels on CPU: train.py itself, with the kernel path in Triton's
interpreter, against the reference path, in one process and on 2 gloo ranks with DDP and with FSDP2.

    python -m experiments.rehearsal                           # the long version: every case, 20 steps, 3 worlds
    python -m experiments.rehearsal --steps=6 --worlds=single  # a shorter one

Each case trains one tiny config twice with the same seed and data, kernel="triton" and kernel="reference",
and compares the per-step losses (a step made non-finite on purpose is skipped by both, as train.py skips
it). Both paths compute in fp32; they differ only in summation order (the kernels accumulate in another
order than the reference's torch ops), about 1e-7 of a value per op, and AdamW carries these differences
from step to step, where they grow as training moves the weights. Over 20 steps of every case in every world
the largest difference measured is 9.5e-7 (results/rehearsal/rehearsal.json, 2 float32 ulps of a loss near
4): TOLERANCE = 1e-5 leaves 10x that, and is 5x below what a kernel path that drops the learned null
source's gradient shows within 6 steps (tests/test_rehearsal.py). Then resume: the kernel
path's run is stopped at step RESUME_AT (its checkpoint is all that is kept) and continued with --resume;
its losses from there on must equal the uninterrupted run's exactly.

The 2-rank worlds run this module under torchrun (the `--worker` entry); rank 0 writes the results.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: the kernels run interpreted

import torch  # noqa: E402

from infra import checkpoint  # noqa: E402
from infra import corpus  # noqa: E402
from infra import distributed  # noqa: E402
import train  # noqa: E402
from infra.config import TrainConfig  # noqa: E402
from depth_kernels.observers import observe_launches  # noqa: E402
from model import ModelConfig  # noqa: E402

TOLERANCE = 1e-5      # |loss(kernel) - loss(reference)| at every step, fp32, 20 steps (see the docstring)
RESUME_AT = 3
WORLDS = ("single", "ddp", "fsdp")
MODEL = dict(d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32, n_blocks=2)
# 8 tokens per micro-batch (the interpreter's cost grows with the tokens); a global batch of 2 sequences: one
# process accumulates 2 micro-steps, 2 ranks one each
TRAIN = dict(seq_len=8, batch_size=2, micro_batch_size=1, eval_batches=1, log_interval=1, eval_interval=10 ** 6,
             warmup_steps=2, lr=1e-2, device="cpu", ckpt_minutes=0.0)


@dataclass(frozen=True)
class Case:
    name: str
    model: dict
    train: dict = field(default_factory=dict)
    nan_at: int = -1          # this step's loss is made non-finite: train.py must skip it


CASES = (
    Case("attnres", dict(residual="attnres")),
    Case("full_attnres, null", dict(residual="full_attnres", null_source=True)),
    Case("delta, gate, learned null", dict(residual="delta", gate=True, null_source=True, learned_null=True)),
    Case("delta_block", dict(residual="delta_block")),
    Case("delta_block, paper, null", dict(residual="delta_block", block_source="paper", null_source=True)),
    Case("delta_block, 1 block, gate", dict(residual="delta_block", n_blocks=1, gate=True)),
    Case("delta, checkpointing", dict(residual="delta"), dict(activation_checkpointing=True)),
    Case("delta_block, skipped step", dict(residual="delta_block", gate=True), nan_at=1),
)
QUICK = ("delta, gate, learned null", "delta_block, paper, null", "delta_block, skipped step")


class NonFiniteAt:
    """train.loss_fn with the training loss of step `step` (0-based, all its micro-steps) multiplied by NaN."""

    def __init__(self, step: int, micro_steps: int):
        self.step, self.micro_steps, self.calls = step, micro_steps, 0
        self.loss_fn = train.loss_fn

    def __call__(self, model, x, y):
        loss = self.loss_fn(model, x, y)
        if not torch.is_grad_enabled():           # evaluation
            return loss
        self.calls += 1
        return loss * float("nan") if (self.calls - 1) // self.micro_steps == self.step else loss


def _train(case: Case, kernel: str, out_dir: str, world: str, steps: int, world_size: int, first_step: int = 0,
           **extra) -> dict:
    """train.train on the case (resumed at first_step, if > 0) -> its result, with the gradient norm of every step
    (from its log) and how many kernels it launched."""
    model_cfg = ModelConfig(**{**MODEL, **case.model}, kernel=kernel)
    cfg = TrainConfig(out_dir=out_dir, max_steps=steps, parallel="fsdp" if world == "fsdp" else "ddp",
                      **{**TRAIN, **case.train, **extra})
    loss_fn = train.loss_fn
    if case.nan_at >= first_step:
        train.loss_fn = NonFiniteAt(case.nan_at - first_step, cfg.batch_size // (cfg.micro_batch_size * world_size))
    launches = []
    try:
        with observe_launches(lambda launch: launches.append(launch.kernel) and False):
            result = train.train(model_cfg, cfg)
    finally:
        train.loss_fn = loss_fn
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    return {**result, "launches": len(launches), "grad_norms": [r["grad_norm"] for r in log if "grad_norm" in r]}


def _same(a: list[float], b: list[float]) -> bool:
    """Equal, step by step, bit for bit (NaN where both skipped a step)."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def _max_diff(a: list[float], b: list[float]) -> float:
    """max |a - b| over the steps where both are finite; inf if only one of them is."""
    if [math.isfinite(x) for x in a] != [math.isfinite(y) for y in b]:
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b) if math.isfinite(x)), default=0.0)


def rehearse_case(case: Case, world: str, steps: int, out: str, rank: int = 0, world_size: int = 1) -> dict:
    """Kernel vs reference over `steps`, and the kernel path resumed at RESUME_AT -> the figures."""
    # the kernel run also saves at RESUME_AT (saving changes nothing in a run)
    runs = {kernel: _train(case, kernel, os.path.join(out, kernel), world, steps, world_size,
                           **(dict(ckpt_interval=RESUME_AT, keep_checkpoints=steps) if kernel == "triton" else {}))
            for kernel in ("triton", "reference")}
    kernel, reference = runs["triton"]["losses"], runs["reference"]["losses"]
    if rank == 0:                             # only the checkpoint at RESUME_AT: a file, or FSDP2's sharded folder
        saved = next(p for p in checkpoint.checkpoint_paths(os.path.join(out, "triton"))
                     if os.path.basename(p).startswith(f"ckpt_{RESUME_AT:07d}"))
        os.makedirs(os.path.join(out, "resumed"))
        (shutil.copytree if os.path.isdir(saved) else shutil.copy)(
            saved, os.path.join(out, "resumed", os.path.basename(saved)))
    if world_size > 1:
        torch.distributed.barrier()
    resumed = _train(case, "triton", os.path.join(out, "resumed"), world, steps, world_size, RESUME_AT, resume=True)
    grads = [runs[k]["grad_norms"] for k in runs]
    return {"case": case.name, "world": world, "steps": steps, "kernel_losses": kernel,
            "reference_losses": reference, "skipped": [runs[k]["skipped_steps"] for k in runs],
            "launches": [runs[k]["launches"] for k in runs], "max_abs_diff": _max_diff(kernel, reference),
            "grad_norm_rel_diff": [abs(a - b) / abs(b) if math.isfinite(b) else None for a, b in zip(*grads)],
            "resume_exact": _same(resumed["losses"], kernel[RESUME_AT:]),
            "val_loss_diff": abs(runs["triton"]["val_loss"] - runs["reference"]["val_loss"])}


def run_world(world: str, cases: list[Case], steps: int, out: str, rank: int = 0, world_size: int = 1) -> list[dict]:
    results = []
    for i, case in enumerate(cases):
        t0 = time.time()
        r = rehearse_case(case, world, steps, os.path.join(out, world, str(i)), rank, world_size)
        results.append({**r, "seconds": time.time() - t0})
        if rank == 0:
            grads = max(x for x in r["grad_norm_rel_diff"] if x is not None)
            print(f"{world:<7}{case.name:<30} max |loss diff| {r['max_abs_diff']:.2e}, grad norm {grads:.1e} rel.; "
                  f"resume exact {r['resume_exact']}; skipped "
                  f"{r['skipped']}; launches {r['launches']}; {time.time() - t0:.0f}s", flush=True)
    return results


def worker(world: str, names: list[str], steps: int, out: str) -> None:
    """One rank of a 2-rank world under torchrun; rank 0 writes results.json."""
    torch.distributed.init_process_group("gloo")
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = run_world(world, [c for c in CASES if c.name in names], steps, out, rank, size)
    if rank == 0:
        with open(os.path.join(out, f"{world}.json"), "w") as f:
            json.dump(results, f)
    distributed.end_worker()


def run_ranks(world: str, names: list[str], steps: int, out: str, timeout: float = 3600) -> list[dict]:
    """A 2-rank world: this module under torchrun, one thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "experiments.rehearsal", "--worker", world, "--steps", str(steps), "--out", out, "--cases", *names]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun ({world}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    print(proc.stdout, end="")
    with open(os.path.join(out, f"{world}.json")) as f:
        return json.load(f)


def rehearse(worlds: tuple[str, ...], names: list[str], steps: int, out: str) -> list[dict]:
    """Every case in every world -> their figures (each case's runs in out/<world>/<i>)."""
    corpus.data_dir(TrainConfig().data)      # the embedded corpus, prepared before any rank looks for it
    results = []
    for world in worlds:
        if world == "single":
            torch.set_num_threads(1)
            results += run_world(world, [c for c in CASES if c.name in names], steps, out)
        else:
            results += run_ranks(world, names, steps, out)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worlds", nargs="+", default=list(WORLDS), choices=WORLDS)
    parser.add_argument("--cases", nargs="+", default=[c.name for c in CASES], help="case names (default: all)")
    parser.add_argument("--json", default=os.path.join(ROOT, "results", "rehearsal", "rehearsal.json"))
    parser.add_argument("--worker", choices=WORLDS[1:], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = sorted(set(args.cases) - {c.name for c in CASES})
    if unknown:
        raise SystemExit(f"unknown cases {unknown}: allowed are {[c.name for c in CASES]}")
    if args.steps <= RESUME_AT:
        raise SystemExit(f"--steps={args.steps}: allowed values are integers > RESUME_AT = {RESUME_AT}")
    if args.worker:
        return worker(args.worker, args.cases, args.steps, args.out)
    with tempfile.TemporaryDirectory() as out:
        results = rehearse(tuple(args.worlds), args.cases, args.steps, out)
    worst = max(r["max_abs_diff"] for r in results)
    ok = worst <= TOLERANCE and all(r["resume_exact"] for r in results)
    print(f"{'PASS' if ok else 'FAIL'}: max |loss diff| {worst:.2e} (tolerance {TOLERANCE:.0e}); resume exact in "
          f"{sum(r['resume_exact'] for r in results)} of {len(results)} runs")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"tolerance": TOLERANCE, "resume_at": RESUME_AT, "model": MODEL, "train": TRAIN,
                   "results": results}, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
