"""Phase 1's forward (depth_kernels/group_read.py) against a direct fp32 computation of its state, at awkward
shapes: widths that are not a power of two or a multiple of the chunk, fewer token rows than programs and more
(persistent programs), receiver counts that are not powers of two or exceed a pass, blocks of sources partly
past the last, an fp32 source first (three bf16 parts) or 16-bit sources only, and the wide-row kernel. Without
CUDA the kernels run under Triton's interpreter (tl.dot in fp32 there: F32_DOT)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # must be set before triton decorates the kernels

import pytest  # noqa: E402

from depth_kernels import group_read  # noqa: E402
from depth_kernels.launch import source_table  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


def state_of(sources, queries, norm_weights):
    """(r_C (R, M d), lse_C (R, M)) in fp64: Eq. 1 over the sources for each receiver."""
    S = torch.stack([s.double().reshape(-1, s.shape[-1]) for s in sources])      # (C, M, d)
    z = torch.einsum("cmd,rd->rcm", S, queries.double() * norm_weights.double())
    z = z * torch.rsqrt(S.pow(2).mean(-1) + EPS)[None]
    return torch.einsum("rcm,cmd->rmd", torch.softmax(z, 1), S).flatten(1), torch.logsumexp(z, 1)


def run(n_sources, d, T, n_recv, first, rest, logit_scale=1.0, seed=0, params=torch.float32):
    g = torch.Generator().manual_seed(seed)
    sources = [(torch.randn(1, T, d, generator=g) * (0.5 + i % 3)).to(DEVICE, first if i == 0 else rest)
               for i in range(n_sources)]
    queries = (torch.randn(n_recv, d, generator=g) * logit_scale / d ** 0.5).to(DEVICE, params)
    norm_weights = (1 + 0.2 * torch.randn(n_recv, d, generator=g)).to(DEVICE, params)
    state = torch.full((n_recv, T * d), float("nan"), device=DEVICE)
    lse = torch.full((n_recv, T), float("nan"), device=DEVICE)
    group_read.group_forward(source_table(sources), queries, norm_weights, EPS, state, lse)
    want_state, want_lse = state_of(sources, queries, norm_weights)
    return state.double(), lse.double(), want_state, want_lse


@pytest.mark.parametrize("n_sources,d,T,n_recv,first,rest", [
    (1, 96, 5, 3, torch.float32, torch.bfloat16),      # the embedding alone: one fp32 source, three parts
    (20, 80, 4, 3, torch.float32, torch.bfloat16),     # a block of 16 and one of 3 past it; a masked chunk
    (17, 96, 7, 9, torch.bfloat16, torch.bfloat16),    # 16-bit sources only; 9 receivers: two passes (8 + 1)
    (5, 64, 2, 5, torch.float32, torch.float32),       # fp32 only: every source in parts; fewer rows than programs
    (3, 48, 6, 1, torch.float16, torch.float16),       # fp16 sources, one receiver
], ids=["embedding", "blocks", "bf16-9recv", "fp32", "fp16"])
def test_forward_state_is_eq1_over_the_committed_sources(n_sources, d, T, n_recv, first, rest):
    """Products of exact 16-bit values and three-part queries: the logits within fp32's rounding (lse to 1e-5
    absolute at logits ~1), the read-out within its two-part weights' 2^-16 of the sources' scale."""
    state, lse, want_state, want_lse = run(n_sources, d, T, n_recv, first, rest)
    assert not state.isnan().any() and not lse.isnan().any(), "unwritten (NaN) elements"
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=0, atol=4 * 2.0 ** -16 * want_state.abs().max().item())


def test_large_logits_keep_fp32_precision():
    """Logits ~300: the queries' three parts keep each logit within some 2^-24 of |z| (one part would be 2^-9:
    a weight off by tens of percent), so lse is right to 1e-5 of the logits' scale."""
    state, lse, want_state, want_lse = run(12, 96, 3, 4, torch.float32, torch.bfloat16, logit_scale=300.0, seed=1)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=0)
    torch.testing.assert_close(state, want_state, rtol=0, atol=1e-4 * want_state.abs().max().item())


def test_16_bit_router_parameters_fold_in_fp32():
    """Under precision="bf16-params" the queries and key-norm weights are bf16: u = q g is their fp32 product
    (a bf16 product would round it to 2^-9), and under the interpreter 16-bit values are widened before any
    arithmetic (its 16-bit tensors are bit patterns: a product of them is not finite)."""
    state, lse, want_state, want_lse = run(17, 32, 5, 3, torch.bfloat16, torch.bfloat16, logit_scale=30.0,
                                           params=torch.bfloat16)
    assert lse.isfinite().all() and state.isfinite().all()
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=0, atol=1e-4 * want_state.abs().max().item())


def test_wide_rows_take_the_row_kernel(monkeypatch):
    """Rows wider than the tensor-core kernel takes go a row per program to _group_fwd_rows (here forced at d =
    96): the same state."""
    monkeypatch.setattr(group_read, "TENSOR_CORE_WIDTH", 64)
    monkeypatch.setattr(group_read, "_forward_config", group_read._forward_config.__wrapped__)
    launched = []
    launch = group_read.launch
    monkeypatch.setattr(group_read, "launch", lambda kernel, *a: launched.append(kernel) or launch(kernel, *a))
    state, lse, want_state, want_lse = run(6, 96, 3, 3, torch.float32, torch.bfloat16)
    assert launched == [group_read._group_fwd_rows]
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=0, atol=1e-5 * want_state.abs().max().item())


