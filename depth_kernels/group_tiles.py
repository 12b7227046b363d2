"""The @triton.jit helpers of phase 1's tensor-core kernels (depth_kernels/group_read.py, group_shares.py and
group_backward.py): a token row of a block of CB sources at a time, as CB columns of bf16 values (an fp32 or fp16
source as three bf16 columns, whose sum it is), in chunks of CHUNK columns, each chunk a (W, CHUNK // W, CB) tile
whose slices go to W warps, so that the products over a row (the logits, K = d) are W batched products, each warp over
its own columns, summed once per block. The receivers' folded queries are split into three 16-bit parts (exact to
fp32's 2^-24) made once per program; every other fp32 operand of a product into two (2^-16, below the 16-bit rounding
of what is stored).
"""
import triton
import triton.language as tl


@triton.jit
def source_block(addresses, lo, first, hi, DTYPE: tl.constexpr, CB: tl.constexpr):
    """Sources lo .. lo + CB of the table (addresses: all of them, loaded once) as (CB,) pointers of DTYPE,
    and which are real (first <= i < hi): the others point at a real one, read again and left out. Taken from
    registers, not loaded in the source loop, so that the loop's software pipeline stages the sources' loads
    (a load whose address an earlier load of the loop gives is not staged); unmasked, so staged whole."""
    i = lo + tl.arange(0, CB)
    at = tl.gather(addresses, tl.minimum(tl.maximum(i, first), hi - 1), 0)
    return tl.multiple_of(at.to(tl.pointer_type(DTYPE)), 16), (i >= first) & (i < hi)


@triton.jit
def chunk_cols(c, CHUNK: tl.constexpr, W: tl.constexpr):
    """Chunk c's columns as (W, CHUNK // W, 1): W slices of the chunk, one per warp."""
    K: tl.constexpr = CHUNK // W
    return c * CHUNK + (tl.arange(0, W)[:, None] * K + tl.arange(0, K)[None, :])[:, :, None]


@triton.jit
def load_chunk(ptrs, start, c, d, CHUNK: tl.constexpr, W: tl.constexpr):
    """Chunk c of one token row (at element `start`) of a block of sources, transposed and in W slices:
    (W, CHUNK // W, CB) in the sources' dtype, 0 past d."""
    cols = chunk_cols(c, CHUNK, W)
    return tl.load((ptrs + start)[None, None, :] + cols, mask=cols < d, other=0.0)


@triton.jit
def queries_chunk(q_ptr, g_ptr, recv, recv_ok, c, d, CHUNK: tl.constexpr, W: tl.constexpr):
    """Chunk c of the receivers' folded queries u = query * norm_weight: (W, R, CHUNK // W) fp32."""
    cols = tl.permute(chunk_cols(c, CHUNK, W), (0, 2, 1))
    at = recv[None, :, None] * d + cols
    mask = recv_ok[None, :, None] & (cols < d)
    # widened first: a 16-bit product would round u (and the interpreter's 16-bit values are bit patterns)
    return tl.load(q_ptr + at, mask=mask, other=0.0).to(tl.float32) * tl.load(g_ptr + at, mask=mask,
                                                                                other=0.0).to(tl.float32)


