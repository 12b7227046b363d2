"""The paper's comparisons in miniature, with seed error bars and at equal wall-clock, on a 2-core CPU.

    python sweep.py                        # every run into runs/sweep (about 50 min on 2 cores), then its table
                                           # compared with the committed results/sweep (runs/sweep/compare.md)
    python sweep.py --out results/sweep    # the same into the committed folder (what was published)
    python sweep.py --report_only          # rewrite the table, JSON and plots from the finished runs
    python sweep.py --depth --jobs=1       # the depth sweep into runs/depth_sweep (about 2 h on one core)

One model (configs/sweep_l12.py: 12 layers, d = 64, byte-level Shakespeare) and four comparisons:
  Table 1   baseline, attnres, full_attnres, delta, delta_block, delta_block with the paper's sources;
            equal steps, 3 seeds each (seed s gives every method the same backbone init and data order);
  Table 4   delta_block with 1, 2, 4, 6, 12 blocks and delta (the fine-grained end), seed 0;
  wall      baseline, delta, delta_block with the same time_budget_s (the baseline's equal-steps wall time);
            each method's cosine schedule is as long as the steps its Table 1 run made in that time;
  init      delta_block's query init (zero or N(0, 0.02)) with and without gate=True, 3 seeds.
--depth trains another plan: the paper's depth claim (AttnRes falls behind the baseline at 36 layers, additive
routing does not) on configs/sweep_depth.py (d = 32): baseline, attnres, delta_block and delta at 36 and at 12
layers, equal steps, 3 seeds each; its plots add depth.png (the paired PPL change vs the baseline by depth).
Two runs train at once, one thread each (--jobs, --threads); runs shared between tables are trained once.
A run whose log.jsonl has its final record is skipped, so an interrupted sweep continues where it stopped.
Writes OUT/runs/<run>/ (log.jsonl, stdout.txt, routing.json, checkpoint), OUT/results.json, OUT/table.md and
OUT/*.png. Training is deterministic for a given seed, torch build and thread count, so the equal-steps rows of a
rerun on the same kind of machine should match the committed table to the last digit.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass

import numpy as np
import torch

from config import load_config

CONFIG = "configs/sweep_l12.py"
SEEDS = (0, 1, 2)
MEMORY_SHAPE = (2, 64)   # (batch, seq_len) of the saved-bytes count: per-token ratios do not depend on it

# Table 1's rows: label -> (run-name slug, config overrides, time per step relative to the baseline). The
# relative times were measured on this model on one core; they only order the queue and estimate the ETA.
METHODS = {
    "baseline": ("baseline", {"residual": "baseline"}, 1.0),
    "attnres": ("attnres", {"residual": "attnres"}, 1.4),
    "full_attnres": ("full_attnres", {"residual": "full_attnres"}, 2.8),
    "delta": ("delta", {"residual": "delta"}, 2.6),
    "delta_block": ("delta_block", {"residual": "delta_block"}, 1.35),
    "delta_block (the authors' variant)": ("delta_block_paper", {"residual": "delta_block", "block_source": "paper"}, 1.35),
}
# The initialisation rows besides Table 1's delta_block (zero queries, no gate): (label, run-name slug, overrides).
INITS = [
    ("delta_block, no gate, queries N(0, 0.02) (the authors' code)", "init_q002_delta_block",
     {"query_init_std": 0.02}),
    ("delta_block, gate=True, zero queries", "init_gate_q0_delta_block", {"gate": True, "query_init_std": 0.0}),
    ("delta_block, gate=True, queries N(0, 0.02) (the gated default)", "init_gate_delta_block", {"gate": True}),
]

# The depth sweep (--depth): configs/sweep_depth.py at these depths, these methods; run times per step relative
# to the 12-layer baseline, measured on one core (they order the queue and estimate the ETA).
DEPTH_CONFIG = "configs/sweep_depth.py"
DEPTHS = (36, 12)
DEPTH_METHODS = ("baseline", "attnres", "delta_block", "delta")
DEPTH_COSTS = {(36, "baseline"): 2.9, (36, "attnres"): 4.4, (36, "delta_block"): 4.9, (36, "delta"): 20.5,
               (12, "baseline"): 1.0, (12, "attnres"): 1.6, (12, "delta_block"): 1.55, (12, "delta"): 3.0}


@dataclass
class Run:
    name: str                        # its out_dir under OUT/runs
    overrides: dict                  # config keys on top of `config`
    cost: float = 1.0                # expected wall time relative to an equal-steps baseline run
    pace_from: tuple[str, ...] = ()  # equal wall-clock: the equal-steps runs whose pace sets max_steps
    config: str = CONFIG             # the config file the run starts from


@dataclass
class Section:
    title: str
    note: str
    rows: list[tuple[str, list[str]]]   # (label, run names); the first row is the reference (baseline)
    plots: tuple[str, ...] = ()         # "curves" (val loss over seeds), "blocks" (PPL vs sources), "depth"
                                        # (PPL change vs the baseline against the layers of every "depth" section)


@dataclass
class Plan:
    name: str                # runs go to runs/NAME by default; the published sweep is results/NAME
    config: str              # the model the runs start from
    runs: list[Run]
    sections: list[Section]

    @property
    def committed(self) -> str:
        return os.path.join("results", self.name, "results.json")


def full_plan() -> Plan:
    runs, t1 = [], []
    for label, (slug, overrides, cost) in METHODS.items():
        names = [f"t1_{slug}_s{s}" for s in SEEDS]
        runs += [Run(n, {**overrides, "seed": s}, cost) for n, s in zip(names, SEEDS)]
        t1.append((label, names))
    t4 = [("baseline", ["t1_baseline_s0"])]
    for k in (1, 2, 4, 6, 12):
        name = "t1_delta_block_s0" if k == 4 else f"t4_delta_block_k{k}"
        if k != 4:
            runs.append(Run(name, {"residual": "delta_block", "n_blocks": k, "seed": 0}, 1.2 + 0.05 * k))
        t4.append((f"delta_block, {k} blocks", [name]))
    t4.append(("delta (fine-grained)", ["t1_delta_s0"]))
    wall = []
    for label in ("baseline", "delta", "delta_block"):
        slug, overrides, _ = METHODS[label]
        runs.append(Run(f"wall_{slug}_s0", {**overrides, "seed": 0}, 1.0, pace_from=tuple(f"t1_{slug}_s{s}" for s in SEEDS)))
        wall.append((label, [f"wall_{slug}_s0"]))
    init = [("baseline", [f"t1_baseline_s{s}" for s in SEEDS]),
            ("delta_block, no gate, zero queries (the paper's init)", [f"t1_delta_block_s{s}" for s in SEEDS])]
    for label, slug, overrides in INITS:
        names = [f"{slug}_s{s}" for s in SEEDS]
        runs += [Run(n, {"residual": "delta_block", **overrides, "seed": s}, 1.35) for n, s in zip(names, SEEDS)]
        init.append((label, names))
    sections = [
        Section("Table 1 in miniature: equal steps, 3 seeds", "Mean ± std over seeds 0, 1, 2; the change vs "
                "the baseline is paired by seed (same init and data order).", t1, ("curves",)),
        Section("Table 4 in miniature: number of blocks (L = 12), seed 0", "K blocks give K + 1 sources to the "
                "last sublayer; the fine-grained delta reads up to 2L + 1 = 25.", t4, ("blocks",)),
        Section("Equal wall-clock, seed 0", "Same time_budget_s for every method (the baseline's equal-steps "
                "wall time); each method's schedule is as long as the steps it makes in that time.", wall),
        Section("Initialisation: query init and gate of delta_block, 3 seeds", "gate=True starts as the baseline "
                "bit for bit; with zero queries its gate gets no useful gradient (the read is c h~ and the pre-norm "
                "is scale invariant), so gate=True defaults to queries drawn from N(0, 0.02). Without a gate the "
                "boundary sources give a near-identity at any query init.", init),
    ]
    return Plan("sweep", CONFIG, runs, sections)


def depth_plan() -> Plan:
    """The paper's depth claim: the same four methods at 36 layers (the 1044M depth) and at 12, with the same
    width and steps, 3 seeds each."""
    sections = []
    runs = []
    for n_layers in DEPTHS:
        rows = []
        for label in DEPTH_METHODS:
            slug, overrides, _ = METHODS[label]
            names = [f"l{n_layers}_{slug}_s{s}" for s in SEEDS]
            cost = DEPTH_COSTS[(n_layers, label)]
            runs += [Run(n, {**overrides, "n_layers": n_layers, "seed": s}, cost, config=DEPTH_CONFIG)
                     for n, s in zip(names, SEEDS)]
            rows.append((label, names))
        plots = ("curves", "depth") if n_layers == DEPTHS[0] else ("depth",)
        sections.append(Section(f"{n_layers} layers: equal steps, 3 seeds", "Mean ± std over seeds 0, 1, 2; the "
                                "change vs the baseline is paired by seed (same init and data order).", rows, plots))
    return Plan("depth_sweep", DEPTH_CONFIG, runs, sections)


# ------------------------------------------------------------------------------------------------ running

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
    import train
    torch.set_num_threads(threads)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    with open(os.path.join(out_dir, "stdout.txt"), "w") as f, redirect_stdout(f):
        train.main(argv)
    return final_record(out_dir)


def run_argv(run: Run, out: str, extra: dict | None = None) -> list[str]:
    values = {**run.overrides, **(extra or {}), "out_dir": os.path.join(out, "runs", run.name)}
    return [run.config] + [f"--{k}={v}" for k, v in values.items()]


def pace(run: Run, out: str, budget_s: float) -> dict:
    """Equal wall-clock: the budget times this method's steps per second in its equal-steps runs (all seeds)."""
    finals = {name: final_record(os.path.join(out, "runs", name)) for name in run.pace_from}
    missing = [name for name, final in finals.items() if final is None]
    if missing:
        raise RuntimeError(f"its equal-steps runs {', '.join(missing)} have not finished")
    steps = max(1, int(np.mean([f["step"] / f["wall_s"] for f in finals.values()]) * budget_s))
    return {"max_steps": steps, "time_budget_s": budget_s, "eval_interval": max(1, steps // 8)}


def wall_budget(runs: list[Run], out: str, budget_s: float | None) -> float:
    """The equal wall-clock budget: given, or the mean wall time of the baseline's equal-steps runs."""
    if budget_s:
        return budget_s
    finals = [final_record(os.path.join(out, "runs", r.name)) for r in runs
              if not r.pace_from and r.overrides.get("residual") == "baseline"]
    if not finals or None in finals:
        raise RuntimeError("the baseline's equal-steps runs, which set the budget, have not all finished")
    return float(np.mean([f["wall_s"] for f in finals]))


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def execute(runs: list[Run], out: str, jobs: int, threads: int, budget_s: float | None = None) -> list[str]:
    """Train every unfinished run, equal-steps runs first, then the equal wall-clock ones, whose
    steps come from the former. One progress line per run. Returns the names of runs that failed."""
    import data
    from config import TrainConfig
    data.data_dir(TrainConfig().data)           # prepare the corpus once, before workers race to do it
    start, total = time.time(), len(runs)
    done_cost, left_cost, failed, index = 0.0, sum(r.cost for r in runs), [], 0

    def report(run: Run, final: dict | None, status: str) -> None:
        nonlocal index, done_cost, left_cost
        index += 1
        left_cost -= run.cost
        if status != "skipped":
            done_cost += run.cost
        elapsed = time.time() - start
        eta = f" | ETA ~{_clock(elapsed / done_cost * left_cost)}" if done_cost and left_cost > 0 else ""
        result = (f"val ppl {final['val_ppl']:7.3f} | step {final['step']:5d} | {final['wall_s']:5.0f}s"
                  if final else "no result")
        print(f"[{index:2d}/{total}] {run.name:<24} {result} | {status} | elapsed {_clock(elapsed)}{eta}", flush=True)

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
                    args = (run_argv(run, out, extra), out_dir, threads)
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


# ---------------------------------------------------------------------------------------------- analysing

def model_config(run: Run):
    return load_config([run.config] + [f"--{k}={v}" for k, v in run.overrides.items()])[0]


def train_config(run: Run):
    return load_config([run.config] + [f"--{k}={v}" for k, v in run.overrides.items()])[1]


def saved_bytes_for(configs: dict[str, dict], kernel: str) -> dict[str, int]:
    """{key: bytes saved for backward by one step of the model with that ModelConfig (as a dict)} on `kernel`'s
    path, for a MEMORY_SHAPE batch of the same random tokens. On CPU the kernel path needs TRITON_INTERPRET=1."""
    from kernels.memory import saved_bytes
    from model import Model, ModelConfig
    batch, seq_len = MEMORY_SHAPE
    out = {}
    for key, cfg in configs.items():
        torch.manual_seed(0)
        model = Model(ModelConfig(**{**cfg, "kernel": kernel}))
        idx = torch.randint(0, cfg["vocab_size"], (batch, seq_len), generator=torch.Generator().manual_seed(0))
        out[key] = saved_bytes(model, idx)
    return out


def saved_bytes_triton(configs: dict[str, dict], timeout_s: float) -> dict[str, int] | str:
    """The kernel path under the Triton interpreter, in a subprocess (the interpreter is chosen when Triton is
    first imported); returns the reason instead when it fails or takes longer than timeout_s."""
    code = "import json, sys, sweep; json.dump(sweep.saved_bytes_for(json.loads(sys.argv[1]), 'triton'), sys.stdout)"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(configs)], capture_output=True, text=True,
                              timeout=timeout_s, env=env, cwd=os.path.dirname(os.path.abspath(__file__)))
    except subprocess.TimeoutExpired:
        return f"omitted: the interpreter took over {timeout_s:.0f}s"
    if proc.returncode:
        return f"omitted: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
    return json.loads(proc.stdout)


