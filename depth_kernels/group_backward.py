"""Phase 1's backward on tensor cores: the committed sources' gradients summed over a group's receivers, and the
committed part of each receiver's du (the equations: depth_kernels/group_read.py's docstring).

Per token row this is a small attention's backward. With S the row's committed sources (C x d), U the R = 8
receivers' folded queries, Go their gradients of the read-out (R x d, phase 2 wrote them), D = go . r and lse
per receiver:

    Z = rstd (U S^T)     G = Go S^T                                   (R x C: K = d, the logits' and go's dots)
    A = exp(Z - lse)     W = A (G - D) rstd                           (per receiver and source, on the CUDA cores)
    dS = A^T Go + W^T U - shrink S,  shrink_i = rstd_i / d sum_r W_ri Z_ri        (C x d: K = R + R = 16)
    du = W S                                                          (R x d: K = C)

The first line needs whole rows (a dot over d), the others none: so the products run in programs per column chunk
(CHUNK = 256 columns for the logits, GRAD_CHUNK = 128 for the gradients) and a share of the token rows
(persistent: rows rp, rp + P, ...), so that a program holds only its chunk of U and of its du, whatever d is, and
the per-row scalars between them in a small kernel of their own.
A chunk's program walks (row, block of CB = 16 sources) pairs in one loop, so that its software pipeline loads the
next rows' blocks while one is worked on (a Delta Block row has a block or two):

- `_group_logits`: per step, the chunk's share of Z, G and the sources' squares (each warp's slice of the chunk
  one batched product, as group_tiles does for the forward), stored per chunk (a (NC, M, 2R + 1, cp) fp32 buffer,
  each dtype's run from a 16-aligned column: 68 bytes per source row and chunk, 2.7 % of a bf16 row's at d = 1280);
- `_group_weights`: per row and block, the chunks' shares summed into Z, G and rstd, and A, W and shrink made into
  Q = [W; A] (the receivers' two rows interleaved), W^T and shrink (1.6 KB a row and block);
- `_group_bwd`: per step, dS^T = [U; Go]^T Q (one K = 16 product) less shrink S, added into the sources' gradient
  accumulators, and du^T += S^T W^T. The next step's Go chunk and accumulators are read by hand while this one is
  worked on: the pipeline stages only loads whose values feed products.

Precision: the products take 16-bit operands and accumulate in fp32. A bf16 source is exact in one part; fp32 and
fp16 sources are split into three bf16 parts whose sum they are (8 + 8 + 8 bits), as are U and Go for Z and G,
whose products keep the terms of parts i + j < 3 (to some 2^-24 of |u| |s|, needed where G - D cancels);
dS and du's operands take two parts, terms i + j < 2 (2^-16, below the 16-bit rounding of what is trained on).
The interpreter multiplies 16-bit bit patterns in tl.dot: there the parts go in as fp32 (F32_DOT), same values.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from depth_kernels.group_tiles import (chunk_cols, load_chunk, mma, part_columns, queries_chunk, source_block,
                                      source_pointer)
from depth_kernels.interpreter import interpreting
from depth_kernels.launch import SourceTable, _sm_count, cdiv, launch, register_budget

R_BLOCK = 8     # receivers a pass: [U; Go] is 16 rows, the K of dS's product
CHUNK = 256       # columns a _group_logits program takes (64 a warp on 4: 128-bit loads); 512 spills
GRAD_CHUNK = 128  # columns a _group_bwd program takes (32 a warp on 4); 256 on 4 warps spills with fp32 sources
# Each kernel's warps and programs per SM (meters/aot.py checks registers and shared memory against them). The
# logits' and gradients' kernels hold small tiles in every thread ((R, CB), the block's addresses) and a 64-bit
# address per element of a (chunk, CB) tile: left alone ptxas gives them some 200 registers, two programs of 4 warps
# an SM, whose waits at their barriers (some 14 and 6 a step) nothing else fills; capped at 168 they spill nothing
# and run three (the speed model: Delta AttnRes's _group_logits 48 % -> 62 % of the copy bandwidth, _group_bwd
# 65 % -> 88 %).
# _group_weights' tiles of a row and block are (R, CB), four values a thread of one warp (128-bit transfers; on four
# warps one, and 32-bit), eight programs an SM.
WARPS = {"_group_logits": 4, "_group_weights": 1, "_group_bwd": 4}
PROGRAMS_PER_SM = {"_group_logits": 3, "_group_weights": 8, "_group_bwd": 3}


@triton.jit
def parts(x, N: tl.constexpr):
    """x (fp32) as N bf16 terms whose sum it is to within 2^-(8 N) of |x|."""
    out = ()
    rest = x
    for k in tl.static_range(N):
        part = rest.to(tl.bfloat16)
        out = out + (part,)
        rest = rest - part.to(tl.float32)
    return out


@triton.jit
def dot_parts(a, b, acc, ORDER: tl.constexpr, F32_DOT: tl.constexpr):
    """acc + sum of a[i] @ b[j] over the parts' terms with i + j < ORDER (a, b: tuples of parts)."""
    for i in tl.static_range(len(a)):
        for j in tl.static_range(len(b)):
            if i + j < ORDER:
                acc = mma(a[i], b[j], acc, F32_DOT)
    return acc


