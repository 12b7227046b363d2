"""The sweeps' plans: which runs exist (a config plus overrides per run) and how their rows form the tables.

full_plan(): the paper's tables in miniature on configs/sweep_l12.py (Table 1, Table 4, equal wall-clock, the
router init); depth_plan(): the paper's depth claim on configs/sweep_depth.py at 36 and at 12 layers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from infra.config import load_config


CONFIG = "configs/sweep_l12.py"


SEEDS = (0, 1, 2)
# The equal wall-clock and precision sections: effects of 5-30 %, which 3 seeds place within a few points but
# cannot resolve once p is corrected over the sweep's ~30 contrasts (a t test on 2 degrees of freedom gives
# p >= 0.003 at these spreads); 5 seeds can.
WIDE_SEEDS = (0, 1, 2, 3, 4)


# Table 1's rows: label -> (run-name slug, config overrides, time per step relative to the baseline). The
# relative times were measured on this model on one core; they only order the queue and estimate the ETA.
METHODS = {
    "baseline": ("baseline", {"residual": "baseline"}, 1.0),
    "attnres": ("attnres", {"residual": "attnres"}, 1.4),
    "full_attnres": ("full_attnres", {"residual": "full_attnres"}, 2.8),
    "delta": ("delta", {"residual": "delta"}, 2.6),
    "delta_block": ("delta_block", {"residual": "delta_block"}, 1.35),
    "delta_block (the authors' variant)": ("delta_block_paper", {"residual": "delta_block", "block_source": "paper"},
                                           1.35),
}


# The initialisation rows besides Table 1's delta_block (zero queries, no gate): (label, run-name slug, overrides).
INITS = [
    ("delta_block, no gate, queries N(0, 0.02) (the authors' code)", "init_q002_delta_block",
     {"query_init_std": 0.02}),
    ("delta_block, gate=True, zero queries", "init_gate_q0_delta_block", {"gate": True, "query_init_std": 0.0}),
    ("delta_block, gate=True, queries N(0, 0.02) (the gated default)", "init_gate_delta_block", {"gate": True}),
]


# The recipe rows: delta_block trained the authors' way in one respect each (docs/method.md, "Recipe differences
# from the authors' code"): (label, run-name slug, overrides, seeds, time per step relative to the baseline).
RECIPES = [
    ("delta_block, out_init='plain' (o_proj, down_proj at N(0, 0.02))", "recipe_plain_init_delta_block",
     {"out_init": "plain"}, SEEDS, 1.35),
    ("delta_block, weight_decay_on='all' (norms and routers decay too)", "recipe_decay_all_delta_block",
     {"weight_decay_on": "all"}, SEEDS, 1.35),
]

# The third recipe choice, the whole model in bf16, is its own section with its own baseline and fp32 delta_block
# runs (the same configs as Table 1's), so that it pairs within whichever machine trains it: bf16's speed varies
# most between CPUs (1.5x to 4.5x the fp32 run's time on the ones measured), so its runs may train apart from the
# rest. (label, run-name slug, overrides, time per step relative to the baseline)
PRECISION = [
    ("baseline", "precision_baseline", {"residual": "baseline"}, 1.0),
    ("delta_block, fp32 parameters (this repository's recipe)", "precision_delta_block", {"residual": "delta_block"},
     1.35),
    ("delta_block, precision='bf16-params' (the whole model in bf16)", "precision_bf16_delta_block",
     {"residual": "delta_block", "precision": "bf16-params"}, 2.0),
]


# The grid (source construction x read-out use): the four routed methods are granularity x use with the paper's
# sources (deltas); sources="states" swaps them for the stream's states at the same places (router.Policy).
# Label -> (run-name slug, overrides); the deltas points are Table 1's runs.
GRID = {
    "fine, deltas (e, v_0, .., v_{l-1}), replacement = full_attnres": ("full_attnres", {"residual": "full_attnres"}),
    "fine, deltas, additive = delta": ("delta", {"residual": "delta"}),
    "fine, states (h~_0, .., h~_l), replacement": ("full_attnres_states",
                                                   {"residual": "full_attnres", "sources": "states"}),
    "fine, states, additive": ("delta_states", {"residual": "delta", "sources": "states"}),
    "block, block sums = boundary deltas (e, B_0, .., partial), replacement = attnres": ("attnres",
                                                                                       {"residual": "attnres"}),
    "block, block sums = boundary deltas, additive = delta_block": ("delta_block", {"residual": "delta_block"}),
    "block, boundary states (e, h~_tau_1, .., h~_l), replacement": ("attnres_states",
                                                                    {"residual": "attnres", "sources": "states"}),
    "block, boundary states, additive": ("delta_block_states", {"residual": "delta_block", "sources": "states"}),
    "block, the authors' deltas, additive = delta_block (the authors' variant)": (
        "delta_block_paper", {"residual": "delta_block", "block_source": "paper"}),
}


# The depth sweep (--depth): configs/sweep_depth.py at these depths, these methods; run times per step relative
# to the 12-layer baseline, measured on one core (they order the queue and estimate the ETA).
DEPTH_CONFIG = "configs/sweep_depth.py"


DEPTHS = (36, 12)


# Eight seeds: at 36 layers the paired change against the baseline moves by 4-5 points from seed to seed, so three
# seeds' interval is wider than any effect the paper names (results/README.md gives the intervals).
DEPTH_SEEDS = tuple(range(8))


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

    def argv(self, extra: dict | None = None) -> list[str]:
        """The run's command line for train.py (config.load_config): its config file and overrides."""
        return [self.config] + [f"--{k}={v}" for k, v in {**self.overrides, **(extra or {})}.items()]