@triton.jit
def mma(a, b, acc, F32_DOT: tl.constexpr):
    """acc + a @ b on tensor cores (fp32 accumulation). F32_DOT: 16-bit operands as fp32, the same values (the
    interpreter's tl.dot multiplies 16-bit floats' bit patterns)."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def query_parts(q_ptr, g_ptr, recv, recv_ok, d, DTYPE: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                W: tl.constexpr):
    """The folded queries as three 16-bit terms of DTYPE whose sum they are to within 2^-24 (bf16: 8 + 8 + 8
    significant bits): CHUNKS tuples of three (W, R, CHUNK // W) tiles, made once per program (Triton keeps them
    in shared memory, where the products read them)."""
    out = ()
    for c in tl.static_range(CHUNKS):
        rest = queries_chunk(q_ptr, g_ptr, recv, recv_ok, c, d, CHUNK, W)
        hi = rest.to(DTYPE)
        rest = rest - hi.to(tl.float32)
        mid = rest.to(DTYPE)
        out = out + ((hi, mid, (rest - mid.to(tl.float32)).to(DTYPE)),)
    return out


@triton.jit
def dot_split(a, b, acc, SPLIT_A: tl.constexpr, PARTS: tl.constexpr, F32_DOT: tl.constexpr):
    """acc + a @ b in fp32 on tensor cores: one operand of 16-bit values (exact in them), the other fp32
    (a if SPLIT_A) split into PARTS 16-bit terms (x = x_1 + x_2 + ...: bf16's 8-bit significands, 3 parts to
    within 2^-24 of x, 2 to 2^-16), one product each."""
    rest = a if SPLIT_A else b
    for k in tl.static_range(PARTS):
        part = rest.to(b.dtype if SPLIT_A else a.dtype)
        acc = mma(part, b, acc, F32_DOT) if SPLIT_A else mma(a, part, acc, F32_DOT)
        rest = rest - part.to(tl.float32)
    return acc


@triton.jit
def block_rows(addresses, lo, first, hi, start, d, DTYPE: tl.constexpr, CB: tl.constexpr, CHUNK: tl.constexpr,
               CHUNKS: tl.constexpr, W: tl.constexpr):
    """One token row of bf16 sources lo .. lo + CB (those in [first, hi) real) as CB columns, CHUNKS tiles
    (W, CHUNK // W, CB), and which columns are real."""
    ptrs, ok = source_block(addresses, lo, first, hi, DTYPE, CB)
    s = ()
    for c in tl.static_range(CHUNKS):
        s = s + (load_chunk(ptrs, start, c, d, CHUNK, W),)
    return s, ok


@triton.jit
def source_pointer(addresses, i, DTYPE: tl.constexpr):
    """Source i of the table (addresses: all of them, loaded once) as a pointer of DTYPE, taken from registers."""
    at = tl.sum(tl.where(tl.arange(0, addresses.shape[0]) == i, addresses, 0))
    return tl.multiple_of(at.to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def part_columns(ptr, start, c, d, CB: tl.constexpr, CHUNK: tl.constexpr, W: tl.constexpr):
    """Chunk c of one token row (at element `start`) of an fp32 or fp16 source as three bf16 columns whose sum it is
    exactly (8 + 8 + 8 significant bits), columns 0..2 of a (W, CHUNK // W, CB) tile, the others 0 (column 0 is the
    source's logit's and weight's); and the chunk itself in fp32, (W, CHUNK // W, 1)."""
    col = tl.arange(0, CB)[None, None, :]
    cols = chunk_cols(c, CHUNK, W)                                            # (W, K, 1)
    x = tl.load(ptr + start + cols, mask=cols < d, other=0.0).to(tl.float32)
    hi = x.to(tl.bfloat16)
    mid = (x - hi.to(tl.float32)).to(tl.bfloat16)
    low = (x - hi.to(tl.float32) - mid.to(tl.float32)).to(tl.bfloat16)
    return tl.where(col == 0, hi, tl.where(col == 1, mid, tl.where(col == 2, low, 0.0))).to(tl.bfloat16), x


@triton.jit
def parts_rows(addresses, i, start, d, DTYPE: tl.constexpr, CB: tl.constexpr, CHUNK: tl.constexpr,
               CHUNKS: tl.constexpr, W: tl.constexpr):
    """One token row of source i (fp32 or fp16) as CHUNKS tiles of part_columns (fold_block's PARTS = 3)."""
    ptr = source_pointer(addresses, i, DTYPE)
    s = ()
    for c in tl.static_range(CHUNKS):
        s = s + (part_columns(ptr, start, c, d, CB, CHUNK, W)[0],)
    return s


@triton.jit
def fold_block(s, ok, u, m, l, acc, d, eps, PARTS: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
               W: tl.constexpr, F32_DOT: tl.constexpr):
    """Fold a block of one token row's sources (block_rows: s, ok; u: query_parts) into its online-softmax
    state (m, l: (R,); acc: CHUNKS tiles (W, CHUNK // W, R), the read-out transposed) on tensor cores, each of W
    warps over its slice of every chunk: Z^T = rstd (U S^T) (R, CB), then acc = acc exp(m - m') + S^T P.
    PARTS = 3: columns 0..2 are the parts of one source (column 0 real), whose logit and square are those of their
    sum and whose weight is its; the other columns are sources as they are. Both
    products take the block as S^T, as it is loaded: the software pipeline stages it in shared memory for both
    (a load used both as it is and transposed is not staged)."""
    CB: tl.constexpr = s[0].shape[2]
    R: tl.constexpr = u[0][0].shape[1]
    z = tl.zeros((W, R, CB), tl.float32)
    squares = tl.zeros((W, CHUNK // W, CB), tl.float32)    # the sources' squares, summed over the chunks
    i = tl.arange(0, CB)
    parts = i < PARTS
    for c in tl.static_range(CHUNKS):
        for k in tl.static_range(3):
            z = mma(u[c][k], s[c], z, F32_DOT)
        x = s[c].to(tl.float32)
        if PARTS > 1:             # columns 0 .. PARTS - 1: one source's parts, whose sum is its value
            value = tl.sum(tl.where(parts[None, None, :], x, 0.0), axis=2)[:, :, None]
            x = tl.where(parts[None, None, :], value, x)
        squares += x * x
    squares = tl.sum(tl.sum(squares, axis=1), axis=0)
    z = tl.sum(z, axis=0)                                                  # (R, CB)
    if PARTS > 1:
        z = tl.where(i[None, :] == 0, tl.sum(tl.where(parts[None, :], z, 0.0), axis=1)[:, None], z)
    z = tl.where(ok[None, :], z * tl.rsqrt(squares / d + eps)[None, :], float("-inf"))
    m_new = tl.maximum(m, tl.max(z, axis=1))
    alpha = tl.exp(m - m_new)             # rescales what was accumulated under the old max
    p = tl.exp(z - m_new[:, None])        # (R, CB)
    l = l * alpha + tl.sum(p, axis=1)
    if PARTS > 1:             # the parts' columns all weighted as the source (column 0)
        p = tl.where(parts[None, :], tl.sum(tl.where(i[None, :] == 0, p, 0.0), axis=1)[:, None], p)
    p = tl.broadcast_to(tl.trans(p)[None, :, :], (W, CB, R))
    out = ()
    for c in tl.static_range(CHUNKS):
        out = out + (dot_split(s[c], p, acc[c] * alpha[None, None, :], False, 2, F32_DOT),)
    return m_new, l, out


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
def walk_step(it, blocks, first, M, NC: tl.constexpr, CB: tl.constexpr):
    """Step `it` of a program's walk over (token row, block of CB sources) pairs, rows program_id // NC, +
    num_programs // NC, ... and blocks from source `first`: the row (past the last: M - 1, read and not written),
    whether it is real, and the block's first source. One loop over the pairs, not a loop over blocks in a loop over
    rows, so that its software pipeline loads the next rows' blocks while one is worked on (a row of Delta Block
    has a block or two)."""
    k = it // tl.maximum(blocks, 1)            # (a run of no sources: no steps, but its first rows are prefetched)
    row = tl.program_id(0) // NC + k * (tl.num_programs(0) // NC)
    return tl.minimum(row, M - 1), row < M, first + (it - k * blocks) * CB


@triton.jit
def program_start(table, n_a, n_b, r0, n_recv, R: tl.constexpr, C_MAX: tl.constexpr, NC: tl.constexpr):
    """What a program of _group_logits or _group_bwd starts from: its column chunk c, the row's C sources, the
    pass's receivers r0 + [0, R) and which of them are real (< n_recv), and the table's addresses, loaded once."""
    c = tl.program_id(0) % NC
    C = n_a + n_b
    recv = r0 + tl.arange(0, R)
    j = tl.arange(0, C_MAX)
    return c, C, recv, recv < n_recv, tl.load(table + j, mask=j < C, other=0)
