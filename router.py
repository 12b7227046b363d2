"""Depth routing: Eq. 1 (a softmax over depth) and Eq. 2 (additive routing) of Delta Attention Residuals.

Read this file first, then model.py. Every sublayer l (attention or MLP) may read, per token, a convex mix
of earlier "sources" s_i (the embedding, earlier sublayer outputs, or sums of them over a block):

    e_i = w_l . RMSNorm_{g_l}(s_i)        keys are normalised sources, w_l a static learned query
    a_i = softmax_i(e_i)                  softmax over the N sources (the depth axis)
    r_l = sum_i a_i s_i                   values are the un-normalised sources

and uses the read-out r_l either additively (Eq. 2: h^_l = h~_l + g_l r_l, the stream h~ is kept) or as a
replacement (Kimi's AttnRes: h^_l = r_l). The five methods differ only in which sources exist, when a
source is committed, and how the read is used; `Policy` holds exactly those facts and `DepthState` runs
them, so the model's sublayer loop never branches on a method's name.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

METHODS = ("baseline", "attnres", "full_attnres", "delta", "delta_block")
BLOCK_SOURCES = ("boundary", "paper")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last axis, computed in (at least) fp32, returned in x's dtype, as Qwen3 does."""
    dtype = x.dtype
    x = x.to(torch.promote_types(dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def depth_weights(values: Tensor, query: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """a_i of Eq. 1. values: (N, B, T, d) stacked sources; query, norm_weight: (d,) -> (N, B, T)."""
    keys = rms_norm(values, norm_weight, eps)                    # (N, B, T, d)  RMSNorm_g(s_i)
    logits = keys @ query                                        # (N, B, T)     e_i = w . key_i
    return logits.softmax(dim=0)                                 # (N, B, T)     a_i, over depth


def depth_route(sources: list[Tensor], query: Tensor, norm_weight: Tensor, eps: float = 1e-6) -> Tensor:
    """The explicit reference of Eq. 1. sources: N tensors (B, T, d); query, norm_weight: (d,) -> (B, T, d).

    Accumulates in fp32 (float64 stays float64, for gradcheck). Every faster path is tested against this.
    """
    dtype = torch.promote_types(sources[0].dtype, torch.float32)
    values = torch.stack(sources).to(dtype)                      # (N, B, T, d)  s_i
    weights = depth_weights(values, query.to(dtype), norm_weight.to(dtype), eps)  # (N, B, T)
    out = (weights.unsqueeze(-1) * values).sum(dim=0)            # (B, T, d)     r = sum_i a_i s_i
    return out.to(sources[0].dtype)


class Router(nn.Module):
    """The parameters one receiving sublayer owns: a static query w_l, its own RMSNorm weight g_l, and an
    optional scalar gate. The query starts at zero (uniform weights); the gate starts at zero, which makes
    h^ = h~ + gate * r an exact identity at initialisation (the paper's zero query alone is not, PAPER.md §5).
    """

    def __init__(self, d_model: int, gate: bool):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d_model))
        self.norm_weight = nn.Parameter(torch.ones(d_model))
        self.gate = nn.Parameter(torch.zeros(())) if gate else None

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)
        nn.init.ones_(self.norm_weight)
        if self.gate is not None:
            nn.init.zeros_(self.gate)


@dataclass(frozen=True)
class Policy:
    """A method, as data.

    read:          "none" (plain pre-norm residual), "add" (Eq. 2) or "replace" (AttnRes).
    boundaries:    sublayer indices before which the current partial is committed as a new source.
                   Every index -> fine-grained (each output is a source); block starts -> block sources.
    block_source:  what is committed: "boundary" = the sum of outputs since the last boundary, which is
                   exactly h~_{tau_{b+1}} - h~_{tau_b}; "paper" = h~ - sources[-1] (the paper's Fig. 3).
    include_partial: the not-yet-committed partial is a source too (once its block has an output).
    null_source:   an extra all-zero source, so a receiver can choose to read nothing.
    final_read:    a last routing over every source produces the input of the final norm.
    """

    read: str
    boundaries: frozenset[int] = frozenset()
    block_source: str = "boundary"
    include_partial: bool = True
    null_source: bool = False
    final_read: bool = False

    def n_receivers(self, n_sublayers: int) -> int:
        """How many routers the model owns: one per sublayer, plus one for the final read."""
        return 0 if self.read == "none" else n_sublayers + int(self.final_read)


