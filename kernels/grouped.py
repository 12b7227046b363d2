"""Grouped depth routing: each committed source read once per group of receivers, not once per receiver.

A group is a run of consecutive receiving sublayers (a Delta Block / AttnRes block, or about six sublayers of
fine-grained Delta AttnRes) that share the sources C committed before it began; each receiver l of the group
also reads a few sources I_l of its own (the outputs committed since the group began, the partial block
h - base, a null source). With e_i = rstd_i (s_i . u_l), Eq. 1 over C and I_l splits exactly:

    lse_C = log sum_{i in C} exp(e_i)        r_C = sum_{i in C} exp(e_i - lse_C) s_i         (phase 1, per group)
    lse   = log(exp(lse_C) + sum_{i in I} exp(e_i))
    r     = exp(lse_C - lse) r_C + sum_{i in I} exp(e_i - lse) s_i                          (phase 2, per receiver)

that is, the receiver's online softmax starts from the state (lse_C, r_C) instead of (-inf, 0). The backward
is that of one softmax over C + I with the full lse: for go = dL/dr and D = go . r,

    a_i = exp(e_i - lse)   de_i = a_i (go . s_i - D)   ds_i = a_i go + de_i rstd_i (u - e_i rstd_i s_i / d)
    du  = sum_i de_i rstd_i s_i                                                  (u = query * norm weight)

so a receiver's backward needs only its own sources and writes go, D (and keeps lse); the group's backward
then reads each committed source once, sums ds_i over the group's receivers and adds it in place into one
gradient accumulator per source, and gives each receiver the committed part of its du.

Kernels (fp32 accumulation; sources in at most two dtypes, one loop each; 128-bit aligned loads; pipelined):
- `_group_fwd`:   phase 1, R receivers at once, one token row per program: (r_C, lse_C) per receiver.
- `_receiver_fwd`: phase 2 fused with the mix and the pre-norm: y = RMSNorm_w(h + gate r) (or of r), and lse.
- `_receiver_bwd`: recomputes r, x and the norm; dy -> dx -> go = dL/dr; the receiver's own sources' gradients
                   into their accumulators, the partial block's into dh and (negated) its base's; go, D for
                   the group; partial sums of du, the norm weight's and the gate's gradients.
- `_group_bwd`:    the committed sources' gradients summed over the receivers, and their du.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.depth_route import (DTYPES, SourceTable, _diff_source, _folded_query, _interpreting, _launch, _logit,
                                 _softmax_step, _source_grad, _table_source, register_budget)

# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _accumulate(ptr, ds, offs, mask, accumulate):
    """Write ds into a gradient accumulator (accumulate == 0), or add it to what is there."""
    ds += tl.load(ptr + offs, mask=mask & (accumulate != 0), other=0.0).to(tl.float32)
    tl.store(ptr + offs, ds.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _receiver_logits(U, s, d, eps):
    """Logits of one source row s (1, BLOCK_D) for receivers with folded queries U (R_BLOCK, BLOCK_D): e
    (R_BLOCK,) and the source's rstd (1,)."""
    rstd = tl.rsqrt(tl.sum(s * s, axis=1) / d + eps)
    return tl.sum(U * s, axis=1) * rstd, rstd


