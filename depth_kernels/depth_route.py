"""Triton kernels for Eq. 1 (depth routing), forward and backward, behind router.depth_route's signature.

Per token (a row of d values), with u = query * norm_weight (the query and norm weight fold into one vector):

    rstd_i = rsqrt(mean(s_i^2) + eps)       z_i = rstd_i (s_i . u)       r = sum_i softmax_i(z) s_i

Memory-lean by construction:
- the sources are read in place through a table of their addresses (no stacked copy of the N sources);
- the forward is one pass with an online softmax and saves only the log-sum-exp per token (4 bytes/token);
- the backward recomputes the normalised keys: pass 1 gets D = grad . r = sum_i a_i (grad . s_i), pass 2
  writes each source's gradient and accumulates the query's.

Everything accumulates in fp32; d need not be a power of two. Sources may be fp32, bf16 or fp16, and may mix
two of these (under autocast the embedding is fp32 and the sublayer outputs bf16): the launcher orders the
address table by dtype and the kernels run one loop per dtype, so no loop branches per source. The read-out
has sources[0]'s dtype, as in the reference.

Made for memory bandwidth on a GPU (tests/test_gpu_ready.py checks the compiled code for sm_90 on a CPU):
sources come through aligned address tables (depth_kernels/launch.py) as 128-bit loads; the loops over sources are
software-pipelined (tl.range(num_stages=...)), so the next source's tile is in flight while the current one is
reduced; rows per program and warps are chosen per width (`_config`) so that nothing spills at the paper's
widths. The jit helpers are depth_kernels/tiles.py's, shared with the model's grouped kernels (group_read.py,
receiver_read.py).
"""
from __future__ import annotations

import functools
import torch
import triton
import triton.language as tl
from torch import Tensor

from depth_kernels.interpreter import interpreting
from depth_kernels.launch import SourceTable, aligned, cdiv, launch, register_budget, row_tiles, source_table
from depth_kernels.tiles import (dot_source, folded_query, grad_source, read_table, row_cols, row_div, row_load,
                                 row_masks, row_offsets, row_own, row_store, row_zeros)

# -------------------------------------------------------------------------------------------- kernels

@triton.jit(do_not_specialize=["n_a", "n_b"])   # one compiled kernel for any number of sources
def _route_fwd(table, n_a, n_b, q_ptr, g_ptr, out_ptr, lse_ptr, M, d, eps,
               A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_T: tl.constexpr, STAGES: tl.constexpr):
    """table: n_a addresses of A_DTYPE sources, then n_b of B_DTYPE; q, g: the query and norm weight.
    Writes r (M, d) and lse (M,). Rows are split rows (depth_kernels/tiles.py) of BLOCK_D + BLOCK_T lanes."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols, own = row_cols(d, BLOCK_D, BLOCK_T)
    masks = row_masks(row_ok, own)
    offs = row_offsets(rows.to(tl.int64)[:, None] * d, cols)              # (BLOCK_M, width) per tile
    u = folded_query(q_ptr, g_ptr, cols, own)                              # one row, fp32
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)                      # running max of the logits
    l = tl.zeros((BLOCK_M,), tl.float32)                                    # running sum of exp(z - m)
    acc = row_zeros(BLOCK_M, cols)                                          # running sum of exp(z - m) s
    m, l, acc = read_table(table, n_a, n_b, offs, masks, u, d, eps, m, l, acc, A_DTYPE, B_DTYPE, STAGES)
    row_store(out_ptr, offs, row_div(acc, l), masks)
    tl.store(lse_ptr + rows, m + tl.log(l), mask=row_ok)


@triton.jit(do_not_specialize=["n_a", "n_b"])  # slab is a multiple of 16 elements: aligned gradient stores
def _route_bwd(table, n_a, n_b, grad_a_ptr, grad_b_ptr, slab, q_ptr, g_ptr, go_ptr, lse_ptr, du_ptr, M, d, eps,
               A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_T: tl.constexpr, STAGES: tl.constexpr):
    """table: the source addresses as in the forward. Writes the gradient of table entry i < n_a at
    grad_a_ptr + i slab and of entry n_a + j at grad_b_ptr + j slab, and this program's partial sum of dL/du
    (row program_id of du_ptr, (programs, d))."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols, own = row_cols(d, BLOCK_D, BLOCK_T)
    masks = row_masks(row_ok, own)
    offs = row_offsets(rows.to(tl.int64)[:, None] * d, cols)
    n = n_a + n_b
    u = folded_query(q_ptr, g_ptr, cols, own)
    go = row_load(go_ptr, offs, masks)                                     # (BLOCK_M, width) tiles of dL/dr
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    # pass 1: D = go . r = sum_i a_i (go . s_i), the softmax backward's shared term
    D = tl.zeros((BLOCK_M,), tl.float32)
    for i in tl.range(0, n_a, num_stages=STAGES):
        D += dot_source(table, i, A_DTYPE, offs, masks, go, u, lse, d, eps)
    for i in tl.range(n_a, n, num_stages=STAGES):
        D += dot_source(table, i, B_DTYPE, offs, masks, go, u, lse, d, eps)
    # pass 2, keys recomputed: each source's gradient, and du = sum over rows and sources of dz rstd s
    du = row_zeros(1, cols)
    for i in tl.range(0, n_a, num_stages=STAGES):
        du = grad_source(table, i, A_DTYPE, offs, masks, go, u, lse, D, d, eps, du, grad_a_ptr + i * slab, 0)
    for i in tl.range(n_a, n, num_stages=STAGES):
        du = grad_source(table, i, B_DTYPE, offs, masks, go, u, lse, D, d, eps, du, grad_b_ptr + (i - n_a) * slab, 0)
    row_store(du_ptr, row_offsets(pid.to(tl.int64) * d, cols), du, row_own(own))   # one partial sum per program


