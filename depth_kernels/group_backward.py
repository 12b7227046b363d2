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
A chunk's program walks (row, step) pairs in one loop, a step a block of CB = 16 bf16 sources or one fp32 or fp16
source, so that its software pipeline loads the next rows' steps while one is worked on (a Delta Block row has two):

- `_group_logits`: per step, the chunk's share of Z, G and the sources' squares (each warp's slice of the chunk
  one batched product, as group_tiles does for the forward; an fp32 or fp16 source as three bf16 columns of a
  block), stored per chunk (a (NC, M, 2R + 1, cp) fp32 buffer,
  each dtype's run from a 16-aligned column: 68 bytes per source row and chunk, 2.7 % of a bf16 row's at d = 1280);
- `_group_weights`: per row and block, the chunks' shares summed into Z, G and rstd, and A, W and shrink made into
  Q = [W; A] (the receivers' two rows interleaved), W^T and shrink (1.6 KB a row and block);
- `_group_bwd`: per bf16 step, dS^T = [U; Go]^T Q (one K = 16 product) less shrink S, added into the sources'
  gradient accumulators, and du^T += S^T W^T; an fp32 or fp16 source's step the same on the CUDA cores, in fp32
  (a block of 16 would load 16 sources for one). The next step's Go chunk and accumulators are read by hand while
  this one is worked on: the pipeline stages only loads whose values feed products.

Precision: the products take 16-bit operands and accumulate in fp32. A bf16 source is exact in one part; fp32 and
fp16 sources are split into three bf16 parts whose sum they are (8 + 8 + 8 bits), as are U and Go for Z and G,
whose products keep the terms of parts i + j < 3 (to some 2^-24 of |u| |s|, needed where G - D cancels);
dS and du's operands take two parts, terms i + j < 2 (2^-16, below the 16-bit rounding of what is trained on),
except an fp32 or fp16 source's, in fp32 on the CUDA cores.
The interpreter multiplies 16-bit bit patterns in tl.dot: there the parts go in as fp32 (F32_DOT), same values.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from depth_kernels.group_shares import _group_logits, _group_weights
from depth_kernels.group_tiles import dot_parts, parts, program_start, source_block, source_pointer, walk_step
from depth_kernels.interpreter import interpreting
from depth_kernels.launch import SourceTable, _sm_count, cdiv, launch, register_budget, source_steps

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
def _grad_rows(it, blocks, first, hi, cols, go_at, ok, go_ptr, grad_ptr, grad_off, slab, accumulate, M, d,
               DTYPE: tl.constexpr, NC: tl.constexpr, CB: tl.constexpr):
    """What step `it` reads that the software pipeline does not stage (its consumers are no products): the row's
    Go^T chunk ((CHUNK, R) fp32) and the step's sources' accumulators ((CHUNK, CB) fp32 for a bf16 block, (CHUNK, 1)
    for an fp32 or fp16 source; 0 unless accumulate). The loop asks for the next step's while it works on this one
    (a prefetch by hand)."""
    STEP: tl.constexpr = CB if DTYPE == tl.bfloat16 else 1
    row, live, lo = walk_step(it, blocks, first, M, NC, STEP)
    start = row * d.to(tl.int64)
    got = tl.load(go_ptr + start + go_at, mask=ok, other=0.0).to(tl.float32)
    at = grad_ptr + ((grad_off + lo + tl.arange(0, STEP)).to(tl.int64) * slab + start)[None, :] + cols[:, None]
    mask = (cols < d)[:, None] & ((lo + tl.arange(0, STEP) < hi) & live)[None, :]
    old = tl.load(at, mask=mask & (accumulate != 0), other=0.0).to(tl.float32)
    return got, old


@triton.jit
def _grad_step(addresses, it, blocks, first, hi, base, cols, ut, got, old, du, q_in, w_in, shrink_in, grad_ptr,
               grad_off, slab, M, cp, d, DTYPE: tl.constexpr, R: tl.constexpr, CB: tl.constexpr, NC: tl.constexpr,
               F32_DOT: tl.constexpr):
    """One step's sources (those < hi) at its row and column chunk (cols, (CHUNK,)), with the row's Go^T chunk and
    the accumulators' old values (_grad_rows) and _group_weights' Q, W^T and shrink: dS added to them and stored
    (grad_ptr slots grad_off + i); du^T ((CHUNK, R)) returned with S^T W^T added (none for a step past the last
    row, whose row is another program's). A bf16 step is a block of CB sources on tensor cores; an fp32 or fp16
    step one source on the CUDA cores (_grad_source)."""
    if DTYPE == tl.bfloat16:
        row, live, lo = walk_step(it, blocks, first, M, NC, CB)
        start = row * d.to(tl.int64)
        v = parts(tl.reshape(tl.join(ut, got), (ut.shape[0], 2 * R)), 2)      # (CHUNK, 2R): U_r, Go_r interleaved
        at = row.to(tl.int64) * (cp // CB) + (base + lo - first) // CB         # the step's block of weights
        iq = tl.arange(0, 2 * R)[:, None] * CB + tl.arange(0, CB)[None, :]
        iw = tl.arange(0, CB)[:, None] * R + tl.arange(0, R)[None, :]
        q = parts(tl.load(q_in + at * (2 * R * CB) + iq), 2)
        wt = parts(tl.load(w_in + at * (CB * R) + iw, mask=live, other=0.0), 2)
        shrink = tl.load(shrink_in + at * CB + tl.arange(0, CB))
        ptrs, real = source_block(addresses, lo, lo, hi, DTYPE, CB)
        mask = (cols < d)[:, None]
        s = tl.load((ptrs + start)[None, :] + cols[:, None], mask=mask, other=0.0)   # (CHUNK, CB): S^T
        ds = dot_parts(v, q, old - s.to(tl.float32) * shrink[None, :], 2, F32_DOT)
        du = dot_parts((s,), wt, du, 2, F32_DOT)
        at = grad_ptr + ((grad_off + lo + tl.arange(0, CB)).to(tl.int64) * slab + start)[None, :] + cols[:, None]
        tl.store(at, ds.to(grad_ptr.dtype.element_ty), mask=mask & (real & live)[None, :])
    else:
        du = _grad_source(addresses, it, blocks, first, base, cols, ut, got, old, du, q_in, shrink_in, grad_ptr,
                          grad_off, slab, M, cp, d, DTYPE, R, CB, NC)
    return du


@triton.jit
def _grad_source(addresses, it, sources, first, base, cols, ut, got, old, du, q_in, shrink_in, grad_ptr, grad_off,
                 slab, M, cp, d, DTYPE: tl.constexpr, R: tl.constexpr, CB: tl.constexpr, NC: tl.constexpr):
    """One fp32 or fp16 source's step (`sources` a row, one a step), on the CUDA cores in fp32: with its column of
    _group_weights' block (W's and A's rows of Q: w, a (R,); shrink), ds = U^T w + Go^T a + old - shrink s and
    du^T += s w^T. (A block of 16 on tensor cores loads 16 sources for this one and multiplies three bf16 parts.)"""
    row, live, i = walk_step(it, sources, first, M, NC, 1)
    start = row * d.to(tl.int64)
    column = base + i - first                                                 # its share column
    at = row.to(tl.int64) * (cp // CB) + column // CB                         # its block of weights
    r = tl.arange(0, R)
    w = tl.load(q_in + at * (2 * R * CB) + 2 * r * CB + column % CB)
    a = tl.load(q_in + at * (2 * R * CB) + (2 * r + 1) * CB + column % CB)
    shrink = tl.load(shrink_in + at * CB + column % CB)
    s = tl.load(source_pointer(addresses, i, DTYPE) + start + cols, mask=cols < d, other=0.0).to(tl.float32)
    ds = tl.sum(ut * w[None, :] + got * a[None, :], axis=1) + tl.sum(old, axis=1) - shrink * s
    tl.store(grad_ptr + (grad_off + i).to(tl.int64) * slab + start + cols, ds.to(grad_ptr.dtype.element_ty),
             mask=(cols < d) & live)
    return du + s[:, None] * tl.where(live, w, 0.0)[None, :]


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
    c, C, recv, recv_ok, addresses = program_start(table, n_a, n_b, r0, n_recv, R, C_MAX, NC)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    at = recv[None, :] * d + cols[:, None]                                     # (CHUNK, R): U^T, Go^T
    ok = recv_ok[None, :] & (cols < d)[:, None]
    ut = tl.load(q_ptr + at, mask=ok, other=0.0).to(tl.float32) * tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
    go_at = recv[None, :].to(tl.int64) * slab + cols[:, None]
    du = tl.zeros((CHUNK, R), tl.float32)
    # a loop per dtype (tiles.fold_source), each step with the next one's rows in flight (_grad_rows)
    steps = row_steps * a_blocks
    got, old = _grad_rows(0, a_blocks, 0, n_a, cols, go_at, ok, go_ptr, acc_a_ptr, off_a, slab, accumulate, M, d,
                          A_DTYPE, NC, CB)
    for it in tl.range(0, row_steps * a_blocks, num_stages=STAGES // CB):
        ahead = _grad_rows(tl.minimum(it + 1, steps - 1), a_blocks, 0, n_a, cols, go_at, ok, go_ptr, acc_a_ptr, off_a,
                           slab, accumulate, M, d, A_DTYPE, NC, CB)
        du = _grad_step(addresses, it, a_blocks, 0, n_a, 0, cols, ut, got, old, du, q_in, w_in, shrink_in, acc_a_ptr,
                        off_a, slab, M, cp, d, A_DTYPE, R, CB, NC, F32_DOT)
        got, old = ahead
    steps = row_steps * b_blocks
    got, old = _grad_rows(0, b_blocks, n_a, C, cols, go_at, ok, go_ptr, acc_b_ptr, off_b - n_a, slab, accumulate, M, d,
                          B_DTYPE, NC, CB)
    for it in tl.range(0, row_steps * b_blocks, num_stages=STAGES // CB):
        ahead = _grad_rows(tl.minimum(it + 1, steps - 1), b_blocks, n_a, C, cols, go_at, ok, go_ptr, acc_b_ptr,
                           off_b - n_a, slab, accumulate, M, d, B_DTYPE, NC, CB)
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
    per_step = source_steps(table, cfg["CB"])      # sources a step of each run, and C_MAX
    cfg = dict(cfg, C_MAX=per_step["C_MAX"], **_dtypes(table))
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
                  **cfg)
    # steps a row: a bf16 run's blocks, an fp32 or fp16 run's sources (one a step)
    common.update(a_blocks=cdiv(n_a, per_step["A_STEP"]), b_blocks=cdiv(n_b, per_step["B_STEP"]))
    for k, r0 in enumerate(range(0, n_recv, R_BLOCK)):     # receivers beyond R: the sources are read again
        chunk = min(R_BLOCK, n_recv - r0)
        inputs = [(table, 1), (queries[r0:r0 + chunk], 1), (norm_weights[r0:r0 + chunk], 1),
                  (go[r0:r0 + chunk, :first.numel()], 1)]
        launch(_group_logits, nc * logits_rows, lambda: (inputs, [part]), first.device,
               dict(common, r0=r0, part_ptr=part, W=WARPS["_group_logits"], row_steps=cdiv(M, logits_rows),
                    **_options("_group_logits")))
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
