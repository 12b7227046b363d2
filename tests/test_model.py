"""Model-level properties: the sources each sublayer reads, identity at init and gradients from step 0,
near-identity from decomposition, causality, configs."""
import glob
import os

import pytest
import torch
import torch.nn as nn

from infra.config import load_config
from model import GATED_QUERY_INIT_STD, Model, ModelConfig
from router import METHODS

TINY = dict(vocab_size=97, d_model=48, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96)
ADDITIVE = [dict(residual="delta"), dict(residual="delta_block", n_blocks=3),
            dict(residual="delta_block", n_blocks=3, block_source="paper"),
            dict(residual="delta_block", n_blocks=2, include_partial=False),
            dict(residual="delta", null_source=True),
            dict(residual="delta_block", n_blocks=3, null_source=True, learned_null=True)]
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


# ------------------------------------------------------------------ the sources each sublayer reads

class UnitOutput(nn.Module):
    """A stub sublayer that ignores its input and outputs one fixed unit vector at every position."""

    def __init__(self, unit: torch.Tensor):
        super().__init__()
        self.unit = unit

    def forward(self, x, *rope):
        return self.unit.expand_as(x)


def stub_trace(**routed) -> list[list[str] | None]:
    """L = 8 layers, K = 4 blocks: the embedding e is the unit vector u_0 and sublayer i outputs u_{i+1}, so
    every source is a sum of distinct unit vectors and can be named: B_k is the sum of block k's outputs,
    "partial" the outputs of the current block so far. Returns, per sublayer, the names of the sources it
    reads (None when it does not read)."""
    n_layers, per_block = 8, 4
    unit = torch.eye(2 * n_layers + 1)
    model = Model(ModelConfig(**{**TINY, "n_layers": n_layers, "d_model": 2 * n_layers + 1, "n_blocks": 4,
                                 **routed})).eval()
    for i, layer in enumerate(model.layers):
        layer.self_attn, layer.mlp = UnitOutput(unit[2 * i + 1]), UnitOutput(unit[2 * i + 2])
    with torch.no_grad():
        model.embed_tokens.weight.copy_(unit[0])
    reads = {}
    model.routing_observer = lambda l, sources, router: reads.setdefault(l, [s[0, 0] for s in sources])

    def name(source: torch.Tensor, l: int) -> str:
        present = {i for i, c in enumerate(source.tolist()) if c != 0}
        assert all(c in (0.0, 1.0) for c in source.tolist())
        outputs = {i - 1 for i in present - {0}}
        current = set(range(l - l % per_block, l))
        if outputs and outputs == current and 0 not in present:
            return "partial"
        terms = ["e"] if 0 in present else []
        for k in range(2 * n_layers // per_block):
            block = set(range(k * per_block, (k + 1) * per_block))
            if block <= outputs:
                terms.append(f"B{k}")
                outputs -= block
        return "+".join(terms + [f"v{i}" for i in sorted(outputs)])

    model(torch.zeros(1, 1, dtype=torch.long))
    return [[name(s, l) for s in reads[l]] if l in reads else None for l in range(2 * n_layers)]


def test_stub_trace_paper_sources_are_the_authors_computation():
    """No partial source, a finished block committed after the next block's first sublayer has read, the last
    block never a source, no read at sublayer 0."""
    e, b0, b1 = ["e"], ["e", "B0"], ["e", "B0", "e+B1"]
    assert stub_trace(residual="delta_block", block_source="paper") == (
        [None] + [e] * 4 + [b0] * 4 + [b1] * 4 + [b1 + ["B0+B2"]] * 3)


def test_stub_trace_boundary_sources():
    """Each finished block is a source from the next block's first sublayer on; the partial is one after."""
    blocks = [["e"], ["e", "B0"], ["e", "B0", "B1"], ["e", "B0", "B1", "B2"]]
    want = []
    for committed in blocks:
        want += [committed] + [committed + ["partial"]] * 3
    assert stub_trace(residual="delta_block") == want
    assert stub_trace(residual="delta_block", block_split="ceil") == want      # ceil(8/4) = 2 layers: the same
    assert stub_trace(residual="delta_block", include_partial=False) == [
        committed for committed in blocks for _ in range(4)]


def state(i: int) -> str:
    """The stub's name of the cumulative state h~_i = e + v_0 + .. + v_{i-1} (whole blocks named B_k)."""
    return "+".join(["e"] + [f"B{k}" for k in range(i // 4)] + [f"v{j}" for j in range(4 * (i // 4), i)])


@pytest.mark.parametrize("residual", ["attnres", "delta_block"])
def test_stub_trace_block_grid_points(residual):
    """The block methods read the same sources whatever they do with the read: deltas (block sums, with the
    partial), or with sources="states" the boundary states and the current state in the partial's place."""
    deltas, states = [], []
    for k in range(4):
        blocks = ["e"] + [f"B{j}" for j in range(k)]
        boundaries = [state(4 * j) for j in range(k + 1)]
        deltas += [blocks] + [blocks + ["partial"]] * 3
        states += [boundaries] + [boundaries + [state(4 * k + i)] for i in range(1, 4)]
    assert stub_trace(residual=residual) == deltas
    assert stub_trace(residual=residual, sources="states") == states


@pytest.mark.parametrize("residual", ["full_attnres", "delta"])
def test_stub_trace_fine_grid_points(residual):
    """Fine-grained: sublayer l reads e and every earlier output, or with sources="states" every cumulative
    state h~_0 = e, .., h~_l (its own input among them)."""
    def output(i: int, l: int) -> str:   # the stub calls an output that is all of the block so far "partial"
        return "partial" if l % 4 == 1 and i == l - 1 else f"v{i}"
    assert stub_trace(residual=residual) == [["e"] + [output(i, l) for i in range(l)] for l in range(16)]
    assert stub_trace(residual=residual, sources="states") == [[state(i) for i in range(l + 1)] for l in range(16)]


def test_stub_trace_paper_sources_with_a_null_source_read_it_at_sublayer_0():
    """As the authors' code: with a null source, sublayer 0 reads only that (a zero vector here: the stub names
    it ""), and every later read ends with it."""
    e, b0, b1 = ["e"], ["e", "B0"], ["e", "B0", "e+B1"]
    want = [[]] + [e] * 4 + [b0] * 4 + [b1] * 4 + [b1 + ["B0+B2"]] * 3
    assert stub_trace(residual="delta_block", block_source="paper", null_source=True) == [w + [""] for w in want]


def test_stub_trace_paper_sources_with_one_block_read_only_the_embedding():
    assert stub_trace(residual="delta_block", block_source="paper", n_blocks=1) == [None] + [["e"]] * 15


# ------------------------------------------------------------------------- initialisation


@pytest.mark.parametrize("routed", ADDITIVE, ids=lambda r: "-".join(map(str, r.values())))
def test_gate_gives_bit_exact_identity(routed):
    base, model = baseline_and(dict(routed, gate=True))
    idx = tokens()
    assert torch.equal(model(idx), base(idx))


def seeded(**cfg) -> Model:
    torch.manual_seed(0)
    return Model(ModelConfig(**TINY, **cfg))


def loss_of(model: Model, idx: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())


def router_grads(model: Model, idx: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """One backward: per router, the query's and the gate's gradient, and how many sources it read."""
    n_sources = {}
    model.routing_observer = lambda l, sources, router: n_sources.setdefault(l, len(sources))
    model.zero_grad()
    loss_of(model, idx).backward()
    model.routing_observer = None
    return (list(model.routers.query.grad.clone()), list(model.routers.gate.grad.clone()),
            [n_sources[l] for l in sorted(n_sources)])


@pytest.mark.parametrize("routed", ADDITIVE, ids=lambda r: "-".join(map(str, r.values())))
def test_gated_init_is_the_baseline_and_learns_from_the_first_step(routed):
    """gate=True: with the same seed the logits are the baseline's bit for bit (the routers are initialised after
    the backbone, which they therefore share), the queries start small and random, the gates get a gradient at
    step 0 (the query's is exactly 0 there: the gate multiplies it) and, after one optimizer step, so does every
    query of a receiver that reads 2+ sources (one source has weight 1 whatever the query)."""
    idx = tokens(T=12)
    model = seeded(**routed, gate=True)
    assert model.cfg.query_std == GATED_QUERY_INIT_STD and model.cfg.query_init_std is None
    assert torch.equal(model(idx), seeded()(idx))
    queries = torch.stack([r.query for r in model.routers])
    assert 0.5 * GATED_QUERY_INIT_STD < queries.std() < 2 * GATED_QUERY_INIT_STD
    query_grads, gate_grads, n_sources = router_grads(model, idx)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in query_grads)
    assert all(g.isfinite() and g != 0 for g in gate_grads)
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    query_grads, gate_grads, n_sources = router_grads(model, idx)
    assert all(g.isfinite().all() for g in query_grads) and all(g.isfinite() for g in gate_grads)
    assert all(g.abs().max() > 0 for g, n in zip(query_grads, n_sources) if n > 1)
    assert all(g != 0 for g in gate_grads)


def test_gated_zero_queries_give_the_gate_no_useful_gradient():
    """Why the gated default is random: with zero queries the boundary sources make the read c h~ and the
    pre-norm is scale invariant, so the gate's gradient is only RMSNorm's eps (rounding without it), while
    random queries tilt the read away from h~ (and the zero queries never get a gradient: the gate is 0)."""
    idx = tokens(T=12)
    common = dict(residual="delta_block", n_blocks=3, gate=True, norm_eps=0.0)
    zero = torch.stack(router_grads(seeded(**common, query_init_std=0.0), idx)[1])
    random = torch.stack(router_grads(seeded(**common), idx)[1])
    assert zero.norm() < 1e-4 * random.norm()


def test_learned_null_source_starts_as_the_constant_one_and_learns():
    idx = tokens(T=12)
    constant = seeded(residual="delta_block", n_blocks=3, null_source=True)
    learned = seeded(residual="delta_block", n_blocks=3, null_source=True, learned_null=True)
    assert all(torch.equal(r.null, torch.zeros(TINY["d_model"])) for r in learned.routers)
    assert constant.routers[0].null is None
    assert torch.equal(learned(idx), constant(idx))
    loss_of(learned, idx).backward()
    grads = list(learned.routers.null.grad)
    assert all(g.isfinite().all() and g.abs().max() > 0 for g in grads)


def test_query_init_std():
    """None is the default, resolved where the routers are made and never written back into the config (which
    a checkpoint records and --resume compares)."""
    model = seeded(residual="delta")
    assert model.cfg.query_init_std is None and model.cfg.query_std == 0.0
    assert all(torch.equal(r.query, torch.zeros(TINY["d_model"])) for r in model.routers)
    model = seeded(residual="attnres", n_blocks=3, query_init_std=0.5)
    assert 0.4 < torch.stack([r.query for r in model.routers]).std() < 0.6
    assert ModelConfig(**TINY, residual="delta", gate=True, query_init_std=0.0).query_std == 0.0
    gated = ModelConfig(**TINY, residual="delta", gate=True)
    assert (gated.query_init_std, gated.query_std) == (None, GATED_QUERY_INIT_STD)


@pytest.mark.parametrize("out_init", ["scaled", "plain"])
def test_out_init_std_of_the_projections_that_write_the_stream(out_init):
    """"scaled": o_proj and down_proj at init_std / sqrt(2 L) (here 0.02 / sqrt(12) = 0.0058); "plain" (the
    authors' code): every matrix at init_std. The other matrices are at init_std either way (the routers' stacked
    rows, 2-D too, are not matrices: their queries start at zero here)."""
    model = Model(ModelConfig(**TINY, residual="delta_block", n_blocks=3, out_init=out_init))
    expected = 0.02 / (2 * TINY["n_layers"]) ** 0.5 if out_init == "scaled" else 0.02
    assert torch.equal(model.routers.query, torch.zeros_like(model.routers.query))
    for name, p in model.named_parameters():
        if p.dim() == 2 and not name.startswith("routers."):
            std = expected if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            assert abs(p.std().item() / std - 1) < 0.1, (name, p.std().item(), std)


def test_paper_sources_have_no_router_for_sublayer_0():
    """Every router reads (DDP needs every parameter used): the paper's variant starts reading at sublayer 1."""
    model = seeded(residual="delta_block", n_blocks=3, block_source="paper")
    assert len(model.routers) == 2 * TINY["n_layers"] - 1
    loss_of(model, tokens(T=12)).backward()
    assert all(p.grad is not None for p in model.parameters())


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_hugging_faces_rotation_bit_for_bit(dtype):
    """apply_rope's roll with the signed sine gives x cos + rotate_half(x) sin, Hugging Face's form with
    rotate_half(x) = (-x2, x1), exactly: (-a) b and a (-b) are the same float, forward and backward."""
    from model import apply_rope, rope_cos_sin
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 24, 2).float() / 24))          # Hugging Face's default RoPE
    emb = torch.outer(torch.arange(13).float(), inv_freq).repeat(1, 2)        # (T, hd)
    cos, sin = emb.cos(), emb.sin()
    got_cos, signed_sin = rope_cos_sin(13, 24, 1e4, torch.device("cpu"))
    assert torch.equal(got_cos, cos) and torch.equal(signed_sin, torch.cat((-sin[:, :12], sin[:, 12:]), dim=-1))
    x = torch.randn(2, 3, 13, 24, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    x1, x2 = x.chunk(2, dim=-1)
    expected = (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(dtype)
    got = apply_rope(x, cos, signed_sin)
    grad = torch.randn_like(got)
    assert got.dtype == dtype and torch.equal(got, expected)
    assert torch.equal(*[torch.autograd.grad(y, x, grad)[0] for y in (got, expected)])


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
    (dict(residual="baseline", query_init_std=0.02), "need a routed method"),
    (dict(residual="delta_block", block_split="floor"), "block_split='floor': allowed values are even, ceil"),
    (dict(residual="attnres", n_blocks=5, block_split="ceil"), r"n_blocks=5 with block_split='ceil' makes 3 blocks"),
    (dict(residual="delta", query_init_std=-0.5), r"query_init_std=-0.5: allowed values are a finite std >= 0, "
                                                  r"or None for the default \(0, or 0.02 with gate=True\)"),
    (dict(residual="delta", query_init_std=-1.0), r"query_init_std=-1.0: allowed values"),   # the old sentinel
    (dict(out_init="zero"), "out_init='zero': allowed values are scaled, plain"),
    (dict(head_dim=15), r"head_dim=15: allowed values are even integers >= 2 \(RoPE rotates pairs of channels\)"),
    (dict(n_heads=4, n_kv_heads=3), "n_heads=4 is not a multiple of n_kv_heads=3"),
    (dict(residual="baseline", sources="states"), "sources='states' needs a routed method"),
    (dict(residual="delta", query_init_std=float("nan")), "query_init_std=nan: allowed values"),
    (dict(residual="delta", learned_null=True), "learned_null=True: .* set null_source=True"),
])
def test_config_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**TINY, **bad})


