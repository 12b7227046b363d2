"""The @triton.jit helpers of the routing kernels (depth_route.py, group_read.py, receiver_read.py): split rows
and their arithmetic; a source's row read through an address table, the folded query, logits, the
online-softmax step, a table's sources folded into it, a source's gradient, an in-place gradient accumulator;
and the receivers' mix, softmax start state and sum of a group's partial-block slots. Everything in fp32.

A row of d values is a split row (depth_kernels.launch.row_split): a tuple of tiles, the head (columns [0, BLOCK_D))
and, where d is not a power of two, a tail over the row's last BLOCK_T columns (those the head holds masked off
in it), so that a row of 1280 lanes is 1024 + 512 lanes, not one tile of 2048 (Triton's tiles are powers of
two). K rows of it are (K, width) tiles; a (d,) vector (a query, a norm weight, a partial sum of du) is one row,
(1, width) tiles, which broadcast against K rows. The row_* helpers are the arithmetic of such tuples, tile by
tile; reductions over a row add the tiles' sums.
"""
import triton
import triton.language as tl

# ------------------------------------------------------------------------------------ split rows: layout

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
def row_masks(row_ok, own):
    """Each tile's (K, width) mask for K rows (row_ok (K,)) of a split row's own columns."""
    masks = ()
    for c in tl.static_range(len(own)):
        masks = masks + (row_ok[:, None] & own[c][None, :],)
    return masks


@triton.jit
def row_own(own):
    """Each tile's (1, width) mask of one row's own columns."""
    masks = ()
    for c in tl.static_range(len(own)):
        masks = masks + (own[c][None, :],)
    return masks


@triton.jit
def row_offsets(start, cols):
    """start (an int64 scalar, or (K, 1)) + each tile's columns: offsets of K rows' tiles, (K, width) each."""
    offs = ()
    for c in tl.static_range(len(cols)):
        offs = offs + (start + cols[c][None, :],)
    return offs


@triton.jit
def row_zeros(rows: tl.constexpr, cols):
    """`rows` rows of zeros, (rows, width) per tile."""
    out = ()
    for c in tl.static_range(len(cols)):
        out = out + (tl.zeros((rows, cols[c].shape[0]), tl.float32),)
    return out


@triton.jit
def row_load(ptr, offs, masks):
    """The split row at ptr + offs (masks: each tile's, broadcastable to it), in fp32; 0 where masked."""
    out = ()
    for c in tl.static_range(len(offs)):
        out = out + (tl.load(ptr + offs[c], mask=masks[c], other=0.0).to(tl.float32),)
    return out


@triton.jit
def row_store(ptr, offs, x, masks):
    """x at ptr + offs, in ptr's dtype."""
    for c in tl.static_range(len(offs)):
        tl.store(ptr + offs[c], x[c].to(ptr.dtype.element_ty), mask=masks[c])


@triton.jit
def row_vector(ptr, cols, own):
    """The (d,) vector at ptr as one split row ((1, width) tiles), fp32."""
    return row_load(ptr, row_offsets(0, cols), row_own(own))


# -------------------------------------------------------------------------------- split rows: arithmetic

@triton.jit
def row_dot(x, y):
    """sum over columns of x * y per row: (K,) (x or y may be one row, broadcast)."""
    out = tl.sum(x[0] * y[0], axis=1)
    for c in tl.static_range(1, len(x)):
        out += tl.sum(x[c] * y[c], axis=1)
    return out


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def row_dot2(a, b, c, e):
    """(a . b, c . e) per row, as row_dot's, in one reduction a tile (one exchange between the row's warps; the
    products broadcast to one shape: one row against K)."""
    ab, ce = tl.reduce(tl.broadcast(a[0] * b[0], c[0] * e[0]), 1, _add2)
    for t in tl.static_range(1, len(a)):
        ab_t, ce_t = tl.reduce(tl.broadcast(a[t] * b[t], c[t] * e[t]), 1, _add2)
        ab += ab_t
        ce += ce_t
    return ab, ce


@triton.jit
def row_dot3(a, b, c, e, f, g):
    """(a . b, c . e, f . g) per row, as row_dot2's."""
    ab, ce = tl.broadcast(a[0] * b[0], c[0] * e[0])
    ab, ce, fg = tl.reduce((ab, ce, f[0] * g[0]), 1, _add3)
    for t in tl.static_range(1, len(a)):
        ab_t, ce_t = tl.broadcast(a[t] * b[t], c[t] * e[t])
        ab_t, ce_t, fg_t = tl.reduce((ab_t, ce_t, f[t] * g[t]), 1, _add3)
        ab += ab_t
        ce += ce_t
        fg += fg_t
    return ab, ce, fg


@triton.jit
def row_add(x, y):
    out = ()
    for c in tl.static_range(len(x)):
        out = out + (x[c] + y[c],)
    return out