# ------------------------------------------------------------------------------------------ launching

def _check(table: SourceTable, query: Tensor, norm_weight: Tensor) -> None:
    d = table.tensors[0].shape[-1]
    if query.shape != (d,) or norm_weight.shape != (d,):
        raise ValueError(f"query {tuple(query.shape)} and norm_weight {tuple(norm_weight.shape)} must be ({d},)")


PROGRAMS_PER_SM = {"_route_fwd": 2, "_route_bwd": 2}   # what meters/aot.py checks registers against


@functools.cache   # a pure function of its arguments, asked at every launch
def _config(M: int, d: int, backward: bool = False) -> dict:
    """Tile and launch shape. A tile covers whole rows (the norm needs them), split where d is not a power of
    two (depth_kernels.launch.row_split). On a GPU, rows per program and warps are chosen per width so that each
    thread holds 16 fp32 values of a tile (8 at d > 2048, where the row alone is that many), and the source
    loop keeps the next tiles in flight: two more in the forward, one in the backward, which holds more tiles
    per source (checked: no spills at d = 768 .. 4096, meters/aot.py).
    The interpreter runs programs one after another but each as whole numpy arrays: there, fewer and larger
    programs are faster."""
    block_d = triton.next_power_of_2(d)       # one tile's lanes, for the rules above
    if interpreting():
        return dict(BLOCK_M=min(triton.next_power_of_2(M), 256), **row_tiles(d, 4), STAGES=1, num_warps=4)
    warps = 4 if block_d <= 1024 else 8
    block_m = max(1, min(16, 16 * 32 * warps // block_d))
    return dict(BLOCK_M=block_m, **row_tiles(d, warps), STAGES=2 if backward else 3, num_warps=warps,
                maxnreg=register_budget(warps, PROGRAMS_PER_SM["_route_bwd" if backward else "_route_fwd"]))


def _slabs(tensors: list[Tensor]) -> tuple[Tensor, int, list[Tensor]]:
    """One buffer for the gradients of same-dtype tensors: (buffer, slab stride in elements, views). Each
    gradient starts a multiple of 16 elements after the last, so every one is 16-byte aligned."""
    like = tensors[0]
    numel = like.numel()
    slab = cdiv(numel, 16) * 16
    buffer = torch.empty(len(tensors), slab, dtype=like.dtype, device=like.device)
    return buffer, slab, list(buffer[:, :numel].view(len(tensors), *like.shape).unbind(0))


def route_forward(table: SourceTable, query: Tensor, norm_weight: Tensor, eps: float,
                  out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """r (B, T, d) in out_dtype (default: the dtype of the caller's sources[0]) and the softmax's log-sum-exp
    (B*T,) fp32, over the table's sources."""
    _check(table, query, norm_weight)
    first = table.tensors[0]
    dev, M, d = first.device, first.numel() // first.shape[-1], first.shape[-1]
    out = torch.empty_like(first, dtype=out_dtype or first.dtype)
    lse = torch.empty(M, dtype=torch.float32, device=dev)
    cfg = _config(M, d)
    launch(_route_fwd, cdiv(M, cfg["BLOCK_M"]), lambda: ([(table, 1), (query, 1), (norm_weight, 1)], [out, lse]), dev,
           dict(table=table.addresses, n_a=table.n_a, n_b=len(table.tensors) - table.n_a, q_ptr=query,
                g_ptr=norm_weight, out_ptr=out, lse_ptr=lse, M=M, d=d, eps=eps, **table.dtype_args(), **cfg))
    return out, lse


def route_backward(table: SourceTable, query: Tensor, norm_weight: Tensor, eps: float, grad_out: Tensor,
                   lse: Tensor) -> tuple[list[Tensor], Tensor]:
    """Gradients of the sources (in the caller's order, each in its dtype) and of u = query * norm_weight
    (fp32 (d,))."""
    _check(table, query, norm_weight)
    first = table.tensors[0]
    dev, M, d = first.device, first.numel() // first.shape[-1], first.shape[-1]
    n_a = table.n_a
    grad_a, slab, grads = _slabs(table.tensors[:n_a])
    grad_b, _, grads_b = _slabs(table.tensors[n_a:]) if n_a < len(table.tensors) else (grad_a, 0, [])
    go = aligned(grad_out)
    cfg = _config(M, d, backward=True)
    grid = cdiv(M, cfg["BLOCK_M"])
    du = torch.empty(grid, d, dtype=torch.float32, device=dev)
    reads = [(table, 2), (go, 1), (lse, 1), (query, 1), (norm_weight, 1)]
    launch(_route_bwd, grid, lambda: (reads, grads + grads_b + [du]), dev, dict(
        table=table.addresses, n_a=n_a, n_b=len(table.tensors) - n_a, grad_a_ptr=grad_a, grad_b_ptr=grad_b, slab=slab,
        q_ptr=query, g_ptr=norm_weight, go_ptr=go, lse_ptr=lse, du_ptr=du, M=M, d=d, eps=eps, **table.dtype_args(),
        **cfg))
    return table.in_caller_order(grads + grads_b), du.sum(0)


# ---------------------------------------------------------------------------------------- autograd + public

class DepthRoute(torch.autograd.Function):
    """Eq. 1 with the kernels; saves the sources by reference and the per-token log-sum-exp only."""

    @staticmethod
    def forward(ctx, query: Tensor, norm_weight: Tensor, eps: float, *sources: Tensor) -> Tensor:
        table = source_table(list(sources))
        out, lse = route_forward(table, query, norm_weight, eps, out_dtype=sources[0].dtype)
        ctx.save_for_backward(query, norm_weight, lse, *sources)   # the table's tensors, by reference
        ctx.table, ctx.eps = table, eps
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        query, norm_weight, lse, *_ = ctx.saved_tensors
        grads, du = route_backward(ctx.table, query, norm_weight, ctx.eps, grad_out, lse)
        # z = rstd * sum_k s_k w_k g_k: dL/dw = du * g, dL/dg = du * w
        return ((du * norm_weight.float()).to(query.dtype), (du * query.float()).to(norm_weight.dtype), None,
                *grads)


def depth_route(sources: list[Tensor], query: Tensor, norm_weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Eq. 1 on the Triton kernels. sources: N tensors (B, T, d); query, norm_weight: (d,) -> (B, T, d).

    Same signature and result as router.depth_route (accumulation in fp32, output in the sources' dtype)."""
    return DepthRoute.apply(query, norm_weight, eps, *sources)
