"""From finished runs to figures: each run's numbers, the table rows with seed statistics, results.json,
table.md, the machine and commit they came from, and the row-by-row comparison of two sweeps."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

import eval as evaluation
from infra import runlog, trained
from infra.config import load_config
from experiments.plan import Plan, Run, Section, memory_key, model_config, n_sources
from experiments.plots import plot
from experiments.runner import read_log
from meters.memory import saved_bytes
from model import Model, ModelConfig
from infra.routing_analysis import routing_analysis

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MEMORY_SHAPE = (2, 64)   # (batch, seq_len) of the saved-bytes count: per-token ratios do not depend on it


def saved_bytes_for(configs: dict[str, dict], kernel: str) -> dict[str, int]:
    """{key: bytes saved for backward by one step of the model with that ModelConfig (as a dict)} on `kernel`'s
    path, for a MEMORY_SHAPE batch of the same random tokens. On CPU the kernel path needs TRITON_INTERPRET=1."""
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
    code = ("import json, sys; from experiments import report; "
            "json.dump(report.saved_bytes_for(json.loads(sys.argv[1]), 'triton'), sys.stdout)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(configs)], capture_output=True, text=True,
                              timeout=timeout_s, env=env, cwd=ROOT)
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
        change = [100 * (f["val_ppl"] / ref.get(s, next(iter(ref.values())))["val_ppl"] - 1)
                  for f, s in zip(got, seeds)]
        change_mean, change_std = _mean_std(change)
        routed = [f["routing"] for f in got if "routing" in f]
        key = memory_key(runs[names[0]])
        cfg = model_config(runs[names[0]])
        rows.append({
            "label": label, "runs": names, "residual": cfg.residual, "n_layers": cfg.n_layers,
            "sources": n_sources(cfg), "seeds": seeds, "steps": float(np.mean([f["step"] for f in got])),
            "wall_s": float(np.mean([f["wall_s"] for f in got])), "val_ppl": ppl, "val_ppl_std": ppl_std,
            "ppl_change_pct": change_mean, "ppl_change_pct_std": change_std, "ppl_change_pct_seeds": change,
            "tok_per_s_rel": float(np.mean([f["tok_per_s"] for f in got]) / ref_speed),
            "saved_bytes_rel": {k: v[key] / v[ref_key] for k, v in memory.items() if isinstance(v, dict)},
            "mean_max_weight": float(np.mean([r["mean_max_weight"] for r in routed])) if routed else None,
            "mean_entropy": float(np.mean([r["mean_entropy"] for r in routed])) if routed else None})
    return rows


# The grid's factors (plan.GRID): each routed point is one level of each; the authors' variant and the baseline
# are outside the 2 x 2 x 2 design.
FACTORS = {"sources": ("deltas", "states"), "use": ("replacement", "additive"), "granularity": ("fine", "block")}


def factor_levels(cfg: ModelConfig) -> dict[str, str] | None:
    """The grid point a config is: {factor: level}, or None outside the design."""
    if cfg.residual == "baseline" or cfg.block_source != "boundary":
        return None
    return {"sources": cfg.sources, "use": "additive" if cfg.residual in ("delta", "delta_block") else "replacement",
            "granularity": "fine" if cfg.residual in ("delta", "full_attnres") else "block"}


def factorial(section: Section, runs: dict[str, Run], rows: list[dict]) -> list[dict]:
    """The grid's effects on the paired PPL change (%), one per factor and per level of each other factor.

    A factor's effect at seed s is the mean change of the points at its second level minus the mean at its first
    (a main effect over every point of the design in the section, or a simple effect within one level of another
    factor); the mean and std are over seeds, and `agree` counts the seeds whose effect has the mean's sign. Points
    are paired by seed throughout, so the baseline's own seed noise cancels."""
    points = []
    for r in rows:
        levels = factor_levels(model_config(runs[r["runs"][0]]))
        if levels is not None:
            points.append((levels, dict(zip(r["seeds"], r["ppl_change_pct_seeds"]))))
    seeds = sorted(set.intersection(*(set(c) for _, c in points))) if points else []
    effects = []
    for factor, (low, high) in FACTORS.items():
        present = {lv[factor] for lv, _ in points}
        if present != {low, high}:
            continue
        scopes = [("all", None)] + [(f"{other}={level}", (other, level)) for other in FACTORS if other != factor
                                    for level in FACTORS[other] if len({lv[other] for lv, _ in points}) > 1]
        for scope, within in scopes:
            chosen = [(lv, c) for lv, c in points if within is None or lv[within[0]] == within[1]]
            if len({lv[factor] for lv, _ in chosen}) < 2:
                continue
            per_seed = [np.mean([c[s] for lv, c in chosen if lv[factor] == high]) -
                        np.mean([c[s] for lv, c in chosen if lv[factor] == low]) for s in seeds]
            mean, std = _mean_std(per_seed)
            effects.append({"factor": factor, "contrast": f"{high} - {low}", "within": scope, "seeds": seeds,
                            "effect_pct": mean, "effect_pct_std": std, "per_seed": [float(v) for v in per_seed],
                            "agree": int(sum(np.sign(v) == np.sign(mean) for v in per_seed))})
    return effects