@triton.jit
def row_sub(x, y):
    out = ()
    for c in tl.static_range(len(x)):
        out = out + (x[c] - y[c],)
    return out


@triton.jit
def row_mul(x, y):
    out = ()
    for c in tl.static_range(len(x)):
        out = out + (x[c] * y[c],)
    return out


@triton.jit
def row_scale(x, a):
    """a[k] x[k] for per-row scalars a (K,) (or (1,))."""
    out = ()
    for c in tl.static_range(len(x)):
        out = out + (a[:, None] * x[c],)
    return out


@triton.jit
def row_div(x, a):
    """x[k] / a[k] for per-row scalars a (K,)."""
    out = ()
    for c in tl.static_range(len(x)):
        out = out + (x[c] / a[:, None],)
    return out


@triton.jit
def row_axpy(a, x, y):
    """a[k] x[k] + y[k] for per-row scalars a (K,)."""
    out = ()
    for c in tl.static_range(len(x)):
        out = out + (a[:, None] * x[c] + y[c],)
    return out


@triton.jit
def row_round(x, DTYPE: tl.constexpr):
    """x rounded to DTYPE, back in fp32."""
    out = ()
    for c in tl.static_range(len(x)):
        out = out + (x[c].to(DTYPE).to(tl.float32),)
    return out


@triton.jit
def row_colsum(acc, x):
    """acc (one row) + the sum of x's rows."""
    out = ()
    for c in tl.static_range(len(x)):
        out = out + (acc[c] + tl.sum(x[c], axis=0)[None, :],)
    return out


# ---------------------------------------------------------------------------------------------- routing

@triton.jit
def table_source(table, i, DTYPE: tl.constexpr, offs, masks):
    """Source i of the address table at offs, a split row in fp32."""
    ptr = tl.multiple_of(tl.load(table + i).to(tl.pointer_type(DTYPE)), 16)   # aligned by the launcher
    return row_load(ptr, offs, masks)


@triton.jit
def folded_query(q_ptr, g_ptr, cols, own):
    """u = query * norm_weight in fp32, one row."""
    return row_mul(row_vector(q_ptr, cols, own), row_vector(g_ptr, cols, own))


@triton.jit
def logit(s, u, d, eps):
    """z = rstd(s) (s . u) per row, and rstd: (K,) each."""
    ss, su = row_dot2(s, s, s, u)
    rstd = tl.rsqrt(ss / d + eps)
    return su * rstd, rstd


@triton.jit
def logit_and_dot(s, u, go, d, eps):
    """logit's z and rstd, and go . s per row, from one reduction (row_dot3)."""
    ss, su, gs = row_dot3(s, s, s, u, go, s)
    rstd = tl.rsqrt(ss / d + eps)
    return su * rstd, rstd, gs


@triton.jit
def softmax_step(m, l, acc, s, z):
    """Online softmax: fold one source (rows s, logits z) into the running max m, normaliser l and sum acc."""
    m_new = tl.maximum(m, z)
    alpha = tl.exp(m - m_new)             # rescales what was accumulated under the old max
    p = tl.exp(z - m_new)
    return m_new, l * alpha + p, row_axpy(p, s, row_scale(acc, alpha))


@triton.jit
def read_table(table, n_a, n_b, offs, masks, u, d, eps, m, l, acc,
               A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, STAGES: tl.constexpr):
    """Fold every source of an address table (n_a of A_DTYPE, then n_b of B_DTYPE: one pipelined loop per
    dtype) into the online-softmax state (m, l, acc) of the rows at offs."""
    for i in tl.range(0, n_a, num_stages=STAGES):
        m, l, acc = fold_source(table, i, A_DTYPE, offs, masks, u, d, eps, m, l, acc)
    for i in tl.range(n_a, n_a + n_b, num_stages=STAGES):
        m, l, acc = fold_source(table, i, B_DTYPE, offs, masks, u, d, eps, m, l, acc)
    return m, l, acc


# One source's step of each pass over a table. A table holds two runs of sources, one per dtype, and a pipelined
# loop loads one dtype, so every pass is a loop pair whose body is one of these. The loops stay in the kernels:
# meters/sass.py knows a loop by the line of its `for`, and two inlined copies of one helper's loop would share
# it (the compiled code's line records name no call site).

@triton.jit
def fold_source(table, i, DTYPE: tl.constexpr, offs, masks, u, d, eps, m, l, acc):
    """Source i of the table (of DTYPE) folded into the online-softmax state (m, l, acc)."""
    s = table_source(table, i, DTYPE, offs, masks)
    return softmax_step(m, l, acc, s, logit(s, u, d, eps)[0])


