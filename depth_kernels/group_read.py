"""Grouped depth routing: each committed source read once per group of receivers, not once per receiver.

A group is a run of consecutive receiving sublayers (a Delta Block / AttnRes block, or fine-grained Delta
AttnRes's groups.fine_group_size sublayers, 8 at 36 layers) that share the sources C committed before it
began; each receiver l of the group also reads a few sources I_l of its own (the outputs committed since the
group began, the partial block h - base, a null source). With z_i = rstd_i (s_i . u_l), Eq. 1 over C and I_l
splits exactly:

    lse_C = log sum_{i in C} exp(z_i)        r_C = sum_{i in C} exp(z_i - lse_C) s_i         (phase 1, per group)
    lse   = log(exp(lse_C) + sum_{i in I} exp(z_i))
    r     = exp(lse_C - lse) r_C + sum_{i in I} exp(z_i - lse) s_i                          (phase 2, per receiver)

that is, the receiver's online softmax starts from the state (lse_C, r_C) instead of (-inf, 0). The backward
is that of one softmax over C + I with the full lse: for go = dL/dr and D = go . r,

    a_i = exp(z_i - lse)   dz_i = a_i (go . s_i - D)   ds_i = a_i go + dz_i rstd_i (u - z_i rstd_i s_i / d)
    du  = sum_i dz_i rstd_i s_i                                                  (u = query * norm weight)

so a receiver's backward needs only its own sources and writes go, D (and keeps lse); the group's backward
then reads each committed source once, sums ds_i over the group's receivers and adds it in place into one
gradient accumulator per source, and gives each receiver the committed part of its du.

Per token row this is a small attention on tensor cores (tl.dot, fp32 accumulation): the C committed sources S
(C, d) against the R receivers' folded queries U (R, d). This file holds phase 1; phase 2, fused with the
pre-norm, is depth_kernels/receiver_read.py:
- `_group_fwd`: Z = rstd S U^T, P = softmax over C, r_C = P^T S and lse_C, R receivers a pass;
- `_group_bwd`: G = S go^T, A = exp(Z - lse), W = A (G - D) rstd; dS = A go + W U - (sum_r W Z) rstd S / d summed
  into each source's gradient accumulator, du = W^T S summed over rows per program.
Both are persistent (a program walks rows program_id, + programs, ...), read the address table once per program,
and make two passes over a row's columns in chunks: the first for the (C, R) logits (and G), which need the whole
row, the second (whose sources come back from cache) for what is written.
"""
from __future__ import annotations

import functools
import torch
import triton
import triton.language as tl
from torch import Tensor

from depth_kernels.launch import SourceTable, cdiv, interpreting, launch, register_budget, sm_count

# ------------------------------------------------------------------------------------------------ kernels

@triton.jit
def _table_rows(table, n_a, n_b, C_PAD: tl.constexpr, A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr):
    """The table's sources as (C_PAD,) vectors: their addresses as pointers of each run's dtype, and which
    rows are of the first run (the n_a of A_DTYPE) and which of the second. Loaded once per program."""
    i = tl.arange(0, C_PAD)
    addresses = tl.multiple_of(tl.load(table + i, mask=i < n_a + n_b, other=0), 16)   # aligned by the launcher
    return (addresses.to(tl.pointer_type(A_DTYPE)), i < n_a, addresses.to(tl.pointer_type(B_DTYPE)),
            (i >= n_a) & (i < n_a + n_b))


