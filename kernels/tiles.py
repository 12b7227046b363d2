"""The @triton.jit helpers of the routing kernels (depth_route.py, group_read.py, receiver_read.py): a source's
tile read through an address table, the folded query, logits, the online-softmax step, a table's sources folded
into it, a source's gradient, an in-place gradient accumulator; and the receivers' mix, softmax start state and
sum of a group's partial-block slots. Tiles are (BLOCK_M, BLOCK_D) rows of sources, everything in fp32.

Phase 1's kernels hold a row as a split row (kernels.launch.row_split): a tuple of tiles, the head (columns
[0, BLOCK_D)) and, where d is not a power of two, a tail (the row's last BLOCK_T columns, those the head holds
masked off), so that a row of 1280 lanes is 1024 + 512 lanes, not 2048; the row_* helpers act on such tuples.
"""
import triton
import triton.language as tl


@triton.jit
def table_source(table, i, DTYPE: tl.constexpr, offs, mask):
    """Source i of the address table as an fp32 (BLOCK_M, BLOCK_D) tile."""
    ptr = tl.multiple_of(tl.load(table + i).to(tl.pointer_type(DTYPE)), 16)   # aligned by the launcher
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def folded_query(q_ptr, g_ptr, cols, d):
    """u = query * norm_weight in fp32, (BLOCK_D,)."""
    q = tl.load(q_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)
    return q * tl.load(g_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)


@triton.jit
def logit(s, u, d, eps):
    """z = rstd(s) (s . u) per row, and rstd: (BLOCK_M,) each."""
    rstd = tl.rsqrt(tl.sum(s * s, axis=1) / d + eps)
    return tl.sum(s * u[None, :], axis=1) * rstd, rstd


@triton.jit
def softmax_step(m, l, acc, s, z):
    """Online softmax: fold one source (tile s, logits z) into the running max m, normaliser l and sum acc."""
    m_new = tl.maximum(m, z)
    alpha = tl.exp(m - m_new)             # rescales what was accumulated under the old max
    p = tl.exp(z - m_new)
    return m_new, l * alpha + p, acc * alpha[:, None] + p[:, None] * s


@triton.jit
def read_table(table, n_a, n_b, offs, mask, u, d, eps, m, l, acc,
                A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, STAGES: tl.constexpr):
    """Fold every source of an address table (n_a of A_DTYPE, then n_b of B_DTYPE: one pipelined loop per
    dtype) into the online-softmax state (m, l, acc) of the rows at offs."""
    for i in tl.range(0, n_a, num_stages=STAGES):
        s = table_source(table, i, A_DTYPE, offs, mask)
        m, l, acc = softmax_step(m, l, acc, s, logit(s, u, d, eps)[0])
    for i in tl.range(n_a, n_a + n_b, num_stages=STAGES):
        s = table_source(table, i, B_DTYPE, offs, mask)
        m, l, acc = softmax_step(m, l, acc, s, logit(s, u, d, eps)[0])
    return m, l, acc


@triton.jit
def source_grad(s, go, u, lse, D, d, eps):
    """Gradient of one source given dL/dr = go: a = exp(z - lse), dz = a (go . s - D),
    ds = a go + dz rstd (u - z rstd s / d). Returns ds and dz rstd (the query gradient's weight for s)."""
    z, rstd = logit(s, u, d, eps)
    a = tl.exp(z - lse)
    dz_rstd = a * (tl.sum(go * s, axis=1) - D) * rstd
    ds = a[:, None] * go + dz_rstd[:, None] * (u[None, :] - (z * rstd / d)[:, None] * s)
    return ds, dz_rstd


