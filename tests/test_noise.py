"""experiments.noise on two seeds of a tiny baseline and delta_block: the changes it measures on the sweep's own
16K tokens are the logs' val PPL changes, and its spreads are the definitions'."""
import json
import math

import numpy as np
import pytest

from experiments import noise, runner
from experiments.plan import Run
from tests.test_sweep import TINY


def test_noise_splits_the_seed_and_the_held_out_sample(tmp_path):
    out = str(tmp_path)
    runs = [Run(f"{m}_s{s}", {**TINY, "residual": r, "seed": s, "eval_batches": 2})
            for m, r in (("base", "baseline"), ("db", "delta_block")) for s in (0, 1)]
    assert runner.execute(runs, out, jobs=1, threads=1) == []
    windows = 2 * TINY["batch_size"]                       # eval_batches x batch_size windows of the run's val PPL
    got = noise.measure(out, "base", ["db"], windows)["db"]
    finals = {r.name: runner.final_record(f"{out}/runs/{r.name}") for r in runs}
    logged = [100 * (finals[f"db_s{s}"]["val_ppl"] / finals[f"base_s{s}"]["val_ppl"] - 1) for s in (0, 1)]
    assert got["seeds"] == [0, 1]
    assert [r["change_16k"] for r in got["per_seed"]] == pytest.approx(logged, rel=1e-3, abs=1e-3)
    assert got["seed_std_16k"] == pytest.approx(np.std(logged, ddof=1), rel=1e-2, abs=1e-3)
    assert got["windows"] > windows and 0 < got["sample_se_all"] < got["sample_se_16k"]
    ratio = got["per_seed"][0]["sample_se_16k"] / got["per_seed"][0]["sample_se_all"]
    assert ratio == pytest.approx(math.sqrt(got["windows"] / windows))
    assert [step for step, _ in got["curve_std"]] == [3, 6]
    # a method whose seed-1 run trained elsewhere pairs on seed 0 only
    path = f"{out}/runs/db_s1/log.jsonl"
    records = [json.loads(line) for line in open(path)]
    records[0]["provenance"]["cpu"] = "another CPU"
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    assert noise.measure(out, "base", ["db"], windows)["db"]["seeds"] == [0]
