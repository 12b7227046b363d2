"""Training a plan's runs: two at a time in worker processes (or one here), finished runs skipped, an
interrupted one retrained from scratch, equal wall-clock runs paced by the equal-steps runs they follow."""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import redirect_stdout

import numpy as np
import torch

from infra import corpus
import train
from infra.config import TrainConfig
from experiments.plan import Run


def read_log(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "log.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def final_record(out_dir: str) -> dict | None:
    return next((r for r in read_log(out_dir) if r.get("final")), None)


def train_one(argv: list[str], out_dir: str, threads: int) -> dict:
    """Train one run from scratch (a leftover of an interrupted attempt is removed: its log would mix)."""
    torch.set_num_threads(threads)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    with open(os.path.join(out_dir, "stdout.txt"), "w") as f, redirect_stdout(f):
        train.main(argv)
    return final_record(out_dir)


def pace(run: Run, out: str, budget_s: float) -> dict:
    """Equal wall-clock: the budget times this method's steps per second in its equal-steps runs (all seeds)."""
    finals = {name: final_record(os.path.join(out, "runs", name)) for name in run.pace_from}
    missing = [name for name, final in finals.items() if final is None]
    if missing:
        raise RuntimeError(f"its equal-steps runs {', '.join(missing)} have not finished")
    steps = max(1, int(np.mean([f["step"] / f["wall_s"] for f in finals.values()]) * budget_s))
    return {"max_steps": steps, "time_budget_s": budget_s, "eval_interval": max(1, steps // 8)}


def wall_budget(runs: list[Run], out: str, budget_s: float | None) -> float:
    """The equal wall-clock budget: given, or the mean wall time of the equal-steps runs that pace the baseline's
    equal wall-clock runs (Table 1's baseline; another section's baseline runs do not move it)."""
    if budget_s:
        return budget_s
    names = sorted({n for r in runs if r.pace_from and r.overrides.get("residual") == "baseline" for n in r.pace_from})
    finals = [final_record(os.path.join(out, "runs", n)) for n in names]
    if not finals or None in finals:
        raise RuntimeError("the baseline's equal-steps runs, which set the budget, have not all finished")
    return float(np.mean([f["wall_s"] for f in finals]))


def clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def execute(runs: list[Run], out: str, jobs: int, threads: int, budget_s: float | None = None) -> list[str]:
    """Train every unfinished run, equal-steps runs first, then the equal wall-clock ones, whose
    steps come from the former. One progress line per run. Returns the names of runs that failed."""
    corpus.data_dir(TrainConfig().data)           # prepare the corpus once, before workers race to do it
    start, total = time.time(), len(runs)
    done_cost, left_cost, failed, index = 0.0, sum(r.cost for r in runs), [], 0

    def report(run: Run, final: dict | None, status: str) -> None:
        nonlocal index, done_cost, left_cost
        index += 1
        left_cost -= run.cost
        if status != "skipped":
            done_cost += run.cost
        elapsed = time.time() - start
        eta = f" | ETA ~{clock(elapsed / done_cost * left_cost)}" if done_cost and left_cost > 0 else ""
        result = (f"val ppl {final['val_ppl']:7.3f} | step {final['step']:5d} | {final['wall_s']:5.0f}s"
                  if final else "no result")
        print(f"[{index:2d}/{total}] {run.name:<24} {result} | {status} | elapsed {clock(elapsed)}{eta}", flush=True)

    pending = []
    for run in runs:
        final = final_record(os.path.join(out, "runs", run.name))
        if final is not None:
            report(run, final, "skipped")
        else:
            pending.append(run)
    # Seed by seed, so an interrupted sweep has complete tables for the first seeds; longest first within one,
    # so the two workers finish together.
    steps_first = sorted([r for r in pending if not r.pace_from], key=lambda r: (r.overrides["seed"], -r.cost))
    wall_last = [r for r in pending if r.pace_from]
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) if jobs > 1 else None
    try:
        for phase in (steps_first, wall_last):
            queue, futures = list(phase), {}
            while queue or futures:
                while queue and len(futures) < jobs:    # jobs = 1: train here, one run at a time
                    run = queue.pop(0)
                    out_dir = os.path.join(out, "runs", run.name)
                    try:
                        extra = pace(run, out, wall_budget(runs, out, budget_s)) if run.pace_from else None
                    except RuntimeError as e:
                        failed.append(run.name)
                        report(run, None, f"FAILED: {e}")
                        continue
                    args = (run.argv({**(extra or {}), "out_dir": out_dir}), out_dir, threads)
                    futures[pool.submit(train_one, *args) if pool else _now(train_one, *args)] = run
                finished, _ = wait(futures, return_when=FIRST_COMPLETED)
                for future in finished:
                    run = futures.pop(future)
                    try:
                        report(run, future.result(), "trained")
                    except Exception as e:  # one broken run must not cost the others; it is reported at the end
                        failed.append(run.name)
                        report(run, None, f"FAILED: {type(e).__name__}: {e}")
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    return failed


def _now(fn, *args):
    """A finished future holding fn(*args): jobs=1 runs in this process through the same loop."""
    future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as e:  # handed to the loop, which reports it like a worker's failure
        future.set_exception(e)
    return future
