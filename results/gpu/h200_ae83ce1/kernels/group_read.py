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

This file holds phase 1 (fp32 accumulation; sources in at most two dtypes, one loop each; 128-bit aligned
loads; pipelined); phase 2, fused with the pre-norm, is depth_kernels/receiver_read.py:
- `_group_fwd`: R receivers at once, one token row per program: (r_C, lse_C) per receiver;
- `_group_bwd`: R receivers at once (8 to d = 2048), their rows of a token taken in groups: the committed
  sources' gradients summed over the receivers, and their du.
"""
from __future__ import annotations

import functools
import torch
import triton
import triton.language as tl
from torch import Tensor

from depth_kernels.interpreter import interpreting
from depth_kernels.launch import SourceTable, cdiv, launch, register_budget, row_tiles, wave
from measured_tiles import (accumulate_grad, read_table, row_add, row_axpy, row_colsum, row_cols, row_div, row_dot,
                            row_load, row_masks, row_mul, row_offsets, row_own, row_scale, row_store, row_zeros,
                            table_source)

# ------------------------------------------------------------------------------------------------ kernels

@triton.jit
def _receiver_queries(q_ptr, g_ptr, recv, recv_ok, cols, own, d):
    """Folded queries u_r = query_r * norm_weight_r of receivers recv ((R, d) rows), in fp32: (R_BLOCK, width)
    tiles."""
    at = row_offsets(recv[:, None] * d, cols)
    masks = row_masks(recv_ok, own)
    return row_mul(row_load(q_ptr, at, masks), row_load(g_ptr, at, masks))


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv"])
def _group_fwd(table, n_a, n_b, q_ptr, g_ptr, r0, n_recv, state_ptr, lse_c_ptr, slab, M, d, eps,
               A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_T: tl.constexpr, STAGES: tl.constexpr):
    """Phase 1 for receivers recv = r0 + [0, R_BLOCK) (those < n_recv) at token row program_id(0): r_C at
    state_ptr + recv slab, lse_C at lse_c_ptr + recv M. q_ptr, g_ptr: the group's (n_recv, d) queries and
    norm weights. A row is split (depth_kernels/tiles.py): BLOCK_D lanes of head, BLOCK_T of tail."""
    row = tl.program_id(0)
    recv = r0 + tl.arange(0, R_BLOCK)
    recv_ok = recv < n_recv
    cols, own = row_cols(d, BLOCK_D, BLOCK_T)
    U = _receiver_queries(q_ptr, g_ptr, recv, recv_ok, cols, own, d)       # (R_BLOCK, width) per tile
    offs = row_offsets(row.to(tl.int64) * d, cols)                         # (1, width): one token row
    masks = row_own(own)
    m = tl.full((R_BLOCK,), float("-inf"), tl.float32)
    l = tl.zeros((R_BLOCK,), tl.float32)
    acc = row_zeros(R_BLOCK, cols)                                         # one running sum per receiver
    m, l, acc = read_table(table, n_a, n_b, offs, masks, U, d, eps, m, l, acc, A_DTYPE, B_DTYPE, STAGES)
    row_store(state_ptr, row_offsets(recv[:, None].to(tl.int64) * slab + row.to(tl.int64) * d, cols), row_div(acc, l),
              row_masks(recv_ok, own))
    tl.store(lse_c_ptr + recv.to(tl.int64) * M + row, m + tl.log(l), mask=recv_ok)


@triton.jit
def _committed_grad(s, U, du, go_row, D, lse, r0, n_recv, slab, cols, own, d, eps,
                    H: tl.constexpr, GROUPS: tl.constexpr):
    """One committed source row s (split: (1, width) tiles), summed over receivers r0 + [0, GROUPS H) taken in
    GROUPS groups of H: its gradient ds (split like s), and du with each receiver's term dz rstd s added. U and
    du are tuples of the groups' folded queries and du sums (split rows of (H, width) tiles), D and lse of their
    (H,) per-row scalars. A group's go rows (go_row + receiver slab) are read here for each source and used at
    once: U and du are all a pass holds across the sources, which lets 8 receivers share one program's
    registers at d <= 2048 (their go as well would not fit). The row's go comes from memory for the first
    source, from cache for the others. The read sits in a branch (which also skips a group past the last
    receiver) so that the source loop's software pipeline, which stages the loads of the loop body, does not
    keep STAGES copies of it in shared memory."""
    rstd = tl.rsqrt(row_dot(s, s) / d + eps)
    ds = row_zeros(1, cols)
    shrink = tl.zeros_like(rstd)                                          # sum_r dz_r rstd z_r
    new_du = ()
    k = tl.arange(0, H)
    for g in tl.static_range(GROUPS):
        first = r0 + g * H
        du_g = du[g]
        if first < n_recv:
            go = row_load(go_row, row_offsets((first + k)[:, None].to(tl.int64) * slab, cols),
                          row_masks(first + k < n_recv, own))
            us = tl.zeros((H,), tl.float32)
            gs = tl.zeros((H,), tl.float32)
            for c in tl.static_range(len(cols)):                          # both dot products, one reduction
                us_c, gs_c = tl.split(tl.sum(tl.join(U[g][c] * s[c], go[c] * s[c]), axis=1))
                us += us_c
                gs += gs_c
            z = us * rstd
            a = tl.exp(z - lse[g])                                        # 0 for masked receivers (lse = inf)
            dz_rstd = a * (gs - D[g]) * rstd
            ds = row_colsum(ds, row_axpy(dz_rstd, U[g], row_scale(go, a)))    # + sum_r a go + dz rstd u
            du_g = row_add(du_g, row_scale(s, dz_rstd))
            shrink += tl.sum(dz_rstd * z, axis=0)
        new_du = new_du + (du_g,)
    return row_axpy(-(shrink * rstd / d), s, ds), new_du


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv", "off_a", "off_b", "tiles", "accumulate"])
def _group_bwd(table, n_a, n_b, q_ptr, g_ptr, r0, n_recv, go_ptr, D_ptr, lse_ptr, slab, acc_a_ptr, acc_b_ptr,
               off_a, off_b, du_ptr, tiles, accumulate, M, d, eps,
               A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R_BLOCK: tl.constexpr, GROUPS: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr):
    """The committed sources' gradients for receivers r0 + [0, R_BLOCK) (those < n_recv), in GROUPS groups of
    R_BLOCK / GROUPS: source i's summed over them goes to accumulator off_a + i of acc_a (a slot = slab
    elements) or off_b + i - n_a of acc_b. Each program takes `tiles` consecutive token rows and writes its
    partial sum of every receiver's du (du_ptr (programs, R_BLOCK, d), row pid). D, lse: (n_recv, M) with fewer
    than 2^31 entries. A row is split as in _group_fwd."""
    pid = tl.program_id(0)
    H: tl.constexpr = R_BLOCK // GROUPS
    k = tl.arange(0, H)
    cols, own = row_cols(d, BLOCK_D, BLOCK_T)
    masks = row_own(own)
    U = ()
    du = ()
    for g in tl.static_range(GROUPS):
        recv = r0 + g * H + k
        U = U + (_receiver_queries(q_ptr, g_ptr, recv, recv < n_recv, cols, own, d),)
        du = du + (row_zeros(H, cols),)
    # disable_licm: what the source loops do once per row (their pipelines' first loads, their bounds) would
    # otherwise be hoisted out of the row loop and held in registers through both source loops
    for t in tl.range(tiles, disable_licm=True):
        row = pid * tiles + t
        if row < M:
            offs = row_offsets(row.to(tl.int64) * d, cols)
            go_row = go_ptr + row.to(tl.int64) * d
            D = ()
            lse = ()
            for g in tl.static_range(GROUPS):
                recv = r0 + g * H + k
                D = D + (tl.load(D_ptr + recv * M + row, mask=recv < n_recv, other=0.0),)
                lse = lse + (tl.load(lse_ptr + recv * M + row, mask=recv < n_recv, other=float("inf")),)
            for i in tl.range(0, n_a, num_stages=STAGES):
                s = table_source(table, i, A_DTYPE, offs, masks)
                ds, du = _committed_grad(s, U, du, go_row, D, lse, r0, n_recv, slab, cols, own, d, eps, H,
                                         GROUPS)
                accumulate_grad(acc_a_ptr + (off_a + i).to(tl.int64) * slab, ds, offs, masks, accumulate)
            for i in tl.range(n_a, n_a + n_b, num_stages=STAGES):
                s = table_source(table, i, B_DTYPE, offs, masks)
                ds, du = _committed_grad(s, U, du, go_row, D, lse, r0, n_recv, slab, cols, own, d, eps, H,
                                         GROUPS)
                accumulate_grad(acc_b_ptr + (off_b + i - n_a).to(tl.int64) * slab, ds, offs, masks,
                                    accumulate)
    out = row_offsets(pid.to(tl.int64) * R_BLOCK * d + k[:, None] * d, cols)
    for g in tl.static_range(GROUPS):
        for c in tl.static_range(len(cols)):
            tl.store(du_ptr + g * H * d + out[c], du[g][c], mask=masks[c])


# ------------------------------------------------------------------------------------------ launching

# Programs per SM each kernel is built for (depth_kernels/tools/aot.py checks registers against it): phase 1 holds every
# receiver's running sum of a row (forward) or its folded query and du (backward), so one program per SM, whose
# software pipeline keeps the next rows of sources in flight.
PROGRAMS_PER_SM = {"_group_fwd": 1, "_group_bwd": 1}


@functools.cache   # a pure function of its arguments, asked at every launch
def _group_config(d: int, backward: bool, element_size: int = 2) -> dict:
    """Phase 1 keeps R_BLOCK receivers' rows of one token row in registers: their running sums (forward), or
    their folded queries and du (backward, in GROUPS groups of R_BLOCK / GROUPS receivers whose go rows are
    read per source, not held). 8 receivers to d = 2048, 4 at 4096: the backward's query and du tiles are then
    (8, 2048) fp32 each, half the registers of an SM, and with go held as well they would spill. More receivers
    than R_BLOCK read the sources again (forward) or in further launches. With one program per SM, the source
    loop's pipeline (STAGES tiles in flight, staged in shared memory) is what keeps loads in flight
    (depth_kernels/tools/occupancy.py): as deep as registers and shared memory allow without spilling at the paper's
    widths (checked by depth_kernels/tools/aot.py: backward, 16-bit sources 8 stages to d = 1024 and 6 to 2048, else
    4; forward 8, 6 at d <= 1024, where 8 would read per-row scalars in more 32-bit pieces). element_size: the
    bytes of the table's sources. A row is split (depth_kernels.launch.row_split) with a tail of at least two
    lanes per thread (32-bit transfers of 16-bit sources): at d = 1280 on 8 warps, 1024 + 512 lanes; the
    forward runs such rows on 8 warps (on 16 its tail would need 1024 lanes, no narrower than one tile)."""
    block_d = triton.next_power_of_2(d)       # one tile's lanes, for the rules above
    if interpreting():
        return dict(R_BLOCK=16, **row_tiles(d, 4), STAGES=1, num_warps=4, **(dict(GROUPS=4) if backward else {}))
    tiles = row_tiles(d, 8)
    if backward:
        stages = (8 if block_d <= 1024 else 6) if block_d <= 2048 and element_size <= 2 else 4
        return dict(R_BLOCK=8 if block_d <= 2048 else 4, GROUPS=4, **tiles, STAGES=stages, num_warps=8,
                    maxnreg=register_budget(8, PROGRAMS_PER_SM["_group_bwd"]))
    warps = 8 if tiles["BLOCK_T"] else 16
    return dict(R_BLOCK=8 if block_d <= 2048 else 4, **tiles, STAGES=8 if block_d > 1024 else 6, num_warps=warps,
                maxnreg=register_budget(warps, PROGRAMS_PER_SM["_group_fwd"]))


def receivers_per_pass(d: int) -> int:
    """How many receivers phase 1's backward serves in one pass over the sources at width d."""
    return _group_config(d, backward=True)["R_BLOCK"]



