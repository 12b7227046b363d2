"""Phase 1's backward on tensor cores: the committed sources' gradients summed over a group's receivers, and the
committed part of each receiver's du (the equations: depth_kernels/group_read.py's docstring).

Per token row this is a small attention's backward. With S the row's committed sources (C x d), U the R = 8
receivers' folded queries, Go their gradients of the read-out (R x d, phase 2 wrote them), D = go . r and lse
per receiver:

    Z = rstd (U S^T)     G = Go S^T                                   (R x C: K = d, the logits' and go's dots)
    A = exp(Z - lse)     W = A (G - D) rstd                           (per receiver and source, on the CUDA cores)
    dS = A^T Go + W^T U - shrink S,  shrink_i = rstd_i / d sum_r W_ri Z_ri        (C x d: K = R + R = 16)
    du = W S                                                          (R x d: K = C)

The first line needs whole rows (a dot over d), the others none: so two kernels, each a program per column chunk
of CHUNK columns and a share of the token rows (persistent: rows rp, rp + P, ...), so that a program holds only
its chunk of U and of its du, in registers, whatever d is, and the grid fills every SM several times over:

- `_group_logits`: per row and block of CB = 16 sources, the chunk's share of Z, G and the sources' squares
  (each chunk of a warp's columns one batched product, as group_tiles does for the forward), stored per chunk
  (a (NC, M, 2R + 1, C) fp32 buffer: 68 bytes per source row and chunk, 2.7 % of a bf16 row's at d = 1280);
- `_group_bwd`: per row and block, the chunks' shares summed into Z, G and rstd; A, W and shrink; then
  dS^T = [U; Go]^T [W; A] (the receivers' two rows interleaved: one K = 16 product) less shrink S, added into
  the sources' gradient accumulators, and du^T += S^T W^T.

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

from depth_kernels.group_tiles import chunk_cols, load_chunk, mma, queries_chunk, source_block
from depth_kernels.interpreter import interpreting
from depth_kernels.launch import SourceTable, _sm_count, cdiv, launch, register_budget

R_BLOCK = 8     # receivers a pass: [U; Go] is 16 rows, the K of dS's product
# Programs per SM each kernel is built for (meters/aot.py checks registers against it): a program holds a chunk
# of 256 columns of 8 receivers' U, Go and du (a few KB) and pipelines blocks of 16 source chunks.
PROGRAMS_PER_SM = {"_group_logits": 4, "_group_bwd": 3}


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
def _logits_block(addresses, lo, hi, start, c, u, go, part, C, d, DTYPE: tl.constexpr, CB: tl.constexpr,
                  CHUNK: tl.constexpr, W: tl.constexpr, F32_DOT: tl.constexpr):
    """Chunk c's share of Z, G ((R, CB) each) and the squares (CB,) of sources lo .. lo + CB (those < hi) at one
    row, stored at part (rows 0..R-1: Z, R..2R-1: G, 2R: squares; C apart)."""
    R: tl.constexpr = u[0].shape[1]
    ptrs, ok = source_block(addresses, lo, lo, hi, DTYPE, CB)
    s = load_chunk(ptrs, start, c, d, CHUNK, W)                              # (W, CHUNK // W, CB)
    sp = source_parts(s, DTYPE)
    z = tl.sum(dot_parts(u, sp, tl.zeros((W, R, CB), tl.float32), 3, F32_DOT), axis=0)
    g = tl.sum(dot_parts(go, sp, tl.zeros((W, R, CB), tl.float32), 3, F32_DOT), axis=0)
    x = s.to(tl.float32)
    squares = tl.sum(tl.sum(x * x, axis=1), axis=0)
    i = lo + tl.arange(0, CB)
    r = tl.arange(0, R)[:, None]
    tl.store(part + r * C + i[None, :], z, mask=ok[None, :])
    tl.store(part + (R + r) * C + i[None, :], g, mask=ok[None, :])
    tl.store(part + 2 * R * C + i, squares, mask=ok)


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv"])
def _group_logits(table, n_a, n_b, q_ptr, g_ptr, r0, n_recv, go_ptr, slab, part_ptr, M, d,
                  A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R: tl.constexpr, CB: tl.constexpr, C_MAX: tl.constexpr,
                  BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, NC: tl.constexpr, W: tl.constexpr,
                  STAGES: tl.constexpr, F32_DOT: tl.constexpr):
    """Per column chunk c = program_id % NC and token rows program_id // NC, + num_programs // NC, ...: the chunk's
    share of Z = U S^T (unscaled), G = Go S^T and the squares, for receivers r0 + [0, R) (those < n_recv), into
    part_ptr (NC, M, 2R + 1, C) with C = n_a + n_b. U's and each row's Go's chunk as three bf16 parts, (W, R, CHUNK
    // W) tiles; sources in blocks of CB, a pipeline STAGES // CB blocks deep. BLOCK_D = NC CHUNK."""
    c = tl.program_id(0) % NC
    C = n_a + n_b
    recv = r0 + tl.arange(0, R)
    recv_ok = recv < n_recv
    j = tl.arange(0, C_MAX)
    addresses = tl.load(table + j, mask=j < C, other=0)
    u = parts(queries_chunk(q_ptr, g_ptr, recv, recv_ok, c, d, CHUNK, W), 3)
    cols = tl.permute(chunk_cols(c, CHUNK, W), (0, 2, 1))                     # (W, 1, CHUNK // W)
    go_at = recv[None, :, None].to(tl.int64) * slab + cols
    go_ok = recv_ok[None, :, None] & (cols < d)
    for row in tl.range(tl.program_id(0) // NC, M, tl.num_programs(0) // NC):
        start = row * d.to(tl.int64)
        go = parts(tl.load(go_ptr + start + go_at, mask=go_ok, other=0.0).to(tl.float32), 3)
        part = part_ptr + ((c * M + row) * (2 * R + 1)).to(tl.int64) * C
        for a in tl.range(0, n_a, CB, num_stages=STAGES // CB):             # a loop per dtype: tiles.fold_source
            _logits_block(addresses, a, n_a, start, c, u, go, part, C, d, A_DTYPE, CB, CHUNK, W, F32_DOT)
        for b in tl.range(n_a, n_a + n_b, CB, num_stages=STAGES // CB):
            _logits_block(addresses, b, C, start, c, u, go, part, C, d, B_DTYPE, CB, CHUNK, W, F32_DOT)


@triton.jit
def _coefficients(part, lo, hi, D, lse, M, C, d, eps, R: tl.constexpr, CB: tl.constexpr, NC: tl.constexpr):
    """Sources lo .. lo + CB (those < hi) at one row, from the chunks' shares at part (chunk 0's; the next chunk's
    M (2R + 1) C further): Q = [W; A] interleaved per receiver ((2R, CB): rows 2r, 2r + 1 multiply U_r and Go_r),
    W^T (CB, R), shrink (CB,) and which sources are real."""
    i = lo + tl.arange(0, CB)
    ok = i < hi
    r = tl.arange(0, R)[:, None]
    z = tl.zeros((R, CB), tl.float32)
    g = tl.zeros((R, CB), tl.float32)
    squares = tl.zeros((CB,), tl.float32)
    for k in tl.static_range(NC):
        at = part + C.to(tl.int64) * (2 * R + 1) * M * k
        z += tl.load(at + r * C + i[None, :], mask=ok[None, :], other=0.0)
        g += tl.load(at + (R + r) * C + i[None, :], mask=ok[None, :], other=0.0)
        squares += tl.load(at + 2 * R * C + i, mask=ok, other=0.0)
    rstd = tl.rsqrt(squares / d + eps)[None, :]
    z = z * rstd
    a = tl.where(ok[None, :], tl.exp(z - lse[:, None]), 0.0)     # 0 for receivers past the last (lse = inf)
    w = a * (g - D[:, None]) * rstd
    shrink = tl.sum(w * z, axis=0) * tl.reshape(rstd, (CB,)) / d
    q = tl.reshape(tl.permute(tl.join(w, a), (0, 2, 1)), (2 * R, CB))
    return q, tl.trans(w), shrink


@triton.jit
def _grad_block(addresses, lo, hi, start, cols, v, du, part, grad_ptr, grad_off, slab, accumulate, D, lse, M, C, d,
                eps, DTYPE: tl.constexpr, R: tl.constexpr, CB: tl.constexpr, NC: tl.constexpr,
                F32_DOT: tl.constexpr):
    """Sources lo .. lo + CB (those < hi) at one row and column chunk (cols, (CHUNK,)): dS added into (or written
    to) their accumulators, grad_ptr slots grad_off + i; du^T ((CHUNK, R)) returned with S^T W^T added."""
    q, wt, shrink = _coefficients(part, lo, hi, D, lse, M, C, d, eps, R, CB, NC)
    ptrs, ok = source_block(addresses, lo, lo, hi, DTYPE, CB)
    mask = (cols < d)[:, None]
    s = tl.load((ptrs + start)[None, :] + cols[:, None], mask=mask, other=0.0)   # (CHUNK, CB): S^T
    ds = dot_parts(v, parts(q, 2), -s.to(tl.float32) * shrink[None, :], 2, F32_DOT)
    du = dot_parts(source_parts(s, DTYPE), parts(wt, 2), du, 2, F32_DOT)
    at = grad_ptr + ((grad_off + lo + tl.arange(0, CB)).to(tl.int64) * slab + start)[None, :] + cols[:, None]
    mask = mask & ok[None, :]
    old = tl.load(at, mask=mask & (accumulate != 0), other=0.0).to(tl.float32)
    tl.store(at, (ds + old).to(grad_ptr.dtype.element_ty), mask=mask)
    return du


@triton.jit(do_not_specialize=["n_a", "n_b", "r0", "n_recv", "off_a", "off_b", "accumulate"])
def _group_bwd(table, n_a, n_b, q_ptr, g_ptr, r0, n_recv, go_ptr, D_ptr, lse_ptr, slab, part_ptr, acc_a_ptr, acc_b_ptr,
               off_a, off_b, du_ptr, accumulate, M, d, eps,
               A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R: tl.constexpr, CB: tl.constexpr, C_MAX: tl.constexpr,
               BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, NC: tl.constexpr, STAGES: tl.constexpr,
               F32_DOT: tl.constexpr):
    """Per column chunk c = program_id % NC and token rows program_id // NC, + num_programs // NC, ...: the
    committed sources' gradients (source i's into slot off_a + i of acc_a, or off_b + i - n_a of acc_b; written or
    added to) from _group_logits' shares at part_ptr, and the program's partial du (du_ptr (programs // NC, R, d),
    its chunk of row program_id // NC). [U; Go]^T's chunk in two bf16 parts, U's made once per program. D, lse:
    (n_recv, M)."""
    c = tl.program_id(0) % NC
    C = n_a + n_b
    recv = r0 + tl.arange(0, R)
    recv_ok = recv < n_recv
    j = tl.arange(0, C_MAX)
    addresses = tl.load(table + j, mask=j < C, other=0)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    at = recv[None, :] * d + cols[:, None]                                     # (CHUNK, R): U^T, Go^T
    ok = recv_ok[None, :] & (cols < d)[:, None]
    ut = tl.load(q_ptr + at, mask=ok, other=0.0).to(tl.float32) * tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
    go_at = recv[None, :].to(tl.int64) * slab + cols[:, None]
    du = tl.zeros((CHUNK, R), tl.float32)
    for row in tl.range(tl.program_id(0) // NC, M, tl.num_programs(0) // NC):
        start = row * d.to(tl.int64)
        got = tl.load(go_ptr + start + go_at, mask=ok, other=0.0).to(tl.float32)
        v = parts(tl.reshape(tl.join(ut, got), (CHUNK, 2 * R)), 2)             # (CHUNK, 2R): U_r, Go_r interleaved
        D = tl.load(D_ptr + recv * M + row, mask=recv_ok, other=0.0)
        lse = tl.load(lse_ptr + recv * M + row, mask=recv_ok, other=float("inf"))
        part = part_ptr + C.to(tl.int64) * (2 * R + 1) * row
        for a in tl.range(0, n_a, CB, num_stages=STAGES // CB):             # a loop per dtype: tiles.fold_source
            du = _grad_block(addresses, a, n_a, start, cols, v, du, part, acc_a_ptr, off_a, slab, accumulate, D, lse,
                             M, C, d, eps, A_DTYPE, R, CB, NC, F32_DOT)
        for b in tl.range(n_a, n_a + n_b, CB, num_stages=STAGES // CB):
            du = _grad_block(addresses, b, C, start, cols, v, du, part, acc_b_ptr, off_b - n_a, slab, accumulate, D,
                             lse, M, C, d, eps, B_DTYPE, R, CB, NC, F32_DOT)
    out = du_ptr + (tl.program_id(0) // NC * R * d).to(tl.int64) + tl.arange(0, R)[None, :] * d + cols[:, None]
    tl.store(out, du, mask=(cols < d)[:, None])


# ------------------------------------------------------------------------------------------ launching

def _registers(kernel: str) -> int:
    """The kernel's register limit on 4 warps, a multiple of 8 (ptxas allocates 8 a thread at a time: 170 would
    take 176 and let 2 programs share an SM, not 3)."""
    return register_budget(4, PROGRAMS_PER_SM[kernel]) // 8 * 8


@functools.cache   # a pure function of its arguments, asked at every launch
def backward_config(d: int) -> dict:
    """Both kernels' tiles at width d: R = 8 receivers a pass, blocks of CB = 16 sources (tl.dot's K >= 16 for du),
    chunks of CHUNK = 256 columns (512 where they divide d; 64 a warp: 128-bit loads) on 4 warps, STAGES = 32
    source chunks in flight (two blocks); the interpreter takes chunks of 64 and fp32 products (F32_DOT)."""
    chunk = 64 if interpreting() else 512 if d % 512 == 0 else 256
    nc = cdiv(d, chunk)
    return dict(R=R_BLOCK, CB=16, BLOCK_D=chunk * nc, CHUNK=chunk, NC=nc, STAGES=32, F32_DOT=interpreting(),
                num_warps=4, maxnreg=_registers("_group_bwd"))   # (the logits': its own)


def _rows_per_chunk(M: int, nc: int, kernel: str, device: torch.device) -> int:
    """Programs per column chunk: one wave of the kernel's programs over every SM (persistent), at most M; the
    interpreter's 3 (awkward: rows left over)."""
    if interpreting():
        return min(M, 3)
    return max(1, min(M, _sm_count(device) * PROGRAMS_PER_SM[kernel] // nc))


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
    cfg = backward_config(d)
    C, nc, n_recv = len(table.tensors), cfg["NC"], queries.shape[0]
    logits_rows, bwd_rows = (_rows_per_chunk(M, nc, kernel, first.device) for kernel in PROGRAMS_PER_SM)
    cfg = dict(cfg, C_MAX=max(16, triton.next_power_of_2(C)), **table.dtype_args())
    part = torch.empty(nc, M, 2 * R_BLOCK + 1, C, dtype=torch.float32, device=first.device)
    du = torch.empty(cdiv(n_recv, R_BLOCK), bwd_rows, R_BLOCK, d, dtype=torch.float32, device=first.device)
    acc_a, acc_b, off_a, off_b = accumulators
    n_a, n_b = table.n_a, C - table.n_a
    grads = [acc_a[off_a:off_a + n_a, :first.numel()], acc_b[off_b:off_b + n_b, :first.numel()]]
    common = dict(table=table.addresses, n_a=n_a, n_b=n_b, q_ptr=queries, g_ptr=norm_weights, n_recv=n_recv,
                  go_ptr=go, slab=go.shape[1], part_ptr=part, M=M, d=d, **cfg)
    for k, r0 in enumerate(range(0, n_recv, R_BLOCK)):     # receivers beyond R: the sources are read again
        chunk = min(R_BLOCK, n_recv - r0)
        inputs = [(table, 1), (queries[r0:r0 + chunk], 1), (norm_weights[r0:r0 + chunk], 1),
                  (go[r0:r0 + chunk, :first.numel()], 1)]
        launch(_group_logits, nc * logits_rows, lambda: (inputs, [part]), first.device,
               dict(common, r0=r0, W=4, maxnreg=_registers("_group_logits")))
        io = lambda: (inputs + [(part, 1), (D[r0:r0 + chunk], 1), (lse[r0:r0 + chunk], 1)]   # noqa: E731
                      + [(g, 1) for g in grads if accumulate or k], grads + [du[k]])
        launch(_group_bwd, nc * bwd_rows, io, first.device, dict(
            common, r0=r0, D_ptr=D, lse_ptr=lse, acc_a_ptr=acc_a, acc_b_ptr=acc_b, off_a=off_a, off_b=off_b,
            du_ptr=du[k], accumulate=int(accumulate or k > 0), eps=eps))
    return du.sum(1).flatten(0, 1)[:n_recv]
