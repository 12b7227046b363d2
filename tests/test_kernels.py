"""The Triton depth-routing kernels against the fp32 reference (router.depth_route), the fused lean path against
the reference path, and the kernel dispatch. Without CUDA the kernels run under Triton's interpreter."""
import functools
import math
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # must be set before triton decorates the kernels

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from depth_kernels.depth_route import depth_route  # noqa: E402
from depth_kernels.launch import SourceList  # noqa: E402
from depth_kernels.observers import observe_launches  # noqa: E402
from depth_kernels.grouped_state import GroupedDepthState  # noqa: E402
from depth_kernels.groups import fine_group_size  # noqa: E402
from model import Model, ModelConfig, RMSNorm, uses_kernel  # noqa: E402
from router import DepthState, Routers, make_policy  # noqa: E402
from router import depth_route as reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def nan_empty(monkeypatch):
    """Outputs the kernels allocate start as NaN, so memory a kernel forgets to write shows up."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(empty_like(*a, **k)))


def make_inputs(n, d, dtype, B=2, T=7, seed=0):
    """n sources of different scales (so rstd matters), a query large enough for peaked weights."""
    g = torch.Generator().manual_seed(seed)
    sources = [(torch.randn(B, T, d, generator=g) * (0.5 + i % 3)).to(DEVICE, dtype).requires_grad_()
               for i in range(n)]
    query = (torch.randn(d, generator=g) * 0.3).to(DEVICE).requires_grad_()
    norm_weight = (1 + 0.2 * torch.randn(d, generator=g)).to(DEVICE).requires_grad_()
    grad_out = torch.randn(B, T, d, generator=g).to(DEVICE, dtype)
    return sources, query, norm_weight, grad_out


def assert_close(got, want, rtol, atol_scale, floor=0.0):
    """Elementwise |got - want| <= rtol |want| + atol_scale * max|want| + floor: relative to the tensor's own scale,
    so sums over many tokens (the query's gradient) and values near zero are held to the same standard. floor
    (a tensor of want's shape, or a number) is the rounding error of terms that cancel, where want is 0 or near it
    in exact arithmetic and its own scale says nothing (cancellation_floor)."""
    assert not got.isnan().any(), "unwritten (NaN) elements"
    got, want = got.double(), want.double()
    scale = want.abs().max().clamp_min(1e-30)
    err = (got - want).abs() - rtol * want.abs() - floor
    assert err.max() <= atol_scale * scale, f"max excess error {err.max():.3e} at scale {scale:.3e}"


U32 = 2.0 ** -24   # fp32's unit roundoff


def cancellation_floor(sources, query, norm_weight, grad_out, eps=1e-6):
    """The rounding error of the softmax backward's cancelling terms, per gradient element: [each source's,
    the query's, the norm weight's]. dz_i = a_i (go . s_i - D) subtracts D = go . r, a weighted mean of the
    go . s_j, from go . s_i: where one source holds the weight (always, for n = 1) they agree and dz_i is 0 or
    near it in exact arithmetic, while each path computes both dots in fp32, in its own order, each within
    (ceil(log2 d) + 2) U32 sum_k |go_k s_ik| (a tree sum of d products, and r's rounding inside D). So dz_i
    carries up to a_i gamma M (gamma: both paths' error, 2 (ceil(log2 d) + 2) U32; M = max_j sum_k |go_k s_jk|),
    and that reaches ds_i through dz_i rstd_i (u - z_i rstd_i s_i / d), the query's gradient through
    sum dz_i rstd_i s_i g and the norm weight's through sum dz_i rstd_i s_i q (sums over tokens and sources)."""
    s = torch.stack([x.detach().double() for x in sources])                     # (n, B, T, d)
    q, g, go = query.detach().double(), norm_weight.detach().double(), grad_out.double()
    d = s.shape[-1]
    u = q * g
    rstd = (s.pow(2).mean(-1, keepdim=True) + eps).rsqrt()                      # (n, B, T, 1)
    z = (s * u).sum(-1, keepdim=True) * rstd
    a = z.softmax(dim=0)
    gamma = 2 * (math.ceil(math.log2(d)) + 2) * U32
    M = (go.abs() * s.abs()).sum(-1, keepdim=True).amax(dim=0)                  # (B, T, 1)
    ddz_rstd = a * gamma * M * rstd                                              # |error of dz_i| rstd_i
    ds = ddz_rstd * (u.abs() + z.abs() * rstd * s.abs() / d)
    dq_dg = (ddz_rstd * s.abs()).sum(dim=(0, 1, 2))                              # (d,)
    return [*ds, dq_dg * g.abs(), dq_dg * q.abs()]


# fp32: both paths accumulate in fp32 in a different order: 1e-5 of the tensor's scale.
# bf16: the reference upcasts to fp32 and rounds its results to bf16 once (<= 0.5 ulp); the kernels round fp32
# values summed in another order, to nearest as a GPU does (the interpreter too: depth_kernels/launch.py), so results
# may differ by 1 bf16 ulp = 2^-7 relative where those values straddle a rounding point; we allow 2 ulp (2^-6).
# The query and norm weight gradients are fp32 sums in both paths and keep the fp32 tolerance.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 ** -6, 1e-5)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 96, 200])
@pytest.mark.parametrize("n", [1, 2, 7, 25])
def test_kernel_matches_reference(n, d, dtype, nan_empty):
    sources, query, norm_weight, grad_out = make_inputs(n, d, dtype, seed=n * 1000 + d)
    want = reference(sources, query, norm_weight)
    want_grads = torch.autograd.grad(want, [*sources, query, norm_weight], grad_out)
    got = depth_route(sources, query, norm_weight)
    got_grads = torch.autograd.grad(got, [*sources, query, norm_weight], grad_out)
    assert got.dtype == want.dtype == dtype
    rtol, atol = TOL[dtype]
    assert_close(got, want, rtol, atol)
    # With one source (and where one source holds the weight) the query's and norm weight's gradients are 0 in
    # exact arithmetic, and a source's gradient has a term that is: each path's is its own rounding noise
    floors = cancellation_floor(sources, query, norm_weight, grad_out)
    for i, (g, w, floor) in enumerate(zip(got_grads[:n], want_grads[:n], floors)):
        assert g.dtype == dtype, i
        assert_close(g, w, rtol, atol, floor)
    for g, w, floor in zip(got_grads[n:], want_grads[n:], floors[n:]):   # query, norm weight
        assert_close(g, w, 1e-5, 1e-5, floor)


def test_kernel_mixes_fp32_and_bf16_sources(nan_empty):
    """Under autocast the embedding is fp32 and sublayer outputs bf16: the read-out is fp32 (sources[0]'s
    dtype) and each gradient comes back in its source's dtype, with that dtype's tolerance."""
    sources, query, norm_weight, grad_out = make_inputs(7, 96, torch.bfloat16)
    sources[0] = sources[0].detach().float().requires_grad_()
    grad_out = grad_out.float()
    want = reference(sources, query, norm_weight)
    got = depth_route(sources, query, norm_weight)
    assert got.dtype == want.dtype == torch.float32
    assert_close(got, want, *TOL[torch.float32])
    got_grads = torch.autograd.grad(got, sources, grad_out)
    for s, g, w in zip(sources, got_grads, torch.autograd.grad(want, sources, grad_out)):
        assert g.dtype == s.dtype
        assert_close(g, w, *TOL[s.dtype])


def test_kernel_takes_non_contiguous_sources():
    sources, query, norm_weight, _ = make_inputs(3, 64, torch.float32)
    strided = [s.detach().transpose(1, 2).contiguous().transpose(1, 2) for s in sources]  # (B, T, d), d-stride T
    assert not strided[0].is_contiguous()
    assert_close(depth_route(strided, query, norm_weight), reference(sources, query, norm_weight), 1e-5, 1e-5)


def test_kernel_reads_misaligned_sources_through_an_aligned_copy():
    """A contiguous view at an odd storage offset is not 16-byte aligned: the launcher copies it once, so
    every address the kernel reads through its table is aligned (the kernels promise the compiler that)."""
    sources, query, norm_weight, grad_out = make_inputs(3, 64, torch.float32)
    flat = torch.empty(sources[1].numel() + 1, device=DEVICE)
    flat[1:] = sources[1].detach().flatten()
    shifted = [sources[0], flat[1:].view_as(sources[1]).requires_grad_(), sources[2]]
    assert shifted[1].is_contiguous() and shifted[1].data_ptr() % 16
    tables = []
    with observe_launches(lambda launch: tables.append(launch.args["table"].tolist()) and False):
        got = depth_route(shifted, query, norm_weight)
        got_grads = torch.autograd.grad(got, shifted, grad_out)
    assert tables and all(address % 16 == 0 for table in tables for address in table)
    want = reference(sources, query, norm_weight)
    assert_close(got, want, 1e-5, 1e-5)
    for g, w in zip(got_grads, torch.autograd.grad(want, sources, grad_out)):
        assert_close(g, w, 1e-5, 1e-5)


def test_source_tables_are_slices_of_one_address_array():
    """A SourceList writes each source's address once; a table whose sources are in dtype order is a slice of
    that array (also past its first capacity, which doubles), any other table an array of its own in dtype
    order, and every table keeps the addresses of its own sources."""
    fp32 = [torch.randn(1, 2, 8) for _ in range(2)]
    bf16 = [torch.randn(1, 2, 8).bfloat16() for _ in range(4)]
    found = SourceList(capacity=2)
    for s in [fp32[0], bf16[0], bf16[1], fp32[1], bf16[2], bf16[3]]:
        found.append(s)
    want = [t.data_ptr() for t in found.tensors]
    assert len(found.host_addresses) == 8 and found.host_view[:6].tolist() == want
    ordered = found.table(0, 3)                                    # fp32, bf16, bf16: in dtype order
    assert ordered.addresses.tolist() == want[:3] and ordered.order == [0, 1, 2] and ordered.n_a == 1
    assert ordered.addresses.untyped_storage().data_ptr() == found.device_addresses.untyped_storage().data_ptr()
    tail = found.table(4)                                          # bf16, bf16
    assert tail.addresses.tolist() == want[4:] and tail.n_a == 2
    mixed = found.table(1, 5)                                      # bf16, bf16, fp32, bf16: reordered
    assert mixed.order == [0, 1, 3, 2] and mixed.n_a == 3
    assert mixed.addresses.tolist() == [want[1], want[2], want[4], want[3]]
    assert mixed.addresses.untyped_storage().data_ptr() != found.device_addresses.untyped_storage().data_ptr()
    early = found.table(0, 2)
    for s in bf16[:3]:                                             # past the capacity: a new array
        found.append(s)
    assert len(found.host_addresses) == 16 and early.addresses.tolist() == want[:2]
    assert found.table(6).addresses.tolist() == [t.data_ptr() for t in found.tensors[6:]]


@pytest.mark.parametrize("bad,message", [
    (lambda s: [s[0], s[1][:, :3]], r"sources\[1\] is .* every source must match"),
    (lambda s: [s[0], s[1].double()], r"take sources of dtype .*; got torch.float64"),
    (lambda s: [s[0], s[1].half(), s[1].bfloat16()], "mix 3 dtypes"),
    (lambda s: [x[0] for x in s], r"sources must be \(B, T, d\)"),
    (lambda s: [], "at least one source"),
])
def test_kernel_rejects_bad_sources(bad, message):
    sources, query, norm_weight, _ = make_inputs(2, 64, torch.float32)
    with pytest.raises(ValueError, match=message):
        depth_route(bad([s.detach() for s in sources]), query, norm_weight)
    with pytest.raises(ValueError, match=r"must be \(64,\)"):
        depth_route(sources, query[:32], norm_weight)


def test_kernel_on_cpu_without_interpreter_says_how_to_run():
    code = ("import torch; from depth_kernels.depth_route import depth_route; "
            "depth_route([torch.ones(1, 1, 4)], torch.ones(4), torch.ones(4))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "set TRITON_INTERPRET=1" in run.stderr


@triton.jit
def _rounds(x_ptr, y_ptr, z_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, x.to(tl.bfloat16))       # a cast
    tl.store(z_ptr + offs, x)                       # a store's conversion to the pointer's dtype


def test_kernels_round_fp32_to_bfloat16_to_nearest_even_as_torch_does():
    """Under the interpreter as on a GPU: Triton's interpreter truncates, which depth_kernels/launch.py corrects. Ties
    go to even; both signs, subnormals, the largest values (to inf), inf and nan."""
    one_ulp = 2.0 ** -7                               # of bf16 at 1.0
    ties = [1 + one_ulp / 2, 1 + 3 * one_ulp / 2, -(1 + one_ulp / 2)]
    x = torch.cat([torch.randn(1000, generator=torch.Generator().manual_seed(0)),
                   torch.tensor(ties + [1 + 0.6 * one_ulp, 3.39e38, 1e-40, -1e-40, -0.0, float("inf"), float("nan")])])
    x = torch.cat([x, torch.zeros(1024 - len(x))]).to(DEVICE)
    y, z = (torch.empty(1024, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    _rounds[(1,)](x, y, z, N=1024)
    want = x.to(torch.bfloat16).view(torch.int16)
    assert torch.equal(y.view(torch.int16), want) and torch.equal(z.view(torch.int16), want)
    assert y[1000:1003].tolist() == [1.0, 1 + 2 * one_ulp, -1.0]                      # ties to even


# ------------------------------------------------------------------------------ the fused read + pre-norm

# (residual, policy options, group size of the grouped state (None: its own choice), router options)
STATES = [("delta", {}, 3, {}), ("delta", {"null_source": True}, 5, {"gate": True}), ("delta", {}, None, {}),
          ("full_attnres", {}, 2, {}), ("delta_block", {"n_blocks": 3}, None, {}),
          ("delta_block", {"n_blocks": 2, "null_source": True}, None, {"gate": True}),
          ("delta_block", {"n_blocks": 2, "null_source": True}, None, {"learned_null": True}),
          ("delta_block", {"n_blocks": 4, "include_partial": False}, None, {}),
          ("delta_block", {"n_blocks": 2, "block_source": "paper"}, None, {}),
          ("delta_block", {"n_blocks": 3, "block_split": "ceil"}, None, {}),
          ("attnres", {"n_blocks": 3, "null_source": True}, None, {})]


def run_state(cls, residual, options, group_size, router_options, scale, d=96):
    """A depth state driven through 4 layers of stand-in sublayers v = tanh(y W_l + c_l) (B = 2, T = 7, width d):
    every sublayer input y_l and the gradients of a loss over them, of the embedding, the maps, the routers
    and the pre-norm weights; and the routers' logit bound (logit_bound)."""
    g = torch.Generator().manual_seed(3)
    n_layers = 4
    policy = make_policy(residual, n_layers, **options)
    routers = Routers(policy.n_receivers(2 * n_layers), d, **{"gate": False, **router_options})
    norms = [RMSNorm(d, 1e-6) for _ in range(2 * n_layers + 1)]   # each sublayer's pre-norm, the final norm
    with torch.no_grad():
        for r in routers:
            r.query.copy_(torch.randn(d, generator=g) * scale)
            r.norm_weight.copy_(1 + 0.2 * torch.randn(d, generator=g))
            for p in (r.gate, r.null):
                if p is not None:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.7)
        for norm in norms:
            norm.weight.copy_(1 + 0.2 * torch.randn(d, generator=g))
    maps = [(torch.randn(d, d, generator=g) / d ** 0.5).requires_grad_() for _ in range(2 * n_layers)]
    # Biases, so that a zero read (x = r = 0 where a null source outweighs every other by e^-300) does not give a
    # zero output: its partial block h - base would be 0, a source at rstd = eps^-1/2 = 1000 whose gradient loops
    # through RMSNorm(0) (x 1000 again) at every later read, to 1e9 in the stream's gradient, where the two
    # paths' cancelling sums differ by its ulp (64) in e's gradient of ~2: a test of fp32's width, not of a path.
    biases = [0.3 * torch.randn(d, generator=g) for _ in range(2 * n_layers)]
    probes = [torch.randn(2, 7, d, generator=g) for _ in range(len(norms))]
    e = torch.randn(2, 7, d, generator=g).requires_grad_()
    leaves = [e, *maps, *routers.parameters(), *(n.weight for n in norms)]
    routers, norms = routers.to(DEVICE), [n.to(DEVICE) for n in norms]
    extra = {"group_size": group_size, "norms": norms} if cls is GroupedDepthState else {}
    state = cls(policy, routers, e.to(DEVICE), reference, 1e-6, **extra)
    ys = []
    for l in range(2 * n_layers):
        ys.append(state.input(norms[l]))
        state.add(torch.tanh(ys[-1] @ maps[l].to(DEVICE) + biases[l].to(DEVICE)))
    if policy.final_read:
        ys.append(state.output(norms[-1]))
    loss = sum((y.float() * p.to(DEVICE)).sum() for y, p in zip(ys, probes))
    return ys, torch.autograd.grad(loss, leaves, allow_unused=True), logit_bound(routers)


def logit_bound(routers) -> float:
    """max over routers of |q * g|_2 sqrt(d): a bound on sum_k |s_k u_k| rstd(s) (Cauchy-Schwarz, with
    |s|_2 rstd(s) <= sqrt(d)), so on |z| and on the terms an fp32 logit sums."""
    return max((r.query * r.norm_weight).detach().double().norm().item() * r.query.numel() ** 0.5 for r in routers)


@pytest.mark.parametrize("scale_of_logits", [0.3, 30.0], ids=["logits~1", "logits~300"])
@pytest.mark.parametrize("case", STATES, ids=lambda c: "-".join(
    [c[0], *(f"{k}={v}" for k, v in {**c[1], **c[3]}.items()), f"G{c[2]}"]))
def test_grouped_read_is_one_softmax_over_every_source(case, scale_of_logits, nan_empty):
    """Phase 1's state over the committed sources, merged with each receiver's own sources (and the partial
    block, the null source) by the online softmax, is Eq. 1 over all of them: every sublayer input and every
    gradient as the reference state's, in groups of several sizes, with moderate and extreme logits."""
    assert_grouped_matches_reference(case, scale_of_logits)


def gpu_configs(monkeypatch):
    """The launchers' configurations as a GPU launch chooses them, asked here whether or not one is present (the
    configuration functions are plain Python; nothing is launched while this is in force)."""
    from depth_kernels import group_backward, group_read, launch, receiver_read
    for module in (launch, group_read, group_backward, receiver_read):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    # caches of their own, so the interpreter's configurations do not meet the GPU's in either one
    for module, name in ((group_backward, "backward_config"), (group_read, "_forward_config"),
                         (receiver_read, "_receiver_config")):
        monkeypatch.setattr(module, name, functools.cache(getattr(module, name).__wrapped__))
    return group_read, group_backward, receiver_read


INTERPRETER_CHUNKS = ("the interpreter's column chunks (64 columns: d = 80 and 96 are a chunk and one partly masked); "
                      "a GPU takes 256, so they are one chunk there: test_phase_one_chunks_rows_as_a_gpu_does and "
                      "test_phase_one_in_column_chunks_on_a_gpu cover a GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason=INTERPRETER_CHUNKS)
@pytest.mark.parametrize("d", [80, 64, 96])
def test_phase_one_in_column_chunks(d, nan_empty):
    """Phase 1's backward takes a row in column chunks, a program per chunk, whose shares of the logits are summed
    before any is used: at d = 80 under the interpreter a chunk of 64 and one of 16 (48 columns masked), at 96 one
    of 64 and one of 32, at 64 one chunk. Every input and gradient as the reference's."""
    from depth_kernels import group_backward
    from depth_kernels.launch import row_split
    config = group_backward.backward_config(d)
    assert (config["CHUNK"], config["NC"]) == (64, {80: 2, 64: 1, 96: 2}[d])
    assert row_split(1280, 512) == (1024, 512) and row_split(768, 512) == (1024, 0)
    assert row_split(2048, 512) == (2048, 0)
    assert_grouped_matches_reference(("delta", {"null_source": True}, 5, {"gate": True}), 0.3, d)


def test_phase_one_chunks_rows_as_a_gpu_does(monkeypatch):
    """On a GPU phase 1's backward takes a row's logits in chunks of 256 columns (64 a warp on 4 warps: 128-bit loads)
    and its gradients in chunks of 128, none masked at the paper's widths; its forward takes rows to d = 1280 on
    tensor cores in chunks of 256 or 512 columns, none masked, and wider ones a row per program, split
    (depth_kernels.launch.row_split) with a tail of at least two lanes a thread."""
    group_read, group_backward, receiver_read = gpu_configs(monkeypatch)
    for d in (768, 1024, 1280, 2048, 4096, 80):
        cfg = group_backward.backward_config(d)
        assert (cfg["CHUNK"], cfg["NC"]) == (256, -(-d // 256)) and not cfg["F32_DOT"], (d, cfg)
        assert (cfg["GRAD_CHUNK"], cfg["GRAD_NC"]) == (128, -(-d // 128)), (d, cfg)
        assert d == 80 or cfg["BLOCK_D"] == d == cfg["GRAD_CHUNK"] * cfg["GRAD_NC"], (d, cfg)
    for d in (768, 1024, 1280):
        kernel, cfg = group_read._forward_config(d)
        assert kernel is group_read._group_fwd and cfg["BLOCK_D"] == d and cfg["CHUNK"] // cfg["W"] >= 64, (d, cfg)
    kernel, cfg = group_read._forward_config(2048)
    assert kernel is group_read._group_fwd_rows and (cfg["BLOCK_D"], cfg["BLOCK_T"]) == (2048, 0), cfg


def test_receivers_hold_a_row_on_few_warps_as_a_gpu_does(monkeypatch):
    """On a GPU a receiver's row is held by one warp forward and two backward to d = 1280 (four for a heavy
    backward), more only where a row is wider, a row per program, the SM shared by 8 warps of several programs;
    rows split without masked lanes (1280 = 1024 + 256)."""
    _, _, receiver_read = gpu_configs(monkeypatch)
    expected = {768: (1, 2, 4), 1024: (1, 2, 4), 1280: (1, 2, 4), 2048: (2, 4, 8), 4096: (4, 8, 8)}
    for d, warps in expected.items():
        configs = [receiver_read._receiver_config(4096, d, backward=False),
                   receiver_read._receiver_config(4096, d, backward=True),
                   receiver_read._receiver_config(4096, d, backward=True, heavy=True)]
        assert tuple(c["num_warps"] for c in configs) == warps, (d, configs)
        for c in configs:
            assert c["BLOCK_M"] == 1 and c["BLOCK_D"] + c["BLOCK_T"] == d, (d, c)
            assert c["num_warps"] * receiver_read.programs_per_sm(c["num_warps"]) == receiver_read.WARPS_PER_SM
    assert receiver_read.backward_wave(4096, 1280, torch.device("meta")) == (512, 8)   # 4 programs on 132 SMs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the interpreter's form is "
                    "test_phase_one_in_column_chunks (at d = 1280 the interpreter takes minutes)")
def test_phase_one_in_column_chunks_on_a_gpu(nan_empty):
    """The chunks a GPU runs: d = 1280 as 5 chunks of 256 columns. Every input and gradient as the reference's."""
    from depth_kernels import group_backward
    assert group_backward.backward_config(1280)["NC"] == 5
    assert_grouped_matches_reference(("delta", {"null_source": True}, 5, {"gate": True}), 0.3, 1280)


def test_a_read_given_a_norm_other_than_the_states_says_so():
    """A group stacks its receivers' pre-norm weights at its start, from the norms the state was given: a read
    given another norm (whose weight the kernels would not use) is an error, not a silent mix-up."""
    d, policy = 16, make_policy("delta", 2)
    routers = Routers(policy.n_receivers(4), d, gate=False).to(DEVICE)
    norms = [RMSNorm(d, 1e-6).to(DEVICE) for _ in range(5)]
    state = GroupedDepthState(policy, routers, torch.randn(1, 3, d, device=DEVICE), reference, 1e-6, norms=norms)
    state.add(torch.tanh(state.input(norms[0])))
    with pytest.raises(ValueError, match=r"sublayer 1 is read with a norm other than norms\[1\]"):
        state.input(RMSNorm(d, 1e-6).to(DEVICE))


def test_a_read_without_a_norm_takes_the_reference_path_of_the_grouped_state():
    """A read given no pre-norm is router.DepthState's reference read, on its stacked committed sources (whose
    stack is the state's own, not the kernels' gradient bank): the same input as the reference state's."""
    d, policy = 16, make_policy("delta", 2)
    routers = Routers(policy.n_receivers(4), d, gate=False).to(DEVICE)
    with torch.no_grad():
        routers.query.normal_()
    norms = [RMSNorm(d, 1e-6).to(DEVICE) for _ in range(5)]
    e, v = torch.randn(1, 3, d, device=DEVICE), torch.randn(1, 3, d, device=DEVICE)
    grouped = GroupedDepthState(policy, routers, e, reference, 1e-6, norms=norms)
    plain = DepthState(policy, routers, e, reference, 1e-6)
    for state in (grouped, plain):
        state.input()
        state.add(v)
    torch.testing.assert_close(grouped.input(), plain.input())


@pytest.mark.parametrize("peek", [False, True], ids=["receivers-add", "stream-read-between"])
def test_a_receiver_that_makes_the_streams_add_gives_the_reference_gradients(peek, monkeypatch, nan_empty):
    """A fine-grained group's later receivers make the stream's add for their newest source (GroupedDepthState.add)
    and add its gradient into that source's accumulator: every input and gradient as the reference's. Read between
    the add and the read (state.h), the stream is made as autograd makes it, and no receiver adds."""
    made, outputs = [], []
    read, add = GroupedDepthState._read, GroupedDepthState.add

    def counted_read(self, norm, add):
        made.append(self.unadded is not None)
        return read(self, norm, add)

    def peeking_add(self, v):
        add(self, v)
        outputs.append(v)
        torch.testing.assert_close(self.h, self.sources[0] + sum(outputs))     # h~ = e + every output so far
    monkeypatch.setattr(GroupedDepthState, "_read", counted_read)
    if peek:
        monkeypatch.setattr(GroupedDepthState, "add", peeking_add)
    assert_grouped_matches_reference(("delta", {"null_source": True}, 3, {"gate": True}), 0.3)
    assert len(made) == 8 and any(made) != peek, made


# The gradients' tolerance where logits are large. An fp32 logit z = rstd (s . u) is off by up to
# LOGIT_ROUNDING U32 Z in absolute terms (Z = logit_bound): ceil(log2 d) (7 at d = 96) for its tree sum of d
# products and ~4 for rstd on a GPU (rsqrt.approx.f32 is within 2^-22.9 = 2.1 U32, the fp32 division in the
# mean of squares 2 ulp, halved by the root; the interpreter's numpy rounds correctly), counted for each of the
# two paths: 2 (7 + 4) = 22. Every other rounding is relative to its own value, as with logits ~1 (whose 1e-5 of
# the scale covers those). A logit off by dz moves a softmax weight by a (1 - a) dz and the softmax's backward
# (go . s_i - D, whose terms cancel where one source dominates) by as much relative to the gradients' scale,
# and one read's error reaches the next reads through their inputs: twice that, 44. At logits ~300 (Z ~ 3100
# here) that is 8e-3 of the scale; measured: up to 0.85 U32 Z of the scale under the interpreter (8 summation
# orders per case, by permuting the features), up to 6.6 on an H200, where the approximate rsqrt makes the
# logits' error a few times larger. A wrong merge is off by O(1) of the scale. tl.exp's ex2.approx.f32 (within
# 2 ulp, PTX ISA) errs relative to a = exp(z - lse), not to Z: some 100x less than the logit's own rounding.
LOGIT_ROUNDING = 44


def assert_grouped_matches_reference(case, scale_of_logits, d=96):
    got_ys, got_grads, bound = run_state(GroupedDepthState, *case, scale_of_logits, d)
    want_ys, want_grads, _ = run_state(DepthState, *case, scale_of_logits, d)
    # With logits ~300 an fp32 logit carries an absolute rounding error ~300 times larger, which the two paths
    # commit in different orders: the inputs agree to 1e-4 there (1e-5 otherwise).
    mild = scale_of_logits == 0.3
    for got, want in zip(got_ys, want_ys):
        assert_close(got, want, 1e-5 if mild else 1e-4, 1e-5 if mild else 1e-4)
    # Gradients that are rounding noise themselves (a receiver with one source has a zero query gradient in
    # exact arithmetic) are held to the scale of all the gradients, as in the whole-model test below, plus the
    # logits' rounding (LOGIT_ROUNDING)
    scale = max(w.abs().max().item() for w in want_grads if w is not None)
    atol = (1e-5 + LOGIT_ROUNDING * U32 * bound) * scale
    for i, (got, want) in enumerate(zip(got_grads, want_grads)):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=lambda m, i=i: f"leaf {i}: {m}")


# ------------------------------------------------------------------------------------------- whole model

TINY = dict(vocab_size=97, d_model=48, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96)
# every method and Delta Block option; blocks of unequal length (4 layers in 3 blocks), of one layer
# (n_blocks = n_layers) and a single block
METHODS = [dict(residual="attnres", n_blocks=2), dict(residual="attnres", n_blocks=3, null_source=True),
           dict(residual="full_attnres", null_source=True), dict(residual="delta"),
           dict(residual="delta", null_source=True, gate=True), dict(residual="delta_block", n_blocks=2),
           dict(residual="delta_block", n_blocks=3), dict(residual="delta_block", n_blocks=4),
           dict(residual="delta_block", n_blocks=1), dict(residual="delta_block", n_blocks=2, block_source="paper"),
           dict(residual="delta_block", n_blocks=2, include_partial=False),
           dict(residual="delta_block", n_blocks=2, null_source=True, gate=True),
           dict(residual="delta_block", n_blocks=2, null_source=True, learned_null=True, block_split="ceil"),
           dict(residual="delta_block", n_blocks=2, block_source="paper", null_source=True, learned_null=True,
                gate=True),
           dict(residual="attnres", n_blocks=3, sources="states"), dict(residual="delta", sources="states"),
           dict(residual="delta_block", n_blocks=3, sources="states", gate=True)]


def loss_and_grads(routed, kernel, idx):
    torch.manual_seed(0)
    model = Model(ModelConfig(**TINY, **routed, kernel=kernel)).to(DEVICE)
    with torch.no_grad():                       # routers away from their init, so every path is exercised
        for r in model.routers:
            r.query.normal_(0, 1.0)
            r.norm_weight.uniform_(0.5, 1.5)
            if r.gate is not None:
                r.gate.fill_(0.7)
            if r.null is not None:
                r.null.normal_(0, 1.0)
    loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}, logit_bound(model.routers)


@pytest.mark.parametrize("routed", METHODS, ids=lambda r: "-".join(map(str, r.values())))
def test_model_with_kernels_matches_reference(routed):
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    loss, grads, _ = loss_and_grads(routed, "triton", idx)
    want_loss, want_grads, bound = loss_and_grads(routed, "reference", idx)
    # fp32 rounding differs between the paths (and Delta Block's partial is h~ - block start in the kernel
    # path, a running sum in the reference); backward through the layers amplifies it. Gradients that are
    # rounding noise themselves (a receiver with one source has a zero query gradient in exact arithmetic)
    # are held to the scale of the model's gradients, not their own, plus the logits' rounding, as in the
    # grouped read's test (LOGIT_ROUNDING): the routers' queries here are N(0, 1), logits up to ~50, so
    # 1.3e-4 of the scale. The most exposed gradient is the tied embedding's: every read takes the embedding as
    # a source and the LM head's gradient adds to it; where the null source replaces the stream (Full AttnRes,
    # null_source), every gradient reaching it has passed through the routing, and on an H200 it exceeded 1e-5
    # of the scale (the interpreter, with a GPU's tile configuration too, stays within 0.15 of that).
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    scale = max(g.abs().max().item() for g in want_grads.values())
    atol = (1e-5 + LOGIT_ROUNDING * U32 * bound) * scale
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=atol,
                                   msg=lambda m, name=name: f"{name} (gradient scale {scale:.3e}): {m}")


@pytest.mark.parametrize("routed", [dict(residual="attnres", n_blocks=3), dict(residual="full_attnres"),
                                    dict(residual="delta", null_source=True, gate=True),
                                    dict(residual="delta_block", n_blocks=3)],
                         ids=["attnres", "full_attnres", "delta", "delta_block"])
def test_model_with_kernels_under_bf16_autocast(routed):
    """As train.py runs on a GPU: bf16 sublayer outputs next to an fp32 embedding and stream, so the kernels
    read mixed dtypes. bf16 carries 8 significant bits and the two paths round at different places (the kernel
    path also keeps phase 1's read-outs, their gradients and Delta Block's committed deltas in bf16), and how
    far bf16 moves the gradients depends on the method (replacement routing, whose gradients all pass through
    the routing, moves most: up to ~40% of the gradient scale for Full AttnRes in this tiny model). So each
    path is held against the fp32 model: the kernel path's loss within 1e-2 of it, and its largest gradient
    error at most 1.5x the reference path's own plus 1% of the gradient scale."""
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    true_loss, true_grads, _ = loss_and_grads(routed, "reference", idx)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss, grads, _ = loss_and_grads(routed, "triton", idx)
        want_loss, want_grads, _ = loss_and_grads(routed, "reference", idx)
    torch.testing.assert_close(loss, true_loss, rtol=1e-2, atol=0)
    scale = max(g.abs().max().item() for g in true_grads.values())

    def error(gs):
        return max((gs[name] - true_grads[name]).abs().max().item() for name in true_grads) / scale
    assert error(grads) <= 1.5 * error(want_grads) + 1e-2, (error(grads), error(want_grads))


def test_dispatch():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not uses_kernel("auto", cpu) and uses_kernel("auto", cuda)
    assert uses_kernel("triton", cpu) and not uses_kernel("reference", cuda)
    h = torch.zeros(1, 2, TINY["d_model"], device=DEVICE)
    auto = Model(ModelConfig(**TINY, residual="delta"))
    assert type(auto.depth_state(h)) is (GroupedDepthState if DEVICE.type == "cuda" else DepthState)
    assert type(Model(ModelConfig(**TINY, residual="delta", kernel="triton")).depth_state(h)) is GroupedDepthState
    assert type(Model(ModelConfig(**TINY, residual="delta", kernel="reference")).depth_state(h)) is DepthState
    assert type(Model(ModelConfig(**TINY, kernel="triton")).depth_state(h)) is DepthState   # nothing to route
    for bad in (lambda: ModelConfig(**TINY, kernel="cuda"), lambda: uses_kernel("Triton", cpu)):
        with pytest.raises(ValueError, match="allowed values are auto, triton, reference"):
            bad()


def test_a_second_backward_through_the_kernel_path_says_to_use_the_reference():
    """Its nodes hand their groups and bank to the backward once (nothing of a step outlives it): a second
    backward (retain_graph=True) is refused with a message, the reference path's is not."""
    idx = torch.randint(0, TINY["vocab_size"], (1, 5), device=DEVICE)
    for kernel in ("triton", "reference"):
        loss = Model(ModelConfig(**TINY, residual="delta", kernel=kernel)).to(DEVICE)(idx).sum()
        loss.backward(retain_graph=True)
        if kernel == "reference":
            loss.backward()
            continue
        with pytest.raises(RuntimeError, match="one backward per forward.*use kernel='reference'"):
            loss.backward()



@pytest.mark.parametrize("residual", ["delta", "full_attnres", "delta_block"])
def test_receivers_share_phase_one_in_groups(residual):
    """Fine-grained methods (full_attnres's final read included) group fine_group_size receivers per
    phase-1 read, not one each; a block method groups a block's receivers."""
    cfg = ModelConfig(**{**TINY, "n_layers": 12, "n_blocks": 4}, residual=residual, kernel="triton")
    state = Model(cfg).depth_state(torch.zeros(1, 2, TINY["d_model"], device=DEVICE))
    sizes = [state.plan.count(g) for g in sorted(set(state.plan))]
    if residual == "delta_block":
        assert sizes == [6, 6, 6, 6]                      # 4 blocks of 3 layers, 2 sublayers each
    else:
        size = fine_group_size(24, TINY["d_model"])
        assert size > 1 and sizes[:-1] == [size] * (len(sizes) - 1) and 1 <= sizes[-1] <= size + 1

def test_receivers_keep_their_read_out_where_it_moves_fewer_bytes():
    """A receiver keeps its r for its backward where two rows of r cost less than the state and its own sources
    read again: in fp32 with 2 sources of its own (test_model_with_kernels_matches_reference checks those
    gradients); under autocast (fp32 r, bf16 sources) only from 4, which groups of 3 never have."""
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for autocast, expected in ((False, True), (True, False)):
        model = Model(ModelConfig(**TINY, residual="delta", kernel="triton")).to(DEVICE)
        saved = []
        with observe_launches(lambda launch: saved.append(launch.args.get("R_SAVED", False)) and False), \
                torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            model(idx).sum().backward()
        assert any(saved) == expected and not all(saved), (autocast, saved)


def test_observer_sees_the_same_candidates_on_both_paths():
    idx = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    seen = {}
    for kernel in ("triton", "reference"):
        torch.manual_seed(0)
        model = Model(ModelConfig(**TINY, residual="delta_block", n_blocks=2, null_source=True, kernel=kernel))
        calls = seen[kernel] = []
        model.routing_observer = lambda l, sources, router: calls.append((l, [s.detach() for s in sources]))
        model.to(DEVICE)(idx)
    assert [l for l, _ in seen["triton"]] == [l for l, _ in seen["reference"]] == list(range(8))
    for (_, got), (_, want) in zip(seen["triton"], seen["reference"]):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_at_1044m_shape_on_gpu():
    """The compiled kernels at the benchmark's shape: d=1280, N=73, 2x1024 tokens, bf16."""
    sources, query, norm_weight, grad_out = make_inputs(73, 1280, torch.bfloat16, B=2, T=1024)
    got = depth_route(sources, query, norm_weight)
    want = reference(sources, query, norm_weight)
    # on the GPU the cast rounds, so kernel and reference differ by at most 1 bf16 ulp
    assert_close(got, want, 2 ** -7, 1e-5)
    for g, w in zip(torch.autograd.grad(got, [*sources, query], grad_out),
                    torch.autograd.grad(want, [*sources, query], grad_out)):
        assert_close(g, w, 2 ** -7, 1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernel_launches_on_the_tensors_device():
    """Triton launches on the current device: tensors on cuda:1 read while cuda:0 is current."""
    sources, query, norm_weight, grad_out = make_inputs(5, 96, torch.bfloat16)
    on_1 = [s.detach().to("cuda:1").requires_grad_() for s in sources]
    q1, g1 = query.detach().to("cuda:1"), norm_weight.detach().to("cuda:1")
    with torch.cuda.device(0):
        got = depth_route(on_1, q1, g1)
        grads = torch.autograd.grad(got, on_1, grad_out.to("cuda:1"))
    want = reference(on_1, q1, g1)
    assert_close(got, want, 2 ** -7, 1e-5)
    for g, w in zip(grads, torch.autograd.grad(want, on_1, grad_out.to("cuda:1"))):
        assert_close(g, w, 2 ** -7, 1e-4)