def routing_summary(out_dir: str) -> dict:
    """routing_analysis.routing_analysis of the run's checkpoint over 32 held-out windows of its training length,
    kept in OUT/runs/<run>/routing.json: the checkpoints are not committed, so a clean clone reports from that
    file."""
    path = os.path.join(out_dir, "routing.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    import eval as evaluation
    import trained
    from routing_analysis import routing_analysis
    model, ckpt = trained.load_model(out_dir)
    arrays, _ = evaluation.load_tokens(ckpt, model, None, "val")
    summary = routing_analysis(model, arrays, trained.context_length(ckpt), n_windows=32)
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f)
    os.replace(path + ".tmp", path)
    return summary


def run_figures(run: Run, out: str) -> dict | None:
    """A finished run's numbers from its log.jsonl (and checkpoint, for routing); None if it is not finished."""
    out_dir = os.path.join(out, "runs", run.name)
    log = read_log(out_dir)
    final = next((r for r in log if r.get("final")), None)
    if final is None:
        return None
    speeds = [r["tok_per_s"] for r in log if "tok_per_s" in r]
    speeds = speeds[1:] or speeds          # the first interval includes start-up, unless it is the only one
    cfg = model_config(run)
    figures = {"overrides": run.overrides, "pace_from": list(run.pace_from), "val_ppl": final["val_ppl"],
               "val_loss": final["val_loss"], "step": final["step"], "wall_s": final["wall_s"],
               "tok_per_s": float(np.mean(speeds)),
               "curve": [[r["step"], r["val_loss"]] for r in log if "val_loss" in r]}
    if cfg.residual != "baseline":
        figures["routing"] = routing_summary(out_dir)
    return figures


