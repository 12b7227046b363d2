"""Triton kernels for Eq. 1 (depth routing), forward and backward, behind router.depth_route's signature.

Per token (a row of d values), with u = query * norm_weight (the query and norm weight fold into one vector):

    rstd_i = rsqrt(mean(s_i^2) + eps)       e_i = rstd_i (s_i . u)       r = sum_i softmax_i(e) s_i

Memory-lean by construction:
- the sources are read in place through a table of their addresses (no stacked copy of the N sources);
- the forward is one pass with an online softmax and saves only the log-sum-exp per token (4 bytes/token);
- the backward recomputes the normalised keys: pass 1 gets D = grad . r = sum_i a_i (grad . s_i), pass 2
  writes each source's gradient and accumulates the query's.

Besides the N sources the kernels take two optional extras, used by the model's fused path (kernels/lean.py):
a "difference" source h - base (Delta Block's partial block, recomputed from two tensors that are saved
anyway instead of being saved itself) and a null source (an all-zero source: logit 0, value 0, never stored).

Everything accumulates in fp32; d need not be a power of two. Sources may be fp32, bf16 or fp16, and may mix
two of these (under autocast the embedding is fp32 and the sublayer outputs bf16): the kernels read them
through one address table per dtype. The read-out has sources[0]'s dtype, as in the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# The kernels are written flat (no @triton.jit helpers): under TRITON_INTERPRET every helper call costs
# milliseconds, which the CPU test budget cannot afford. Candidate i is read, for i < n_a, through table_a
# (element type of like_a), for n_a <= i < n_a + n_b through table_b (like_b), and the last one, when
# HAS_DIFF, is h - base. n_total counts them all.

@triton.jit
def _route_fwd(table_a, like_a, n_a, table_b, like_b, n_b, h_ptr, base_ptr, u_ptr, out_ptr, lse_ptr,
               n_total, M, d, eps, HAS_NULL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < d)[None, :]
    offs = rows.to(tl.int64)[:, None] * d + cols[None, :]                  # (BLOCK_M, BLOCK_D)
    u = tl.load(u_ptr + cols, mask=cols < d, other=0.0)                     # (BLOCK_D,) fp32 folded query
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)                      # running max of the logits
    l = tl.zeros((BLOCK_M,), tl.float32)                                    # running sum of exp(e - m)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)                          # running sum of exp(e - m) s
    for i in range(n_total):
        if i < n_a:
            ptr_a = tl.load(table_a + i).to(tl.pointer_type(like_a.dtype.element_ty))
            s = tl.load(ptr_a + offs, mask=mask, other=0.0).to(tl.float32)
        elif i < n_a + n_b:
            ptr_b = tl.load(table_b + (i - n_a)).to(tl.pointer_type(like_b.dtype.element_ty))
            s = tl.load(ptr_b + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            s = (tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                 - tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32))
        e = tl.sum(s * u[None, :], axis=1) * tl.rsqrt(tl.sum(s * s, axis=1) / d + eps)   # (BLOCK_M,) logit
        m_new = tl.maximum(m, e)
        alpha = tl.exp(m - m_new)         # rescales what was accumulated under the old max
        p = tl.exp(e - m_new)
        l = l * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * s
        m = m_new
    if HAS_NULL:                          # logit 0, value 0: only the normaliser changes
        m_new = tl.maximum(m, 0.0)
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.exp(-m_new)
        acc = acc * alpha[:, None]
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + rows, m + tl.log(l), mask=row_ok)


@triton.jit
def _route_bwd(table_a, grads_a, like_a, n_a, table_b, grads_b, like_b, n_b, h_ptr, base_ptr, dpart_ptr,
               u_ptr, go_ptr, lse_ptr, D_ptr, du_ptr, n_total, M, d, eps,
               HAS_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < d)[None, :]
    offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
    u = tl.load(u_ptr + cols, mask=cols < d, other=0.0)
    go = tl.load(go_ptr + offs, mask=mask, other=0.0).to(tl.float32)       # (BLOCK_M, BLOCK_D) dL/dr
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    # pass 1: D = go . r = sum_i a_i (go . s_i), the softmax backward's shared term (the null source adds 0);
    # skipped when the caller has r at hand and passes D
    if HAS_D:
        D = tl.load(D_ptr + rows, mask=row_ok, other=0.0)
    else:
        D = tl.zeros((BLOCK_M,), tl.float32)
    for i in range(0 if HAS_D else n_total):
        if i < n_a:
            ptr_a = tl.load(table_a + i).to(tl.pointer_type(like_a.dtype.element_ty))
            s = tl.load(ptr_a + offs, mask=mask, other=0.0).to(tl.float32)
        elif i < n_a + n_b:
            ptr_b = tl.load(table_b + (i - n_a)).to(tl.pointer_type(like_b.dtype.element_ty))
            s = tl.load(ptr_b + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            s = (tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                 - tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32))
        e = tl.sum(s * u[None, :], axis=1) * tl.rsqrt(tl.sum(s * s, axis=1) / d + eps)
        D += tl.exp(e - lse) * tl.sum(go * s, axis=1)
    # pass 2, keys recomputed: a = exp(e - lse); de = a (go . s - D); ds = a go + de rstd (u - e rstd s / d);
    # du = sum over rows and sources of de rstd s
    du = tl.zeros((BLOCK_D,), tl.float32)
    for i in range(n_total):
        if i < n_a:
            ptr_a = tl.load(table_a + i).to(tl.pointer_type(like_a.dtype.element_ty))
            s = tl.load(ptr_a + offs, mask=mask, other=0.0).to(tl.float32)
        elif i < n_a + n_b:
            ptr_b = tl.load(table_b + (i - n_a)).to(tl.pointer_type(like_b.dtype.element_ty))
            s = tl.load(ptr_b + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            s = (tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                 - tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32))
        rstd = tl.rsqrt(tl.sum(s * s, axis=1) / d + eps)
        e = tl.sum(s * u[None, :], axis=1) * rstd
        a = tl.exp(e - lse)
        de_rstd = a * (tl.sum(go * s, axis=1) - D) * rstd
        ds = a[:, None] * go + de_rstd[:, None] * (u[None, :] - (e * rstd / d)[:, None] * s)
        du += tl.sum(de_rstd[:, None] * s, axis=0)
        if i < n_a:
            gptr_a = tl.load(grads_a + i).to(tl.pointer_type(like_a.dtype.element_ty))
            tl.store(gptr_a + offs, ds.to(like_a.dtype.element_ty), mask=mask)
        elif i < n_a + n_b:
            gptr_b = tl.load(grads_b + (i - n_a)).to(tl.pointer_type(like_b.dtype.element_ty))
            tl.store(gptr_b + offs, ds.to(like_b.dtype.element_ty), mask=mask)
        else:
            tl.store(dpart_ptr + offs, ds.to(dpart_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + pid * BLOCK_D + cols, du)                            # one partial sum per program


# ---------------------------------------------------------------------------------------------- launchers

def _interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_route_fwd, InterpretedFunction)


def _check(sources: list[Tensor], query: Tensor, norm_weight: Tensor,
           diff: tuple[Tensor, Tensor] | None) -> list[Tensor]:
    """Validate the inputs; return the sources made contiguous (a copy only of those that are not)."""
    if not sources:
        raise ValueError("depth_route needs at least one source")
    first = sources[0]
    if first.dim() != 3:
        raise ValueError(f"sources must be (B, T, d); got a source of shape {tuple(first.shape)}")
    named = [(f"sources[{i}]", s) for i, s in enumerate(sources)]
    named += [("diff[0]", diff[0]), ("diff[1]", diff[1])] if diff is not None else []
    for name, t in named:
        if t.shape != first.shape or t.device != first.device:
            raise ValueError(f"{name} is {tuple(t.shape)} on {t.device}; every source must match sources[0]: "
                             f"{tuple(first.shape)} on {first.device}")
        if t.dtype not in DTYPES:
            raise ValueError(f"the depth-routing kernels take sources of dtype {', '.join(map(str, DTYPES))}; "
                             f"{name} is {t.dtype} (the reference router.depth_route takes any float dtype)")
    if len({s.dtype for s in sources}) > 2:
        raise ValueError(f"the sources mix {len({s.dtype for s in sources})} dtypes; the kernels read at most two")
    d = first.shape[-1]
    if query.shape != (d,) or norm_weight.shape != (d,):
        raise ValueError(f"query {tuple(query.shape)} and norm_weight {tuple(norm_weight.shape)} must be ({d},)")
    if first.device.type == "cpu" and not _interpreting():
        raise RuntimeError("the Triton kernels got CPU tensors: set TRITON_INTERPRET=1 before importing triton "
                           "to run them on CPU, or use kernel='reference'")
    return [s.contiguous() for s in sources]


def _groups(sources: list[Tensor]) -> tuple[list[int], list[int]]:
    """Indices of the sources with sources[0]'s dtype, and of the others (one other dtype at most)."""
    a = [i for i, s in enumerate(sources) if s.dtype == sources[0].dtype]
    return a, [i for i in range(len(sources)) if i not in set(a)]