def group_forward(table: SourceTable, queries: Tensor, norm_weights: Tensor, eps: float, state: Tensor,
                  lse_c: Tensor) -> None:
    """Phase 1 for the n_recv = len(queries) receivers of a group: state[r] = r_C (a slot), lse_c[r] (M,)."""
    first = table.tensors[0]
    M, d = first.numel() // first.shape[-1], first.shape[-1]
    cfg = _group_config(d, backward=False)
    n_recv, block = queries.shape[0], cfg["R_BLOCK"]
    for r0 in range(0, n_recv, block):        # receivers beyond R_BLOCK: the sources are read again
        chunk = min(block, n_recv - r0)
        io = lambda: ([(table, 1), (queries[r0:r0 + chunk], 1), (norm_weights[r0:r0 + chunk], 1)],  # noqa: E731
                      [state[r0:r0 + chunk, :first.numel()], lse_c[r0:r0 + chunk]])
        launch(_group_fwd, M, io, first.device, dict(
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
    cfg = _group_config(d, backward=True, element_size=table.tensors[-1].element_size())
    n_recv, block = queries.shape[0], cfg["R_BLOCK"]
    programs, tiles = wave(M, PROGRAMS_PER_SM["_group_bwd"], first.device)
    du = torch.empty(cdiv(n_recv, block), programs, block, d, dtype=torch.float32, device=first.device)
    acc_a, acc_b, off_a, off_b = accumulators
    n_a, n_b = table.n_a, len(table.tensors) - table.n_a

    def io(c: int, r0: int, chunk: int) -> tuple[list, list]:
        grads = [acc_a[off_a:off_a + n_a, :first.numel()], acc_b[off_b:off_b + n_b, :first.numel()]]
        reads = [(table, 1), (go[r0:r0 + chunk, :first.numel()], 1), (D[r0:r0 + chunk], 1), (lse[r0:r0 + chunk], 1)]
        return reads + [(g, 1) for g in grads if accumulate or c], grads + [du[c]]

    for c, r0 in enumerate(range(0, n_recv, block)):
        chunk = min(block, n_recv - r0)
        launch(_group_bwd, programs, lambda: io(c, r0, chunk), first.device, dict(
            table=table.addresses, n_a=n_a, n_b=n_b, q_ptr=queries, g_ptr=norm_weights, r0=r0, n_recv=n_recv,
            go_ptr=go, D_ptr=D, lse_ptr=lse, slab=go.shape[1], acc_a_ptr=acc_a, acc_b_ptr=acc_b, off_a=off_a,
            off_b=off_b, du_ptr=du[c], tiles=tiles, M=M, d=d, eps=eps, accumulate=int(accumulate or c > 0),
            **table.dtype_args(), **cfg))
    return du.sum(1).flatten(0, 1)[:n_recv]
