"""Model-level properties: identity at init, near-identity from decomposition, causality, configs."""
import glob
import os

import pytest
import torch

from model import Model, ModelConfig
from router import METHODS

TINY = dict(vocab_size=97, d_model=48, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96)
ADDITIVE = [dict(residual="delta"), dict(residual="delta_block", n_blocks=3),
            dict(residual="delta_block", n_blocks=3, block_source="paper"),
            dict(residual="delta_block", n_blocks=2, include_partial=False),
            dict(residual="delta", null_source=True)]
ALL = [dict(residual="baseline"), dict(residual="attnres", n_blocks=3), dict(residual="full_attnres")] + ADDITIVE


def tokens(B=2, T=11, vocab=97, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def baseline_and(routed: dict, **common):
    """A random baseline and a routed model carrying the baseline's weights (routers at their init)."""
    torch.manual_seed(0)
    base = Model(ModelConfig(**TINY, **common))
    with torch.no_grad():  # make sublayer outputs large next to the embedding, so differences show
        for name, p in base.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3 if "embed" in name else 0.15)
    routed_model = Model(ModelConfig(**TINY, **common, **routed))
    missing, unexpected = routed_model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("routers.") for k in missing)
    return base.eval(), routed_model.eval()


def rel_diff(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("routed", ADDITIVE, ids=lambda r: "-".join(map(str, r.values())))
def test_gate_gives_bit_exact_identity(routed):
    base, model = baseline_and(dict(routed, gate=True))
    idx = tokens()
    assert torch.equal(model(idx), base(idx))


@pytest.mark.parametrize("routed", [dict(residual="delta"), dict(residual="delta_block", n_blocks=3),
                                    dict(residual="delta_block", n_blocks=6)])
def test_zero_query_near_identity_from_decomposition(routed):
    """Sources that sum to the stream + uniform weights give h^ = c h~, and pre-norm is scale invariant."""
    idx = tokens()
    base, model = baseline_and(routed, norm_eps=0.0)
    assert rel_diff(model(idx), base(idx)) < 1e-5          # fp32 rounding only
    base, model = baseline_and(routed)
    assert rel_diff(model(idx), base(idx)) < 5e-3          # RMSNorm's eps breaks exact scale invariance


@pytest.mark.parametrize("n_blocks", [3, 6])
def test_zero_query_paper_sources_are_not_near_identity(n_blocks):
    base, model = baseline_and(dict(residual="delta_block", n_blocks=n_blocks, block_source="paper"))
    idx = tokens()
    assert rel_diff(model(idx), base(idx)) > 5e-2


@pytest.mark.parametrize("routed", ALL, ids=lambda r: "-".join(map(str, r.values())))
def test_causality(routed):
    torch.manual_seed(0)
    model = Model(ModelConfig(**TINY, **routed)).eval()
    with torch.no_grad():
        for r in model.routers:
            r.query.normal_()
    idx = tokens(B=1, T=13)
    t = 7
    changed = idx.clone()
    changed[0, t] = (idx[0, t] + 1) % 97
    a, b = model(idx), model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.equal(a[:, t], b[:, t])


def test_block_attnres_model_feeds_the_read_out_to_sublayers():
    model = Model(ModelConfig(**TINY, residual="attnres", n_blocks=3)).eval()
    reads, inputs = [], []
    route = model.route
    model.route = lambda *a: reads.append(route(*a)) or reads[-1]
    hooks = [m.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
             for layer in model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    hooks.append(model.norm.register_forward_pre_hook(lambda m, args: inputs.append(args[0])))
    model(tokens())
    assert len(reads) == len(inputs) == 2 * TINY["n_layers"] + 1   # one read per sublayer + the final read
    for read, x in zip(reads, inputs):
        assert torch.equal(read, x)
    for h in hooks:
        h.remove()


def test_router_counts():
    counts = {m: len(Model(ModelConfig(**TINY, residual=m, n_blocks=2)).routers) for m in METHODS}
    assert counts == {"baseline": 0, "attnres": 13, "full_attnres": 13, "delta": 12, "delta_block": 12}


@pytest.mark.parametrize("bad,message", [
    (dict(residual="deltablock"), "allowed values are baseline, attnres, full_attnres, delta, delta_block"),
    (dict(residual="delta_block", n_blocks=0), "allowed values are 1..n_layers=6"),
    (dict(residual="attnres", n_blocks=7), "allowed values are 1..n_layers=6"),
    (dict(residual="delta_block", block_source="hidden"), "allowed values are boundary, paper"),
    (dict(residual="attnres", gate=True), "gate=True is for additive routing"),
    (dict(residual="baseline", null_source=True), "need a routed method"),
])
def test_config_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**TINY, **bad})


# Paper configurations: parameter counts (Qwen3 vocabulary, tied embeddings) vs the paper's labels.
LABELS = {"220m": 220e6, "533m": 533e6, "1044m": 1044e6, "qwen3_0.6b": 508e6, "qwen3_8b": 7.57e9}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("size", LABELS)
def test_paper_config_parameter_counts(size):
    import train
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", f"{size}_*.py")))
    assert {os.path.basename(p)[len(size) + 1:-3] for p in paths} == set(METHODS)
    for path in paths:
        model_cfg, _ = train.load_config([path])
        assert model_cfg.vocab_size == 151936 and model_cfg.tie_embeddings
        with torch.device("meta"):
            n = Model(model_cfg).num_params()
        assert abs(n / LABELS[size] - 1) < 0.03, (path, n)


@pytest.mark.parametrize("residual", ["delta", "attnres", "full_attnres", "baseline"])
def test_block_source_options_need_delta_block(residual):
    for option in (dict(block_source="paper"), dict(include_partial=False)):
        with pytest.raises(ValueError, match="choose Delta Block's sources"):
            ModelConfig(**{**TINY, "residual": residual, "n_blocks": 2, **option})
