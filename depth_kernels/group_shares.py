"""Phase 1's backward, its first two kernels (the equations, the buffers' layout and the precision:
depth_kernels/group_backward.py's docstring, which launches them):

- `_group_logits`: per column chunk and step, the chunk's share of Z, G and the sources' squares, stored per chunk;
- `_group_weights`: per row and block of 16 sources, the chunks' shares summed and made into the weights Q = [W; A],
  W^T and shrink that `_group_bwd` multiplies by.
"""
import triton
import triton.language as tl

from depth_kernels.group_tiles import (chunk_cols, dot_parts, load_chunk, part_columns, parts, program_start,
                                      queries_chunk, source_block, source_pointer, walk_step)


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
    row, live, lo = walk_step(it, blocks, first, M, NC, STEP)
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
    # a one-source step: its column, and the padding of its block past the run's last source (so that no share
    # _group_weights reads is left unwritten)
    ok = live & ((j < STEP) | ((lo + j >= hi) & (i // CB == (base + lo - first) // CB)))
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
    c, C, recv, recv_ok, addresses = program_start(table, n_a, n_b, r0, n_recv, R, C_MAX, NC)
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
