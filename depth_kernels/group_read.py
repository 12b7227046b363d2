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

This file holds phase 1's forward (fp32 accumulation; sources in at most two dtypes, one loop each; 128-bit
aligned loads; pipelined); its backward is depth_kernels/group_backward.py, and phase 2, fused with the
pre-norm, depth_kernels/receiver_read.py:
- `_group_fwd`: R receivers at once on tensor cores, per token row a small attention over its sources taken in
  blocks of 16 (Z^T = rstd U S^T, then r_C += S^T P with the online softmax's rescaling once per block), in
  persistent programs, two per SM (helpers: depth_kernels/group_tiles.py); `_group_fwd_rows` for rows wider
  than d = 1280 (a row per program on the CUDA cores).
"""
from __future__ import annotations

import functools
import triton
import triton.language as tl
from torch import Tensor

from depth_kernels.interpreter import interpreting
from depth_kernels.launch import SourceTable, _sm_count, cdiv, launch, register_budget, row_tiles, source_steps
from depth_kernels.group_tiles import block_rows, chunk_cols, fold_block, parts_rows, query_parts
from depth_kernels.tiles import (read_table, row_cols, row_div, row_load, row_masks, row_mul, row_offsets, row_own,
                                 row_store, row_zeros)

# ------------------------------------------------------------------------------------------------ kernels

@triton.jit
def _receiver_queries(q_ptr, g_ptr, recv, recv_ok, cols, own, d):
    """Folded queries u_r = query_r * norm_weight_r of receivers recv ((R, d) rows), in fp32: (R_BLOCK, width)
    tiles."""
    at = row_offsets(recv[:, None] * d, cols)
    masks = row_masks(recv_ok, own)
    return row_mul(row_load(q_ptr, at, masks), row_load(g_ptr, at, masks))


@triton.jit
def _fold_step(addresses, j, hi, start, u, m, l, acc, d, eps, DTYPE: tl.constexpr, CB: tl.constexpr,
               CHUNK: tl.constexpr, CHUNKS: tl.constexpr, W: tl.constexpr, F32_DOT: tl.constexpr):
    """One step of phase 1's fold at a token row: sources j.. (before hi) of one dtype into (m, l, acc), CB of
    them for bf16, one for fp32 or fp16 (as three bf16 parts)."""
    if DTYPE == tl.bfloat16:
        s, ok = block_rows(addresses, j, j, hi, start, d, DTYPE, CB, CHUNK, CHUNKS, W)
        m, l, acc = fold_block(s, ok, u, m, l, acc, d, eps, 1, CHUNK, CHUNKS, W, F32_DOT)
    else:
        s = parts_rows(addresses, j, start, d, DTYPE, CB, CHUNK, CHUNKS, W)
        m, l, acc = fold_block(s, tl.arange(0, CB) == 0, u, m, l, acc, d, eps, 3, CHUNK, CHUNKS, W, F32_DOT)
    return m, l, acc


@triton.jit
def _read_row(table, addresses, n_a, n_b, row, u, recv, recv_ok, state_ptr, lse_c_ptr, slab, M, d, eps,
              A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, CB: tl.constexpr, A_STEP: tl.constexpr,
              B_STEP: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, W: tl.constexpr,
              STAGES: tl.constexpr, F32_DOT: tl.constexpr):
    """Phase 1 at one token row: the table's sources folded in (a bf16 run CB sources a step, an fp32 or fp16
    run one a step, as three bf16 parts), then r_C and lse_C stored (from acc, (W, CHUNK // W, R) per chunk)."""
    start = row * d.to(tl.int64)
    R: tl.constexpr = recv.shape[0]
    m = tl.full((R,), float("-inf"), tl.float32)
    l = tl.zeros((R,), tl.float32)
    acc = ()
    for c in tl.static_range(CHUNKS):
        acc = acc + (tl.zeros((W, CHUNK // W, R), tl.float32),)
    for a in tl.range(0, n_a, A_STEP, num_stages=STAGES // CB):        # a loop per dtype: see tiles.fold_source
        m, l, acc = _fold_step(addresses, a, n_a, start, u, m, l, acc, d, eps, A_DTYPE, CB, CHUNK, CHUNKS, W,
                               F32_DOT)
    for b in tl.range(n_a, n_a + n_b, B_STEP, num_stages=STAGES // CB):
        m, l, acc = _fold_step(addresses, b, n_a + n_b, start, u, m, l, acc, d, eps, B_DTYPE, CB, CHUNK, CHUNKS,
                               W, F32_DOT)
    out = state_ptr + recv[None, None, :].to(tl.int64) * slab + start
    for c in tl.static_range(CHUNKS):
        cols = chunk_cols(c, CHUNK, W)                                        # (W, K, 1)
        tl.store(out + cols, (acc[c] / l[None, None, :]).to(state_ptr.dtype.element_ty),
                 mask=(cols < d) & recv_ok[None, None, :])
    tl.store(lse_c_ptr + recv.to(tl.int64) * M + row, m + tl.log(l), mask=recv_ok)


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv"])
def _group_fwd(table, n_a, n_b, q_ptr, g_ptr, r0, n_recv, state_ptr, lse_c_ptr, slab, M, d, eps,
               A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R_BLOCK: tl.constexpr, CB: tl.constexpr,
               A_STEP: tl.constexpr, B_STEP: tl.constexpr, C_MAX: tl.constexpr, BLOCK_D: tl.constexpr,
               CHUNK: tl.constexpr, W: tl.constexpr, STAGES: tl.constexpr, F32_DOT: tl.constexpr):
    """Phase 1 for receivers recv = r0 + [0, R_BLOCK) (those < n_recv) at token rows program_id(0), +
    num_programs(0), ...: r_C at state_ptr + recv slab, lse_C at lse_c_ptr + recv M. q_ptr, g_ptr: the group's
    (n_recv, d) queries and norm weights. A row's sources come in blocks of CB (a software pipeline STAGES // CB
    blocks deep: STAGES source rows), each block's row in BLOCK_D // CHUNK chunks of CHUNK columns, a slice of
    each for each of W warps. The table's addresses (C_MAX >= n_a + n_b of them) and the folded queries, split
    into 16-bit parts, are made once per program (the queries' parts in shared memory)."""
    recv = r0 + tl.arange(0, R_BLOCK)
    recv_ok = recv < n_recv
    j = tl.arange(0, C_MAX)
    addresses = tl.load(table + j, mask=j < n_a + n_b, other=0)
    u = query_parts(q_ptr, g_ptr, recv, recv_ok, d, tl.bfloat16, CHUNK, BLOCK_D // CHUNK, W)
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0)):
        _read_row(table, addresses, n_a, n_b, row, u, recv, recv_ok, state_ptr, lse_c_ptr, slab, M, d,
                  eps, A_DTYPE, B_DTYPE, CB, A_STEP, B_STEP, CHUNK, BLOCK_D // CHUNK, W, STAGES, F32_DOT)


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv"])
def _group_fwd_rows(table, n_a, n_b, q_ptr, g_ptr, r0, n_recv, state_ptr, lse_c_ptr, slab, M, d, eps,
                    A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr):
    """Phase 1 on the CUDA cores for rows wider than _group_fwd's blocks fit in shared memory (d > 1280): as
    _group_fwd, one token row per program (program_id(0)), its R_BLOCK running sums in registers; a row is
    split (depth_kernels/tiles.py): BLOCK_D lanes of head, BLOCK_T of tail. BLOCK_M = 1: the rows a program
    takes (meters/occupancy.py counts them)."""
    tl.static_assert(BLOCK_M == 1)
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


# ------------------------------------------------------------------------------------------ launching

# Programs per SM each kernel is built for (meters/aot.py checks registers against it). The forward
# (tensor cores) holds a row's read-outs (R_BLOCK x d fp32, 80 registers a thread at d = 1280 on 4 warps) and
# stages a block of sources and the queries' parts in shared memory (107 KB at d = 1280): two programs per SM, each
# with its blocks of sources in flight. _group_fwd_rows holds every receiver's running sum of a row: one program
# per SM, whose software pipeline keeps source rows in flight.
PROGRAMS_PER_SM = {"_group_fwd": 2, "_group_fwd_rows": 1}
TENSOR_CORE_WIDTH = 1280   # the widest row _group_fwd takes: a block of 16 at 2048 and its queries' parts (8 x 2048
                           # x 3 bf16) would not fit two programs' shared memory (_group_fwd_rows reads wider ones)


@functools.cache   # a pure function of its arguments, asked at every launch
def _forward_config(d: int) -> tuple[triton.JITFunction, dict]:
    """The forward's kernel and tiles at width d. _group_fwd: R_BLOCK = 8 receivers a pass, blocks of CB = 16
    sources (tl.dot's K >= 16 for the read-out S^T P), a row in chunks of CHUNK = 256 columns (64 per warp:
    128-bit loads, K = 64 for the logits' products; 512 where they divide d), STAGES = 32 source rows in flight
    (two blocks: the pipeline's depth); the interpreter takes chunks of 64 (two, one partly masked, at d = 80
    or 96), a grid of at most 3 persistent programs and fp32 products (F32_DOT). Wider rows:
    _group_fwd_rows, one row per program on the CUDA cores, 8 receivers to d = 2048 and 4 at 4096, its STAGES
    source rows in flight (8; 6 at d <= 1024, where 8 would read per-row scalars in more 32-bit pieces), a split
    row (depth_kernels.launch.row_split) with a tail of at least two lanes per thread."""
    if d <= TENSOR_CORE_WIDTH:
        chunk = 64 if interpreting() else 512 if d % 512 == 0 else 256   # (4 chunks of 256 spill at d = 1024)
        return _group_fwd, dict(R_BLOCK=8, CB=16, BLOCK_D=chunk * cdiv(d, chunk), CHUNK=chunk, W=4, STAGES=32,
                                F32_DOT=interpreting(), num_warps=4,
                                maxnreg=register_budget(4, PROGRAMS_PER_SM["_group_fwd"]))
    block_d, tiles = triton.next_power_of_2(d), row_tiles(d, 8)
    warps = 8 if tiles["BLOCK_T"] else 16
    return _group_fwd_rows, dict(R_BLOCK=8 if block_d <= 2048 else 4, BLOCK_M=1, **tiles,
                                 STAGES=8 if block_d > 1024 else 6,
                                 num_warps=warps, maxnreg=register_budget(warps, PROGRAMS_PER_SM["_group_fwd_rows"]))


def group_forward(table: SourceTable, queries: Tensor, norm_weights: Tensor, eps: float, state: Tensor,
                  lse_c: Tensor) -> None:
    """Phase 1 for the n_recv = len(queries) receivers of a group: state[r] = r_C (a slot), lse_c[r] (M,)."""
    first = table.tensors[0]
    M, d = first.numel() // first.shape[-1], first.shape[-1]
    kernel, cfg = _forward_config(d)
    n_recv, block = queries.shape[0], cfg["R_BLOCK"]
    if kernel is _group_fwd:     # persistent: every SM's programs, rows program_id, + programs, ...
        programs = min(M, 3 if interpreting() else _sm_count(first.device) * PROGRAMS_PER_SM["_group_fwd"])
        cfg = dict(cfg, **source_steps(table, cfg["CB"]))
    else:
        programs = M
    for r0 in range(0, n_recv, block):        # receivers beyond R_BLOCK: the sources are read again
        chunk = min(block, n_recv - r0)
        io = lambda: ([(table, 1), (queries[r0:r0 + chunk], 1), (norm_weights[r0:r0 + chunk], 1)],  # noqa: E731
                      [state[r0:r0 + chunk, :first.numel()], lse_c[r0:r0 + chunk]])
        launch(kernel, programs, io, first.device, dict(
            table=table.addresses, n_a=table.n_a, n_b=len(table.tensors) - table.n_a, q_ptr=queries,
            g_ptr=norm_weights, r0=r0, n_recv=n_recv, state_ptr=state, lse_c_ptr=lse_c, slab=state.shape[1], M=M,
            d=d, eps=eps, **table.dtype_args(), **cfg))