@dataclass
class Section:
    title: str
    note: str
    rows: list[tuple[str, list[str]]]   # (label, run names); the first row is the reference (baseline)
    plots: tuple[str, ...] = ()         # "curves" (val loss over seeds), "blocks" (PPL vs sources), "depth",
                                        # "grid" (PPL change per grid point, and report.factorial's effects)


@dataclass
class Plan:
    name: str                # runs go to runs/NAME by default; the published sweep is results/NAME
    config: str              # the model the runs start from
    runs: list[Run]
    sections: list[Section]

    @property
    def committed(self) -> str:
        return os.path.join("results", self.name, "results.json")


def _names(name: str, seeds: tuple[int, ...] = SEEDS) -> list[str]:
    """The run names of one row: NAME_s<seed> per seed."""
    return [f"{name}_s{s}" for s in seeds]


def _seeded(runs: list[Run], label: str, name: str, overrides: dict, cost: float, seeds: tuple[int, ...] = SEEDS,
            pace_from: tuple[str, ...] = (), config: str = CONFIG) -> tuple[str, list[str]]:
    """A table row of one run per seed (_names), its runs added to `runs`: (label, run names)."""
    names = _names(name, seeds)
    runs += [Run(n, {**overrides, "seed": s}, cost, pace_from, config) for n, s in zip(names, seeds)]
    return label, names


def _t1(slug: str) -> list[str]:
    """The names of Table 1's runs of one method, which other sections' rows reuse."""
    return _names(f"t1_{slug}")


def full_plan() -> Plan:
    runs = []
    t1 = [_seeded(runs, label, f"t1_{slug}", overrides, cost) for label, (slug, overrides, cost) in METHODS.items()]
    t4 = [("baseline", ["t1_baseline_s0"])]
    for k in (1, 2, 4, 6, 12):
        name = "t1_delta_block_s0" if k == 4 else f"t4_delta_block_k{k}"
        if k != 4:
            runs.append(Run(name, {"residual": "delta_block", "n_blocks": k, "seed": 0}, 1.2 + 0.05 * k))
        t4.append((f"delta_block, {k} blocks", [name]))
    t4.append(("delta (fine-grained)", ["t1_delta_s0"]))
    wall = [_seeded(runs, label, f"wall_{METHODS[label][0]}", METHODS[label][1], 1.0, WIDE_SEEDS,
                    pace_from=tuple(_t1(METHODS[label][0])))
            for label in ("baseline", "delta", "delta_block")]
    init = [("baseline", _t1("baseline")),
            ("delta_block, no gate, zero queries (the paper's init)", _t1("delta_block"))]
    init += [_seeded(runs, label, slug, {"residual": "delta_block", **overrides}, 1.35)
             for label, slug, overrides in INITS]
    grid = [("baseline", _t1("baseline"))]
    for label, (slug, overrides) in GRID.items():
        if any(m[0] == slug for m in METHODS.values()):
            grid.append((label, _t1(slug)))
        else:
            grid.append(_seeded(runs, label, f"grid_{slug}", overrides, METHODS[overrides["residual"]][2]))
    recipe = [("baseline", _t1("baseline")), ("delta_block (this repository's recipe)", _t1("delta_block"))]
    recipe += [_seeded(runs, label, slug, {"residual": "delta_block", **overrides}, cost, seeds)
               for label, slug, overrides, seeds, cost in RECIPES]
    precision = [_seeded(runs, label, slug, overrides, cost, WIDE_SEEDS) for label, slug, overrides, cost in PRECISION]
    sections = [
        Section("Table 1 in miniature: equal steps, 3 seeds", "Mean ± std over seeds 0, 1, 2; the change vs "
                "the baseline is paired by seed (same init and data order).", t1, ("curves",)),
        Section("Table 4 in miniature: number of blocks (L = 12), seed 0", "K blocks give K + 1 sources to the "
                "last sublayer; the fine-grained delta reads up to 2L = 24.", t4, ("blocks",)),
        Section("Equal wall-clock, 5 seeds", "Same time_budget_s for every method (the baseline's equal-steps "
                "wall time); each method's schedule is as long as the steps it makes in that time.", wall),
        Section("Initialisation: query init and gate of delta_block, 3 seeds", "gate=True starts as the baseline "
                "bit for bit, and defaults to queries drawn from N(0, 0.02) (docs/method.md, Correction 2, says "
                "why).", init),
        Section("The grid: granularity x source construction x use, equal steps, 3 seeds", "The four routed "
                "methods are granularity x use with deltas as sources; sources='states' swaps each delta for the "
                "stream at the same place (the cumulative states of Sec. 2.2). Block sums and boundary deltas are "
                "the same numbers (B_b = h~_{tau_{b+1}} - h~_{tau_b}); the authors' deltas are the alternating sums "
                "of their code, with its other changes (commit timing, no partial, no read at sublayer 0).",
                grid, ("grid",)),
        Section("Recipe: delta_block trained the authors' way, one difference at a time", "Each row changes one "
                "choice of this repository's recipe to the authors' code's (docs/method.md, 'Recipe differences "
                "from the authors' code'); the change vs the baseline is paired by seed. Saved activations are "
                "counted for the fp32 model in every row.", recipe),
        Section("Precision: delta_block with the whole model in bf16, 5 seeds", "The authors' code trains with "
                "bf16 parameters; this repository keeps them in fp32 (infra/distributed.py, the precision rule). "
                "Saved activations are counted for the fp32 model in every row.", precision),
    ]
    return Plan("sweep", CONFIG, runs, sections)


