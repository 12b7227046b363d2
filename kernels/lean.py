"""The model's memory-lean routing path: the depth read fused with the sublayer's pre-norm.

The reference path (router.DepthState) computes, per receiving sublayer,

    x = h~ + g r   (additive, Eq. 2)   or   x = r   (replacement, AttnRes)        y = RMSNorm_w(x)

and autograd saves whatever every op needs: the stacked sources, the partial block (a fresh (B, T, d) tensor
per sublayer in Delta Block), x and its normalised form. `RoutedNorm` computes y in one autograd node that
saves only tensors which exist anyway (the stream h~, the committed sources, the stream at the block start)
plus 4 bytes per token, and recomputes r, x and the norm in backward. The recomputed r also gives the
softmax's shared term, so the backward reads the sources twice, as a backward that saved r would.
Delta Block's partial block is passed as the difference h~ - base (base = the stream at the block start, or
the last source for the paper's formula), so it is never stored; the null source is a flag, never a tensor
of zeros.

`LeanDepthState` is router.DepthState with those fused reads; model.Model picks it (the one dispatch point,
model.uses_kernel) for CUDA tensors or when ModelConfig.kernel == "triton".
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from kernels.depth_route import route_backward, route_forward
from router import DepthState, Router, rms_norm


def _mix(h: Tensor | None, gate: Tensor | None, r: Tensor) -> Tensor:
    """x = r (replacement, h None), h + r, or h + gate * r: the same ops as DepthState.input."""
    if h is None:
        return r
    return h + (r if gate is None else gate * r)


class RoutedNorm(torch.autograd.Function):
    """y = RMSNorm_weight(x), x = _mix(h, gate, r), r = Eq. 1 over sources [+ (h - base)] [+ a zero source]."""

    @staticmethod
    def forward(ctx, h: Tensor | None, base: Tensor | None, query: Tensor, norm_weight: Tensor,
                gate: Tensor | None, weight: Tensor, eps: float, norm_eps: float, null: bool,
                *sources: Tensor) -> Tensor:
        diff = (h, base) if base is not None else None
        r, lse = route_forward(list(sources), query, norm_weight, eps, diff, null)   # (B, T, d), (B*T,)
        y = rms_norm(_mix(h, gate, r), weight, norm_eps)
        ctx.save_for_backward(h, base, query, norm_weight, gate, weight, lse, *sources)
        ctx.eps, ctx.norm_eps, ctx.null = eps, norm_eps, null
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        h, base, query, norm_weight, gate, weight, lse, *sources = ctx.saved_tensors
        diff = (h, base) if base is not None else None
        # r is recomputed, not saved; in fp32, so that D = dL/dr . r below is as exact as the kernel's own
        r32, _ = route_forward(sources, query, norm_weight, ctx.eps, diff, ctx.null, out_dtype=torch.float32)
        r = r32.to(sources[0].dtype)      # what the forward mixed in
        # the mix and the norm are a few elementwise ops: rerun them under autograd for their gradients
        leaves = {name: t.detach().requires_grad_() for name, t in
                  (("r", r), ("h", h), ("gate", gate), ("weight", weight)) if t is not None}
        with torch.enable_grad():
            y = rms_norm(_mix(leaves.get("h"), leaves.get("gate"), leaves["r"]), leaves["weight"], ctx.norm_eps)
            grads = dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), dy)))
        D = (grads["r"].float() * r32).sum(-1).flatten()                   # (B*T,) the softmax's shared term
        dsources, dpart, du = route_backward(sources, query, norm_weight, ctx.eps, grads["r"], lse, diff, D)
        dh = grads.get("h")
        dbase = None
        if dpart is not None:             # the partial is h - base
            dh, dbase = dh + dpart, -dpart
        # e = rstd * sum_k s_k w_k g_k: dL/dw = du * g, dL/dg = du * w
        dquery = (du * norm_weight.float()).to(query.dtype)
        dnorm_weight = (du * query.float()).to(norm_weight.dtype)
        return (dh, dbase, dquery, dnorm_weight, grads.get("gate"), grads["weight"], None, None, None,
                *dsources)


def routed_norm(h: Tensor | None, sources: list[Tensor], router: Router, norm: nn.Module, eps: float,
                base: Tensor | None = None, null: bool = False) -> Tensor:
    """RMSNorm_norm(h + gate r) (or RMSNorm(r) when h is None), r read over `sources`, then h - base if base
    is given, then a zero source if `null`. h, base, sources: (B, T, d) -> (B, T, d)."""
    return RoutedNorm.apply(h, base, router.query, router.norm_weight, router.gate, norm.weight, eps, norm.eps,
                            null, *sources)


class LeanDepthState(DepthState):
    """DepthState whose reads, when given the sublayer's pre-norm, go through `routed_norm`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.block_start = self.h         # (B, T, d) h~ at the last commit: the partial is h~ - block_start

    def commit(self) -> None:
        n = len(self.sources)
        super().commit()
        if len(self.sources) > n:
            self.block_start = self.h

    def fused_read(self, router: Router, norm: nn.Module, additive: bool) -> Tensor:
        if self.observer is not None:
            self.observer(self.l, self.candidates(router), router)
        sources, base, null = list(self.sources), None, self.policy.null_source
        if null and router.null is not None:   # a learned null source is an ordinary source to the kernels
            sources, null = sources + [router.null.expand_as(self.h)], False
        if self.partial is not None and self.policy.include_partial:
            if not additive:              # replacement keeps no stream to subtract from: pass the partial
                sources.append(self.new_source())
            else:
                base = self.sources[-1] if self.policy.block_source == "paper" else self.block_start
        return routed_norm(self.h if additive else None, sources, router, norm, self.eps, base, null)

    def input(self, norm: nn.Module | None = None) -> Tensor:
        if norm is None or not self.reads():
            return super().input(norm)
        self.commit()
        return self.fused_read(self.router(), norm, additive=self.policy.read == "add")

    def output(self, norm: nn.Module | None = None) -> Tensor:
        if norm is None or not self.policy.final_read:
            return super().output(norm)
        return self.fused_read(self.router(), norm, additive=False)