def _blocks(M: int, d: int) -> tuple[int, int, int]:
    """BLOCK_D covers a whole row (the norm needs it); BLOCK_M rows per program keep ~8K fp32 in flight on a
    GPU. The interpreter runs programs one after another but each as whole numpy arrays: there, fewer and
    larger programs are much faster."""
    block_d = triton.next_power_of_2(d)
    if _interpreting():
        return min(triton.next_power_of_2(M), 256), block_d, 4
    return max(1, min(64, 8192 // block_d)), block_d, 8 if block_d >= 2048 else 4


def _table(tensors: list[Tensor], device: torch.device) -> Tensor:
    """(len,) int64 addresses; an empty group gets a one-entry table that the kernel never reads. On a GPU the
    table goes up from pinned memory without blocking, so the host keeps queueing work."""
    table = torch.tensor([t.data_ptr() for t in tensors] or [0], dtype=torch.int64)
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table


def route_forward(sources: list[Tensor], query: Tensor, norm_weight: Tensor, eps: float,
                  diff: tuple[Tensor, Tensor] | None = None, null: bool = False,
                  out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """r (B, T, d) in out_dtype (default sources[0]'s dtype) and the softmax's log-sum-exp (B*T,) fp32.

    The candidates are `sources`, then diff[0] - diff[1] if given, then a zero source if `null`."""
    sources = _check(sources, query, norm_weight, diff)
    first, dev = sources[0], sources[0].device
    M, d = first.numel() // first.shape[-1], first.shape[-1]
    a, b = _groups(sources)
    src_a, src_b = [sources[i] for i in a], [sources[i] for i in b]
    h, base = (diff[0].contiguous(), diff[1].contiguous()) if diff is not None else (first, first)
    u = (query.float() * norm_weight.float()).contiguous()                 # (d,) folded query
    out = torch.empty_like(first, dtype=out_dtype or first.dtype)
    lse = torch.empty(M, dtype=torch.float32, device=dev)
    block_m, block_d, warps = _blocks(M, d)
    _route_fwd[(triton.cdiv(M, block_m),)](
        _table(src_a, dev), first, len(a), _table(src_b, dev), (src_b or src_a)[0], len(b), h, base, u, out, lse,
        len(sources) + (diff is not None), M, d, eps,
        HAS_NULL=null, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps)
    return out, lse


def route_backward(sources: list[Tensor], query: Tensor, norm_weight: Tensor, eps: float, grad_out: Tensor,
                   lse: Tensor, diff: tuple[Tensor, Tensor] | None = None, D: Tensor | None = None
                   ) -> tuple[list[Tensor], Tensor | None, Tensor]:
    """Gradients of the sources (each in its dtype), of the difference source (None without one) and of
    u = query * norm_weight (fp32 (d,)). The null source has no gradient; its weight is in lse.

    D (B*T,) fp32, if given, is grad_out . r per token: one read of the sources fewer."""
    sources = _check(sources, query, norm_weight, diff)
    first, dev = sources[0], sources[0].device
    M, d = first.numel() // first.shape[-1], first.shape[-1]
    a, b = _groups(sources)
    src_a, src_b = [sources[i] for i in a], [sources[i] for i in b]
    grads = [torch.empty_like(s) for s in sources]
    h, base = (diff[0].contiguous(), diff[1].contiguous()) if diff is not None else (first, first)
    dpart = torch.empty_like(h) if diff is not None else first
    u = (query.float() * norm_weight.float()).contiguous()
    block_m, block_d, warps = _blocks(M, d)
    grid = triton.cdiv(M, block_m)
    du = torch.empty(grid, block_d, dtype=torch.float32, device=dev)
    _route_bwd[(grid,)](
        _table(src_a, dev), _table([grads[i] for i in a], dev), first, len(a),
        _table(src_b, dev), _table([grads[i] for i in b], dev), (src_b or src_a)[0], len(b),
        h, base, dpart, u, grad_out.contiguous(), lse, lse if D is None else D.contiguous(), du,
        len(sources) + (diff is not None), M, d, eps,
        HAS_D=D is not None, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps)
    return grads, (dpart if diff is not None else None), du.sum(0)[:d]


# ---------------------------------------------------------------------------------------- autograd + public

class DepthRoute(torch.autograd.Function):
    """Eq. 1 with the kernels; saves the sources by reference and the per-token log-sum-exp only."""

    @staticmethod
    def forward(ctx, query: Tensor, norm_weight: Tensor, eps: float, *sources: Tensor) -> Tensor:
        out, lse = route_forward(list(sources), query, norm_weight, eps)
        ctx.save_for_backward(query, norm_weight, lse, *sources)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        query, norm_weight, lse, *sources = ctx.saved_tensors
        grads, _, du = route_backward(sources, query, norm_weight, ctx.eps, grad_out, lse)
        # e = rstd * sum_k s_k w_k g_k: dL/dw = du * g, dL/dg = du * w
        return ((du * norm_weight.float()).to(query.dtype), (du * query.float()).to(norm_weight.dtype), None,
                *grads)


def depth_route(sources: list[Tensor], query: Tensor, norm_weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Eq. 1 on the Triton kernels. sources: N tensors (B, T, d); query, norm_weight: (d,) -> (B, T, d).

    Same signature and result as router.depth_route (accumulation in fp32, output in the sources' dtype)."""
    return DepthRoute.apply(query, norm_weight, eps, *sources)