@triton.jit
def _receiver_queries(q_ptr, g_ptr, recv, recv_ok, cols, d):
    """(R_BLOCK, BLOCK_D) fp32 folded queries u_r = query_r * norm_weight_r of receivers recv ((R, d) rows)."""
    mask = recv_ok[:, None] & (cols < d)[None, :]
    at = recv[:, None] * d + cols[None, :]
    q = tl.load(q_ptr + at, mask=mask, other=0.0).to(tl.float32)
    return q * tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _committed_grad(s, U, go, D, lse, d, eps):
    """One committed source row s (1, BLOCK_D), summed over the receivers (rows of U, go; entries of D, lse):
    its gradient ds (1, BLOCK_D) and every receiver's du term de rstd s (R_BLOCK, BLOCK_D)."""
    e, rstd = _receiver_logits(U, s, d, eps)
    a = tl.exp(e - lse)                                                   # 0 for masked receivers (lse = inf)
    de_rstd = a * (tl.sum(go * s, axis=1) - D) * rstd
    ds = (tl.sum(a[:, None] * go + de_rstd[:, None] * U, axis=0)[None, :]
          - tl.sum(de_rstd * e, axis=0) * rstd[:, None] / d * s)
    return ds, de_rstd[:, None] * s


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv"])
def _group_fwd(table, n_a, n_b, q_ptr, g_ptr, r0, n_recv, state_ptr, lse_c_ptr, slab, M, d, eps,
               A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
               STAGES: tl.constexpr):
    """Phase 1 for receivers recv = r0 + [0, R_BLOCK) (those < n_recv) at token row program_id(0): r_C at
    state_ptr + recv slab, lse_C at lse_c_ptr + recv M. q_ptr, g_ptr: the group's (n_recv, d) queries and
    norm weights."""
    row = tl.program_id(0)
    recv = r0 + tl.arange(0, R_BLOCK)
    recv_ok = recv < n_recv
    cols = tl.arange(0, BLOCK_D)
    U = _receiver_queries(q_ptr, g_ptr, recv, recv_ok, cols, d)           # (R_BLOCK, BLOCK_D)
    offs = row.to(tl.int64) * d + cols[None, :]                            # (1, BLOCK_D): one token row
    mask = (cols < d)[None, :]
    m = tl.full((R_BLOCK,), float("-inf"), tl.float32)
    l = tl.zeros((R_BLOCK,), tl.float32)
    acc = tl.zeros((R_BLOCK, BLOCK_D), tl.float32)                         # one running sum per receiver
    for i in tl.range(0, n_a, num_stages=STAGES):
        s = _table_source(table, i, A_DTYPE, offs, mask)
        m, l, acc = _softmax_step(m, l, acc, s, _receiver_logits(U, s, d, eps)[0])
    for i in tl.range(n_a, n_a + n_b, num_stages=STAGES):
        s = _table_source(table, i, B_DTYPE, offs, mask)
        m, l, acc = _softmax_step(m, l, acc, s, _receiver_logits(U, s, d, eps)[0])
    smask = recv_ok[:, None] & mask
    tl.store(state_ptr + recv[:, None].to(tl.int64) * slab + offs, (acc / l[:, None]).to(state_ptr.dtype.element_ty),
             mask=smask)
    tl.store(lse_c_ptr + recv.to(tl.int64) * M + row, m + tl.log(l), mask=recv_ok)


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv", "off_a", "off_b", "tiles", "accumulate"])
def _group_bwd(table, n_a, n_b, q_ptr, g_ptr, r0, n_recv, go_ptr, D_ptr, lse_ptr, slab, acc_a_ptr, acc_b_ptr,
               off_a, off_b, du_ptr, tiles, accumulate, M, d, eps,
               A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R_BLOCK: tl.constexpr,
               BLOCK_D: tl.constexpr, STAGES: tl.constexpr):
    """The committed sources' gradients for receivers r0 + [0, R_BLOCK): source i's summed over them goes to
    accumulator off_a + i of acc_a (a slot = slab elements) or off_b + i - n_a of acc_b. Each program takes
    `tiles` consecutive token rows and writes its partial sum of every receiver's du (du_ptr row pid)."""
    pid = tl.program_id(0)
    recv = r0 + tl.arange(0, R_BLOCK)
    recv_ok = recv < n_recv
    cols = tl.arange(0, BLOCK_D)
    mask = (cols < d)[None, :]
    rmask = recv_ok[:, None] & mask
    U = _receiver_queries(q_ptr, g_ptr, recv, recv_ok, cols, d)
    du = tl.zeros((R_BLOCK, BLOCK_D), tl.float32)
    for t in range(tiles):
        row = pid * tiles + t
        if row < M:
            offs = row.to(tl.int64) * d + cols[None, :]
            go = tl.load(go_ptr + recv[:, None].to(tl.int64) * slab + offs, mask=rmask, other=0.0).to(tl.float32)
            D = tl.load(D_ptr + recv.to(tl.int64) * M + row, mask=recv_ok, other=0.0)
            lse = tl.load(lse_ptr + recv.to(tl.int64) * M + row, mask=recv_ok, other=float("inf"))
            for i in tl.range(0, n_a, num_stages=STAGES):
                s = _table_source(table, i, A_DTYPE, offs, mask)
                ds, du_i = _committed_grad(s, U, go, D, lse, d, eps)
                du += du_i
                _accumulate(acc_a_ptr + (off_a + i).to(tl.int64) * slab, ds, offs, mask, accumulate)
            for i in tl.range(n_a, n_a + n_b, num_stages=STAGES):
                s = _table_source(table, i, B_DTYPE, offs, mask)
                ds, du_i = _committed_grad(s, U, go, D, lse, d, eps)
                du += du_i
                _accumulate(acc_b_ptr + (off_b + i - n_a).to(tl.int64) * slab, ds, offs, mask, accumulate)
    tl.store(du_ptr + pid.to(tl.int64) * R_BLOCK * BLOCK_D + tl.arange(0, R_BLOCK)[:, None] * BLOCK_D + cols[None, :],
             du)


