"""train.py through the kernel path (interpreted) against the reference path (experiments/rehearsal.py): one
process, and 2 gloo ranks with DDP and with FSDP2 (the gate included), a skipped non-finite step, exact resume.
CI runs a few cases for a few steps; `python -m experiments.rehearsal` runs every case for 20 steps in all three
worlds (docs/kernels.md)."""
import math

import pytest
import torch

if torch.cuda.is_available():   # the rehearsal interprets the kernels on CPU; CUDA runs the compiled ones
    pytest.skip("the rehearsal is for machines without CUDA", allow_module_level=True)

from experiments import rehearsal  # noqa: E402

STEPS = 6
CASES = {"single": ["delta, gate, learned null", "delta_block, skipped step"], "ddp": ["delta_block, paper, null"],
         "fsdp": ["delta, gate, learned null"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("rehearsal"))
    found = {}
    for world, names in CASES.items():
        for r in rehearsal.rehearse((world,), names, STEPS, out):
            found[(world, r["case"])] = r
    return found


@pytest.mark.parametrize("world, case", [(w, c) for w, names in CASES.items() for c in names])
def test_kernel_path_trains_as_the_reference_does_and_resumes_exactly(results, world, case):
    r = results[(world, case)]
    assert len(r["kernel_losses"]) == len(r["reference_losses"]) == STEPS
    assert r["max_abs_diff"] <= rehearsal.TOLERANCE, r
    assert r["resume_exact"], r
    assert r["launches"][0] > 0 and r["launches"][1] == 0     # the kernels ran, and only on the kernel path
    losses = [x for x in r["kernel_losses"] if math.isfinite(x)]
    assert losses[-1] < losses[0] - 0.05                      # it trains: the runs are not two constants
    skipped = next(c for c in rehearsal.CASES if c.name == case).nan_at >= 0
    assert r["skipped"] == [int(skipped)] * 2 and math.isnan(r["kernel_losses"][1]) == skipped


def test_the_rehearsal_sees_a_wrong_gradient(tmp_path, monkeypatch):
    """A kernel path that drops the learned null sources' gradient trains differently, by more than the
    tolerance, within the same few steps."""
    from depth_kernels import grouped_state
    monkeypatch.setattr(grouped_state, "learned_null_grads", lambda null, *a: (null * 0, null.new_zeros(null.shape)))
    r, = rehearsal.rehearse(("single",), ["delta, gate, learned null"], STEPS, str(tmp_path))
    assert r["max_abs_diff"] > rehearsal.TOLERANCE, r