@triton.jit
def source_parts(s, DTYPE: tl.constexpr):
    """A loaded tile of sources as bf16 parts: itself if bf16 (exact), else three."""
    if DTYPE == tl.bfloat16:
        return (s,)
    return parts(s.to(tl.float32), 3)


@triton.jit
def _step(it, blocks, first, M, NC: tl.constexpr, CB: tl.constexpr):
    """Step `it` of a program's walk over (token row, block of CB sources) pairs, rows program_id // NC, +
    num_programs // NC, ... and blocks from source `first`: the row (past the last: M - 1, read and not written),
    whether it is real, and the block's first source. One loop over the pairs, not a loop over blocks in a loop over
    rows, so that its software pipeline loads the next rows' blocks while one is worked on (a row of Delta Block
    has a block or two)."""
    k = it // tl.maximum(blocks, 1)            # (a run of no sources: no steps, but its first rows are prefetched)
    row = tl.program_id(0) // NC + k * (tl.num_programs(0) // NC)
    return tl.minimum(row, M - 1), row < M, first + (it - k * blocks) * CB


@triton.jit
def _logits_step(addresses, it, blocks, first, hi, base, c, u, go_at, go_ok, go_ptr, part_ptr, M, cp, d,
                 DTYPE: tl.constexpr, CB: tl.constexpr, CHUNK: tl.constexpr, NC: tl.constexpr, W: tl.constexpr,
                 F32_DOT: tl.constexpr):
    """Chunk c's share of Z, G ((R, CB) each) and the squares (CB,) of one step's sources (those < hi) at its row,
    stored at the row's part (Z and G side by side, _zg_offsets; then the squares, 2R cp on), the run's source first at
    column base (see _group_logits). A bf16 step is a block of CB sources, whole blocks of 16 aligned columns stored
    unmasked (a block's columns past hi are the run's padding); an fp32 or fp16 step is one source as three bf16
    columns (group_tiles.part_columns: one source loaded, not a block), whose sums it stores in the source's column."""
    R: tl.constexpr = u[0].shape[1]
    STEP: tl.constexpr = CB if DTYPE == tl.bfloat16 else 1
    row, live, lo = _step(it, blocks, first, M, NC, STEP)
    start = row * d.to(tl.int64)
    j = tl.arange(0, CB)
    if STEP == CB:
        ptrs, _ = source_block(addresses, lo, lo, hi, DTYPE, CB)
        s = load_chunk(ptrs, start, c, d, CHUNK, W)                          # (W, CHUNK // W, CB)
        i = tl.multiple_of(base + lo - first, CB) + j
    else:
        s, x = part_columns(source_pointer(addresses, lo, DTYPE), start, c, d, CB, CHUNK, W)
        i = base + lo - first + j
    z = dot_parts(u, (s,), tl.zeros((W, R, CB), tl.float32), 3, F32_DOT)           # each warp's share: (W, R, CB)
    if STEP == CB:
        x = s.to(tl.float32)
    squares = tl.sum(tl.sum(x * x, axis=1), axis=0)          # (CB,), or a one-source step's (1,): column 0's
    # Go's chunk loaded after Z's products, so that its parts and the sources' are not all held at once
    cols = tl.permute(chunk_cols(c, CHUNK, W), (0, 2, 1))      # (W, 1, CHUNK // W): not held over the loop
    go = parts(tl.load(go_ptr + (go_at + start) + cols, mask=go_ok, other=0.0).to(tl.float32), 3)
    g = dot_parts(go, (s,), tl.zeros((W, R, CB), tl.float32), 3, F32_DOT)
    zg = _part_sums(tl.sum(tl.join(z, g), axis=0), STEP)      # the warps' shares summed at once: (R, CB, 2)
    part = part_ptr + (c.to(tl.int64) * M + row) * (2 * R + 1) * cp
    ok = live & (j < STEP)                                   # a one-source step: its column only
    tl.store(part + _zg_offsets(i[None, :], cp, R), zg, mask=ok[None, :, None])
    tl.store(part + 2 * R * cp + i, squares, mask=ok)


