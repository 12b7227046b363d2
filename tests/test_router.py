"""Eq. 1 (depth_route) and the per-method source bookkeeping of DepthState."""
import pytest
import torch

import router
from router import DepthState, Routers, block_starts, depth_route, make_policy


def random_sources(n, B=2, T=5, d=12, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, d, generator=g, dtype=dtype) for _ in range(n)]


def test_depth_route_gradcheck_float64():
    sources = [s.requires_grad_() for s in random_sources(4, B=2, T=3, d=6, dtype=torch.float64)]
    query = torch.randn(6, dtype=torch.float64, requires_grad=True)
    norm_weight = (1 + 0.1 * torch.randn(6, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: depth_route(list(a[:4]), a[4], a[5], 1e-6),
                                    (*sources, query, norm_weight))


def test_depth_route_matches_hand_computation():
    # two sources per token; keys are normalised (rms 1), logits = w . key
    s1 = torch.tensor([3.0, 0.0, 0.0, 0.0]).view(1, 1, 4)
    s2 = torch.tensor([0.0, 2.0, 0.0, 0.0]).view(1, 1, 4)
    query = torch.tensor([1.0, 0.5, 0.0, 0.0])
    # RMSNorm(s1) = [2, 0, 0, 0] (rms = 3/2), RMSNorm(s2) = [0, 2, 0, 0]; logits 2 and 1
    a1 = torch.tensor(2.0).exp() / (torch.tensor(2.0).exp() + torch.tensor(1.0).exp())
    expected = a1 * s1 + (1 - a1) * s2
    torch.testing.assert_close(depth_route([s1, s2], query, torch.ones(4), eps=0.0), expected)


def test_depth_route_weights_sum_to_one():
    # when every source is the same vector, any convex mix returns it
    s = random_sources(1)[0]
    query = torch.randn(12)
    out = depth_route([s, s.clone(), s.clone()], query, torch.rand(12) + 0.5)
    torch.testing.assert_close(out, s)


def test_depth_route_invariant_to_source_order():
    sources = random_sources(5)
    query, g = torch.randn(12), torch.rand(12) + 0.5
    out = depth_route(sources, query, g)
    perm = [3, 0, 4, 1, 2]
    torch.testing.assert_close(depth_route([sources[i] for i in perm], query, g), out)


def test_zero_query_is_the_mean():
    sources = random_sources(3)
    torch.testing.assert_close(depth_route(sources, torch.zeros(12), torch.ones(12)), sum(sources) / 3)


def test_block_starts():
    assert block_starts(12, 1) == frozenset()
    assert block_starts(12, 4) == frozenset({6, 12, 18})
    assert block_starts(4, 4) == frozenset({2, 4, 6})
    assert block_starts(7, 3) == frozenset({4, 8})     # blocks of 2, 2, 3 layers


def test_block_starts_ceil_split():
    """The authors' split: blocks of ceil(L / K) layers; the same as the even split when K divides L."""
    for n_layers, n_blocks in [(12, 4), (12, 2), (36, 4), (28, 28), (8, 1)]:
        assert block_starts(n_layers, n_blocks, "ceil") == block_starts(n_layers, n_blocks)
    layers = lambda starts: sorted(s // 2 for s in starts)   # noqa: E731
    assert layers(block_starts(36, 8, "ceil")) == [5, 10, 15, 20, 25, 30, 35]     # 5 x 7 layers, then 1
    assert layers(block_starts(36, 8)) == [4, 9, 13, 18, 22, 27, 31]              # 4, 5, 4, 5, 4, 5, 4, 5
    assert layers(block_starts(7, 3, "ceil")) == [3, 6]                           # 3, 3, 1


# --------------------------------------------------------------------- driving DepthState by hand

def drive(policy, outputs, e, routers=None, route=None):
    """Run a DepthState over given sublayer outputs; return, per sublayer, (the sources it read, or None when it
    does not read; h~; its input)."""
    d = e.shape[-1]
    routers = routers or Routers(policy.n_receivers(len(outputs)), d, gate=False)
    reads = {}
    state = DepthState(policy, routers, e, route or depth_route, eps=1e-6,
                       observer=lambda l, sources, router: reads.__setitem__(l, list(sources)))
    trace = []
    for l, v in enumerate(outputs):
        x = state.input()
        trace.append((reads.get(l), state.h, x))
        state.add(v)
    return trace, state


def test_scalar_example_boundary_vs_paper_sources():
    # three one-layer blocks; boundary states h~ = 1, 3, 6 at sublayers 0, 2, 4
    e = torch.ones(1, 1, 1)
    outputs = [torch.full((1, 1, 1), v) for v in (1.0, 1.0, 2.0, 1.0, 0.5)]
    expected = {"boundary": [1.0, 2.0, 3.0], "paper": [1.0, 2.0, 4.0]}
    for block_source, sources in expected.items():
        policy = make_policy("delta_block", n_layers=3, n_blocks=3, block_source=block_source)
        _, state = drive(policy, outputs, e)          # sublayer 4's read commits the second block
        assert [s.item() for s in state.sources] == sources, block_source


@pytest.mark.parametrize("n_layers,n_blocks", [(6, 3), (7, 3), (4, 1), (4, 4)])
def test_boundary_sources_decompose_the_stream(n_layers, n_blocks):
    """At every sublayer: e + sum_b Delta_b + partial == h~, and each Delta_b is the stream's change across
    its block."""
    policy = make_policy("delta_block", n_layers, n_blocks, "boundary", include_partial=True)
    outputs = random_sources(2 * n_layers, seed=1)
    e = random_sources(1, seed=2)[0]
    trace, state = drive(policy, outputs, e)
    boundary_states = [e]   # h~ at each block start
    for l, (candidates, h, _) in enumerate(trace):
        torch.testing.assert_close(sum(candidates), h, rtol=1e-5, atol=1e-5)
        if l in policy.boundaries:
            boundary_states.append(h)
            delta = state.sources[len(boundary_states) - 1]
            torch.testing.assert_close(delta, boundary_states[-1] - boundary_states[-2], rtol=1e-5, atol=1e-5)
    assert len(state.sources) == n_blocks   # e and K-1 completed blocks; the last block never commits


def test_paper_sources_do_not_decompose_the_stream():
    policy = make_policy("delta_block", 6, 3, "paper")
    trace, _ = drive(policy, random_sources(12, seed=1), random_sources(1, seed=2)[0])
    candidates, h, _ = trace[-1]
    assert (sum(candidates) - h).abs().max() > 0.1


def test_fine_grained_sources_are_every_output():
    outputs = random_sources(8, seed=3)
    e = random_sources(1, seed=4)[0]
    trace, _ = drive(make_policy("delta", 4), outputs, e)
    for l, (candidates, _, _) in enumerate(trace):
        assert len(candidates) == l + 1
        for got, want in zip(candidates, [e] + outputs[:l]):
            assert torch.equal(got, want)


def test_null_source_is_zero_and_last():
    trace, _ = drive(make_policy("delta", 2, null_source=True), random_sources(4), random_sources(1)[0])
    for candidates, _, _ in trace:
        assert torch.equal(candidates[-1], torch.zeros_like(candidates[-1]))


def test_block_attnres_replacement_reset_and_final_read():
    """Kimi Block AttnRes: the input is the read-out itself; at a boundary the partial becomes a completed
    block and resets while earlier blocks stay; a final read over every source feeds the last norm."""
    calls = []

    def recording_route(sources, query, norm_weight, eps):
        calls.append([s.clone() for s in sources])
        return depth_route(sources, query, norm_weight, eps)

    n_layers, n_blocks = 4, 2                      # blocks start at sublayers 0 and 4
    policy = make_policy("attnres", n_layers, n_blocks)
    outputs = random_sources(8, seed=5)
    e = random_sources(1, seed=6)[0]
    trace, state = drive(policy, outputs, e, route=recording_route)
    for l, (candidates, _, x) in enumerate(trace):
        torch.testing.assert_close(x, depth_route(candidates, torch.zeros(12), torch.ones(12)))  # replacement
    block1 = sum(outputs[:4])
    # sublayer 0 reads [e]; 1..3 read [e, partial of block 1]; 4 reads [e, block 1]; 5..7 add block 2's partial
    assert [len(c) for c in calls[:8]] == [1, 2, 2, 2, 2, 3, 3, 3]
    torch.testing.assert_close(calls[3][1], sum(outputs[:3]))
    torch.testing.assert_close(calls[4][1], block1)                        # completed block kept
    torch.testing.assert_close(calls[5][2], outputs[4])                    # partial reset, then v_4
    torch.testing.assert_close(calls[7][1], block1)
    final = state.output()
    assert len(calls) == 9 and len(calls[8]) == 3                          # final read: e, block 1, block 2
    torch.testing.assert_close(calls[8][2], sum(outputs[4:]))
    torch.testing.assert_close(final, depth_route(calls[8], torch.zeros(12), torch.ones(12)))


def test_additive_update_keeps_the_stream():
    """h~_{l+1} = h~_l + v_l: the read-out is fed to the sublayer but never written into the stream."""
    outputs = random_sources(6, seed=7)
    e = random_sources(1, seed=8)[0]
    trace, state = drive(make_policy("delta", 3), outputs, e)
    torch.testing.assert_close(state.h, e + sum(outputs))
    for candidates, h, x in trace[1:]:
        torch.testing.assert_close(x, h + depth_route(candidates, torch.zeros(12), torch.ones(12)))


@pytest.mark.parametrize("residual,options", [("delta", {}), ("full_attnres", {"null_source": True}),
                                              ("delta_block", {"n_blocks": 2}),
                                              ("delta_block", {"n_blocks": 2, "block_source": "paper"}),
                                              ("attnres", {"n_blocks": 2, "sources": "states"})])
def test_each_read_of_the_reference_gets_its_sources_stacked_from_one_growing_stack(residual, options):
    """DepthState.stacked, which the reference's reads take: every read's stacked sources are torch.stack of its
    sources, exactly; the committed ones come from one stack grown as sources are committed (its rows are the
    committed sources so far)."""
    policy = make_policy(residual, n_layers=3, **options)
    e, outputs = random_sources(1)[0], random_sources(6, seed=1)
    reads = []
    state = DepthState(policy, Routers(policy.n_receivers(6), 12, gate=False), e, depth_route, eps=1e-6,
                       observer=lambda l, sources, router: reads.append(list(sources)))
    for v in [*outputs, None]:
        state.input() if v is not None else state.output()
        if reads and state.l >= policy.sources_from:
            assert torch.equal(state.stacked(reads[-1]), torch.stack(reads[-1]))
            assert torch.equal(state.committed_stack, torch.stack(state.sources))
        if v is not None:
            state.add(v)
    assert len(state.committed_stack) == len(state.sources) >= 2 and len(reads) >= 5


def test_a_read_in_a_compiled_graph_keeps_only_its_inputs_and_recomputes_the_rest(monkeypatch):
    """router.recomputed_read, the reference's read inside a compiled graph: the same output and gradients as
    depth_read bit for bit, while what it keeps for the backward is its inputs alone (depth_read also keeps the
    normalized sources and the weights); DepthState.read takes it only while torch compiles."""
    def run(read):
        g = torch.Generator().manual_seed(0)
        inputs = [torch.randn(5, 2, 3, 8, generator=g), torch.randn(8, generator=g), 1 + torch.rand(8, generator=g)]
        inputs = [t.requires_grad_() for t in inputs]
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
            out = read(*inputs, 1e-6)
        out.backward(torch.randn(out.shape, generator=g))
        return out, [t.grad for t in inputs], sum(kept)
    plain, recomputed = run(router.depth_read), run(router.recomputed_read)
    assert torch.equal(recomputed[0], plain[0]) and all(map(torch.equal, recomputed[1], plain[1]))
    assert recomputed[2] == 5 * 2 * 3 * 8 + 8 + 8 < plain[2]
    calls = []
    monkeypatch.setattr(router, "recomputed_read", lambda *args: calls.append(1) or router.depth_read(*args))
    policy = make_policy("delta", n_layers=2)
    state = DepthState(policy, Routers(policy.n_receivers(4), 12, gate=False), random_sources(1)[0], depth_route,
                       eps=1e-6)
    state.input()
    assert not calls
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    state.add(random_sources(1, seed=1)[0])
    state.input()
    assert calls == [1]