def _mean_std(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def section_rows(section: Section, runs: dict[str, Run], figures: dict, memory: dict) -> list[dict]:
    """One dict per row with every table column; rows whose runs are not all finished are left out."""
    ref = {runs[n].overrides["seed"]: figures[n] for n in section.rows[0][1] if figures.get(n)}
    ref_key = memory_key(runs[section.rows[0][1][0]])
    ref_speed = np.mean([f["tok_per_s"] for f in ref.values()]) if ref else float("nan")
    rows = []
    for label, names in section.rows:
        got = [figures[n] for n in names if figures.get(n)]
        if len(got) < len(names) or not ref:
            continue
        seeds = [runs[n].overrides["seed"] for n in names]
        ppl, ppl_std = _mean_std([f["val_ppl"] for f in got])
        # Paired by seed: the same seed gives every method the same backbone init and the same batches.
        change = [100 * (f["val_ppl"] / ref.get(s, next(iter(ref.values())))["val_ppl"] - 1) for f, s in zip(got, seeds)]
        change_mean, change_std = _mean_std(change)
        routed = [f["routing"] for f in got if "routing" in f]
        key = memory_key(runs[names[0]])
        cfg = model_config(runs[names[0]])
        rows.append({
            "label": label, "runs": names, "residual": cfg.residual, "n_layers": cfg.n_layers,
            "sources": n_sources(cfg), "seeds": seeds, "steps": float(np.mean([f["step"] for f in got])),
            "wall_s": float(np.mean([f["wall_s"] for f in got])), "val_ppl": ppl, "val_ppl_std": ppl_std,
            "ppl_change_pct": change_mean, "ppl_change_pct_std": change_std,
            "tok_per_s_rel": float(np.mean([f["tok_per_s"] for f in got]) / ref_speed),
            "saved_bytes_rel": {k: v[key] / v[ref_key] for k, v in memory.items() if isinstance(v, dict)},
            "mean_max_weight": float(np.mean([r["mean_max_weight"] for r in routed])) if routed else None,
            "mean_entropy": float(np.mean([r["mean_entropy"] for r in routed])) if routed else None})
    return rows


def n_sources(cfg) -> int:
    """Sources as Table 4 counts them: K + 1 for K blocks (the partial included; the paper's variant has none),
    2L + 1 fine-grained."""
    blocks = cfg.n_blocks + int(cfg.residual == "attnres" or (cfg.include_partial and cfg.block_source == "boundary"))
    return {"baseline": 0, "attnres": blocks, "delta_block": blocks}.get(cfg.residual, 2 * cfg.n_layers + 1)


def memory_key(run: Run) -> str:
    """The name of the model a run trains, as far as memory goes: depth, method, blocks, sources, gate."""
    cfg = model_config(run)
    key = f"L{cfg.n_layers}/{cfg.residual}"
    if cfg.residual in ("attnres", "delta_block"):
        key += f"/K{cfg.n_blocks}"
    if cfg.residual == "delta_block":
        key += f"/{cfg.block_source}"
    return key + ("/gate" if cfg.gate else "")


def _pm(mean: float, std: float, n: int, fmt: str) -> str:
    return f"{mean:{fmt}} ± {std:{fmt.lstrip('+')}}" if n > 1 else f"{mean:{fmt}}"


def markdown(sections: list[Section], rows: dict[str, list[dict]], memory: dict, meta: dict) -> str:
    paths = [k for k, v in memory.items() if isinstance(v, dict)]
    lines = [f"# Sweep results ({meta['model']})", "",
             f"Commit `{meta['git_commit'][:12]}`{' (with uncommitted changes)' if meta['git_dirty'] else ''}, "
             f"{meta['machine']['cpu']} ({meta['machine']['cores']} cores), torch {meta['machine']['torch']}, "
             f"{meta['date']}. Val PPL: byte-level perplexity on 16K held-out tokens (two plays never trained on). "
             f"tok/s: training throughput from log.jsonl, relative to the section's baseline. Saved activations: "
             f"bytes autograd keeps for backward in one step (kernels.memory.saved_bytes, batch {MEMORY_SHAPE[0]} x "
             f"{MEMORY_SHAPE[1]}), relative to the baseline. Routing: eval.routing_analysis on 32 held-out windows, "
             f"mean over receivers with 2+ sources of the max mean weight and of H(a)/log N."]
    if not isinstance(memory.get("triton"), dict):
        lines.append(f"Kernel-path memory: {memory.get('triton', 'not measured')}.")
    for section in sections:
        lines += ["", f"## {section.title}", "", section.note, ""]
        head = ["method", "seeds", "steps", "wall s", "val PPL", "PPL vs baseline", "tok/s vs baseline"]
        head += [f"saved act. ({p})" for p in paths] + ["mean max weight", "mean norm. entropy"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows[section.title]:
            n = len(r["runs"])
            cells = [r["label"], ",".join(map(str, r["seeds"])), f"{r['steps']:.0f}", f"{r['wall_s']:.0f}",
                     _pm(r["val_ppl"], r["val_ppl_std"], n, ".3f"),
                     _pm(r["ppl_change_pct"], r["ppl_change_pct_std"], n, "+.2f") + " %",
                     f"{r['tok_per_s_rel']:.2f}x"]
            cells += [f"{r['saved_bytes_rel'][p]:.2f}x" for p in paths]
            cells += ["—" if r["mean_max_weight"] is None else f"{r['mean_max_weight']:.3f}",
                      "—" if r["mean_entropy"] is None else f"{r['mean_entropy']:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(section: Section, figures: dict, path: str, plt) -> bool:
    """Validation loss over steps, mean and min-max band over seeds, per row; and its second half zoomed."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, names in section.rows:
        curves = [np.array(figures[n]["curve"]) for n in names if figures.get(n)]
        if not curves or len({len(c) for c in curves}) > 1:
            continue
        steps, losses = curves[0][:, 0], np.stack([c[:, 1] for c in curves])   # (seeds, points)
        for ax in axes:
            line, = ax.plot(steps, losses.mean(0), "o-", ms=3, label=f"{label} ({len(curves)} seeds)")
            ax.fill_between(steps, losses.min(0), losses.max(0), color=line.get_color(), alpha=0.2)
    drawn = bool(axes[0].lines)
    if drawn:
        half = axes[0].lines[0].get_xdata()[len(axes[0].lines[0].get_xdata()) // 2]
        tail = [y for line in axes[1].lines for x, y in zip(line.get_xdata(), line.get_ydata()) if x >= half]
        axes[1].set(xlim=(half, None), ylim=(min(tail) - 0.01, max(tail) + 0.01), title="second half, zoomed")
        axes[0].set(title=f"{section.title.split(':')[0]}: validation loss, mean and min-max over seeds")
        for ax in axes:
            ax.set(xlabel="step", ylabel="val loss (nats/token)")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def plot_blocks(blocks: list[dict], reference: dict, seed_std: dict[str, float], path: str, plt) -> None:
    """Table 4: PPL against the number of sources, one seed; bars are Table 1's seed std of the method."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    sources = [r["sources"] for r in blocks]
    ax.errorbar(sources, [r["val_ppl"] for r in blocks], yerr=[seed_std.get(r["residual"], 0.0) for r in blocks],
                fmt="o-", capsize=3, label="delta_block with K blocks (K + 1 sources), then delta; seed 0\n"
                                             "bars: Table 1's std over seeds")
    ax.annotate("delta (fine-grained)", (sources[-1], blocks[-1]["val_ppl"]), fontsize=8,
                textcoords="offset points", xytext=(-90, 8))
    ax.axhline(reference["val_ppl"], ls="--", color="gray", label="baseline, seed 0")
    ax.set(xscale="log", xlabel="sources (K + 1 for K blocks; 2L + 1 fine-grained, as the paper counts)",
           ylabel="val PPL", title="PPL vs number of blocks")
    ax.set_xticks(sources, [str(x) for x in sources])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_depth(sections: list[list[dict]], path: str, plt) -> None:
    """Each routed method's PPL change vs the baseline (paired by seed: mean ± std) against the number of layers."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    labels = [r["label"] for r in sections[0][1:]]
    for i, label in enumerate(labels):
        points = sorted((r["n_layers"], r["ppl_change_pct"], r["ppl_change_pct_std"], len(r["runs"]))
                        for rows in sections for r in rows if r["label"] == label)
        if len(points) != len(sections):
            raise ValueError(f"{label!r} is in {len(points)} of the {len(sections)} depth sections")
        layers, change, std, seeds = map(np.array, zip(*points))
        ax.errorbar(layers + 0.4 * (i - (len(labels) - 1) / 2), change, yerr=std, fmt="o-", capsize=3,
                    label=f"{label} ({seeds.min()} seeds)")
    ax.axhline(0.0, ls="--", color="gray", label="baseline")
    depths = sorted({r["n_layers"] for rows in sections for r in rows})
    ax.set_xticks(depths, [str(x) for x in depths])
    ax.set(xlabel="layers (same width, steps and data)", ylabel="val PPL vs baseline (%), mean ± std over seeds",
           title="PPL change vs the baseline by depth (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(sections: list[Section], rows: dict[str, list[dict]], figures: dict, out: str) -> list[str]:
    """The plots the sections ask for: val_loss.png ("curves"; val_loss_<i>.png for a later one), blocks.png,
    depth.png (every "depth" section in one), and routing_*.png (attnres vs delta_block of the first section)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from routing_analysis import plot_routing

    paths = []
    curves = [s for s in sections if "curves" in s.plots]
    for i, section in enumerate(curves):
        path = os.path.join(out, "val_loss.png" if i == 0 else f"val_loss_{i}.png")
        if plot_curves(section, figures, path, plt):
            paths.append(path)
    seed_std = {r["residual"]: r["val_ppl_std"] for r in rows[sections[0].title] if len(r["runs"]) > 1}
    for section in sections:
        blocks = [r for r in rows.get(section.title, []) if r["label"] != "baseline"]
        if "blocks" in section.plots and blocks:
            paths.append(os.path.join(out, "blocks.png"))
            plot_blocks(blocks, rows[section.title][0], seed_std, paths[-1], plt)
    depth = [rows.get(s.title, []) for s in sections if "depth" in s.plots]
    finished = set.intersection(*({r["label"] for r in d} for d in depth)) if depth else set()
    depth = [[r for r in d if r["label"] in finished] for d in depth]   # methods finished at every depth
    if depth and len(depth[0]) > 1 and depth[0][0]["label"] == "baseline":
        paths.append(os.path.join(out, "depth.png"))
        plot_depth(depth, paths[-1], plt)

    routed = {label: figures[names[0]]["routing"] for label, names in sections[0].rows
              if label in ("attnres", "delta_block") and figures.get(names[0])}
    if len(routed) == 2:
        paths += plot_routing(routed, os.path.join(out, "routing"))
    return paths


def machine() -> dict:
    cpu = "unknown"
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cores": os.cpu_count(), "torch": torch.__version__}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()


def summarise(plan: Plan, out: str, triton: bool, invocation_s: float, command: str) -> dict:
    """Write OUT/results.json, OUT/table.md and the plots from whatever runs of the plan have finished."""
    runs, sections = plan.runs, plan.sections
    by_name = {r.name: r for r in runs}
    figures = {r.name: run_figures(r, out) for r in runs}
    configs = {memory_key(r): asdict(model_config(r)) for r in runs}
    memory: dict = {"reference": saved_bytes_for(configs, "reference")}
    memory["triton"] = saved_bytes_triton(configs, 300) if triton else "not measured (--no_triton)"
    rows = {s.title: section_rows(s, by_name, figures, memory) for s in sections}
    model_cfg, train_cfg = load_config([plan.config])
    layers = "/".join(str(n) for n in sorted({model_config(r).n_layers for r in runs}, reverse=True))
    meta = {"command": command, "git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "config": plan.config,
            "model": f"L={layers}, d={model_cfg.d_model}, {train_cfg.max_steps} steps of "
                     f"{train_cfg.batch_size}x{train_cfg.seq_len} tokens",
            "invocation_wall_s": invocation_s,
            "train_wall_s_sum": sum(f["wall_s"] for f in figures.values() if f)}
    results = {**meta, "memory_shape": MEMORY_SHAPE, "saved_bytes": memory,
               "sections": [{"title": s.title, "note": s.note, "rows": rows[s.title]} for s in sections],
               "runs": figures}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(markdown(sections, rows, memory, meta))
    results["plots"] = plot(sections, rows, figures, out)
    return results


def compare(new: dict, old: dict, within: float = 2.0) -> list[dict]:
    """Each row of one sweep's results.json (`new`) against the same row of another (`old`).

    The noise of a difference of two means of n_new and n_old seeds is sigma = s * sqrt(1/n_new + 1/n_old), with s
    the seed-to-seed std of that method in Table 1 (pooled over the two sweeps): one-seed rows have no std of
    their own. A row reproduces when |new - old| <= within * sigma. Rows only one sweep has are left out."""
    def seed_std(results: dict) -> dict[str, float]:     # residual -> std of its first multi-seed row
        out = {}
        for section in results["sections"]:
            for r in section["rows"]:
                if len(r["runs"]) > 1:
                    out.setdefault(r["residual"], r["val_ppl_std"])
        return out
    old_std, new_std = seed_std(old), seed_std(new)
    old_rows = {(s["title"], r["label"]): r for s in old["sections"] for r in s["rows"]}
    rows = []
    for section in new["sections"]:
        for r in section["rows"]:
            o = old_rows.get((section["title"], r["label"]))
            if o is None or r["residual"] not in old_std or r["residual"] not in new_std:
                continue
            s = math.sqrt((old_std[r["residual"]] ** 2 + new_std[r["residual"]] ** 2) / 2)
            sigma = s * math.sqrt(1 / len(r["runs"]) + 1 / len(o["runs"]))
            diff = r["val_ppl"] - o["val_ppl"]
            rows.append({"section": section["title"], "label": r["label"], "old_val_ppl": o["val_ppl"],
                         "new_val_ppl": r["val_ppl"], "diff": diff, "sigma": sigma,
                         "old_steps": o["steps"], "new_steps": r["steps"],
                         "old_tok_per_s_rel": o["tok_per_s_rel"], "new_tok_per_s_rel": r["tok_per_s_rel"],
                         "reproduced": abs(diff) <= within * sigma})
    return rows


def compare_markdown(rows: list[dict], new: dict, old: dict, old_path: str, within: float = 2.0) -> str:
    """compare()'s rows as OUT/compare.md: a table, the count reproduced, and the rows whose steps differ."""
    lines = [f"# Sweep reproduction: {new['git_commit'][:12]} on {new['machine']['cpu']} against {old_path} "
             f"({old['git_commit'][:12]} on {old['machine']['cpu']})", "",
             f"Reproduced: |new - committed| <= {within:g} sigma, sigma = the noise of a difference of means "
             f"(Table 1's seed-to-seed std of the method x sqrt(1/n_new + 1/n_old)). Equal wall-clock rows "
             f"depend on the machine's speed: their steps are shown.", "",
             "| section | method | committed PPL | new PPL | diff | sigma | steps (committed / new) | "
             "tok/s vs baseline (committed / new) | reproduced |", "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['section'].split(':')[0]} | {r['label']} | {r['old_val_ppl']:.3f} | {r['new_val_ppl']:.3f} "
                     f"| {r['diff']:+.3f} | {r['sigma']:.3f} | {r['old_steps']:.0f} / {r['new_steps']:.0f} | "
                     f"{r['old_tok_per_s_rel']:.2f}x / {r['new_tok_per_s_rel']:.2f}x | "
                     f"{'yes' if r['reproduced'] else 'NO'} |")
    lines += ["", f"{sum(r['reproduced'] for r in rows)} of {len(rows)} rows reproduced."]
    moved = [f"{r['label']} ({r['section'].split(':')[0]}: {r['old_steps']:.0f} -> {r['new_steps']:.0f} steps)"
             for r in rows if not r["reproduced"] and abs(r["new_steps"] / r["old_steps"] - 1) > 0.02]
    if moved:
        lines.append(f"Not reproduced with a different step count: {'; '.join(moved)}. An equal wall-clock run's "
                     f"steps come from the speed measured on the machine, which the seed-noise sigma does not cover.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", action="store_true", help="the depth sweep (36 and 12 layers) instead of the tables")
    p.add_argument("--out", help="results folder (default runs/sweep or runs/depth_sweep); runs go to OUT/runs/<name>")
    p.add_argument("--compare", help="a results.json to compare the table with (default: the committed "
                   "results/sweep or results/depth_sweep; '' for none); written to OUT/compare.md")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once (one process each)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--budget_s", type=float, help="equal wall-clock budget (default: the baseline's wall time)")
    p.add_argument("--report_only", action="store_true", help="write the table, JSON and plots; train nothing")
    p.add_argument("--no_triton", action="store_true", help="skip the kernel path's memory count")
    args = p.parse_args(argv)
    if args.compare and not os.path.isfile(args.compare):
        p.error(f"--compare: no results file at {args.compare}")
    plan = depth_plan() if args.depth else full_plan()
    args.out = args.out or os.path.join("runs", plan.name)
    args.compare = plan.committed if args.compare is None else args.compare
    start = time.time()
    failed = [] if args.report_only else execute(plan.runs, args.out, args.jobs, args.threads, args.budget_s)
    torch.set_num_threads(max(1, args.jobs * args.threads))
    results = summarise(plan, args.out, not args.no_triton, time.time() - start,
                        "python sweep.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {os.path.join(args.out, 'results.json')}, {os.path.join(args.out, 'table.md')}, "
          f"{', '.join(results['plots'])} | {_clock(time.time() - start)}")
    mine = os.path.join(args.out, "results.json")
    if args.compare and not os.path.isfile(args.compare):
        print(f"no committed sweep at {args.compare} to compare with")
    elif args.compare and not os.path.samefile(args.compare, mine):
        with open(args.compare) as f:
            old = json.load(f)
        rows = compare(results, old)
        text = (compare_markdown(rows, results, old, args.compare) if rows else
                f"no finished row to compare with {args.compare} yet\n")
        with open(os.path.join(args.out, "compare.md"), "w") as f:
            f.write(text)
        print(text, end="")
    if failed:
        print(f"failed runs: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
