"""The @triton.jit helpers of the routing kernels (depth_route.py, group_read.py, receiver_read.py): a source's
tile read through an address table, the folded query, logits, the online-softmax step, a table's sources folded
into it, a source's gradient, an in-place gradient accumulator; and the receivers' mix, softmax start state and
sum of a group's partial-block slots. Tiles are (BLOCK_M, BLOCK_D) rows of sources, everything in fp32.
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