def factorial_markdown(effects: list[dict]) -> list[str]:
    lines = ["", "Effects on the PPL change vs the baseline (percentage points, paired by seed; mean ± std over "
             "seeds; 'agree': seeds with the mean's sign):", "",
             "| factor | contrast | within | effect | per seed | agree |", "|---|---|---|---|---|---|"]
    for e in effects:
        lines.append(f"| {e['factor']} | {e['contrast']} | {e['within']} | {e['effect_pct']:+.2f} ± "
                     f"{e['effect_pct_std']:.2f} | {', '.join(f'{v:+.2f}' for v in e['per_seed'])} | "
                     f"{e['agree']}/{len(e['per_seed'])} |")
    return lines


def _pm(mean: float, std: float, n: int, fmt: str) -> str:
    return f"{mean:{fmt}} ± {std:{fmt.lstrip('+')}}" if n > 1 else f"{mean:{fmt}}"


def markdown(sections: list[Section], rows: dict[str, list[dict]], memory: dict, meta: dict,
             effects: dict[str, list[dict]] | None = None) -> str:
    paths = [k for k, v in memory.items() if isinstance(v, dict)]
    lines = [f"# Sweep results ({meta['model']})", "",
             f"Commit `{meta['git_commit'][:12]}`{' (with uncommitted changes)' if meta['git_dirty'] else ''}, "
             f"{meta['machine']['cpu']} ({meta['machine']['cores']} cores), torch {meta['machine']['torch']}, "
             f"{meta['date']}. Val PPL: byte-level perplexity on 16K held-out tokens (two plays never trained on). "
             f"tok/s: training throughput from log.jsonl, relative to the section's baseline. Saved activations: "
             f"bytes autograd keeps for backward in one step (meters.memory.saved_bytes, "
             f"batch {MEMORY_SHAPE[0]} x {MEMORY_SHAPE[1]}), relative to the baseline. Routing: infra.routing_analysis "
             f"on 32 held-out windows, "
             f"mean over receivers with 2+ sources of the per-token max weight and normalised entropy H(a)/log N, "
             f"averaged over tokens."]
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
        if (effects or {}).get(section.title):
            lines += factorial_markdown(effects[section.title])
    return "\n".join(lines) + "\n"


def summarise(plan: Plan, out: str, triton: bool, invocation_s: float, command: str) -> dict:
    """Write OUT/results.json, OUT/table.md and the plots from whatever runs of the plan have finished."""
    runs, sections = plan.runs, plan.sections
    by_name = {r.name: r for r in runs}
    figures = {r.name: run_figures(r, out) for r in runs}
    configs = {memory_key(r): asdict(model_config(r)) for r in runs}
    memory: dict = {"reference": saved_bytes_for(configs, "reference")}
    memory["triton"] = saved_bytes_triton(configs, 300) if triton else "not measured (--no_triton)"
    rows = {s.title: section_rows(s, by_name, figures, memory) for s in sections}
    effects = {s.title: factorial(s, by_name, rows[s.title]) for s in sections if "grid" in s.plots}
    model_cfg, train_cfg = load_config([plan.config])
    layers = "/".join(str(n) for n in sorted({model_config(r).n_layers for r in runs}, reverse=True))
    # uncommitted changes to the code, not to the results being rewritten
    dirty = bool(runlog.git("status", "--porcelain", "--untracked-files=no", "--", ".",
                     f":!{os.path.relpath(os.path.abspath(out), ROOT)}"))
    meta = {"command": command, "git_commit": runlog.git("rev-parse", "HEAD"), "git_dirty": dirty,
            "machine": runlog.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "config": plan.config,
            "model": f"L={layers}, d={model_cfg.d_model}, {train_cfg.max_steps} steps of "
                     f"{train_cfg.batch_size}x{train_cfg.seq_len} tokens",
            "invocation_wall_s": invocation_s,
            "train_wall_s_sum": sum(f["wall_s"] for f in figures.values() if f)}
    results = {**meta, "memory_shape": MEMORY_SHAPE, "saved_bytes": memory,
               "sections": [{"title": s.title, "note": s.note, "rows": rows[s.title],
                             **({"factorial": effects[s.title]} if s.title in effects else {})} for s in sections],
               "runs": figures}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(markdown(sections, rows, memory, meta, effects))
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