@triton.jit
def _mix(h, r, gate, ADD: tl.constexpr, X_DTYPE: tl.constexpr):
    """x = h + gate r (additive, Eq. 2; gate 1.0 without a gate: exactly h + r) or r (replacement), rounded to
    the dtype the reference mixes in."""
    if ADD:
        x = h + gate * r
    else:
        x = r
    return x.to(X_DTYPE).to(tl.float32)


@triton.jit
def _start_state(state_ptr, lse_c_ptr, slot, slab, rows, row_ok, offs, mask, M, HAS_STATE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The online softmax's starting (max, normaliser, sum): phase 1's (lse_C, 1, r_C), or empty."""
    if HAS_STATE:
        m = tl.load(lse_c_ptr + slot.to(tl.int64) * M + rows, mask=row_ok, other=0.0)
        l = tl.full((BLOCK_M,), 1.0, tl.float32)
        acc = tl.load(state_ptr + slot.to(tl.int64) * slab + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    return m, l, acc


@triton.jit
def _null_source(null_ptr, NULL: tl.constexpr, u, cols, d, eps):
    """The null source (BLOCK_D,) and its logit: the receiver's learned vector (NULL == 2), or zero (value 0,
    logit 0) otherwise."""
    if NULL == 2:
        n = tl.load(null_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
    else:
        n = tl.zeros((u.shape[0],), tl.float32)
    rstd = tl.rsqrt(tl.sum(n * n, axis=0) / d + eps)
    return n, tl.sum(n * u, axis=0) * rstd, rstd


@triton.jit(do_not_specialize=["n_a", "n_b", "slot", "has_gate"])
def _receiver_fwd(table, n_a, n_b, state_ptr, lse_c_ptr, slot, slab, h_ptr, base_ptr, q_ptr, g_ptr, gate_ptr,
                  has_gate, w_ptr, y_ptr, lse_ptr, null_ptr, M, d, eps, norm_eps,
                  A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr,
                  HAS_STATE: tl.constexpr, HAS_DIFF: tl.constexpr, ADD: tl.constexpr, NULL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr):
    """Receiver `slot` of a group: its read over [phase 1's state] + table sources [+ h - base] [+ a null
    source: zero, or the learned vector at null_ptr], mixed and normalised: y = RMSNorm_w(x) written to y_ptr,
    the full lse to lse_ptr + slot M."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < d)[None, :]
    offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
    u = _folded_query(q_ptr, g_ptr, cols, d)
    m, l, acc = _start_state(state_ptr, lse_c_ptr, slot, slab, rows, row_ok, offs, mask, M, HAS_STATE, BLOCK_M,
                             BLOCK_D)
    for i in tl.range(0, n_a, num_stages=STAGES):
        s = _table_source(table, i, A_DTYPE, offs, mask)
        m, l, acc = _softmax_step(m, l, acc, s, _logit(s, u, d, eps)[0])
    for i in tl.range(n_a, n_a + n_b, num_stages=STAGES):
        s = _table_source(table, i, B_DTYPE, offs, mask)
        m, l, acc = _softmax_step(m, l, acc, s, _logit(s, u, d, eps)[0])
    h = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    if ADD or HAS_DIFF:
        h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DIFF:                          # the partial block h - base
        p = h - tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m, l, acc = _softmax_step(m, l, acc, p, _logit(p, u, d, eps)[0])
    if NULL != 0:                         # the null source: 0 (none), 1 (zero), 2 (learned, at null_ptr)
        n, e_n, _ = _null_source(null_ptr, NULL, u, cols, d, eps)
        m, l, acc = _softmax_step(m, l, acc, n[None, :], tl.zeros((BLOCK_M,), tl.float32) + e_n)
    tl.store(lse_ptr + slot.to(tl.int64) * M + rows, m + tl.log(l), mask=row_ok)
    r = (acc / l[:, None]).to(R_DTYPE).to(tl.float32)
    gate = tl.load(gate_ptr, mask=has_gate != 0, other=1.0).to(tl.float32)   # 1.0: h + 1.0 r is h + r
    x = _mix(h, r, gate, ADD, X_DTYPE)
    xn = (x * tl.rsqrt(tl.sum(x * x, axis=1) / d + norm_eps)[:, None]).to(X_DTYPE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (w[None, :] * xn).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_a", "n_b", "slot", "has_gate", "off_a", "off_b", "dsum_lo", "dsum_hi", "tiles",
                             "accumulate"])
