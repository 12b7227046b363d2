"""routing_analysis.py: recorded weights sum to one and change nothing, zero queries route uniformly, and
eval.py --routing writes the JSON and both plots for several checkpoints."""
import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

import eval as ev
from model import Model
from infra.routing_analysis import RoutingRecorder, routing_analysis
from tests.helpers import byte_data, routed_model, save, tiny_config


@pytest.mark.parametrize("residual,kw", [("delta", {}), ("delta_block", {"null_source": True}), ("attnres", {})])
def test_recorded_weights_sum_to_one_and_recording_changes_nothing(residual, kw):
    model = routed_model(residual, **kw)
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        off = model(x)
        recorder = RoutingRecorder(model)
        model.routing_observer = recorder
        on = model(x)
    assert torch.equal(on, off)
    receivers = recorder.summary(model)
    assert len(receivers) == len(model.routers)
    for r in receivers:
        assert sum(r["weights"]) == pytest.approx(1.0, abs=1e-6)   # fp32 softmax
        assert r["max_weight"] == max(r["weights"])
    if residual == "delta":          # fine-grained: receiver l reads e and the l outputs before it
        assert [r["n_sources"] for r in receivers] == [l + 1 for l in range(4)]
    if residual == "attnres":
        assert receivers[-1]["name"] == "final"
    assert min(r["entropy"] for r in receivers if r["n_sources"] > 1) < 0.99   # random queries: not uniform


def test_zero_queries_route_uniformly(tmp_path):
    model = Model(tiny_config("delta")).eval()
    tokens = np.random.default_rng(0).integers(0, 256, size=200)
    result = routing_analysis(model, [tokens], seq_len=16, n_windows=4, batch_size=2)
    for r in result["receivers"][1:]:
        assert r["entropy"] == pytest.approx(1.0, abs=1e-6)
        assert r["token_entropy"] == pytest.approx(1.0, abs=1e-6)
        assert r["max_weight"] == pytest.approx(1 / r["n_sources"], abs=1e-6)
    assert result["receivers"][0]["entropy"] is None           # a single source: entropy undefined
    assert result["mean_entropy"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="residual='baseline' has no depth routing"):
        routing_analysis(Model(tiny_config("baseline")), [tokens], seq_len=16)


def test_routing_command_writes_json_and_png_for_several_checkpoints(tmp_path):
    directory = byte_data(tmp_path / "data", n=400)
    paths = []
    for residual in ("attnres", "delta_block"):
        (tmp_path / residual).mkdir()
        paths.append(save(routed_model(residual), tmp_path / residual, directory))
    prefix = str(tmp_path / "plots" / "routing")
    ev.main(paths + ["--routing", f"--out={prefix}", "--routing_windows=4", "--batch_size=2"])
    runs = json.loads(Path(prefix + ".json").read_text())
    assert list(runs) == ["attnres", "delta_block"]
    for run in runs.values():
        routed = [r for r in run["receivers"] if r["n_sources"] > 1]
        assert run["mean_max_weight"] == pytest.approx(np.mean([r["max_weight"] for r in routed]))
        assert run["tokens"] == 4 * 16
    for suffix in ("_depth.png", "_matrix.png"):
        with open(prefix + suffix, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(prefix + suffix)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
