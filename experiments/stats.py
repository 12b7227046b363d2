"""Seed statistics for the sweeps' paired comparisons.

A comparison is a list of paired changes, one per seed (a seed gives both sides the same backbone init and
batches, so the seed's own luck cancels in the difference). Its reading: the mean, the 95 % confidence interval
of Student's t on n - 1 degrees of freedom, n, and the two-sided p of the t test against no change. A sweep
reports many comparisons at once, so its p-values are corrected together with Holm's step-down method (the
family-wise error rate stays at the level for any dependence between the comparisons). A comparison is
resolved when its corrected p is below 0.05; then its interval also excludes zero, so its half-width is below
the effect it names."""
from __future__ import annotations

import math

import numpy as np
from scipy import stats

LEVEL = 0.95    # the intervals' confidence, and 1 - the family-wise level of the corrected p-values


def paired(changes: list[float]) -> dict:
    """{n, mean, std, half_width, ci, p} of one comparison's per-seed changes; std, interval and p are None
    below two seeds."""
    n, mean = len(changes), float(np.mean(changes)) if changes else math.nan
    if n < 2:
        return {"n": n, "mean": mean, "std": None, "half_width": None, "ci": None, "p": None}
    std = float(np.std(changes, ddof=1))
    se = std / math.sqrt(n)
    half = float(stats.t.ppf(0.5 + LEVEL / 2, n - 1)) * se
    if se == 0:                                      # every seed alike: no spread to test against
        p = 1.0 if mean == 0 else 0.0
    else:
        p = float(2 * stats.t.sf(abs(mean) / se, n - 1))
    return {"n": n, "mean": mean, "std": std, "half_width": half, "ci": [mean - half, mean + half], "p": p}


def holm(p_values: list[float | None]) -> list[float | None]:
    """Holm-adjusted p-values in the input's order (None stays None and is not counted in the family): the
    i-th smallest of m is multiplied by m - i + 1, capped at 1 and made monotone."""
    order = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    m, out, running = len(order), list(p_values), 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def correct(readings: list[dict], keys: list | None = None) -> int:
    """Holm over a family of paired() readings, in place: each gets p_holm and resolved (p_holm < 1 - LEVEL).
    Readings with equal keys are one contrast shown twice (one row in two tables) and count once. Returns the
    family's size."""
    keys = list(range(len(readings))) if keys is None else keys
    first = {}
    for key, r in zip(keys, readings):
        first.setdefault(key, r)
    adjusted = dict(zip(first, holm([r["p"] for r in first.values()])))
    for key, r in zip(keys, readings):
        r["p_holm"] = adjusted[key]
        r["resolved"] = adjusted[key] is not None and adjusted[key] < 1 - LEVEL
    return sum(p is not None for p in adjusted.values())


def describe(reading: dict, unit: str = " %") -> str:
    """One reading as a table cell: mean [low, high] unit, or the single seed's value."""
    if reading["ci"] is None:
        return f"{reading['mean']:+.2f}{unit} (1 seed)"
    low, high = reading["ci"]
    return f"{reading['mean']:+.2f} [{low:+.2f}, {high:+.2f}]{unit}"


def p_cell(reading: dict) -> str:
    """The corrected p, with the uncorrected one beside it; '—' below two seeds."""
    if reading.get("p_holm") is None:
        return "—"
    mark = " ✓" if reading["resolved"] else ""
    return f"{reading['p_holm']:.2g} ({reading['p']:.2g}){mark}"
