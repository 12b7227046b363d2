"""From finished runs to figures: each run's numbers and where it trained, the table rows with their paired
statistics (experiments/stats.py), results.json, table.md, and the row-by-row comparison of two sweeps."""
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
from experiments.stats import correct, describe, p_cell, paired
from meters.memory import saved_bytes
from model import Model, ModelConfig
from infra.routing_analysis import max_weight_x_n, routing_analysis

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
    kept in OUT/runs/<run>/routing.json (and in OUT/results.json), so a report made again needs no checkpoint;
    compact(), as the sweep's tables and plots need it."""
    path = os.path.join(out_dir, "routing.json")
    if os.path.isfile(path):
        with open(path) as f:
            return compact(json.load(f))
    model, ckpt = trained.load_model(out_dir)
    arrays, _ = evaluation.load_tokens(ckpt, model, None, "val")
    summary = compact(routing_analysis(model, arrays, trained.context_length(ckpt), n_windows=32))
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f)
    os.replace(path + ".tmp", path)
    return summary


def compact(summary: dict) -> dict:
    """A routing summary without its receivers' key-similarity matrices (N x N per view: 8 MB for 36 fine-grained
    layers), which no sweep table or plot reads; their means stay (`eval.py --routing` writes them in full)."""
    return {**summary, "receivers": [{k: v for k, v in r.items() if k != "similarity_matrix"}
                                     for r in summary["receivers"]]}


# What must agree for two runs to be compared: the same seed trains to other digits on another CPU, ISA level,
# thread count, torch or code (a commit, and whether tracked files differed from it).
ORIGIN_KEYS = ("cpu", "isa", "threads", "torch", "commit", "dirty")


def origin(log: list[dict]) -> dict | None:
    """Where a run trained, from the provenance records train.py writes at every start of the run (None for a
    log from before they existed); a run resumed elsewhere has no single origin and is refused."""
    places = [{k: r["provenance"].get(k) for k in ORIGIN_KEYS} for r in log if "provenance" in r]
    if any(p != places[0] for p in places[1:]):
        raise ValueError(f"a run trained in {len(places)} places ({places}): it compares with no other run")
    return places[0] if places else None


def origin_key(figures: dict) -> tuple:
    """Runs pair only when this agrees; runs whose logs predate the records share the key 'not recorded'."""
    place = figures.get("origin")
    return tuple(place[k] for k in ORIGIN_KEYS) if place else ("not recorded",)


def origin_label(key: tuple) -> str:
    if key == ("not recorded",):
        return "not recorded"
    cpu, isa, threads, torch_version, commit, dirty = key
    return (f"{cpu}, {isa}, {threads} thread{'s' * (threads != 1)}, torch {torch_version}, commit {commit[:8]}"
            + (" with uncommitted changes" if dirty else ""))


def run_figures(run: Run, out: str, kept: dict | None = None) -> dict | None:
    """A finished run's numbers from its log.jsonl (and checkpoint, for routing), else the figures an earlier
    report kept of it in OUT/results.json (`kept`: a committed sweep holds no per-run logs) if they are of the
    same run; None if it is not finished."""
    out_dir = os.path.join(out, "runs", run.name)
    log = read_log(out_dir)
    final = next((r for r in log if r.get("final")), None)
    if final is None:
        if kept is None or kept.get("overrides") != run.overrides:
            return None
        return {**kept, "routing": compact(kept["routing"])} if "routing" in kept else kept
    speeds = [r["tok_per_s"] for r in log if "tok_per_s" in r]
    speeds = speeds[1:] or speeds          # the first interval includes start-up, unless it is the only one
    cfg = model_config(run)
    figures = {"overrides": run.overrides, "pace_from": list(run.pace_from), "origin": origin(log),
               "val_ppl": final["val_ppl"],
               "val_loss": final["val_loss"], "step": final["step"], "wall_s": final["wall_s"],
               "tok_per_s": float(np.mean(speeds)),
               "curve": [[r["step"], r["val_loss"]] for r in log if "val_loss" in r]}
    if cfg.residual != "baseline":
        figures["routing"] = routing_summary(out_dir)
    return figures