def _receiver_bwd(table, n_a, n_b, state_ptr, lse_c_ptr, slot, slab, h_ptr, base_ptr, q_ptr, g_ptr, gate_ptr,
                  has_gate, w_ptr, dy_ptr, lse_ptr, acc_a_ptr, acc_b_ptr, off_a, off_b, dh_ptr, dbase_ptr, go_ptr, D_ptr,
                  dsum_ptr, dsum_lo, dsum_hi, null_ptr, du_ptr, dw_ptr, dgate_ptr, tiles,
                  accumulate, M, d, eps, norm_eps,
                  A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr,
                  HAS_STATE: tl.constexpr, HAS_DIFF: tl.constexpr, ADD: tl.constexpr, SUMS: tl.constexpr,
                  NULL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr):
    """Backward of `_receiver_fwd` for `tiles` row tiles per program: dh (the stream's, with the partial
    block's, and with SUMS the slots dsum_lo..dsum_hi - 1 of dsum_ptr: the group's other receivers' -dL/d
    (partial), since this receiver's h is their base), -dL/d(partial) at dbase_ptr, the table sources'
    gradients into their accumulators, go = dL/dr and D = go . r for phase 1's backward, and per-program
    partial sums of du, dw (norm weight) and dgate."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    u = _folded_query(q_ptr, g_ptr, cols, d)
    w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr, mask=has_gate != 0, other=1.0).to(tl.float32)
    if NULL == 2:                         # the learned null's vector and logit
        n, e_n, rstd_n = _null_source(null_ptr, NULL, u, cols, d, eps)
    du = tl.zeros((BLOCK_D,), tl.float32)
    dw = tl.zeros((BLOCK_D,), tl.float32)
    dgate = tl.zeros((BLOCK_M,), tl.float32)
    for t in range(tiles):
        rows = (pid * tiles + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols < d)[None, :]
        offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
        lse = tl.load(lse_ptr + slot.to(tl.int64) * M + rows, mask=row_ok, other=float("inf"))  # rows past M:
        # every weight exp(z - lse) is 0, so nothing there overflows into the sums over rows
        # the read-out again: r = exp(lse_C - lse) r_C + sum_i exp(e_i - lse) s_i (+ the partial block's term)
        m, _, r = _start_state(state_ptr, lse_c_ptr, slot, slab, rows, row_ok, offs, mask, M, HAS_STATE, BLOCK_M,
                               BLOCK_D)
        r = r * tl.exp(m - lse)[:, None]
        for i in tl.range(0, n_a, num_stages=STAGES):
            s = _table_source(table, i, A_DTYPE, offs, mask)
            r += tl.exp(_logit(s, u, d, eps)[0] - lse)[:, None] * s
        for i in tl.range(n_a, n_a + n_b, num_stages=STAGES):
            s = _table_source(table, i, B_DTYPE, offs, mask)
            r += tl.exp(_logit(s, u, d, eps)[0] - lse)[:, None] * s
        h = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        p = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        if ADD or HAS_DIFF:
            h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DIFF:
            p = h - tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            r += tl.exp(_logit(p, u, d, eps)[0] - lse)[:, None] * p
        if NULL == 2:
            r += tl.exp(e_n - lse)[:, None] * n[None, :]
        r_mixed = r.to(R_DTYPE).to(tl.float32)
        # the norm's backward: y = w xn, xn = x rstd  ->  dx = rstd (gy - xn (gy . xn) / d), gy = dy w
        x = _mix(h, r_mixed, gate, ADD, X_DTYPE)
        rstd_x = tl.rsqrt(tl.sum(x * x, axis=1) / d + norm_eps)
        xn = x * rstd_x[:, None]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dw += tl.sum(dy * xn.to(X_DTYPE).to(tl.float32), axis=0)
        gy = dy * w[None, :]
        dx = rstd_x[:, None] * (gy - xn * (tl.sum(gy * xn, axis=1) / d)[:, None])
        if ADD:                           # x = h + gate r: dL/dh = dx, dL/dr = gate dx
            dgate += tl.sum(dx * r_mixed, axis=1)
            dh = dx
            dr = dx * gate
        else:
            dh = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
            dr = dx
        if HAS_STATE:                     # go as phase 1's backward will read it, used alike here: the
            dr = dr.to(go_ptr.dtype.element_ty).to(tl.float32)   # softmax backward's go . s_i - D is consistent
        D = tl.sum(dr * r, axis=1)
        if HAS_DIFF:                      # d(h - base): + to h, - to base
            dp, de_rstd = _source_grad(p, dr, u, lse, D, d, eps)
            du += tl.sum(de_rstd[:, None] * p, axis=0)
            dh += dp
            tl.store(dbase_ptr + offs, (-dp).to(dbase_ptr.dtype.element_ty), mask=mask)
        if ADD or HAS_DIFF or SUMS:
            tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=mask)
        if HAS_STATE:                     # for phase 1's backward
            tl.store(go_ptr + slot.to(tl.int64) * slab + offs, dr.to(go_ptr.dtype.element_ty), mask=mask)
            tl.store(D_ptr + slot.to(tl.int64) * M + rows, D, mask=row_ok)
        for i in tl.range(0, n_a, num_stages=STAGES):
            s = _table_source(table, i, A_DTYPE, offs, mask)
            ds, de_rstd = _source_grad(s, dr, u, lse, D, d, eps)
            du += tl.sum(de_rstd[:, None] * s, axis=0)
            _accumulate(acc_a_ptr + (off_a + i).to(tl.int64) * slab, ds, offs, mask, accumulate)
        for i in tl.range(n_a, n_a + n_b, num_stages=STAGES):
            s = _table_source(table, i, B_DTYPE, offs, mask)
            ds, de_rstd = _source_grad(s, dr, u, lse, D, d, eps)
            du += tl.sum(de_rstd[:, None] * s, axis=0)
            _accumulate(acc_b_ptr + (off_b + i - n_a).to(tl.int64) * slab, ds, offs, mask, accumulate)
        if SUMS:                          # last, when few registers are live: dh += the group's slots
            tl.debug_barrier()            # dh stored above by this program's threads, now read back
            dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            slot_ptr = dsum_ptr + dsum_lo.to(tl.int64) * slab
            for _ in range(dsum_lo, dsum_hi):
                dh += tl.load(slot_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                slot_ptr += slab
            tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + pid * BLOCK_D + cols, du)
    tl.store(dw_ptr + pid * BLOCK_D + cols, dw)
    tl.store(dgate_ptr + pid, tl.sum(dgate, axis=0))


# ------------------------------------------------------------------------------------------ launching

H100_SMS = 132        # streaming multiprocessors assumed where no CUDA device says (the meta device)


def slab_of(like: Tensor) -> int:
    """Elements between consecutive (B, T, d) slots of a buffer: numel rounded up to 16 (16-byte aligned)."""
    return triton.cdiv(like.numel(), 16) * 16


def slots(n: int, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An (n, slab) buffer of slots shaped like `like`."""
    return torch.empty(n, slab_of(like), dtype=dtype or like.dtype, device=like.device)