@triton.jit
def accumulate_grad(ptr, ds, offs, mask, accumulate):
    """Write ds into a gradient accumulator (accumulate == 0), or add it to what is there."""
    ds += tl.load(ptr + offs, mask=mask & (accumulate != 0), other=0.0).to(tl.float32)
    tl.store(ptr + offs, ds.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def mix(h, r, gate, ADD: tl.constexpr, X_DTYPE: tl.constexpr):
    """x = h + gate r (additive, Eq. 2; gate 1.0 without a gate: exactly h + r) or r (replacement), rounded to
    the dtype the reference mixes in."""
    if ADD:
        x = h + gate * r
    else:
        x = r
    return x.to(X_DTYPE).to(tl.float32)


@triton.jit
def start_state(state_ptr, lse_c_ptr, slot, slab, rows, row_ok, offs, mask, M, HAS_STATE: tl.constexpr,
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
def add_slots(dh, dsum_ptr, lo, hi, slab, offs, mask):
    """dh plus slots lo..hi-1 of the buffer at dsum_ptr (the group's other receivers' -dL/d(partial))."""
    slot_ptr = dsum_ptr + lo.to(tl.int64) * slab
    for _ in range(lo, hi):
        dh += tl.load(slot_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        slot_ptr += slab
    return dh


# ------------------------------------------------------------------------------------------- split rows

@triton.jit
def row_cols(d, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """A split row's columns, (head,) or (head, tail), and each tile's mask of the columns it owns."""
    head = tl.arange(0, BLOCK_D)
    cols = (head,)
    own = (head < d,)
    if BLOCK_T > 0:
        tail = d - BLOCK_T + tl.arange(0, BLOCK_T)
        cols = cols + (tail,)
        own = own + (tail >= BLOCK_D,)
    return cols, own


@triton.jit
def row_offsets(start, cols):
    """start (int64 scalar, or (K, 1)) + each tile's columns: offsets of K rows' tiles, (K, width) each."""
    offs = ()
    for c in tl.static_range(len(cols)):
        offs = offs + (start + cols[c][None, :],)
    return offs


@triton.jit
def row_zeros(rows: tl.constexpr, cols):
    """A split row of `rows` rows of zeros, (rows, width) per tile, fp32."""
    out = ()
    for c in tl.static_range(len(cols)):
        out = out + (tl.zeros((rows, cols[c].shape[0]), tl.float32),)
    return out


@triton.jit
def row_load(ptr, offs, masks, other: tl.constexpr = 0.0):
    """The split row at ptr + offs (masks: each tile's, broadcastable to it), in fp32."""
    out = ()
    for c in tl.static_range(len(offs)):
        out = out + (tl.load(ptr + offs[c], mask=masks[c], other=other).to(tl.float32),)
    return out


@triton.jit
def row_store(ptr, offs, x, masks):
    for c in tl.static_range(len(offs)):
        tl.store(ptr + offs[c], x[c].to(ptr.dtype.element_ty), mask=masks[c])


@triton.jit
def table_row(table, i, DTYPE: tl.constexpr, offs, masks):
    """Source i of the address table as a split row, fp32."""
    ptr = tl.multiple_of(tl.load(table + i).to(tl.pointer_type(DTYPE)), 16)   # aligned by the launcher
    return row_load(ptr, offs, masks)


@triton.jit
def row_dot(x, y):
    """sum over columns of x * y, per row: (K,) for split rows of K rows (or broadcast against one row)."""
    out = tl.sum(x[0] * y[0], axis=1)
    for c in tl.static_range(1, len(x)):
        out += tl.sum(x[c] * y[c], axis=1)
    return out


@triton.jit
def row_softmax_step(m, l, acc, s, z):
    """softmax_step on split rows: fold source s (logits z) into (m, l, acc)."""
    m_new = tl.maximum(m, z)
    alpha = tl.exp(m - m_new)
    p = tl.exp(z - m_new)
    out = ()
    for c in tl.static_range(len(acc)):
        out = out + (acc[c] * alpha[:, None] + p[:, None] * s[c],)
    return m_new, l * alpha + p, out


@triton.jit
def row_accumulate_grad(ptr, ds, offs, masks, accumulate):
    """accumulate_grad on a split row."""
    for c in tl.static_range(len(offs)):
        accumulate_grad(ptr, ds[c], offs[c], masks[c], accumulate)
