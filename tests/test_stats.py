"""The sweeps' statistics (experiments/stats.py) against values worked by hand and the definitions."""
import math

import numpy as np
import pytest

from experiments import stats


def test_paired_interval_and_p_are_students_t():
    changes = [-4.09, -1.44, -3.51]
    r = stats.paired(changes)
    se = np.std(changes, ddof=1) / math.sqrt(3)
    assert r["n"] == 3 and r["mean"] == pytest.approx(np.mean(changes))
    assert r["half_width"] == pytest.approx(4.302653 * se, rel=1e-6)       # t(0.975, 2 dof), from tables
    assert r["ci"] == pytest.approx([r["mean"] - r["half_width"], r["mean"] + r["half_width"]])
    # two-sided p of t = mean / se on 2 dof: 1 - t/sqrt(t^2 + 2), the closed form for 2 degrees of freedom
    t = abs(r["mean"]) / se
    assert r["p"] == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9)
    assert stats.paired([2.0])["ci"] is None and stats.paired([2.0])["p"] is None
    assert stats.paired([1.0, 1.0])["p"] == 0.0 and stats.paired([0.0, 0.0])["p"] == 1.0


def test_an_interval_excludes_zero_exactly_when_p_is_below_the_level():
    rng = np.random.default_rng(0)
    for _ in range(200):
        r = stats.paired(list(rng.normal(rng.uniform(-2, 2), 1.0, size=rng.integers(2, 9))))
        assert (r["p"] < 0.05) == (r["ci"][0] > 0 or r["ci"][1] < 0)


def test_holm_steps_down_and_counts_a_shown_twice_contrast_once():
    assert stats.holm([0.01, 0.04, None, 0.03]) == pytest.approx([0.03, 0.06, None, 0.06])
    assert stats.holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert stats.holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])           # capped at 1, monotone
    a, b, c = ({"p": p} for p in (0.01, 0.01, 0.02))
    assert stats.correct([a, b, c], keys=["x", "x", "y"]) == 2              # a and b are one contrast
    assert a["p_holm"] == b["p_holm"] == pytest.approx(0.02) and a["resolved"]
    assert c["p_holm"] == pytest.approx(0.02) and c["resolved"]
    one = stats.paired([1.0])
    stats.correct([one])
    assert one["p_holm"] is None and not one["resolved"] and stats.p_cell(one) == "—"
    assert stats.describe(one) == "+1.00 % (1 seed)"