def slot_view(buffer: Tensor, i: int, like: Tensor) -> Tensor:
    return buffer[i, :like.numel()].view(like.shape)


# Programs per SM each kernel is built for (kernels/aot.py checks registers against it). The forward reads
# keep two programs per SM. Phase 1 holds every receiver's running sum of a row (forward) or its go, query and
# du (backward), and a receiver's backward holds a row's r, x, dy, dr and h: one program per SM, whose software
# pipeline keeps the next rows of sources in flight.
PROGRAMS_PER_SM = {"_group_fwd": 1, "_group_bwd": 1, "_receiver_fwd": 2, "_receiver_bwd": 1}


def _group_config(d: int, backward: bool) -> dict:
    """Phase 1 keeps R_BLOCK receivers' rows (running sums; backward: go, folded queries and du) of one token
    row in registers; more receivers than R_BLOCK read the sources again (forward) or in further launches."""
    block_d = triton.next_power_of_2(d)
    if _interpreting():
        return dict(R_BLOCK=16, BLOCK_D=block_d, STAGES=1, num_warps=4)
    if backward:
        return dict(R_BLOCK=4 if block_d <= 2048 else 2, BLOCK_D=block_d, STAGES=2, num_warps=8,
                    maxnreg=register_budget(8, PROGRAMS_PER_SM["_group_bwd"]))
    return dict(R_BLOCK=8 if block_d <= 2048 else 4, BLOCK_D=block_d, STAGES=4, num_warps=16,
                maxnreg=register_budget(16, PROGRAMS_PER_SM["_group_fwd"]))


def receivers_per_pass(d: int) -> int:
    """How many receivers phase 1's backward serves in one pass over the sources at width d."""
    return _group_config(d, backward=True)["R_BLOCK"]


