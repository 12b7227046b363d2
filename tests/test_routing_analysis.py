"""routing_analysis.py: recorded weights sum to one and change nothing; per-token entropy and max weight by hand
(uniform 1 and 1/N, one-hot 0 and 1, and one-hot on a different source per token, which the mean weights call
uniform); key similarity by hand (identical sources 1, orthogonal 0); the states rebuilt from a forward's sources
are that forward's streams; eval.py --routing writes the JSON and every plot for several checkpoints."""
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import matplotlib.image
import numpy as np
import pytest
import torch

import eval as ev
import router
from model import Model
from infra.routing_analysis import RoutingRecorder, key_similarity, routing_analysis, stream_views
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
        assert r["mean_weights_max"] == max(r["weights"])
        # max_i E[a_i] <= E[max_i a_i] and, H being concave, E[H(a)] <= H(E[a])
        assert r["mean_weights_max"] <= r["max_weight"] + 1e-9
        if r["n_sources"] > 1:
            assert r["entropy"] <= r["mean_weights_entropy"] + 1e-9
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
        assert r["mean_weights_entropy"] == pytest.approx(1.0, abs=1e-6)
        assert r["max_weight"] == pytest.approx(1 / r["n_sources"], abs=1e-6)
    assert result["receivers"][0]["entropy"] is None           # a single source: entropy undefined
    assert result["receivers"][0]["similarity_deltas"] is None  # and no pair to compare
    assert result["mean_entropy"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="residual='baseline' has no depth routing"):
        routing_analysis(Model(tiny_config("baseline")), [tokens], seq_len=16)


def unit(d, i, scale=1.0):
    v = torch.zeros(d)
    v[i] = scale
    return v


def test_one_hot_routing_per_token_against_the_mean_weights():
    """Two sources along e_0 and e_1, a query 100 e_0: token 0 has s_0 = e_0, s_1 = e_1 (all weight on s_0),
    token 1 the two swapped (all weight on its s_1). Per token: entropy 0, max weight 1. The mean weights are
    (1/2, 1/2): entropy 1, max 1/2, as if routing were uniform."""
    d = 4
    recorder = RoutingRecorder(Model(tiny_config("delta")))
    s0 = torch.stack([unit(d, 0), unit(d, 1)]).view(1, 2, d)        # (B=1, T=2, d)
    s1 = torch.stack([unit(d, 1), unit(d, 0)]).view(1, 2, d)
    fake = SimpleNamespace(query=unit(d, 0, 100.0), norm_weight=torch.ones(d))
    recorder(1, [s0, s1], fake)
    r = recorder.summary(Model(tiny_config("delta")))[0]
    assert r["entropy"] == pytest.approx(0.0, abs=1e-6) and r["max_weight"] == pytest.approx(1.0, abs=1e-6)
    assert r["mean_weights_entropy"] == pytest.approx(1.0, abs=1e-6)
    assert r["mean_weights_max"] == pytest.approx(0.5, abs=1e-6)
    # the keys: token 0 has e_0 against e_1, token 1 e_1 against e_0: orthogonal on both
    assert r["similarity_deltas"] == pytest.approx(0.0, abs=1e-7)
    # the states e_0 and e_0 + e_1 (RMSNorm keeps directions): cos 45 degrees
    assert r["similarity_states"] == pytest.approx(2 ** -0.5, abs=1e-6)


def test_key_similarity_by_hand():
    d = 8
    same = torch.randn(2, 3, d)
    g = torch.rand(d) + 0.5
    gram = key_similarity([same, 3.0 * same, same], g, 1e-6) / 6        # 6 tokens
    assert torch.allclose(gram, torch.ones(3, 3, dtype=torch.float64), atol=1e-6)  # scale is normalised away
    a, b = unit(d, 2).expand(2, 3, d), unit(d, 5, -7.0).expand(2, 3, d)
    assert torch.allclose(key_similarity([a, b], g, 1e-6) / 6, torch.eye(2, dtype=torch.float64), atol=1e-6)
    # the receiver's norm weight is part of the key: g = 0 on a coordinate hides it
    g = torch.ones(d)
    g[1] = 0.0
    x, y = unit(d, 0) + unit(d, 1), unit(d, 0) - unit(d, 1)                        # orthogonal, but not as keys
    assert (key_similarity([x.view(1, 1, d), y.view(1, 1, d)], g, 1e-6)[0, 1]).item() == pytest.approx(1.0)


def test_stream_views_by_hand():
    """docs/method.md's scalar example: boundary states H = 1, 3, 6."""
    t = lambda *v: [torch.tensor([float(x)]) for x in v]  # noqa: E731
    flat = lambda views: {k: [x.item() for x in v] for k, v in views.items()}  # noqa: E731
    boundary = router.make_policy("delta_block", 8, 4)
    assert flat(stream_views(boundary, t(1, 2, 3))) == {"sources": [1, 2, 3], "deltas": [1, 2, 3],
                                                        "states": [1, 3, 6]}
    paper = router.make_policy("delta_block", 8, 4, block_source="paper", null_source=True)
    assert flat(stream_views(paper, t(1, 2, 4, 0))) == {"sources": [1, 2, 4], "deltas": [1, 2, 3],
                                                        "states": [1, 3, 6]}   # the null source left out
    states = router.make_policy("attnres", 8, 4, sources="states")
    assert flat(stream_views(states, t(1, 3, 6))) == {"sources": [1, 3, 6], "deltas": [1, 2, 3],
                                                      "states": [1, 3, 6]}


@pytest.mark.parametrize("residual,kw", [("delta", {}), ("delta_block", {"null_source": True}),
                                         ("attnres", {"n_layers": 4}), ("full_attnres", {})])
def test_rebuilt_states_are_the_forwards_streams(residual, kw, monkeypatch):
    """The last state of every receiver is h~_l, the stream DepthState holds when it reads (or, for AttnRes's
    final read, the stream after the last sublayer). AttnRes at 4 layers: blocks of 2 layers, partials."""
    torch.manual_seed(0)
    model = Model(dataclasses.replace(tiny_config(residual), **kw)).eval()
    streams, read = {}, router.DepthState.read

    def recording_read(state, r):
        streams[state.l] = state.h.clone()
        return read(state, r)

    monkeypatch.setattr(router.DepthState, "read", recording_read)
    seen = {}
    model.routing_observer = lambda l, sources, r: seen.setdefault(l, stream_views(model.policy, sources))
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 10)))
    assert set(seen) == set(streams) and len(seen) == len(model.routers)
    for l, views in seen.items():
        assert torch.allclose(views["states"][-1], streams[l], atol=1e-5), l


def test_routing_command_writes_json_and_png_for_several_checkpoints(tmp_path, capsys):
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
        assert run["mean_entropy"] == pytest.approx(np.mean([r["entropy"] for r in routed]))
        compared = [r for r in run["receivers"] if r["similarity_states"] is not None]
        assert run["mean_similarity_states"] == pytest.approx(np.mean([r["similarity_states"] for r in compared]))
        assert run["tokens"] == 4 * 16
    assert "key similarity deltas" in capsys.readouterr().out
    for suffix in ("_depth.png", "_matrix.png", "_similarity.png", "_similarity_matrix.png"):
        with open(prefix + suffix, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(prefix + suffix)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