def depth_plan() -> Plan:
    """The paper's depth claim: the same four methods at 36 layers (the 1044M depth) and at 12, with the same
    width and steps, 8 seeds each."""
    sections = []
    runs = []
    for n_layers in DEPTHS:
        rows = []
        for label in DEPTH_METHODS:
            slug, overrides, _ = METHODS[label]
            rows.append(_seeded(runs, label, f"l{n_layers}_{slug}", {**overrides, "n_layers": n_layers},
                                DEPTH_COSTS[(n_layers, label)], DEPTH_SEEDS, config=DEPTH_CONFIG))
        plots = ("curves", "depth") if n_layers == DEPTHS[0] else ("depth",)
        sections.append(Section(f"{n_layers} layers: equal steps, {len(DEPTH_SEEDS)} seeds",
                                f"Mean ± std over seeds {DEPTH_SEEDS[0]}-{DEPTH_SEEDS[-1]}; the change vs the "
                                "baseline is paired by seed (same init and data order).", rows, plots))
    # the block points of the grid at 36 layers: boundary states beside Table 1's block sums (= boundary deltas)
    n_layers, rows = DEPTHS[0], [("baseline", _names(f"l{DEPTHS[0]}_baseline", DEPTH_SEEDS))]
    for label in ("attnres", "delta_block"):
        for sources in ("deltas", "states"):
            row, slug = f"{label}, {sources}", METHODS[label][0]
            if sources == "deltas":         # the equal-steps section's runs
                rows.append((row, _names(f"l{n_layers}_{slug}", DEPTH_SEEDS)))
            else:
                rows.append(_seeded(runs, row, f"l{n_layers}_{slug}_states",
                                    {"residual": label, "sources": sources, "n_layers": n_layers},
                                    DEPTH_COSTS[(n_layers, label)], DEPTH_SEEDS, config=DEPTH_CONFIG))
    sections.append(Section(f"{n_layers} layers: the grid's block points, equal steps, {len(DEPTH_SEEDS)} seeds",
                            "Block sums (= boundary deltas) or boundary states, replacement (attnres) or additive "
                            "(delta_block).",
                            rows, ("grid",)))
    return Plan("depth_sweep", DEPTH_CONFIG, runs, sections)


def model_config(run: Run):
    return load_config(run.argv())[0]


def train_config(run: Run):
    return load_config(run.argv())[1]


def memory_key(run: Run) -> str:
    """The name of the model a run trains, as far as memory goes: depth, method, blocks, sources, gate."""
    cfg = model_config(run)
    key = f"L{cfg.n_layers}/{cfg.residual}"
    if cfg.residual in ("attnres", "delta_block"):
        key += f"/K{cfg.n_blocks}"
    if cfg.residual == "delta_block":
        key += f"/{cfg.block_source}"
    return key + ("/states" if cfg.sources == "states" else "") + ("/gate" if cfg.gate else "")


def n_sources(cfg) -> int:
    """The most sources a sublayer reads, a null source not counted: K + 1 for K blocks (the partial included;
    the paper's variant reads at most K), 2L fine-grained (2L + 1 at Full AttnRes's final read). The paper's
    counts fit these and the paper's variant plus a null source alike (docs/method.md#block-counts)."""
    blocks = cfg.n_blocks + int(cfg.residual == "attnres" or (cfg.include_partial and cfg.block_source == "boundary"))
    fine = {"delta": 2 * cfg.n_layers, "full_attnres": 2 * cfg.n_layers + 1}
    return {"baseline": 0, "attnres": blocks, "delta_block": blocks, **fine}[cfg.residual]