def _receiver_config(M: int, d: int, backward: bool) -> dict:
    """As kernels.depth_route._config: rows per program so that a thread holds 16 values of a tile in the
    forward (8 at d > 2048, on 16 warps) and 8 in the backward, which holds more tiles of a row; the source
    loops pipelined (the forward's three stages deep below d = 4096, else two)."""
    block_d = triton.next_power_of_2(d)
    if _interpreting():
        return dict(BLOCK_M=min(triton.next_power_of_2(M), 256), BLOCK_D=block_d, STAGES=1, num_warps=4)
    wide = block_d > 2048
    warps = 4 if block_d <= 1024 else (16 if wide and not backward else 8)
    per_thread = 8 if backward or wide else 16
    block_m = max(1, min(16, per_thread * 32 * warps // block_d))
    kernel = "_receiver_bwd" if backward else "_receiver_fwd"
    return dict(BLOCK_M=block_m, BLOCK_D=block_d, STAGES=2 if backward or wide else 3, num_warps=warps,
                maxnreg=register_budget(warps, PROGRAMS_PER_SM[kernel]))


def _tiles(n_tiles: int, kernel: str, device: torch.device) -> tuple[int, int]:
    """(programs, tiles per program) for a backward kernel over n_tiles row tiles: one wave of programs (the
    SMs times the kernel's programs per SM), each summing its tiles' du, dw and dgate into one partial sum, so
    the partial sums stay few."""
    if _interpreting():
        return n_tiles, 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H100_SMS
    tiles = triton.cdiv(n_tiles, sms * PROGRAMS_PER_SM[kernel])
    return triton.cdiv(n_tiles, tiles), tiles


def _dtypes(table: SourceTable) -> dict:
    return dict(A_DTYPE=table.dtype(0), B_DTYPE=table.dtype(1))


def group_forward(table: SourceTable, queries: Tensor, norm_weights: Tensor, eps: float, state: Tensor,
                  lse_c: Tensor) -> None:
    """Phase 1 for the n_recv = len(queries) receivers of a group: state[r] = r_C (a slot), lse_c[r] (M,)."""
    first = table.tensors[0]
    M, d = first.numel() // first.shape[-1], first.shape[-1]
    cfg = _group_config(d, backward=False)
    n_recv, block = queries.shape[0], cfg["R_BLOCK"]
    for r0 in range(0, n_recv, block):        # receivers beyond R_BLOCK: the sources are read again
        chunk = min(block, n_recv - r0)
        _launch(_group_fwd, M, [(table, 1), (queries[r0:r0 + chunk], 1),
                (norm_weights[r0:r0 + chunk], 1)], [state[r0:r0 + chunk, :first.numel()], lse_c[r0:r0 + chunk]],
                first.device, table=table.addresses, n_a=table.n_a, n_b=len(table.tensors) - table.n_a,
                q_ptr=queries, g_ptr=norm_weights, r0=r0, n_recv=n_recv, state_ptr=state, lse_c_ptr=lse_c,
                slab=state.shape[1], M=M, d=d, eps=eps, **_dtypes(table), **cfg)


def group_backward(table: SourceTable, queries: Tensor, norm_weights: Tensor, eps: float, go: Tensor, D: Tensor,
                   lse: Tensor, accumulators: tuple[Tensor, Tensor, int, int], accumulate: bool) -> Tensor:
    """Phase 1's backward: the committed sources' gradients into `accumulators` (acc_a, acc_b, off_a, off_b:
    see GradBank.pointers), written or added to; returns du (n_recv, d) fp32, the committed part."""
    first = table.tensors[0]
    M, d = first.numel() // first.shape[-1], first.shape[-1]
    cfg = _group_config(d, backward=True)
    n_recv, block = queries.shape[0], cfg["R_BLOCK"]
    programs, tiles = _tiles(M, "_group_bwd", first.device)
    du = torch.empty(triton.cdiv(n_recv, block), programs, block, cfg["BLOCK_D"], dtype=torch.float32,
                     device=first.device)
    acc_a, acc_b, off_a, off_b = accumulators
    n_a, n_b = table.n_a, len(table.tensors) - table.n_a
    grads = [acc_a[off_a:off_a + n_a, :first.numel()], acc_b[off_b:off_b + n_b, :first.numel()]]
    for c, r0 in enumerate(range(0, n_recv, block)):
        chunk = min(block, n_recv - r0)
        reads = [(table, 1), (go[r0:r0 + chunk, :first.numel()], 1), (D[r0:r0 + chunk], 1), (lse[r0:r0 + chunk], 1)]
        _launch(_group_bwd, programs, reads + [(g, 1) for g in grads if accumulate or c], grads + [du[c]],
                first.device, table=table.addresses, n_a=n_a, n_b=n_b, q_ptr=queries, g_ptr=norm_weights, r0=r0,
                n_recv=n_recv, go_ptr=go, D_ptr=D, lse_ptr=lse, slab=go.shape[1], acc_a_ptr=acc_a, acc_b_ptr=acc_b,
                off_a=off_a, off_b=off_b, du_ptr=du[c], tiles=tiles, M=M, d=d, eps=eps,
                accumulate=int(accumulate or c > 0), **_dtypes(table), **cfg)
    return du.sum(1).flatten(0, 1)[:n_recv, :d]


def _null_args(null: Tensor | bool, placeholder: Tensor) -> dict:
    """The null-source arguments: none (0), zero (1) or a learned vector (2)."""
    if isinstance(null, Tensor):
        return dict(null_ptr=null, NULL=2)
    return dict(null_ptr=placeholder, NULL=int(bool(null)))


def learned_null_grads(null: Tensor, query: Tensor, norm_weight: Tensor, eps: float, go: Tensor, D: Tensor,
                       lse: Tensor) -> tuple[Tensor, Tensor]:
    """The learned null source n's gradient and its term of du, from a receiver's go (M, d), D and lse (M,):
    the softmax backward of a source that is the same vector n at every row,
    dn = sum_rows a go + (sum_rows de rstd) u - (sum_rows de rstd) e rstd n / d and du += (sum_rows de rstd) n,
    with a = exp(e - lse), de rstd = a (go . n - D) rstd (a few (M,) and (d,) ops: an option, not the paper's)."""
    n, u = null.float(), query.float() * norm_weight.float()
    rstd = torch.rsqrt(n.pow(2).mean() + eps)
    e = (n @ u) * rstd
    a = torch.exp(e - lse)                                                 # (M,)
    go = go.float()
    de_rstd = a * (go @ n - D) * rstd
    c = de_rstd.sum()
    return a @ go + c * u - c * e * rstd / n.numel() * n, c * n


def _receiver_args(table: SourceTable | None, first: Tensor) -> dict:
    """Address table arguments; a receiver with no sources of its own gets an empty table."""
    if table is None:
        return dict(table=torch.empty(1, dtype=torch.int64, device=first.device), n_a=0, n_b=0,
                    A_DTYPE=DTYPES[first.dtype], B_DTYPE=DTYPES[first.dtype])
    return dict(table=table.addresses, n_a=table.n_a, n_b=len(table.tensors) - table.n_a, **_dtypes(table))


def receiver_forward(table: SourceTable | None, state: Tensor | None, lse_c: Tensor, slot: int, lse: Tensor,
                     h: Tensor, base: Tensor | None, query: Tensor, norm_weight: Tensor, gate: Tensor | None,
                     weight: Tensor, eps: float, norm_eps: float, null: Tensor | bool, add: bool,
                     r_dtype: torch.dtype, x_dtype: torch.dtype, y_dtype: torch.dtype) -> Tensor:
    """y = RMSNorm_weight(h + gate r) (add) or RMSNorm_weight(r), r read over [state slot] + table sources
    [+ h - base] [+ a null source: zero if null is True, the (d,) vector if null is a tensor]; writes
    lse[slot]. h (B, T, d) is the stream (and the partial block's minuend);
    r and x are rounded to r_dtype and x_dtype where the reference rounds them."""
    M, d = h.numel() // h.shape[-1], h.shape[-1]
    y = torch.empty(h.shape, dtype=y_dtype, device=h.device)
    cfg = _receiver_config(M, d, backward=False)
    reads = ([(table, 1)] if table is not None else []) + ([(slot_view(state, slot, h), 1)] if state is not None else [])
    reads += ([(h, 1)] if add or base is not None else []) + ([(base, 1)] if base is not None else [])
    _launch(_receiver_fwd, triton.cdiv(M, cfg["BLOCK_M"]), reads, [y, lse[slot]], h.device,
            **_receiver_args(table, h), state_ptr=state if state is not None else h, lse_c_ptr=lse_c, slot=slot,
            slab=slab_of(h), h_ptr=h, base_ptr=base if base is not None else h, q_ptr=query, g_ptr=norm_weight,
            gate_ptr=gate if gate is not None else weight, has_gate=int(gate is not None), w_ptr=weight, y_ptr=y,
            lse_ptr=lse, **_null_args(null, weight), M=M, d=d, eps=eps,
            norm_eps=norm_eps, R_DTYPE=DTYPES[r_dtype], X_DTYPE=DTYPES[x_dtype], HAS_STATE=state is not None,
            HAS_DIFF=base is not None, ADD=add, **cfg)
    return y


def receiver_backward(table: SourceTable | None, state: Tensor | None, lse_c: Tensor, slot: int, lse: Tensor,
                      h: Tensor, base: Tensor | None, query: Tensor, norm_weight: Tensor, gate: Tensor | None,
                      weight: Tensor, eps: float, norm_eps: float, add: bool, r_dtype: torch.dtype,
                      x_dtype: torch.dtype, dy: Tensor,
                      accumulators: tuple[Tensor, Tensor, int, int], accumulate: bool, go: Tensor | None,
                      D: Tensor | None, dbase: Tensor | None, dsum: tuple[Tensor, int, int] | None = None,
                      null: Tensor | bool = False) -> dict:
    """Backward of receiver_forward. The table sources' gradients go into `accumulators` (written, or added
    to when `accumulate`); go[slot], D[slot] are written for phase 1's backward when there is a state;
    dbase receives -dL/d(partial block); dsum = (buffer, lo, hi): slots lo..hi-1 of buffer are added to dh.
    Returns {"dh", "du", "dweight", "dgate"} (dh None when h is unused). A learned null's own gradient and
    its du term are left to `learned_null_grads`, from go, D and lse."""
    M, d = h.numel() // h.shape[-1], h.shape[-1]
    cfg = _receiver_config(M, d, backward=True)
    programs, tiles = _tiles(triton.cdiv(M, cfg["BLOCK_M"]), "_receiver_bwd", h.device)
    uses_h = add or base is not None or dsum is not None
    dh = torch.empty_like(h) if uses_h else None
    dsum_ptr, dsum_lo, dsum_hi = dsum if dsum is not None else (h, 0, 0)
    du = torch.empty(programs, cfg["BLOCK_D"], dtype=torch.float32, device=h.device)
    dweight = torch.empty_like(du)
    dgate = torch.empty(programs, dtype=torch.float32, device=h.device)
    acc_a, acc_b, off_a, off_b = accumulators
    n_a, n_b = (table.n_a, len(table.tensors) - table.n_a) if table is not None else (0, 0)
    grads = [acc_a[off_a:off_a + n_a, :h.numel()], acc_b[off_b:off_b + n_b, :h.numel()]]
    reads = ([(table, 2)] if table is not None else []) + [(dy, 1), (lse[slot], 1)]
    reads += [(slot_view(state, slot, h), 1)] if state is not None else []
    reads += ([(h, 1)] if uses_h else []) + ([(base, 1)] if base is not None else [])
    reads += [(g, 1) for g in grads] if accumulate else []
    reads += [(dsum_ptr[dsum_lo:dsum_hi, :h.numel()], 1), (dh, 1)] if dsum is not None else []
    writes = grads + [du, dweight] + ([dh] * (1 + (dsum is not None)) if uses_h else [])
    writes += [dbase] if base is not None else []
    writes += [slot_view(go, slot, h), D[slot]] if state is not None else []
    _launch(_receiver_bwd, programs, reads, writes, h.device, **_receiver_args(table, h),
            state_ptr=state if state is not None else h, lse_c_ptr=lse_c, slot=slot, slab=slab_of(h), h_ptr=h,
            base_ptr=base if base is not None else h, q_ptr=query, g_ptr=norm_weight,
            gate_ptr=gate if gate is not None else weight, has_gate=int(gate is not None), w_ptr=weight, dy_ptr=dy,
            lse_ptr=lse, acc_a_ptr=acc_a,
            acc_b_ptr=acc_b, off_a=off_a, off_b=off_b, dh_ptr=dh if uses_h else h,
            dbase_ptr=dbase if dbase is not None else h, go_ptr=go if go is not None else h,
            D_ptr=D if D is not None else lse, dsum_ptr=dsum_ptr, dsum_lo=dsum_lo, dsum_hi=dsum_hi,
            **_null_args(null, weight), du_ptr=du, dw_ptr=dweight, dgate_ptr=dgate, tiles=tiles,
            accumulate=int(accumulate), M=M, d=d, eps=eps, norm_eps=norm_eps, R_DTYPE=DTYPES[r_dtype],
            X_DTYPE=DTYPES[x_dtype], HAS_STATE=state is not None, HAS_DIFF=base is not None, ADD=add,
            SUMS=dsum is not None, **cfg)
    return {"dh": dh, "du": du.sum(0)[:d], "dweight": dweight.sum(0)[:d],
            "dgate": dgate.sum() if gate is not None else None}