def _mean_std(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def section_rows(section: Section, runs: dict[str, Run], figures: dict, memory: dict) -> list[dict]:
    """One dict per row with every table column, from the row's finished runs that pair with the first row's
    (the baseline's) run of the same seed trained in the same place; rows with no such run are left out, and the
    runs that have no partner are named in `unpaired`."""
    ref = {runs[n].overrides["seed"]: figures[n] for n in section.rows[0][1] if figures.get(n)}
    ref_key = memory_key(runs[section.rows[0][1][0]])
    ref_speed = np.mean([f["tok_per_s"] for f in ref.values()]) if ref else float("nan")
    rows = []
    for label, names in section.rows:
        finished = [n for n in names if figures.get(n)]
        paired_names = [n for n in finished if runs[n].overrides["seed"] in ref and
                        origin_key(figures[n]) == origin_key(ref[runs[n].overrides["seed"]])]
        if not paired_names:
            continue
        got = [figures[n] for n in paired_names]
        seeds = [runs[n].overrides["seed"] for n in paired_names]
        ppl, ppl_std = _mean_std([f["val_ppl"] for f in got])
        # Paired by seed: the same seed gives every method the same backbone init and the same batches.
        change = [100 * (f["val_ppl"] / ref[s]["val_ppl"] - 1) for f, s in zip(got, seeds)]
        key = memory_key(runs[names[0]])
        cfg = model_config(runs[names[0]])
        rows.append({
            "label": label, "runs": paired_names, "unpaired": [n for n in finished if n not in paired_names],
            "origins": sorted({origin_label(origin_key(f)) for f in got}), "residual": cfg.residual,
            "n_layers": cfg.n_layers, "sources": n_sources(cfg), "seeds": seeds,
            "steps": float(np.mean([f["step"] for f in got])), "wall_s": float(np.mean([f["wall_s"] for f in got])),
            "val_ppl": ppl, "val_ppl_std": ppl_std, "ppl_change_pct": float(np.mean(change)),
            "ppl_change_pct_seeds": change, "change": paired(change) if label != section.rows[0][0] else None,
            "tok_per_s_rel": float(np.mean([f["tok_per_s"] for f in got]) / ref_speed),
            "saved_bytes_rel": {k: v[key] / v[ref_key] for k, v in memory.items() if isinstance(v, dict)},
            **routing_means([f["routing"] for f in got if "routing" in f])})
    return rows


ROUTING_MEANS = ("mean_max_weight", "mean_max_weight_x_n", "mean_entropy", "mean_similarity_deltas",
                 "mean_similarity_states")


def routing_means(summaries: list[dict]) -> dict:
    """The routing headline over a row's seeds: {key: mean over the runs' routing summaries that have it, or
    None} for ROUTING_MEANS (max weight × N computed from the receivers where a summary predates it; a summary
    from before the key similarities has None for them)."""
    def mean(key: str) -> float | None:
        values = [max_weight_x_n(r["receivers"]) if key not in r else r[key] for r in summaries]
        values = [v for v in values if v is not None]
        return float(np.mean(values)) if values else None
    return {k: mean(k) for k in ROUTING_MEANS}


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
    factor); its reading (stats.paired) is over seeds, and `agree` counts the seeds whose effect has the mean's
    sign. Points are paired by seed throughout, so the baseline's own seed noise cancels; a seed enters only where
    every point has it."""
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
            reading = paired([float(v) for v in per_seed])
            effects.append({"factor": factor, "contrast": f"{high} - {low}", "within": scope, "seeds": seeds,
                            "effect_pct": reading["mean"], "change": reading, "per_seed": [float(v) for v in per_seed],
                            "agree": int(sum(np.sign(v) == np.sign(reading["mean"]) for v in per_seed))})
    return effects


def factorial_markdown(effects: list[dict]) -> list[str]:
    lines = ["", "Effects on the PPL change vs the baseline (percentage points, paired by seed; mean [95 % "
             "interval]; p Holm-corrected over the sweep, uncorrected in brackets, ✓ below 0.05; 'agree': seeds "
             "with the mean's sign):", "",
             "| factor | contrast | within | effect | n | p | per seed | agree |", "|" + "---|" * 8]
    for e in effects:
        lines.append(f"| {e['factor']} | {e['contrast']} | {e['within']} | {describe(e['change'], '')} | "
                     f"{e['change']['n']} | {p_cell(e['change'])} | {', '.join(f'{v:+.2f}' for v in e['per_seed'])} "
                     f"| {e['agree']}/{len(e['per_seed'])} |")
    return lines


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else f"{value:{fmt}}"


def markdown(sections: list[Section], rows: dict[str, list[dict]], memory: dict, meta: dict,
             effects: dict[str, list[dict]] | None = None) -> str:
    paths = [k for k, v in memory.items() if isinstance(v, dict)]
    lines = [f"# Sweep results ({meta['model']})", "",
             f"Report made at commit `{meta['git_commit'][:12]}`"
             f"{' (with uncommitted changes)' if meta['git_dirty'] else ''} on {meta['machine']['cpu']}, "
             f"{meta['date']}; where each run trained is under its section, and a run is paired only with the "
             f"baseline's run of its seed trained in the same place (CPU, ISA level, threads, torch, commit). "
             f"Val PPL: byte-level perplexity on 16K held-out tokens (two plays never trained on), mean ± std over "
             f"seeds. PPL vs baseline: the paired change's mean [95 % interval], n seeds; p: Holm-corrected over "
             f"the sweep's {meta['contrasts']} contrasts (uncorrected in brackets), ✓ below 0.05, the only changes "
             f"this table resolves. tok/s: training throughput from log.jsonl, relative to the section's baseline. "
             f"Saved activations: bytes autograd keeps for backward in one step (meters.memory.saved_bytes, "
             f"batch {MEMORY_SHAPE[0]} x {MEMORY_SHAPE[1]}), relative to the baseline. Routing: "
             f"infra.routing_analysis on 32 held-out windows, mean over receivers with 2+ sources of the per-token "
             f"max weight, of max weight × N (1 for a uniform read over N sources, N for a one-hot one: comparable "
             f"across methods whose receivers see different N) and of the normalised entropy H(a)/log N; key "
             f"similarity: the mean pairwise cosine of the keys RMSNorm(s_i) a receiver's query sees, for its "
             f"sources as deltas and as cumulative states (the paper's redundancy, whichever the model routes over)."]
    if not isinstance(memory.get("triton"), dict):
        lines.append(f"Kernel-path memory: {memory.get('triton', 'not measured')}.")
    for section in sections:
        lines += ["", f"## {section.title}", "", section.note, ""]
        head = ["method", "n", "seeds", "steps", "wall s", "val PPL", "PPL vs baseline", "p", "tok/s vs baseline"]
        head += [f"saved act. ({p})" for p in paths] + ["max weight", "max weight × N", "norm. entropy",
                                                         "key sim. deltas", "key sim. states"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows[section.title]:
            n = len(r["runs"])
            cells = [r["label"], str(n), ",".join(map(str, r["seeds"])), f"{r['steps']:.0f}", f"{r['wall_s']:.0f}",
                     f"{r['val_ppl']:.3f}" + (f" ± {r['val_ppl_std']:.3f}" if n > 1 else ""),
                     "—" if r["change"] is None else describe(r["change"]),
                     "—" if r["change"] is None else p_cell(r["change"]), f"{r['tok_per_s_rel']:.2f}x"]
            cells += [f"{r['saved_bytes_rel'][p]:.2f}x" for p in paths]
            cells += [_cell(r["mean_max_weight"], ".3f"), _cell(r["mean_max_weight_x_n"], ".2f"),
                      _cell(r["mean_entropy"], ".3f"), _cell(r["mean_similarity_deltas"], ".3f"),
                      _cell(r["mean_similarity_states"], ".3f")]
            lines.append("| " + " | ".join(cells) + " |")
        places = sorted({o for r in rows[section.title] for o in r["origins"]})
        if places:
            lines += ["", "Trained on: " + "; ".join(places) + "."]
        unpaired = [n for r in rows[section.title] for n in r["unpaired"]]
        if unpaired:
            lines.append(f"Left out, with no finished baseline run of their seed from the same place: "
                         f"{', '.join(unpaired)}.")
        if (effects or {}).get(section.title):
            lines += factorial_markdown(effects[section.title])
    return "\n".join(lines) + "\n"


def summarise(plan: Plan, out: str, triton: bool, invocation_s: float, command: str) -> dict:
    """Write OUT/results.json, OUT/table.md and the plots from whatever runs of the plan have finished."""
    runs, sections = plan.runs, plan.sections
    by_name = {r.name: r for r in runs}
    kept = {}
    if os.path.isfile(os.path.join(out, "results.json")):
        with open(os.path.join(out, "results.json")) as f:
            kept = json.load(f).get("runs", {})
    figures = {r.name: run_figures(r, out, kept.get(r.name)) for r in runs}
    configs = {memory_key(r): asdict(model_config(r)) for r in runs}
    memory: dict = {"reference": saved_bytes_for(configs, "reference")}
    memory["triton"] = saved_bytes_triton(configs, 1200) if triton else "not measured (--no_triton)"
    rows = {s.title: section_rows(s, by_name, figures, memory) for s in sections}
    effects = {s.title: factorial(s, by_name, rows[s.title]) for s in sections if "grid" in s.plots}
    # one family: every change vs a baseline and every factorial effect the sweep reports
    changes = [r for rs in rows.values() for r in rs if r["change"]]
    effects_all = [(title, e) for title, es in effects.items() for e in es]
    contrasts = correct([r["change"] for r in changes] + [e["change"] for _, e in effects_all],
                        [tuple(r["runs"]) for r in changes] + [(t, e["factor"], e["within"]) for t, e in effects_all])
    model_cfg, train_cfg = load_config([plan.config])
    layers = "/".join(str(n) for n in sorted({model_config(r).n_layers for r in runs}, reverse=True))
    # uncommitted changes to the code, not to the results being rewritten
    dirty = bool(runlog.git("status", "--porcelain", "--untracked-files=no", "--", ".",
                     f":!{os.path.relpath(os.path.abspath(out), ROOT)}"))
    meta = {"command": command, "git_commit": runlog.git("rev-parse", "HEAD"), "git_dirty": dirty,
            "machine": runlog.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "config": plan.config,
            "model": f"L={layers}, d={model_cfg.d_model}, {train_cfg.max_steps} steps of "
                     f"{train_cfg.batch_size}x{train_cfg.seq_len} tokens",
            "contrasts": contrasts, "invocation_wall_s": invocation_s,
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
    their own. A row reproduces when |new - old| <= within * sigma. Rows only one sweep has are left out; sections
    match by name, whatever their seed counts ("Equal wall-clock, seed 0" and "Equal wall-clock, 3 seeds")."""
    def seed_std(results: dict) -> dict[str, float]:     # residual -> std of its first multi-seed row
        out = {}
        for section in results["sections"]:
            for r in section["rows"]:
                if len(r["runs"]) > 1:
                    out.setdefault(r["residual"], r["val_ppl_std"])
        return out
    old_std, new_std = seed_std(old), seed_std(new)
    key = lambda title: title.split(":")[0].split(",")[0]   # a section's name without its seed count
    old_rows = {(key(s["title"]), r["label"]): r for s in old["sections"] for r in s["rows"]}
    rows = []
    for section in new["sections"]:
        for r in section["rows"]:
            o = old_rows.get((key(section["title"]), r["label"]))
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
