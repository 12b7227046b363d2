"""The sweep's machinery (experiments/) on a 2-run plan of a few steps: training, skipping finished runs, redoing an
unfinished one, the equal wall-clock pacing, and the table and JSON it writes."""
import json
import os
import shutil

import pytest

from experiments import plan as plans, plots, report, runner, sweep
from experiments.plan import Plan, Run, Section

TINY = {"d_model": 16, "n_layers": 2, "n_blocks": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 8, "d_ff": 32,
        "seq_len": 16, "batch_size": 4, "micro_batch_size": 4, "max_steps": 6, "warmup_steps": 2,
        "eval_interval": 3, "eval_batches": 2, "log_interval": 2}


def plan():
    runs = [Run("base_s0", {**TINY, "residual": "baseline", "seed": 0}),
            Run("db_s0", {**TINY, "residual": "delta_block", "seed": 0}, 1.3)]
    sections = [Section("Tiny", "two runs", [("baseline", ["base_s0"]), ("delta_block", ["db_s0"])], ("curves",))]
    return Plan("tiny", plans.CONFIG, runs, sections)


def log_path(out, name):
    return os.path.join(out, "runs", name, "log.jsonl")


def test_sweep_trains_skips_redoes_and_reports(tmp_path, capsys):
    out = str(tmp_path)
    tiny = plan()
    runs = tiny.runs
    assert runner.execute(runs, out, jobs=1, threads=1) == []
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(lines) == 2 and all("trained" in line and "val ppl" in line for line in lines)
    assert lines[-1].startswith("[ 2/2]")

    # An interrupted run: its log lost the final record. The finished run must be left alone.
    base_log = open(log_path(out, "base_s0")).read()
    base_mtime = os.stat(log_path(out, "base_s0")).st_mtime_ns
    records = [json.loads(line) for line in open(log_path(out, "db_s0"))]
    with open(log_path(out, "db_s0"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records if not r.get("final"))
    assert runner.execute(runs, out, jobs=1, threads=1) == []
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [("skipped" in line, "trained" in line) for line in lines] == [(True, False), (False, True)]
    assert open(log_path(out, "base_s0")).read() == base_log
    assert os.stat(log_path(out, "base_s0")).st_mtime_ns == base_mtime
    redone = [json.loads(line) for line in open(log_path(out, "db_s0"))]
    assert sum(bool(r.get("final")) for r in redone) == 1 and len(redone) == len(records)

    results = report.summarise(tiny, out, triton=False, invocation_s=1.0, command="test")
    saved = json.load(open(os.path.join(out, "results.json")))
    assert {"git_commit", "machine", "date", "saved_bytes", "sections", "runs"} <= set(saved)
    assert {"platform", "cpu", "torch"} <= set(saved["machine"])
    base, db = saved["sections"][0]["rows"]
    assert base["ppl_change_pct"] == 0 and base["tok_per_s_rel"] == 1 and base["saved_bytes_rel"]["reference"] == 1
    assert base["mean_max_weight"] is None
    assert 0 < db["mean_max_weight"] <= 1 and 0 < db["mean_entropy"] <= 1
    assert db["saved_bytes_rel"]["reference"] > 1          # the sources are kept for backward
    assert db["val_ppl"] == pytest.approx(saved["runs"]["db_s0"]["val_ppl"])
    assert [p for p, _ in saved["runs"]["db_s0"]["curve"]] == [3, 6]
    table = open(os.path.join(out, "table.md")).read().splitlines()
    header = next(line for line in table if line.startswith("| method"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "method", "n", "seeds", "steps", "wall s", "val PPL", "PPL vs baseline", "p", "tok/s vs baseline",
        "saved act. (reference)", "max weight", "max weight × N", "norm. entropy", "key sim. deltas",
        "key sim. states"]
    assert 0 < db["mean_similarity_states"] <= 1 and db["mean_similarity_deltas"] is not None
    assert any(line.startswith("| delta_block | 1 | 0 | 6 |") for line in table)
    assert db["mean_max_weight_x_n"] == pytest.approx(saved["runs"]["db_s0"]["routing"]["mean_max_weight_x_n"])
    here = saved["runs"]["db_s0"]["origin"]                 # where each run trained, from its own log
    assert here["commit"] == saved["git_commit"] and here["threads"] == 1 and here["isa"]
    assert f"Trained on: {report.origin_label(report.origin_key(saved['runs']['db_s0']))}." in table
    assert results["plots"] == [os.path.join(out, "val_loss.png")] and os.path.getsize(results["plots"][0]) > 0

    # A clean clone has the logs and routing.json but no checkpoints: the report must come out the same.
    os.remove(os.path.join(out, "runs", "db_s0", "routing.json"))
    report.summarise(tiny, out, triton=False, invocation_s=1.0, command="test")   # writes it again
    assert json.load(open(os.path.join(out, "runs", "db_s0", "routing.json"))) == saved["runs"]["db_s0"]["routing"]
    receivers = saved["runs"]["db_s0"]["routing"]["receivers"]
    assert "similarity_matrix" not in receivers[-1] and receivers[-1]["similarity_deltas"] is not None
    for name in ("base_s0", "db_s0"):
        for f in os.listdir(os.path.join(out, "runs", name)):
            if f.endswith(".pt"):
                os.remove(os.path.join(out, "runs", name, f))
    again = report.summarise(tiny, out, triton=False, invocation_s=1.0, command="test")
    assert again["sections"] == saved["sections"]
    # A committed sweep keeps no per-run folders: the figures its results.json kept make the same report.
    shutil.rmtree(os.path.join(out, "runs"))
    kept = report.summarise(tiny, out, triton=False, invocation_s=1.0, command="test")
    assert kept["sections"] == saved["sections"] and kept["runs"] == json.loads(json.dumps(saved["runs"]))
    changed = Plan("tiny", plans.CONFIG, [Run("base_s0", {**TINY, "residual": "baseline", "seed": 0, "d_model": 8}),
                                          *tiny.runs[1:]], tiny.sections)
    assert report.summarise(changed, out, triton=False, invocation_s=1.0, command="test")["runs"]["base_s0"] is None


def test_equal_wall_clock_pace(tmp_path):
    """The budget is the baseline's mean equal-steps wall time; each method's schedule is the steps it made in it."""
    out = str(tmp_path)
    walls = {"t1_baseline_s0": (600, 100.0), "t1_baseline_s1": (600, 120.0), "t1_delta_s0": (600, 330.0),
             "precision_baseline_s0": (600, 40.0)}      # a baseline of another section: not the budget's
    for name, (step, wall) in walls.items():
        os.makedirs(os.path.join(out, "runs", name))
        with open(log_path(out, name), "w") as f:
            f.write(json.dumps({"step": step, "val_loss": 1.0, "val_ppl": 2.7, "final": True, "wall_s": wall}) + "\n")
    runs = [Run("t1_baseline_s0", {"residual": "baseline", "seed": 0}),
            Run("t1_baseline_s1", {"residual": "baseline", "seed": 1}),
            Run("t1_delta_s0", {"residual": "delta", "seed": 0}),
            Run("precision_baseline_s0", {"residual": "baseline", "seed": 0}),
            Run("wall_baseline_s0", {"residual": "baseline", "seed": 0},
                pace_from=("t1_baseline_s0", "t1_baseline_s1")),
            Run("wall_delta_s0", {"residual": "delta", "seed": 0}, pace_from=("t1_delta_s0",))]
    budget = runner.wall_budget(runs, out, None)
    assert budget == 110.0
    assert runner.pace(runs[5], out, budget) == {"max_steps": 200, "time_budget_s": 110.0, "eval_interval": 25}
    assert runner.pace(runs[4], out, budget)["max_steps"] == int((6 + 5) / 2 * 110)   # 6 and 5 steps/s
    assert runner.wall_budget(runs, out, 50.0) == 50.0
    with pytest.raises(RuntimeError, match="t1_delta_s1 have not finished"):
        runner.pace(Run("wall_delta_s1", {"residual": "delta"}, pace_from=("t1_delta_s0", "t1_delta_s1")), out, budget)
    unfinished = Run("wall_baseline_s2", {"residual": "baseline", "seed": 2}, pace_from=("t1_baseline_s2",))
    with pytest.raises(RuntimeError, match="have not all finished"):
        runner.wall_budget(runs + [unfinished], out, None)


def results_with(rows_by_section: dict[str, list[tuple[str, str, list[float]]]]) -> dict:
    """A results.json-like dict: {section: [(label, residual, per-seed PPLs)]}."""
    sections = []
    for title, rows in rows_by_section.items():
        out = []
        for label, residual, ppls in rows:
            mean, std = report._mean_std(ppls)
            out.append({"label": label, "residual": residual, "runs": [f"{label}_s{i}" for i in range(len(ppls))],
                        "val_ppl": mean, "val_ppl_std": std, "steps": 800.0, "tok_per_s_rel": 1.0})
        sections.append({"title": title, "rows": out})
    return {"sections": sections, "git_commit": "0" * 40, "machine": {"cpu": "test cpu"}}


def test_compare_judges_each_row_against_seed_noise():
    old = results_with({"T1": [("baseline", "baseline", [7.0, 7.2, 7.4]), ("delta", "delta", [7.0, 7.1, 7.2])],
                        "T4": [("delta, 1 block", "delta", [7.0]), ("only old", "delta", [7.0])]})
    new = results_with({"T1": [("baseline", "baseline", [7.1, 7.3, 7.5]), ("delta", "delta", [7.5, 7.6, 7.7])],
                        "T4": [("delta, 1 block", "delta", [7.25]), ("only new", "delta", [7.0])]})
    rows = {r["label"]: r for r in report.compare(new, old)}
    assert set(rows) == {"baseline", "delta", "delta, 1 block"}            # rows only one side has are left out
    # baseline: std 0.2 in both, 3 vs 3 seeds: sigma = 0.2 * sqrt(2/3); the means differ by 0.1 < 2 sigma.
    assert rows["baseline"]["sigma"] == pytest.approx(0.2 * (2 / 3) ** 0.5)
    assert rows["baseline"]["diff"] == pytest.approx(0.1) and rows["baseline"]["reproduced"]
    # delta: std 0.1, a shift of 0.5 is over 6 sigma.
    assert rows["delta"]["diff"] == pytest.approx(0.5) and not rows["delta"]["reproduced"]
    # one seed on each side: Table 1's std of the method, sigma = 0.1 * sqrt(2) = 0.141; 0.25 is within 2 sigma.
    assert rows["delta, 1 block"]["sigma"] == pytest.approx(0.1 * 2 ** 0.5)
    assert rows["delta, 1 block"]["reproduced"]
    assert not report.compare(new, old, within=1.5)[2]["reproduced"]
    text = report.compare_markdown(report.compare(new, old), new, old, "old.json")
    assert "| T1 | delta | 7.100 | 7.600 | +0.500 |" in text and text.rstrip().endswith("2 of 3 rows reproduced.")
    new["sections"][0]["rows"][1]["steps"] = 900.0      # an equal wall-clock row that made more steps this time
    text = report.compare_markdown(report.compare(new, old), new, old, "old.json")
    assert "different step count: delta (T1: 800 -> 900 steps)" in text


def test_compare_matches_sections_whatever_their_seed_counts():
    old = results_with({"Wall, seed 0": [("delta", "delta", [7.0])], "T1: 3 seeds": [("delta", "delta", [7.0, 7.2])]})
    new = results_with({"Wall, 3 seeds": [("delta", "delta", [7.0, 7.1, 7.2])],
                        "T2: 3 seeds": [("delta", "delta", [7.1])]})
    rows = report.compare(new, old)
    assert [(r["section"], r["new_val_ppl"]) for r in rows] == [("Wall, 3 seeds", pytest.approx(7.1))]
    # the method's std: 0.1414 old (T1), 0.1 new (Wall); pooled 0.1225, over 3 seeds new and 1 old
    assert rows[0]["sigma"] == pytest.approx(0.015 ** 0.5 * (1 / 3 + 1) ** 0.5)


def test_compare_file_must_exist(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--out", str(tmp_path), "--compare", str(tmp_path / "missing.json"), "--report_only"])
    assert "--compare: no results file at" in capsys.readouterr().err


def test_plans_are_well_formed():
    """Every row names runs the plan trains, names are unique, each run's overrides make a valid config."""
    for one in (plans.full_plan(), plans.depth_plan()):
        names = [r.name for r in one.runs]
        assert len(names) == len(set(names))
        for section in one.sections:
            assert section.rows[0][0] == "baseline"
            for _, row in section.rows:
                assert set(row) <= set(names)
        for run in one.runs:
            plans.model_config(run)
    depth = plans.depth_plan()
    assert depth.committed == os.path.join("results", "depth_sweep", "results.json")
    assert [s.title.split(":")[0] for s in depth.sections] == ["36 layers", "12 layers", "36 layers"]
    for section, n_layers in zip(depth.sections, (36, 12)):
        assert [label for label, _ in section.rows] == ["baseline", "attnres", "delta_block", "delta"]
        for _, row in section.rows:
            configs = [plans.model_config(r) for r in depth.runs if r.name in row]
            assert [c.n_layers for c in configs] == [n_layers] * len(plans.DEPTH_SEEDS) >= [n_layers] * 8
            assert len({c.d_model for c in configs}) == 1
    steps = {plans.train_config(r).max_steps for r in depth.runs}
    assert len(steps) == 1                                       # equal steps
    # the grid's block points at 36 layers: Table 1's methods (deltas) and the same with sources="states"
    grid = [(label, [plans.model_config(r) for r in depth.runs if r.name in row])
            for label, row in depth.sections[2].rows]
    assert [label for label, _ in grid] == ["baseline", "attnres, deltas", "attnres, states", "delta_block, deltas",
                                            "delta_block, states"]
    for label, configs in grid[1:]:
        assert {(c.n_layers, c.residual, c.sources) for c in configs} == {(36, *label.split(", "))}
    full = plans.full_plan()
    grid = next(s for s in full.sections if s.title.startswith("The grid"))
    states = [r for r in full.runs if any(r.name in row for _, row in grid.rows) and r.overrides.get("sources")]
    assert {(plans.model_config(r).residual, plans.model_config(r).sources) for r in states} == {
        (m, "states") for m in ("attnres", "full_attnres", "delta", "delta_block")}
    assert len(states) == 4 * 3
    init = next(s for s in full.sections if s.title.startswith("Initialisation"))
    gated = [r for r in plans.full_plan().runs if r.name in init.rows[-1][1]]
    assert all(plans.model_config(r).gate and plans.model_config(r).query_std == 0.02 for r in gated)


def test_depth_plot_reads_every_depth_section(tmp_path):
    def rows(n_layers, changes):
        return [{"label": label, "n_layers": n_layers, "ppl_change_pct": c, "change": {"half_width": 0.5},
                 "runs": ["a", "b", "c"]} for label, c in changes.items()]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path = str(tmp_path / "depth.png")
    plots.plot_depth([rows(36, {"baseline": 0.0, "attnres": 3.0, "delta": -1.0}),
                      rows(12, {"baseline": 0.0, "attnres": -1.0, "delta": -1.5})], path, plt)
    assert os.path.getsize(path) > 0
    with pytest.raises(ValueError):          # a method missing at one depth is not silently drawn as a point
        plots.plot_depth([rows(36, {"baseline": 0.0, "attnres": 3.0}), rows(12, {"baseline": 0.0})], path, plt)


def test_each_recipe_row_changes_one_choice_of_delta_block():
    """The recipe rows are Table 1's delta_block runs with exactly one config field set the authors' way; the
    precision section's references are Table 1's baseline and delta_block under their own names."""
    from dataclasses import asdict
    full = plans.full_plan()
    runs = {r.name: r for r in full.runs}

    def diff(ref: str, name: str) -> set:
        a, b = runs[ref], runs[name]
        return {k for x, y in zip((plans.model_config(a), plans.train_config(a)),
                                  (plans.model_config(b), plans.train_config(b)))
                for k, v in asdict(y).items() if asdict(x)[k] != v and k != "out_dir"}

    recipe = next(s for s in full.sections if s.title.startswith("Recipe"))
    precision = next(s for s in full.sections if s.title.startswith("Precision"))
    changed = []
    for section, first in ((recipe, 2), (precision, 2)):
        for label, row in section.rows[first:]:
            for name in row:
                seed = int(name.rsplit("_s", 1)[1])
                ref = "t1_delta_block" if section is recipe else "precision_delta_block"
                one = diff(f"{ref}_s{seed}", name)
                assert len(one) == 1, (name, one)
                changed.append(one.pop())
    assert sorted(set(changed)) == ["out_init", "precision", "weight_decay_on"]
    for (label, row), twin in zip(precision.rows[:2], ("t1_baseline", "t1_delta_block")):
        assert [diff(f"{twin}_s0", n) - {"seed"} for n in row] == [set()] * len(row), label   # seeds 0-4


def test_factorial_effects_of_the_grid():
    """Changes built from known effects (states +1, additive -2, block +0.5 points, a seed offset that pairing
    cancels) come back as every main and simple effect; the authors' variant is outside the design."""
    full = plans.full_plan()
    grid = next(s for s in full.sections if s.title.startswith("The grid"))
    runs = {r.name: r for r in full.runs}
    rows = []
    for label, names in grid.rows:
        levels = report.factor_levels(plans.model_config(runs[names[0]]))
        value = 100.0 if levels is None else (1.0 * (levels["sources"] == "states") - 2.0 * (levels["use"] ==
                                              "additive") + 0.5 * (levels["granularity"] == "block"))
        rows.append({"label": label, "runs": names, "seeds": [0, 1, 2],
                     "ppl_change_pct_seeds": [value + 0.3 * s for s in (0, 1, 2)]})
    effects = report.factorial(grid, runs, rows)
    expected = {"sources": 1.0, "use": -2.0, "granularity": 0.5}
    assert {e["factor"] for e in effects} == set(expected)
    assert len(effects) == 3 * 5                 # each factor: overall, and within each level of the two others
    for e in effects:
        assert e["effect_pct"] == pytest.approx(expected[e["factor"]]) and e["change"]["std"] == pytest.approx(0)
        assert e["agree"] == 3
    depth = plans.depth_plan()
    block_grid = depth.sections[2]
    runs = {r.name: r for r in depth.runs}
    rows = [{"label": label, "runs": names, "seeds": [0, 1, 2], "ppl_change_pct_seeds": [0.0, 1.0, 2.0]}
            for label, names in block_grid.rows]
    assert {e["factor"] for e in report.factorial(block_grid, runs, rows)} == {"sources", "use"}  # one granularity


def test_runs_pair_only_with_a_baseline_run_from_the_same_place(tmp_path):
    """Seeds 0 and 1 of both methods, but delta_block's seed 1 trained on another CPU: the row keeps seed 0 and
    names seed 1 as unpaired; a log that trained in two places is refused."""
    runs = {f"{m}_s{s}": Run(f"{m}_s{s}", {**TINY, "residual": r, "seed": s})
            for m, r in (("base", "baseline"), ("db", "delta_block")) for s in (0, 1)}
    section = Section("Two seeds", "", [("baseline", ["base_s0", "base_s1"]), ("delta_block", ["db_s0", "db_s1"])])
    here = {"cpu": "A", "isa": "AVX2", "threads": 1, "torch": "2", "commit": "c" * 40, "dirty": False}
    figures = {name: {"val_ppl": ppl, "step": 6, "wall_s": 1.0, "tok_per_s": 1.0, "origin": dict(here)}
               for name, ppl in (("base_s0", 10.0), ("base_s1", 10.0), ("db_s0", 9.0), ("db_s1", 11.0))}
    figures["db_s1"]["origin"]["cpu"] = "B"
    base, db = report.section_rows(section, runs, figures, {})
    assert base["runs"] == ["base_s0", "base_s1"] and db["runs"] == ["db_s0"] and db["unpaired"] == ["db_s1"]
    assert db["ppl_change_pct_seeds"] == [pytest.approx(-10.0)] and db["change"]["n"] == 1
    log = [{"provenance": here}, {"step": 1}, {"provenance": {**here, "commit": "d" * 40}}]
    with pytest.raises(ValueError, match="trained in 2 places"):
        report.origin(log)
    assert report.origin(log[:2]) == here and report.origin([{"step": 1}]) is None


def test_routing_means_skip_what_an_older_summary_lacks():
    receivers = [{"max_weight": 0.5, "n_sources": 4}, {"max_weight": 1.0, "n_sources": 1}]
    new = {"mean_max_weight": 0.5, "mean_max_weight_x_n": 2.0, "mean_entropy": 0.8, "mean_similarity_deltas": 0.1,
           "mean_similarity_states": 0.5, "receivers": receivers}
    old = {"mean_max_weight": 0.7, "mean_entropy": 0.6, "mean_similarity_deltas": None,
           "mean_similarity_states": None, "receivers": [{"max_weight": 0.75, "n_sources": 4}]}
    means = report.routing_means([new, old])
    assert means["mean_max_weight_x_n"] == pytest.approx((2.0 + 3.0) / 2)    # the old one's from its receivers
    assert means["mean_similarity_deltas"] == pytest.approx(0.1) and means["mean_entropy"] == pytest.approx(0.7)
    assert report.routing_means([old])["mean_similarity_states"] is None
    assert report.routing_means([]) == dict.fromkeys(report.ROUTING_MEANS)