def backward_of(sources, queries, norm_weights, go, D, lse, magnitudes=False):
    """(dS (C, M d), du (R, d)) in fp64: Eq. 1's backward over the committed sources, summed over the receivers,
    with the full softmax's lse and D = go . r given. magnitudes: the same sums of every term's absolute value (the
    scale of their rounding, which a result that cancels to near 0 does not show)."""
    f = torch.abs if magnitudes else (lambda x: x)
    S = torch.stack([s.double().reshape(-1, s.shape[-1]) for s in sources])      # (C, M, d)
    u, go = queries.double() * norm_weights.double(), go.double()                 # (R, d), (R, M, d)
    rstd = torch.rsqrt(S.pow(2).mean(-1) + EPS)                                   # (C, M)
    z = torch.einsum("cmd,rd->rcm", S, u) * rstd
    a = torch.exp(z - lse.double()[:, None])
    S, u, go, z = f(S), f(u), f(go), f(z)
    G = torch.einsum("cmd,rmd->rcm", S, go)
    w = a * (G + D.double().abs()[:, None] if magnitudes else G - D.double()[:, None]) * rstd    # dz rstd
    shrink = ((w * z).sum(0) * rstd / S.shape[-1])[..., None] * S
    ds = torch.einsum("rcm,rmd->cmd", a, go) + torch.einsum("rcm,rd->cmd", w, u) + (shrink if magnitudes else -shrink)
    return ds.flatten(1), torch.einsum("rcm,cmd->rd", w, S)


@pytest.mark.parametrize("n_sources,d,T,n_recv,first,rest,accumulate", [
    (20, 80, 4, 3, torch.float32, torch.bfloat16, True),    # an fp32 source first; a block of 16 and one of 3 past it
    (17, 96, 7, 9, torch.bfloat16, torch.bfloat16, False),  # two passes (8 + 1); more rows than programs
    (5, 64, 2, 5, torch.float32, torch.float32, True),      # fp32 only: every source in parts; few rows
    (3, 48, 6, 1, torch.float16, torch.float16, False),     # fp16 sources, one receiver
], ids=["embedding", "bf16-9recv", "fp32", "fp16"])
@pytest.mark.parametrize("logit_scale", [1.0, 300.0], ids=["logits~1", "logits~300"])
def test_backward_is_eq1s_over_the_committed_sources(n_sources, d, T, n_recv, first, rest, accumulate, logit_scale):
    """Phase 1's backward (depth_kernels/group_backward.py): each source's gradient summed over the receivers,
    written to or added into its accumulator slot (run A's at acc_a[2 + i], run B's at acc_b[3 + i - n_a]; the
    other slots untouched), and du, against fp64, with D = the committed part of go . r (so that G - D cancels:
    at logits ~300 one source holds nearly all the weight and G - D is nearly 0) and lse above the committed
    sources' logsumexp. Within 2^-14 of the terms' magnitudes: Z and G's products in three parts (a logit of 300
    to some 2^-24 of it), dS and du's in two (2^-16)."""
    from depth_kernels import group_backward
    gen = torch.Generator().manual_seed(2)
    sources = [(torch.randn(1, T, d, generator=gen) * (0.5 + i % 3)).to(DEVICE, first if i == 0 else rest)
               for i in range(n_sources)]
    queries = (torch.randn(n_recv, d, generator=gen) * logit_scale / d ** 0.5).to(DEVICE)
    norm_weights = (1 + 0.2 * torch.randn(n_recv, d, generator=gen)).to(DEVICE)
    state, lse_c = state_of(sources, queries, norm_weights)
    go = torch.randn(n_recv, T, d, generator=gen).to(DEVICE)
    D = torch.einsum("rmd,rmd->rm", go.double(), state.view(n_recv, T, d)).float()
    lse = (lse_c + 0.3).float()
    table = source_table(sources)
    n_a, n_b, slab = table.n_a, n_sources - table.n_a, -(-T * d // 16) * 16
    acc_a = torch.randn(n_a + 4, slab, generator=gen).to(DEVICE)
    acc_b = torch.randn(n_b + 5, slab, generator=gen).to(DEVICE)
    before = acc_a.clone(), acc_b.clone()
    go_slots = torch.zeros(n_recv, slab, device=DEVICE)
    go_slots[:, :T * d] = go.reshape(n_recv, -1)
    du = group_backward.group_backward(table, queries, norm_weights, EPS, go_slots, D, lse, (acc_a, acc_b, 2, 3),
                                       accumulate)
    want_ds, want_du = backward_of(sources, queries, norm_weights, go, D, lse)
    scale_ds, scale_du = backward_of(sources, queries, norm_weights, go, D, lse, magnitudes=True)
    got = torch.cat([acc_a[2:2 + n_a], acc_b[3:3 + n_b]])[:, :T * d].double()
    if accumulate:
        got -= torch.cat([before[0][2:2 + n_a], before[1][3:3 + n_b]])[:, :T * d].double()
    torch.testing.assert_close(got, want_ds, rtol=0, atol=2.0 ** -14 * scale_ds.max().item())
    torch.testing.assert_close(du.double(), want_du, rtol=0, atol=2.0 ** -14 * scale_du.max().item())
    for acc, old, lo, n in ((acc_a, before[0], 2, n_a), (acc_b, before[1], 3, n_b)):
        untouched = torch.ones(len(acc), dtype=torch.bool)
        untouched[lo:lo + n] = False
        assert torch.equal(acc[untouched], old[untouched])