@triton.jit
def mix_source(table, i, DTYPE: tl.constexpr, offs, masks, u, d, eps, lse, r):
    """r + exp(z_i - lse) s_i for source i of the table: a read-out recomputed from its lse."""
    s = table_source(table, i, DTYPE, offs, masks)
    return row_axpy(tl.exp(logit(s, u, d, eps)[0] - lse), s, r)


@triton.jit
def dot_source(table, i, DTYPE: tl.constexpr, offs, masks, go, u, lse, d, eps):
    """a_i (go . s_i) for source i of the table: its term of D = go . r, the softmax backward's shared term."""
    s = table_source(table, i, DTYPE, offs, masks)
    z, _, gs = logit_and_dot(s, u, go, d, eps)
    return tl.exp(z - lse) * gs


@triton.jit
def grad_source(table, i, DTYPE: tl.constexpr, offs, masks, go, u, lse, D, d, eps, du, grad, accumulate):
    """Source i's gradient given dL/dr = go, written or added (accumulate) to its accumulator row `grad`; returns
    du + its term of the query's gradient."""
    s = table_source(table, i, DTYPE, offs, masks)
    ds, dz_rstd = source_grad(s, go, u, lse, D, d, eps)
    accumulate_grad(grad, ds, offs, masks, accumulate)
    return row_colsum(du, row_scale(s, dz_rstd))


@triton.jit
def source_grad(s, go, u, lse, D, d, eps):
    """Gradient of one source given dL/dr = go: a = exp(z - lse), dz = a (go . s - D),
    ds = a go + dz rstd (u - z rstd s / d). Returns ds and dz rstd (the query gradient's weight for s)."""
    z, rstd, gs = logit_and_dot(s, u, go, d, eps)
    a = tl.exp(z - lse)
    dz_rstd = a * (gs - D) * rstd
    ds = ()
    for c in tl.static_range(len(s)):
        ds = ds + (a[:, None] * go[c] + dz_rstd[:, None] * (u[c] - (z * rstd / d)[:, None] * s[c]),)
    return ds, dz_rstd


@triton.jit
def accumulate_grad(ptr, ds, offs, masks, accumulate):
    """Write ds into a gradient accumulator (accumulate == 0), or add it to what is there."""
    for c in tl.static_range(len(offs)):
        old = tl.load(ptr + offs[c], mask=masks[c] & (accumulate != 0), other=0.0).to(tl.float32)
        tl.store(ptr + offs[c], (ds[c] + old).to(ptr.dtype.element_ty), mask=masks[c])


# -------------------------------------------------------------------------------------------- receivers

# The NULL flag of the receiver kernels (depth_kernels/receiver_read.py): no null source, a zero one (value 0, logit 0),
# or the receiver's learned vector
NULL_NONE, NULL_ZERO, NULL_LEARNED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def null_source(null_ptr, NULL: tl.constexpr, u, cols, own, d, eps):
    """The null source (one row) and its logit (1,): the receiver's learned vector (NULL_LEARNED), or zero
    (value 0, logit 0) otherwise."""
    if NULL == NULL_LEARNED:
        n = row_vector(null_ptr, cols, own)
    else:
        n = row_zeros(1, cols)
    z, _ = logit(n, u, d, eps)
    return n, z


@triton.jit
def mix(h, r, gate, ADD: tl.constexpr, X_DTYPE: tl.constexpr):
    """x = h + gate r (additive, Eq. 2; gate 1.0 without a gate: exactly h + r) or r (replacement), rounded to
    the dtype the reference mixes in."""
    x = ()
    for c in tl.static_range(len(r)):
        if ADD:
            x = x + ((h[c] + gate * r[c]).to(X_DTYPE).to(tl.float32),)
        else:
            x = x + (r[c].to(X_DTYPE).to(tl.float32),)
    return x


@triton.jit
def start_state(state_ptr, lse_c_ptr, slot, slab, rows, row_ok, offs, masks, cols, M, HAS_STATE: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """The online softmax's starting (max, normaliser, sum): phase 1's (lse_C, 1, r_C), or empty."""
    if HAS_STATE:
        m = tl.load(lse_c_ptr + slot.to(tl.int64) * M + rows, mask=row_ok, other=0.0)
        l = tl.full((BLOCK_M,), 1.0, tl.float32)
        acc = row_load(state_ptr + slot.to(tl.int64) * slab, offs, masks)
    else:
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_M,), tl.float32)
        acc = row_zeros(BLOCK_M, cols)
    return m, l, acc


@triton.jit
def add_slots(dh, dsum_ptr, lo, hi, slab, offs, masks):
    """dh plus slots lo..hi-1 of the buffer at dsum_ptr (the group's other receivers' -dL/d(partial))."""
    slot_ptr = dsum_ptr + lo.to(tl.int64) * slab
    for _ in range(lo, hi):
        dh = row_add(dh, row_load(slot_ptr, offs, masks))
        slot_ptr += slab
    return dh