# Paper configurations: parameter counts (Qwen3 vocabulary, tied embeddings) vs the paper's labels.
LABELS = {"220m": 220e6, "533m": 533e6, "1044m": 1044e6, "qwen3_0p6b": 508e6, "qwen3_8b": 7.57e9}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("size", LABELS)
def test_paper_config_parameter_counts(size):
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", f"{size}_*.py")))
    assert {os.path.basename(p)[len(size) + 1:-3] for p in paths} == set(METHODS)
    for path in paths:
        model_cfg, _ = load_config([path])
        assert model_cfg.vocab_size == 151936 and model_cfg.tie_embeddings
        with torch.device("meta"):
            n = Model(model_cfg).num_params()
        assert abs(n / LABELS[size] - 1) < 0.03, (path, n)


# Block counts: the paper's where it gives one, else the authors' run names and scripts (default 4).
BLOCKS = {"220m_attnres": 4, "220m_delta_block": 2, "533m_attnres": 4, "533m_delta_block": 4,
          "1044m_attnres": 4, "1044m_delta_block": 4, "qwen3_0p6b_attnres": 28, "qwen3_0p6b_delta_block": 28,
          "qwen3_8b_attnres": 4, "qwen3_8b_delta_block": 4}


@pytest.mark.parametrize("name", BLOCKS)
def test_paper_config_block_counts(name):
    path = os.path.join(ROOT, "configs", f"{name}.py")
    model_cfg, _ = load_config([path])
    assert (model_cfg.n_blocks, model_cfg.block_split, model_cfg.block_source) == (BLOCKS[name], "ceil", "boundary")
    with open(path) as f:
        assert "n_blocks = " in f.read()            # each says where its number comes from


@pytest.mark.parametrize("residual", ["delta", "attnres", "full_attnres", "baseline"])
def test_block_source_options_need_delta_block(residual):
    for option in (dict(block_source="paper"), dict(include_partial=False)):
        with pytest.raises(ValueError, match="choose Delta Block's sources"):
            ModelConfig(**{**TINY, "residual": residual, "n_blocks": 2, **option})