@triton.jit
def _sources(a_ptr, a_ok, b_ptr, b_ok, at, col_ok, SAME: tl.constexpr):
    """Columns `at` (BK,) of every source, (C_PAD, BK) in fp32, 0 where masked: one load per dtype run (one in
    all when both runs have one dtype)."""
    if SAME:
        return tl.load(a_ptr[:, None] + at[None, :], mask=(a_ok | b_ok)[:, None] & col_ok[None, :],
                       other=0.0).to(tl.float32)
    s = tl.load(a_ptr[:, None] + at[None, :], mask=a_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    return s + tl.load(b_ptr[:, None] + at[None, :], mask=b_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _queries(q_ptr, g_ptr, recv, recv_ok, cols, col_ok, d):
    """Columns `cols` of the receivers' folded queries u = query * norm_weight, (R_BLOCK, BK) in fp32."""
    at = recv[:, None] * d + cols[None, :]
    mask = recv_ok[:, None] & col_ok[None, :]
    q = tl.load(q_ptr + at, mask=mask, other=0.0).to(tl.float32)
    return q * tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rows(ptr, recv, recv_ok, slab, at, col_ok):
    """Columns `at` of the receivers' slots of a (R, slab) buffer (go), (R_BLOCK, BK) in fp32."""
    return tl.load(ptr + recv[:, None].to(tl.int64) * slab + at[None, :], mask=recv_ok[:, None] & col_ok[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _add_into(ptr, rows, ok, at, col_ok, ds, accumulate):
    """ds (C_PAD, BK) written into the gradient accumulators at row pointers `rows` (those `ok`), or added to
    what is there (accumulate != 0)."""
    mask = ok[:, None] & col_ok[None, :]
    at = rows[:, None] + at[None, :]
    old = tl.load(at, mask=mask & (accumulate != 0), other=0.0).to(tl.float32)
    tl.store(at, (ds + old).to(ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv"])
def _group_fwd(table, n_a, n_b, q_ptr, g_ptr, r0, n_recv, state_ptr, lse_c_ptr, slab, M, d, eps,
               A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, C_PAD: tl.constexpr, R_BLOCK: tl.constexpr,
               BK: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr):
    """Phase 1 for receivers recv = r0 + [0, R_BLOCK) (those < n_recv), token rows program_id(0), + programs,
    ...: r_C at state_ptr + recv slab, lse_C at lse_c_ptr + recv M. Per row, its C sources S (C, d) against the
    receivers' folded queries U (R, d) are a small attention: Z = rstd * S U^T (C, R), P = softmax over C,
    r_C = P^T S. Two passes over the row's columns in chunks of BK: the first accumulates S U^T and the sources'
    squares, the second (whose sources come back from cache) writes P^T S."""
    recv = r0 + tl.arange(0, R_BLOCK)
    recv_ok = recv < n_recv
    a_ptr, a_ok, b_ptr, b_ok = _table_rows(table, n_a, n_b, C_PAD, A_DTYPE, B_DTYPE)
    src_ok = a_ok | b_ok
    cols = tl.arange(0, BK)
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0)):
        start = row * d.to(tl.int64)
        z = tl.zeros((C_PAD, R_BLOCK), tl.float32)
        squares = tl.zeros((C_PAD,), tl.float32)
        for k in tl.range(0, d, BK, num_stages=STAGES):
            col_ok = k + cols < d
            s = _sources(a_ptr, a_ok, b_ptr, b_ok, start + k + cols, col_ok, A_DTYPE == B_DTYPE)   # (C, BK)
            u = _queries(q_ptr, g_ptr, recv, recv_ok, k + cols, col_ok, d)                       # (R, BK)
            z = tl.dot(s, tl.trans(u), z, input_precision=PRECISION)
            squares += tl.sum(s * s, axis=1)
        z = tl.where(src_ok[:, None], z * tl.rsqrt(squares / d + eps)[:, None], float("-inf"))
        m = tl.max(z, axis=0)                                                  # (R,)
        p = tl.exp(z - m[None, :])
        l = tl.sum(p, axis=0)
        tl.store(lse_c_ptr + recv.to(tl.int64) * M + row, m + tl.log(l), mask=recv_ok)
        pt = tl.trans(p / l[None, :])                                          # (R, C)
        out = state_ptr + recv[:, None].to(tl.int64) * slab + start
        for k in tl.range(0, d, BK, num_stages=STAGES):
            col_ok = k + cols < d
            s = _sources(a_ptr, a_ok, b_ptr, b_ok, start + k + cols, col_ok, A_DTYPE == B_DTYPE)
            r = tl.dot(pt, s, input_precision=PRECISION)                       # (R, BK)
            tl.store(out + k + cols[None, :], r.to(state_ptr.dtype.element_ty), mask=recv_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv", "off_a", "off_b", "accumulate"])
def _group_bwd(table, n_a, n_b, q_ptr, g_ptr, r0, n_recv, go_ptr, D_ptr, lse_ptr, slab, acc_a_ptr, acc_b_ptr,
               off_a, off_b, du_ptr, accumulate, M, d, eps,
               A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, C_PAD: tl.constexpr, R_BLOCK: tl.constexpr,
               BK: tl.constexpr, PARTS: tl.constexpr, CHUNKS: tl.constexpr, STAGES: tl.constexpr,
               PRECISION: tl.constexpr):
    """The committed sources' gradients for receivers recv = r0 + [0, R_BLOCK) (those < n_recv): source i's,
    summed over them, into accumulator off_a + i of acc_a (a slot = slab elements) or off_b + i - n_a of acc_b;
    and each program's partial sum of du into row program_id(0) // PARTS of du_ptr (programs, R_BLOCK, d).

    Per row, with go = dL/dr_C (R, d) and D = go . r, lse per receiver (group_read's docstring):
    Z = rstd * S U^T, A = exp(Z - lse), G = S go^T (C, R) from a first pass over the columns; then
    W = A (G - D) rstd, dS = A go + W U - (sum_r W Z) rstd S / d and du += W^T S. A program takes the columns of
    its part (program_id(0) % PARTS: CHUNKS chunks of BK) in the second pass and keeps their du (R, CHUNKS BK) in
    registers across its rows; the PARTS programs of a row range run side by side, so that the first pass's
    reads of the same rows are served by the cache. D, lse: (n_recv, M) with fewer than 2^31 entries."""
    part = tl.program_id(0) % PARTS
    program, programs = tl.program_id(0) // PARTS, tl.num_programs(0) // PARTS
    recv = r0 + tl.arange(0, R_BLOCK)
    recv_ok = recv < n_recv
    a_ptr, a_ok, b_ptr, b_ok = _table_rows(table, n_a, n_b, C_PAD, A_DTYPE, B_DTYPE)
    src_ok = a_ok | b_ok
    i = tl.arange(0, C_PAD)
    grad_a = acc_a_ptr + (off_a + i).to(tl.int64) * slab      # each source's accumulator, as pointers of its dtype
    grad_b = acc_b_ptr + (off_b + i - n_a).to(tl.int64) * slab
    cols = tl.arange(0, BK)
    du = ()
    for c in tl.static_range(CHUNKS):
        du = du + (tl.zeros((R_BLOCK, BK), tl.float32),)
    for row in tl.range(program, M, programs):
        start = row * d.to(tl.int64)
        lse = tl.load(lse_ptr + recv * M + row, mask=recv_ok, other=float("inf"))   # inf: A = 0 past n_recv
        D = tl.load(D_ptr + recv * M + row, mask=recv_ok, other=0.0)
        z = tl.zeros((C_PAD, R_BLOCK), tl.float32)
        g = tl.zeros((C_PAD, R_BLOCK), tl.float32)
        squares = tl.zeros((C_PAD,), tl.float32)
        for k in tl.range(0, d, BK, num_stages=STAGES):
            col_ok = k + cols < d
            s = _sources(a_ptr, a_ok, b_ptr, b_ok, start + k + cols, col_ok, A_DTYPE == B_DTYPE)
            z = tl.dot(s, tl.trans(_queries(q_ptr, g_ptr, recv, recv_ok, k + cols, col_ok, d)), z,
                       input_precision=PRECISION)
            g = tl.dot(s, tl.trans(_rows(go_ptr, recv, recv_ok, slab, start + k + cols, col_ok)), g,
                       input_precision=PRECISION)
            squares += tl.sum(s * s, axis=1)
        rstd = tl.rsqrt(squares / d + eps)
        z = z * rstd[:, None]
        a = tl.exp(tl.where(src_ok[:, None], z - lse[None, :], float("-inf")))   # 0 past the sources
        w = a * (g - D[None, :]) * rstd[:, None]                                 # dz rstd, (C, R)
        shrink = tl.sum(w * z, axis=1) * rstd / d                                # (C,)
        new_du = ()
        for c in tl.static_range(CHUNKS):
            k = (part * CHUNKS + c) * BK
            col_ok = k + cols < d
            at = start + k + cols
            s = _sources(a_ptr, a_ok, b_ptr, b_ok, at, col_ok, A_DTYPE == B_DTYPE)
            u = _queries(q_ptr, g_ptr, recv, recv_ok, k + cols, col_ok, d)
            go = _rows(go_ptr, recv, recv_ok, slab, at, col_ok)
            ds = tl.dot(a, go, input_precision=PRECISION)
            ds = tl.dot(w, u, ds, input_precision=PRECISION) - shrink[:, None] * s
            _add_into(acc_a_ptr, grad_a, a_ok, at, col_ok, ds, accumulate)
            _add_into(acc_b_ptr, grad_b, b_ok, at, col_ok, ds, accumulate)
            new_du = new_du + (tl.dot(tl.trans(w), s, du[c], input_precision=PRECISION),)
        du = new_du
    out = du_ptr + program.to(tl.int64) * R_BLOCK * d + tl.arange(0, R_BLOCK)[:, None] * d
    for c in tl.static_range(CHUNKS):
        k = (part * CHUNKS + c) * BK
        tl.store(out + k + cols[None, :], du[c], mask=(k + cols < d)[None, :])


# ------------------------------------------------------------------------------------------ launching

# Programs per SM each kernel is built for (depth_kernels/tools/aot.py checks registers against it): the forward
# holds a (C, BK) chunk of sources, a (R, BK) chunk of queries and the (C, R) logits of one row at a time; the
# backward also its part's du and the (C, R) weights of the row, and takes 8 warps.
PROGRAMS_PER_SM = {"_group_fwd": 2, "_group_bwd": 1}


@functools.cache   # a pure function of its arguments, asked at every launch
def _group_config(d: int, n_sources: int, backward: bool, exact: bool = False) -> dict:
    """The tiles of phase 1 at width d over n_sources committed sources. C_PAD: the sources, padded to a power
    of two of at least 16 (tl.dot's least dimension); R_BLOCK = 16 receivers per pass (a fine group of 8 is
    padded); BK = 32 columns a chunk. The backward splits a row's columns into PARTS parts of CHUNKS chunks
    (128 columns a part), whose du (R_BLOCK, CHUNKS BK) a program keeps across its rows.

    PRECISION: the products run on tensor cores in TF32 (10-bit mantissa) where a table holds 16-bit sources
    (autocast, bf16): their values are exact in it, and the folded queries, weights and an fp32 embedding
    are rounded to 2^-11, below the 2^-9 to which r_C and go are rounded when they are stored in 16 bits.
    Tables of fp32 sources only (exact) take three TF32 products per product (tf32x3: fp32's precision).
    Under the interpreter every product is fp32's; small chunks and two parts, so that the tests see several
    chunks, a masked tail chunk and both parts."""
    c_pad = max(16, triton.next_power_of_2(n_sources))
    if interpreting():
        cfg = dict(C_PAD=c_pad, R_BLOCK=16, BK=16 if d <= 64 else 32, STAGES=1, num_warps=4, PRECISION="ieee")
        parts = 2
    else:
        warps = 8 if backward else 4
        per_sm = PROGRAMS_PER_SM["_group_bwd" if backward else "_group_fwd"]
        wide = c_pad > 32 or exact or backward    # (C, R) tiles of 64 rows and more, or three products each
        cfg = dict(C_PAD=c_pad, R_BLOCK=16, BK=32, STAGES=2, num_warps=warps,
                   PRECISION="tf32x3" if exact else "tf32",
                   maxnreg=register_budget(warps, per_sm) if wide else register_budget(warps, 2 * per_sm))
        parts = triton.cdiv(d, 128)
    if backward:
        cfg.update(PARTS=parts, CHUNKS=triton.cdiv(triton.cdiv(d, cfg["BK"]), parts))
    return cfg


def receivers_per_pass(d: int) -> int:
    """How many receivers phase 1 serves in one pass over the sources at width d."""
    return _group_config(d, 1, backward=True)["R_BLOCK"]


def _exact(table: SourceTable) -> bool:
    """Whether every source of the table is fp32 (phase 1 then computes at fp32's precision)."""
    return table.dtype(0) == tl.float32 and table.dtype(1) == tl.float32


def _programs(M: int, per_sm: int, device: torch.device, parts: int) -> int:
    """Row programs of a persistent phase-1 launch, each of `parts` programs: a row per program under the
    interpreter; on a GPU `per_sm` programs for every SM (a second wave, where per_sm is twice what fits, keeps
    the SMs busy to the end), or one per row where there are fewer rows."""
    return M if interpreting() else max(1, min(M, sm_count(device) * per_sm // parts))


def group_forward(table: SourceTable, queries: Tensor, norm_weights: Tensor, eps: float, state: Tensor,
                  lse_c: Tensor) -> None:
    """Phase 1 for the n_recv = len(queries) receivers of a group: state[r] = r_C (a slot), lse_c[r] (M,)."""
    first = table.tensors[0]
    M, d = first.numel() // first.shape[-1], first.shape[-1]
    cfg = _group_config(d, len(table.tensors), backward=False, exact=_exact(table))
    n_recv, block = queries.shape[0], cfg["R_BLOCK"]
    programs = _programs(M, PROGRAMS_PER_SM["_group_fwd"], first.device, 1)
    for r0 in range(0, n_recv, block):        # receivers beyond R_BLOCK: the sources are read again
        chunk = min(block, n_recv - r0)
        io = lambda: ([(table, 1), (queries[r0:r0 + chunk], 1), (norm_weights[r0:r0 + chunk], 1)],  # noqa: E731
                      [state[r0:r0 + chunk, :first.numel()], lse_c[r0:r0 + chunk]])
        launch(_group_fwd, programs, io, first.device, dict(
            table=table.addresses, n_a=table.n_a, n_b=len(table.tensors) - table.n_a, q_ptr=queries,
            g_ptr=norm_weights, r0=r0, n_recv=n_recv, state_ptr=state, lse_c_ptr=lse_c, slab=state.shape[1], M=M,
            d=d, eps=eps, **table.dtype_args(), **cfg))


def group_backward(table: SourceTable, queries: Tensor, norm_weights: Tensor, eps: float, go: Tensor, D: Tensor,
                   lse: Tensor, accumulators: tuple[Tensor, Tensor, int, int], accumulate: bool) -> Tensor:
    """Phase 1's backward: the committed sources' gradients into `accumulators` (acc_a, acc_b, off_a, off_b:
    see GradBank.pointers), written or added to; returns du (n_recv, d) fp32, the committed part."""
    first = table.tensors[0]
    M, d = first.numel() // first.shape[-1], first.shape[-1]
    if D.numel() >= 2 ** 31:      # the kernel reads D and lse (n_recv, M) at 32-bit offsets
        raise ValueError(f"phase 1's backward takes fewer than 2^31 per-row scalars; got {tuple(D.shape)}")
    cfg = _group_config(d, len(table.tensors), backward=True, exact=_exact(table))
    n_recv, block, parts = queries.shape[0], cfg["R_BLOCK"], cfg["PARTS"]
    programs = _programs(M, 2 * PROGRAMS_PER_SM["_group_bwd"], first.device, parts)
    du = torch.empty(cdiv(n_recv, block), programs, block, d, dtype=torch.float32, device=first.device)
    acc_a, acc_b, off_a, off_b = accumulators
    n_a, n_b = table.n_a, len(table.tensors) - table.n_a

    def io(c: int, r0: int, chunk: int) -> tuple[list, list]:
        grads = [acc_a[off_a:off_a + n_a, :first.numel()], acc_b[off_b:off_b + n_b, :first.numel()]]
        reads = [(table, 1), (go[r0:r0 + chunk, :first.numel()], 1), (D[r0:r0 + chunk], 1),
                 (lse[r0:r0 + chunk], 1)]
        return reads + [(g, 1) for g in grads if accumulate or c], grads + [du[c]]

    for c, r0 in enumerate(range(0, n_recv, block)):
        chunk = min(block, n_recv - r0)
        launch(_group_bwd, programs * parts, lambda: io(c, r0, chunk), first.device, dict(
            table=table.addresses, n_a=n_a, n_b=n_b, q_ptr=queries, g_ptr=norm_weights, r0=r0, n_recv=n_recv,
            go_ptr=go, D_ptr=D, lse_ptr=lse, slab=go.shape[1], acc_a_ptr=acc_a, acc_b_ptr=acc_b, off_a=off_a,
            off_b=off_b, du_ptr=du[c], M=M, d=d, eps=eps, accumulate=int(accumulate or c > 0),
            **table.dtype_args(), **cfg))
    return du.sum(1).flatten(0, 1)[:n_recv]