def block_starts(n_layers: int, n_blocks: int) -> frozenset[int]:
    """Sublayer indices where blocks 1..K-1 start: K blocks of (near) equal numbers of whole layers."""
    return frozenset(2 * (b * n_layers // n_blocks) for b in range(1, n_blocks))


def make_policy(residual: str, n_layers: int, n_blocks: int = 1, block_source: str = "boundary",
                include_partial: bool = True, null_source: bool = False) -> Policy:
    """The five methods of the paper. Arguments are validated by ModelConfig."""
    every = frozenset(range(1, 2 * n_layers))  # commit each output before the next sublayer reads
    blocks = block_starts(n_layers, n_blocks)
    policies = {
        "baseline": Policy(read="none"),
        "attnres": Policy(read="replace", boundaries=blocks, null_source=null_source, final_read=True),
        "full_attnres": Policy(read="replace", boundaries=every, null_source=null_source, final_read=True),
        "delta": Policy(read="add", boundaries=every, null_source=null_source),
        "delta_block": Policy(read="add", boundaries=blocks, block_source=block_source,
                              include_partial=include_partial, null_source=null_source),
    }
    return policies[residual]


class DepthState:
    """The routing state of one forward pass, driven by the model's sublayer loop:

        state = DepthState(policy, routers, e, route, eps)
        for each sublayer f_l with pre-norm n_l:  state.add(f_l(state.input(n_l)))
        y = state.output(final_norm)

    It keeps the ordinary residual stream h~ (the sum of the embedding and every output so far), the
    committed sources, and the partial: the sum of outputs since the last commit (None when empty).
    `observer`, if given, is called as observer(receiver_index, sources, router) before each read (eval.py
    records routing weights this way); it must not modify anything.
    """

    def __init__(self, policy: Policy, routers: nn.ModuleList, embedding: Tensor, route, eps: float,
                 observer=None):
        self.policy, self.routers, self.route, self.eps, self.observer = policy, routers, route, eps, observer
        self.h = embedding                    # (B, T, d) h~_0 = e
        self.sources = [embedding]            # s_0 = e
        self.partial: Tensor | None = None    # sum of outputs since the last commit
        self.l = 0                            # index of the next sublayer
        self.tracks_sources = policy.read != "none"

    def new_source(self) -> Tensor:
        """The source the current partial block would become if it were committed now."""
        if self.policy.block_source == "paper":
            return self.h - self.sources[-1]  # Fig. 3: hidden - deltas[-1] (not a boundary difference)
        return self.partial                   # = h~_now - h~_{last boundary}, summed without cancellation

    def candidates(self) -> list[Tensor]:
        """The sources a receiver reads now: committed ones, the partial, the null source."""
        srcs = list(self.sources)
        if self.partial is not None and self.policy.include_partial:
            srcs.append(self.new_source())
        if self.policy.null_source:
            srcs.append(torch.zeros_like(self.h))
        return srcs

    def read(self, router: Router) -> Tensor:
        sources = self.candidates()
        if self.observer is not None:
            self.observer(self.l, sources, router)
        return self.route(sources, router.query, router.norm_weight, self.eps)

    def commit(self) -> None:
        """Before sublayer l reads: at a boundary the partial becomes a committed source."""
        if self.l in self.policy.boundaries and self.partial is not None:
            self.sources.append(self.new_source())
            self.partial = None

    def input(self, norm: nn.Module | None = None) -> Tensor:
        """The input of sublayer l: h~ (baseline), h~ + g r (additive) or r (replacement), passed through the
        sublayer's pre-norm if one is given (the kernel path fuses the read with that norm)."""
        self.commit()
        if self.policy.read == "none":
            x = self.h
        else:
            router = self.routers[self.l]
            r = self.read(router)
            x = r if self.policy.read == "replace" else self.h + (r if router.gate is None else router.gate * r)
        return x if norm is None else norm(x)

    def add(self, v: Tensor) -> None:
        """Hand over sublayer l's output v_l: h~_{l+1} = h~_l + v_l (never h^_l + v_l)."""
        self.h = self.h + v
        if self.tracks_sources:
            self.partial = v if self.partial is None else self.partial + v
        self.l += 1

    def output(self, norm: nn.Module | None = None) -> Tensor:
        """The input of the final norm (or its output, if `norm` is given): the stream, or a final read over
        every source (AttnRes)."""
        x = self.read(self.routers[self.l]) if self.policy.final_read else self.h
        return x if norm is None else norm(x)