@triton.jit
def _zg_offsets(i, cp, R: tl.constexpr):
    """Where a row's part (_group_logits) keeps Z and G at share columns i ((1, CB)): side by side, (R, CB, 2), so
    that one store and one load move both."""
    return ((tl.arange(0, R)[:, None] * cp + i) * 2)[:, :, None] + tl.arange(0, 2)[None, None, :]


@triton.jit
def _part_sums(zg, STEP: tl.constexpr):
    """A one-source step's (R, CB, 2) products: column 0 the sum of its three parts' columns (the source's)."""
    if STEP == 1:
        j = tl.arange(0, zg.shape[1])[None, :, None]
        zg = tl.where(j == 0, tl.sum(tl.where(j < 3, zg, 0.0), axis=1)[:, None, :], zg)
    return zg


@triton.jit
def _program_start(table, n_a, n_b, r0, n_recv, R: tl.constexpr, C_MAX: tl.constexpr, NC: tl.constexpr):
    """What a program of _group_logits or _group_bwd starts from: its column chunk c, the row's C sources, the
    pass's receivers r0 + [0, R) and which of them are real (< n_recv), and the table's addresses, loaded once."""
    c = tl.program_id(0) % NC
    C = n_a + n_b
    recv = r0 + tl.arange(0, R)
    j = tl.arange(0, C_MAX)
    return c, C, recv, recv < n_recv, tl.load(table + j, mask=j < C, other=0)


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv", "row_steps", "a_blocks", "b_blocks"])
def _group_logits(table, n_a, n_b, q_ptr, g_ptr, r0, n_recv, go_ptr, slab, part_ptr, cp, b_base, M, d, row_steps,
                  a_blocks, b_blocks, A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R: tl.constexpr, CB: tl.constexpr,
                  C_MAX: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, NC: tl.constexpr,
                  W: tl.constexpr, STAGES: tl.constexpr, F32_DOT: tl.constexpr):
    """Per column chunk c = program_id % NC and token rows program_id // NC, + num_programs // NC, ... (row_steps
    of them, the last perhaps past M): the chunk's share of Z = U S^T (unscaled), G = Go S^T and the squares, for
    receivers r0 + [0, R) (those < n_recv), into part_ptr (NC, M, 2R + 1, cp): source i < n_a at column i, source
    i >= n_a at b_base + i - n_a (each run from a multiple of 16: a block's 16 columns are 64-byte aligned, moved in
    128-bit transfers). U's and each row's Go's chunk in three bf16 parts, (W, R, CHUNK // W) tiles; sources in
    blocks of CB (a_blocks, b_blocks a row for the two dtypes' runs), a pipeline STAGES // CB steps deep. BLOCK_D
    = NC CHUNK."""
    c, C, recv, recv_ok, addresses = _program_start(table, n_a, n_b, r0, n_recv, R, C_MAX, NC)
    u = parts(queries_chunk(q_ptr, g_ptr, recv, recv_ok, c, d, CHUNK, W), 3)
    cols = tl.permute(chunk_cols(c, CHUNK, W), (0, 2, 1))                     # (W, 1, CHUNK // W)
    go_at = recv[None, :, None].to(tl.int64) * slab                           # (1, R, 1): + start + cols a step
    go_ok = recv_ok[None, :, None] & (cols < d)
    for it in tl.range(0, row_steps * a_blocks, num_stages=STAGES // CB):     # a loop per dtype: tiles.fold_source
        _logits_step(addresses, it, a_blocks, 0, n_a, 0, c, u, go_at, go_ok, go_ptr, part_ptr, M, cp, d, A_DTYPE,
                     CB, CHUNK, NC, W, F32_DOT)
    for it in tl.range(0, row_steps * b_blocks, num_stages=STAGES // CB):
        _logits_step(addresses, it, b_blocks, n_a, C, b_base, c, u, go_at, go_ok, go_ptr, part_ptr, M, cp, d,
                     B_DTYPE, CB, CHUNK, NC, W, F32_DOT)


@triton.jit
def _coefficients(part, ok, j, D, lse, M, cp, d, eps, R: tl.constexpr, CB: tl.constexpr, NC: tl.constexpr):
    """Columns j .. j + CB of the shares at one row (part: chunk 0's; the next chunk's M (2R + 1) cp further; each
    chunk's loaded whole, an aligned block, and summed as it comes, so that no sum crosses threads; only the real
    sources `ok` kept), with D and lse (R, 1): W = A (G - D) rstd and A, (R, CB), and shrink (CB,)."""
    i = (tl.multiple_of(j, CB) + tl.arange(0, CB))[None, :]
    at = part + _zg_offsets(i, cp, R)                         # chunk 0's shares: (R, CB, 2) and (1, CB)
    zg = tl.load(at)
    squares = tl.load(part + 2 * R * cp + i)
    for k in tl.static_range(1, NC):                          # the other chunks' shares, added in place: no reduction
        step = k * M.to(tl.int64) * (2 * R + 1) * cp
        zg += tl.load(at + step)
        squares += tl.load(part + step + 2 * R * cp + i)
    z, g = tl.split(zg)
    ok = ok[None, :]
    rstd = tl.rsqrt(tl.where(ok, squares, 0.0) / d + eps)
    z = tl.where(ok, z, 0.0) * rstd
    a = tl.where(ok, tl.exp(z - lse), 0.0)                    # 0 for receivers past the last (lse = inf)
    w = a * (tl.where(ok, g, 0.0) - D) * rstd
    shrink = tl.sum(w * z, axis=0) * tl.reshape(rstd, (CB,)) / d
    return w, a, shrink


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv"])
def _group_weights(part_ptr, cp, b_base, n_a, n_b, D_ptr, lse_ptr, r0, n_recv, q_out, w_out, shrink_out, M, d, eps,
                   R: tl.constexpr, CB: tl.constexpr, NC: tl.constexpr, ROW_STAGES: tl.constexpr):
    """Each (token row, block of CB share columns), steps program_id, + num_programs, ... (a pipeline ROW_STAGES
    deep): the chunks' shares summed and made into what _group_bwd multiplies by, in fp32: Q = [W; A] (q_out
    (M cp / CB, 2R, CB)), W^T (w_out (M cp / CB, CB, R)) and shrink (shrink_out (M cp / CB, CB)). Made once here,
    not by each of _group_bwd's column chunks: the exponentials, reductions and transposes leave its steps."""
    recv = r0 + tl.arange(0, R)[:, None]
    recv_ok = recv < n_recv
    blocks = cp // CB
    for it in tl.range(tl.program_id(0), M * (cp // CB), tl.num_programs(0), num_stages=ROW_STAGES):
        row = it // blocks
        j = (it - row * blocks) * CB
        col = j + tl.arange(0, CB)
        ok = (col < n_a) | ((col >= b_base) & (col < b_base + n_b))
        D = tl.load(D_ptr + recv * M + row, mask=recv_ok, other=0.0)                   # (R, 1)
        lse = tl.load(lse_ptr + recv * M + row, mask=recv_ok, other=float("inf"))
        w, a, shrink = _coefficients(part_ptr + cp.to(tl.int64) * (2 * R + 1) * row, ok, j, D, lse, M, cp, d, eps,
                                     R, CB, NC)
        at = row.to(tl.int64) * blocks + j // CB                                  # = it
        r, c = tl.arange(0, R)[:, None], tl.arange(0, CB)[None, :]
        tl.store(q_out + at * (2 * R * CB) + 2 * r * CB + c, w)                 # Q's rows 2r and 2r + 1, in place
        tl.store(q_out + at * (2 * R * CB) + (2 * r + 1) * CB + c, a)
        tl.store(w_out + at * (CB * R) + c * R + r, w)                          # W^T, by its addresses
        tl.store(shrink_out + at * CB + tl.arange(0, CB), shrink)


@triton.jit
def _grad_rows(it, blocks, first, hi, cols, go_at, ok, go_ptr, grad_ptr, grad_off, slab, accumulate, M, d,
               NC: tl.constexpr, CB: tl.constexpr):
    """What step `it` reads that the software pipeline does not stage (its consumers are no products): the row's
    Go^T chunk ((CHUNK, R) fp32) and the sources' accumulators ((CHUNK, CB) fp32; 0 unless accumulate), with where
    they go. The loop asks for the next step's while it works on this one (a prefetch by hand)."""
    row, live, lo = _step(it, blocks, first, M, NC, CB)
    start = row * d.to(tl.int64)
    got = tl.load(go_ptr + start + go_at, mask=ok, other=0.0).to(tl.float32)
    at = grad_ptr + ((grad_off + lo + tl.arange(0, CB)).to(tl.int64) * slab + start)[None, :] + cols[:, None]
    mask = (cols < d)[:, None] & ((lo + tl.arange(0, CB) < hi) & live)[None, :]
    old = tl.load(at, mask=mask & (accumulate != 0), other=0.0).to(tl.float32)
    return got, old


@triton.jit
def _grad_step(addresses, it, blocks, first, hi, base, cols, ut, got, old, du, q_in, w_in, shrink_in, grad_ptr,
               grad_off, slab, M, cp, d, DTYPE: tl.constexpr, R: tl.constexpr, CB: tl.constexpr, NC: tl.constexpr,
               F32_DOT: tl.constexpr):
    """One step's sources (those < hi) at its row and column chunk (cols, (CHUNK,)), with the row's Go^T chunk and
    the accumulators' old values (_grad_rows) and _group_weights' Q, W^T and shrink: dS added to them and stored
    (grad_ptr slots grad_off + i); du^T ((CHUNK, R)) returned with S^T W^T added (none for a step past the last
    row, whose row is another program's)."""
    row, live, lo = _step(it, blocks, first, M, NC, CB)
    start = row * d.to(tl.int64)
    v = parts(tl.reshape(tl.join(ut, got), (ut.shape[0], 2 * R)), 2)          # (CHUNK, 2R): U_r, Go_r interleaved
    at = row.to(tl.int64) * (cp // CB) + (base + lo - first) // CB             # the step's block of weights
    iq = tl.arange(0, 2 * R)[:, None] * CB + tl.arange(0, CB)[None, :]
    iw = tl.arange(0, CB)[:, None] * R + tl.arange(0, R)[None, :]
    q = parts(tl.load(q_in + at * (2 * R * CB) + iq), 2)
    wt = parts(tl.load(w_in + at * (CB * R) + iw, mask=live, other=0.0), 2)
    shrink = tl.load(shrink_in + at * CB + tl.arange(0, CB))
    ptrs, real = source_block(addresses, lo, lo, hi, DTYPE, CB)
    mask = (cols < d)[:, None]
    s = tl.load((ptrs + start)[None, :] + cols[:, None], mask=mask, other=0.0)   # (CHUNK, CB): S^T
    ds = dot_parts(v, q, old - s.to(tl.float32) * shrink[None, :], 2, F32_DOT)
    du = dot_parts(source_parts(s, DTYPE), wt, du, 2, F32_DOT)
    at = grad_ptr + ((grad_off + lo + tl.arange(0, CB)).to(tl.int64) * slab + start)[None, :] + cols[:, None]
    tl.store(at, ds.to(grad_ptr.dtype.element_ty), mask=mask & (real & live)[None, :])
    return du


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv", "off_a", "off_b", "accumulate", "row_steps", "a_blocks",
                               "b_blocks"])
def _group_bwd(table, n_a, n_b, q_ptr, g_ptr, r0, n_recv, go_ptr, slab, q_in, w_in, shrink_in, cp, b_base, acc_a_ptr,
               acc_b_ptr, off_a, off_b, du_ptr, accumulate, M, d, row_steps, a_blocks, b_blocks,
               A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R: tl.constexpr, CB: tl.constexpr, C_MAX: tl.constexpr,
               BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, NC: tl.constexpr, STAGES: tl.constexpr,
               F32_DOT: tl.constexpr):
    """Per column chunk c = program_id % NC and token rows program_id // NC, + num_programs // NC, ... (row_steps
    of them): the committed sources' gradients (source i's into slot off_a + i of acc_a, or off_b + i - n_a of
    acc_b; written or added to) from _group_weights' Q, W^T and shrink (q_in, w_in, shrink_in), and the program's
    partial du (du_ptr (programs // NC, R, d), its chunk of row program_id // NC). U^T's chunk made once per
    program; [U; Go]^T in two bf16 parts a step."""
    c, C, recv, recv_ok, addresses = _program_start(table, n_a, n_b, r0, n_recv, R, C_MAX, NC)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    at = recv[None, :] * d + cols[:, None]                                     # (CHUNK, R): U^T, Go^T
    ok = recv_ok[None, :] & (cols < d)[:, None]
    ut = tl.load(q_ptr + at, mask=ok, other=0.0).to(tl.float32) * tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
    go_at = recv[None, :].to(tl.int64) * slab + cols[:, None]
    du = tl.zeros((CHUNK, R), tl.float32)
    # a loop per dtype (tiles.fold_source), each step with the next one's rows in flight (_grad_rows)
    steps = row_steps * a_blocks
    got, old = _grad_rows(0, a_blocks, 0, n_a, cols, go_at, ok, go_ptr, acc_a_ptr, off_a, slab, accumulate, M, d, NC,
                          CB)
    for it in tl.range(0, row_steps * a_blocks, num_stages=STAGES // CB):
        ahead = _grad_rows(tl.minimum(it + 1, steps - 1), a_blocks, 0, n_a, cols, go_at, ok, go_ptr, acc_a_ptr, off_a,
                           slab, accumulate, M, d, NC, CB)
        du = _grad_step(addresses, it, a_blocks, 0, n_a, 0, cols, ut, got, old, du, q_in, w_in, shrink_in, acc_a_ptr,
                        off_a, slab, M, cp, d, A_DTYPE, R, CB, NC, F32_DOT)
        got, old = ahead
    steps = row_steps * b_blocks
    got, old = _grad_rows(0, b_blocks, n_a, C, cols, go_at, ok, go_ptr, acc_b_ptr, off_b - n_a, slab, accumulate, M, d,
                          NC, CB)
    for it in tl.range(0, row_steps * b_blocks, num_stages=STAGES // CB):
        ahead = _grad_rows(tl.minimum(it + 1, steps - 1), b_blocks, n_a, C, cols, go_at, ok, go_ptr, acc_b_ptr,
                           off_b - n_a, slab, accumulate, M, d, NC, CB)
        du = _grad_step(addresses, it, b_blocks, n_a, C, b_base, cols, ut, got, old, du, q_in, w_in, shrink_in,
                        acc_b_ptr, off_b - n_a, slab, M, cp, d, B_DTYPE, R, CB, NC, F32_DOT)
        got, old = ahead
    out = du_ptr + (tl.program_id(0) // NC * R * d).to(tl.int64) + tl.arange(0, R)[None, :] * d + cols[:, None]
    tl.store(out, du, mask=(cols < d)[:, None])


# ------------------------------------------------------------------------------------------ launching

def _options(kernel: str) -> dict:
    """The kernel's warps and register limit: launch.register_budget in the 8 a thread ptxas allocates at a time
    (170 would take 176 and let 2 programs of 4 warps share an SM, not 3), 255 where that is the cap."""
    warps = WARPS[kernel]
    budget = register_budget(warps, PROGRAMS_PER_SM[kernel])
    return dict(num_warps=warps, maxnreg=budget if budget == 255 else budget // 8 * 8)


@functools.cache   # a pure function of its arguments, asked at every launch
def backward_config(d: int) -> dict:
    """The kernels' tiles at width d: R = 8 receivers a pass, blocks of CB = 16 sources (tl.dot's K >= 16 for du),
    STAGES = 32 source chunks in flight (two blocks); _group_logits' shares in NC chunks of CHUNK columns,
    _group_bwd's programs over GRAD_NC chunks of GRAD_CHUNK. The interpreter takes chunks of 64 for both and fp32
    products (F32_DOT)."""
    chunk, grad_chunk = (64, 64) if interpreting() else (CHUNK, GRAD_CHUNK)
    nc, grad_nc = cdiv(d, chunk), cdiv(d, grad_chunk)
    return dict(R=R_BLOCK, CB=16, BLOCK_D=chunk * nc, CHUNK=chunk, NC=nc, GRAD_CHUNK=grad_chunk, GRAD_NC=grad_nc,
                STAGES=32, F32_DOT=interpreting())


def _programs(n: int, nc: int, kernel: str, device: torch.device) -> int:
    """Programs per column chunk over n token rows (or a row's blocks): one wave of the kernel's programs over every
    SM (persistent), at most n; the interpreter's 3 (awkward: rows left over)."""
    if interpreting():
        return min(n, 3)
    return max(1, min(n, _sm_count(device) * PROGRAMS_PER_SM[kernel] // nc))


def _dtypes(table: SourceTable) -> dict:
    """A_DTYPE and B_DTYPE of the table's two runs; an empty second run taken as bf16, not as the first run's dtype,
    so that a table of one fp32 source compiles no fp32-only specialisation."""
    dtypes = table.dtype_args()
    return dtypes if len(table.tensors) > table.n_a else dict(dtypes, B_DTYPE=tl.bfloat16)


def receivers_per_pass(d: int) -> int:
    """How many receivers phase 1's backward serves in one pass over the sources (at any width d)."""
    return R_BLOCK


def group_backward(table: SourceTable, queries: Tensor, norm_weights: Tensor, eps: float, go: Tensor, D: Tensor,
                   lse: Tensor, accumulators: tuple[Tensor, Tensor, int, int], accumulate: bool) -> Tensor:
    """Phase 1's backward: the committed sources' gradients into `accumulators` (acc_a, acc_b, off_a, off_b:
    see GradBank.pointers), written or added to; returns du (n_recv, d) fp32, the committed part."""
    first = table.tensors[0]
    M, d = first.numel() // first.shape[-1], first.shape[-1]
    if D.numel() >= 2 ** 31:      # the kernels read D and lse (n_recv, M) at 32-bit offsets
        raise ValueError(f"phase 1's backward takes fewer than 2^31 per-row scalars; got {tuple(D.shape)}")
    cfg = dict(backward_config(d))
    grad_tiles = dict(CHUNK=cfg.pop("GRAD_CHUNK"), NC=cfg.pop("GRAD_NC"))
    grad_tiles["BLOCK_D"] = grad_tiles["CHUNK"] * grad_tiles["NC"]
    C, nc, n_recv = len(table.tensors), cfg["NC"], queries.shape[0]
    logits_rows = _programs(M, nc, "_group_logits", first.device)
    bwd_rows = _programs(M, grad_tiles["NC"], "_group_bwd", first.device)
    cfg = dict(cfg, C_MAX=max(16, triton.next_power_of_2(C)), **_dtypes(table))
    b_base = cdiv(table.n_a, cfg["CB"]) * cfg["CB"]         # each run's shares from a 16-aligned column
    cp = b_base + cdiv(C - table.n_a, cfg["CB"]) * cfg["CB"]
    part = torch.empty(nc, M, 2 * R_BLOCK + 1, cp, dtype=torch.float32, device=first.device)
    steps, block = M * cp // cfg["CB"], 2 * R_BLOCK * cfg["CB"]
    weights = (torch.empty(steps, block, dtype=torch.float32, device=first.device),          # Q
               torch.empty(steps, block // 2, dtype=torch.float32, device=first.device),     # W^T
               torch.empty(steps, cfg["CB"], dtype=torch.float32, device=first.device))      # shrink
    du = torch.empty(cdiv(n_recv, R_BLOCK), bwd_rows, R_BLOCK, d, dtype=torch.float32, device=first.device)
    acc_a, acc_b, off_a, off_b = accumulators
    n_a, n_b = table.n_a, C - table.n_a
    grads = [acc_a[off_a:off_a + n_a, :first.numel()], acc_b[off_b:off_b + n_b, :first.numel()]]
    common = dict(table=table.addresses, n_a=n_a, n_b=n_b, q_ptr=queries, g_ptr=norm_weights, n_recv=n_recv,
                  go_ptr=go, slab=go.shape[1], cp=cp, b_base=b_base, M=M, d=d,
                  a_blocks=cdiv(n_a, cfg["CB"]), b_blocks=cdiv(n_b, cfg["CB"]), **cfg)
    # _group_logits' steps a row: a bf16 run's blocks, an fp32 or fp16 run's sources (one a step, as three parts)
    logits_steps = {f"{run}_blocks": n if cfg[f"{run.upper()}_DTYPE"] != tl.bfloat16 else cdiv(n, cfg["CB"])
                    for run, n in (("a", n_a), ("b", n_b))}
    for k, r0 in enumerate(range(0, n_recv, R_BLOCK)):     # receivers beyond R: the sources are read again
        chunk = min(R_BLOCK, n_recv - r0)
        inputs = [(table, 1), (queries[r0:r0 + chunk], 1), (norm_weights[r0:r0 + chunk], 1),
                  (go[r0:r0 + chunk, :first.numel()], 1)]
        launch(_group_logits, nc * logits_rows, lambda: (inputs, [part]), first.device,
               dict(common, r0=r0, part_ptr=part, W=WARPS["_group_logits"], row_steps=cdiv(M, logits_rows),
                    **logits_steps, **_options("_group_logits")))
        launch(_group_weights, _programs(steps, 1, "_group_weights", first.device),
               lambda: ([(part, 1), (D[r0:r0 + chunk], 1), (lse[r0:r0 + chunk], 1)], list(weights)), first.device,
               dict(part_ptr=part, cp=cp, b_base=b_base, n_a=n_a, n_b=n_b, D_ptr=D, lse_ptr=lse, r0=r0, n_recv=n_recv,
                    q_out=weights[0], w_out=weights[1], shrink_out=weights[2], M=M, d=d, eps=eps, R=R_BLOCK,
                    CB=cfg["CB"], NC=nc, ROW_STAGES=4 if nc <= 8 else 2,   # a stage's shares: NC 1.1 KB
                    **_options("_group_weights")))
        io = lambda: (inputs + [(w, 1) for w in weights] + [(g, 1) for g in grads if accumulate or k],  # noqa: E731
                      grads + [du[k]])
        launch(_group_bwd, grad_tiles["NC"] * bwd_rows, io, first.device, dict(
            common, **grad_tiles, r0=r0, q_in=weights[0], w_in=weights[1], shrink_in=weights[2], acc_a_ptr=acc_a,
            acc_b_ptr=acc_b, off_a=off_a, off_b=off_b, du_ptr=du[k], accumulate=int(accumulate or k > 0),
            row_steps=cdiv(M, bwd_rows), **_options("_group_bwd")))
    return du.sum(1).flatten(0, 1)[:n_recv]
