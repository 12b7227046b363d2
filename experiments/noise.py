"""Where a sweep's noise comes from, so that compute goes where it narrows the intervals most.

    python -m experiments.noise runs/depth_sweep --baseline l36_baseline \
        --methods l36_attnres,l36_delta_block,l36_delta --out results/depth_sweep/noise.json

A paired change (a method's val PPL vs the baseline's, same seed) moves for two reasons: the seed (init and
batches) and the held-out sample it is measured on. For every seed both runs finished (their final checkpoints
in DIR/runs/<name>_s<seed>/), both models' loss on every window of the whole held-out split gives

- the change measured on the first 16K tokens (the sweep's own val PPL: the log's, checked) and on the whole split;
- the held-out sample's share: the standard error of the mean per-window loss difference, for 16K tokens and for
  the whole split (windows taken as independent, which the models' per-window differences nearly are);
- the seed's share: the std over seeds of the change, on 16K tokens and on the whole split.

If the seed's std is far above the sample's standard error, a larger held-out set cannot narrow the intervals and
more seeds can. The logs' validation curves add the same std at each evaluation step (a longer schedule's effect
on the spread, read from one schedule's intermediate points). Writes the JSON and prints a table."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import eval as evaluation
from infra import shards, trained
from experiments.report import origin
from experiments.runner import read_log


@torch.no_grad()
def window_losses(out_dir: str, batch_size: int = 16) -> tuple[np.ndarray, int]:
    """(mean loss of every full window of the run's held-out split, in order (n_windows,), window length)."""
    model, ckpt = trained.load_model(out_dir)
    seq_len = trained.context_length(ckpt)
    arrays, _ = evaluation.load_tokens(ckpt, model, None, "val")
    chunks = [w for arr in arrays for w in shards.windows(np.asarray(arr), seq_len) if len(w) == seq_len + 1]
    losses = []
    for i in range(0, len(chunks), batch_size):
        spans = torch.from_numpy(np.stack(chunks[i:i + batch_size]).astype(np.int64))
        logits = model(spans[:, :-1])
        losses.append(F.cross_entropy(logits.flatten(0, 1), spans[:, 1:].flatten(), reduction="none")
                      .view(len(spans), seq_len).mean(1).numpy())
    return np.concatenate(losses), seq_len


def change_pct(method: np.ndarray, baseline: np.ndarray) -> float:
    """The val PPL change (%) of one model against another on the same windows."""
    return 100 * (math.exp(method.mean() - baseline.mean()) - 1)


def curve_std(logs: dict[str, list[dict]], method: str, baseline: str, seeds: list[int]) -> list[list[float]]:
    """[[step, std over seeds of the paired change at that evaluation], ...] from the runs' validation curves."""
    curves = [{r["step"]: r["val_loss"] for r in logs[f"{name}_s{s}"] if "val_loss" in r}
              for name in (method, baseline) for s in seeds]
    m, b = curves[:len(seeds)], curves[len(seeds):]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return [[step, float(np.std([100 * (math.exp(mc[step] - bc[step]) - 1) for mc, bc in zip(m, b)], ddof=1))]
            for step in steps]


def same_place(a: list[dict], b: list[dict]) -> bool:
    """Whether two runs' logs trained on one machine and commit (report.origin: both unrecorded counts as one
    place, as the report pairs them)."""
    return origin(a) == origin(b)


def measure(sweep: str, baseline: str, methods: list[str], eval_windows: int) -> dict:
    runs = os.path.join(sweep, "runs")
    logs = {name: read_log(os.path.join(runs, name)) for name in os.listdir(runs)}
    finished = {name for name, log in logs.items() if any(r.get("final") for r in log)}
    cache: dict[str, np.ndarray] = {}

    def losses(name: str) -> np.ndarray:
        if name not in cache:
            cache[name], _ = window_losses(os.path.join(runs, name))
            logged = next(r["val_loss"] for r in logs[name] if r.get("final"))
            if not math.isclose(cache[name][:eval_windows].mean(), logged, rel_tol=1e-4):
                raise ValueError(f"{name}: the first {eval_windows} windows give loss "
                                 f"{cache[name][:eval_windows].mean():.5f}, its log {logged:.5f}")
        return cache[name]

    out = {}
    for method in methods:
        seeds = sorted(int(n.rsplit("_s", 1)[1]) for n in finished if n.rsplit("_s", 1)[0] == method
                       and f"{baseline}_s{n.rsplit('_s', 1)[1]}" in finished)
        seeds = [s for s in seeds if same_place(logs[f"{method}_s{s}"], logs[f"{baseline}_s{s}"])]
        rows = []
        for s in seeds:
            m, b = losses(f"{method}_s{s}"), losses(f"{baseline}_s{s}")
            diff = m - b
            rows.append({"seed": s, "change_16k": change_pct(m[:eval_windows], b[:eval_windows]),
                         "change_all": change_pct(m, b),
                         "sample_se_16k": 100 * float(diff.std(ddof=1)) / math.sqrt(eval_windows),
                         "sample_se_all": 100 * float(diff.std(ddof=1)) / math.sqrt(len(diff))})
        std = (lambda k: float(np.std([r[k] for r in rows], ddof=1)) if len(rows) > 1 else None)
        out[method] = {"seeds": seeds, "windows": len(cache[f"{baseline}_s{seeds[0]}"]) if seeds else 0,
                       "seed_std_16k": std("change_16k"), "seed_std_all": std("change_all"),
                       "sample_se_16k": float(np.mean([r["sample_se_16k"] for r in rows])) if rows else None,
                       "sample_se_all": float(np.mean([r["sample_se_all"] for r in rows])) if rows else None,
                       "curve_std": curve_std(logs, method, baseline, seeds) if len(seeds) > 1 else [],
                       "per_seed": rows}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", help="a sweep's folder (its runs/<name>_s<seed>/ hold the final checkpoints)")
    p.add_argument("--baseline", required=True, help="the baseline's run name without _s<seed>")
    p.add_argument("--methods", required=True, help="comma-separated run names without _s<seed>")
    p.add_argument("--eval_windows", type=int, default=256, help="windows of the sweep's own val PPL (16 x 16)")
    p.add_argument("--out", help="JSON to write")
    args = p.parse_args(argv)
    if not os.path.isdir(os.path.join(args.sweep, "runs")):
        p.error(f"{args.sweep}: no runs/ folder in it")
    result = measure(args.sweep, args.baseline, args.methods.split(","), args.eval_windows)
    print("| method | n | seed std, 16K tokens | seed std, whole split | held-out SE, 16K | held-out SE, whole |")
    print("|---|---|---|---|---|---|")
    fmt = (lambda v: "—" if v is None else f"{v:.2f}")
    for method, r in result.items():
        print(f"| {method} | {len(r['seeds'])} | {fmt(r['seed_std_16k'])} | {fmt(r['seed_std_all'])} | "
              f"{fmt(r['sample_se_16k'])} | {fmt(r['sample_se_all'])} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m experiments.noise " + " ".join(sys.argv[1:] if argv is None else argv),
                       "unit": "percentage points of the val PPL change", "methods": result}, f, indent=1)
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
