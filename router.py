"""Depth routing: Eq. 1 (a softmax over depth) and Eq. 2 (additive routing) of Delta Attention Residuals.

Read this file first, then model.py; docs/method.md derives what is stated here. Every sublayer l (attention
or MLP) may read, per token, a convex mix of earlier "sources" s_i (the embedding e, earlier sublayer
outputs, or sums of them over a block):

    z_i = w_l . RMSNorm_{g_l}(s_i)        logits: keys are normalised sources, w_l a static learned query,
                                          g_l the receiver's own RMSNorm weight
    a_i = softmax_i(z_i)                  softmax over the N sources (the depth axis)
    r_l = sum_i a_i s_i                   values are the un-normalised sources          (Eq. 1)

and uses the read-out r_l in one of three ways (DepthState.input):

    additive (Eq. 2, the paper's):        h^_l = h~_l + r_l         the stream h~ is kept
    gated additive (an extension here):   h^_l = h~_l + γ_l r_l     scalar γ_l = 0 at init: exact identity
    replacement (Kimi's AttnRes):         h^_l = r_l

The five methods differ only in which sources exist, when a source is committed, and how the read is used;
`Policy` holds exactly those facts and `DepthState` runs them, so the model's sublayer loop never branches on
a method's name. They are four corners of a grid, granularity (a source per sublayer, or per block) x use
(replacement, additive), and a third switch, what a source is, completes it (docs/method.md, "The grid"):

    sources="deltas" (the five methods): changes of the stream, the embedding e and then the sublayer outputs
                   v_i, or per block their sum B_b = h~_{tau_{b+1}} - h~_{tau_b}, and the partial block;
    sources="states": the stream itself, the cumulative states h~_i = e + sum_{j<i} v_j at every commit, and
                   the current state h~_l where the partial block would be (Sec. 2.2's "redundant" sources).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint

METHODS = ("baseline", "attnres", "full_attnres", "delta", "delta_block")
BLOCK_SOURCES = ("boundary", "paper")
SOURCES = ("deltas", "states")
BLOCK_SPLITS = ("even", "ceil")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last axis, computed in (at least) fp32, returned in x's dtype, as Qwen3 does."""
    dtype = x.dtype
    x = x.to(torch.promote_types(dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def depth_weights(values: Tensor, query: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """a_i of Eq. 1. values: (N, B, T, d) stacked sources; query, norm_weight: (d,) -> (N, B, T)."""
    keys = rms_norm(values, norm_weight, eps)                    # (N, B, T, d)  RMSNorm_g(s_i)
    logits = keys @ query                                        # (N, B, T)     z_i = w . key_i
    return logits.softmax(dim=0)                                 # (N, B, T)     a_i, over depth


def depth_route(sources: list[Tensor], query: Tensor, norm_weight: Tensor, eps: float = 1e-6) -> Tensor:
    """The explicit reference of Eq. 1. sources: N tensors (B, T, d); query, norm_weight: (d,) -> (B, T, d).

    Accumulates in fp32 (float64 stays float64, for gradcheck). Every faster path is tested against this.
    """
    return depth_read(torch.stack(sources), query, norm_weight, eps).to(sources[0].dtype)


def depth_read(values: Tensor, query: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """Eq. 1 on sources already stacked: values (N, B, T, d); query, norm_weight: (d,) -> (B, T, d) in fp32 (or
    float64)."""
    dtype = torch.promote_types(values.dtype, torch.float32)
    values = values.to(dtype)                                    # (N, B, T, d)  s_i
    weights = depth_weights(values, query.to(dtype), norm_weight.to(dtype), eps)  # (N, B, T)
    return (weights.unsqueeze(-1) * values).sum(dim=0)           # (B, T, d)     r = sum_i a_i s_i


def recomputed_read(values: Tensor, query: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """depth_read whose backward recomputes the read from its inputs (activation checkpointing) instead of keeping
    its intermediates: the sources' 1/rms, the normalized sources (N, B, T, d) and the weights. The sources
    themselves are kept whatever the choice. The reference's read in a compiled graph (DepthState.read): at 12
    layers of delta it cut what the compiled whole forward keeps for the backward by a third (14.0 -> 9.2 MB at
    2 x 32 tokens, d = 64), and the host's calls a step with it (docs/kernels.md#host-time); the same values."""
    return checkpoint(depth_read, values, query, norm_weight, eps, use_reentrant=False, preserve_rng_state=False)


@dataclass
class Router:
    """What one receiving sublayer reads with: its static query w_l (d,), its own RMSNorm weight g_l (d,), an
    optional scalar gate γ_l (1,) and an optional learned null source n_l (d,). Rows of `Routers`' parameters (views:
    their gradients reach the stacked parameters)."""
    query: Tensor
    norm_weight: Tensor
    gate: Tensor | None = None
    null: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.query, self.norm_weight, self.gate, self.null) if t is not None]


class Routers(nn.Module):
    """The routers of a model's n receiving sublayers, as one parameter per kind with a row per receiver: queries
    (n, d), key-norm weights (n, d), and optionally gates (n, 1) and learned null sources (n, d). `routers[i]` and
    iteration give each receiver's `Router` (rows unbound once: DepthState takes them once per forward). One tensor
    per kind rather than a module per receiver: at 36 layers the 144 tensors of per-receiver modules cost a step
    about 2 ms of host time (autograd's accumulation, the optimizer's and clipping's loops over tensors).

    query_init_std: the queries start at N(0, std), or at zero (uniform weights, as the paper states) for 0.
    gate: a scalar γ per receiver starting at zero, so h^ = h~ + γ r is an exact identity at initialisation (zero
        queries alone are not one), and gated routers start from random queries (ModelConfig's default for
        gate=True is N(0, 0.02)): why both, docs/method.md, "Correction 2".
    learned_null: the null source is a learned vector n_l (d,) of each receiver, zero at init (the authors'
        code), rather than a constant zero.
    A model without receivers (the baseline) has no parameters here. State dicts written when each receiver was a
    module of its own (`routers.{i}.query`, ...) load: their rows are stacked (`_stack_rows`).
    """

    KINDS = ("query", "norm_weight", "gate", "null")

    def __init__(self, n: int, d_model: int, gate: bool, query_init_std: float = 0.0, learned_null: bool = False):
        super().__init__()
        self.n, self.query_init_std = n, query_init_std
        # queries zero here, drawn in reset_parameters: building routers must not move the RNG that the backbone's
        # init draws from (model.Model initialises routers last). Gates (n, 1): FSDP2 shards no 0-d row.
        made = {"query": torch.zeros(n, d_model), "norm_weight": torch.ones(n, d_model),
                "gate": torch.zeros(n, 1) if gate else None, "null": torch.zeros(n, d_model) if learned_null else None}
        for kind, value in made.items():
            self.register_parameter(kind, nn.Parameter(value) if value is not None and n else None)
        self.register_load_state_dict_pre_hook(_stack_rows)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Router:
        return Router(*(None if p is None else p[i] for p in self._kinds()))

    def __iter__(self):
        """Every receiver's Router, its tensors unbound from the stacked parameters in one op per kind."""
        rows = [[None] * self.n if p is None else p.unbind(0) for p in self._kinds()]
        return iter([Router(*row) for row in zip(*rows)])

    def _kinds(self) -> list[Tensor | None]:
        return [getattr(self, kind) for kind in self.KINDS]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.n == 0:
            return
        for row in self.query:         # row by row: the draws a module per receiver made, in the same order
            if self.query_init_std > 0:
                nn.init.normal_(row, mean=0.0, std=self.query_init_std)
            else:
                nn.init.zeros_(row)
        nn.init.ones_(self.norm_weight)
        for p in (self.gate, self.null):
            if p is not None:
                nn.init.zeros_(p)


def _stack_rows(module: Routers, state_dict: dict, prefix: str, *args) -> None:
    """A state dict with a module per receiver (`{prefix}{i}.query`, ...) -> the stacked rows (`{prefix}query`)."""
    for kind in Routers.KINDS:
        rows = [state_dict.pop(f"{prefix}{i}.{kind}") for i in range(module.n) if f"{prefix}{i}.{kind}" in state_dict]
        if rows:
            state_dict[prefix + kind] = torch.stack(rows)


@dataclass(frozen=True)
class Policy:
    """A method, as data.

    read:          "none" (plain pre-norm residual), "add" (Eq. 2, gated if the routers have a gate) or
                   "replace" (AttnRes).
    boundaries:    sublayer indices where a new block starts: there the block before becomes a committed
                   source. Every index -> fine-grained (each output is a source); block starts -> block sources.
    sources:       "deltas": what is committed is a change of the stream (below); "states": the stream h~
                   itself at the commit, and the partial's place is taken by the current stream h~_l.
    block_source:  with deltas, what is committed: "boundary" = the sum of outputs since the last boundary,
                   exactly h~_{tau_{b+1}} - h~_{tau_b}; "paper" = h~ - sources[-1] (the paper's Fig. 3).
    commit_after_read: False: a finished block is a source for the boundary sublayer itself; True (the
                   authors' code): it is committed only after that sublayer has read, from the stream at the
                   boundary, so the first sublayer of a block does not see the previous block.
    include_partial: the not-yet-committed partial is a source too (once its block has an output).
    reads_from:    sublayers before this index read nothing (the authors' code: sublayer 0 has no read, or
                   with a null source reads only that).
    sources_from:  sublayers before this index have no sources but the null source (the authors' code: e is
                   a source from sublayer 1 on, as if committed after sublayer 0's read).
    null_source:   an extra null source (zero, or the receiver's learned vector), so a receiver can read
                   nothing.
    final_read:    a last routing over every source produces the input of the final norm.
    """

    read: str
    boundaries: frozenset[int] = frozenset()
    sources: str = "deltas"
    block_source: str = "boundary"
    commit_after_read: bool = False
    include_partial: bool = True
    reads_from: int = 0
    sources_from: int = 0
    null_source: bool = False
    final_read: bool = False

    def n_receivers(self, n_sublayers: int) -> int:
        """How many routers the model owns: one per reading sublayer, plus one for the final read."""
        return 0 if self.read == "none" else n_sublayers - self.reads_from + int(self.final_read)


def block_starts(n_layers: int, n_blocks: int, split: str = "even") -> frozenset[int]:
    """Sublayer indices where blocks 1.. start. "even": K blocks whose lengths differ by at most one layer
    (block b starts at layer floor(b L / K)); "ceil" (the authors' code): blocks of ceil(L / K) layers, the last
    one shorter (with 36 layers and 8 blocks: 5, 5, 5, 5, 5, 5, 5, 1; "even" gives 4, 5, 4, 5, 4, 5, 4, 5)."""
    if split == "ceil":
        size = -(-n_layers // n_blocks)
        return frozenset(2 * layer for layer in range(size, n_layers, size))
    return frozenset(2 * (b * n_layers // n_blocks) for b in range(1, n_blocks))


def make_policy(residual: str, n_layers: int, n_blocks: int = 1, block_source: str = "boundary",
                include_partial: bool = True, null_source: bool = False, block_split: str = "even",
                sources: str = "deltas") -> Policy:
    """The five methods of the paper. Arguments are validated by ModelConfig.

    delta_block's block_source="paper" is the authors' computation exactly: Fig. 3's formula, committed
    after the boundary sublayer has read, no partial source (so the last block is never a source) and no read
    at sublayer 0 (with a null source, sublayer 0 reads only that). With L = 8, K = 4 and B_k the sum of block
    k's outputs, sublayers 1-4 read [e], 5-8 [e, B0], 9-12 [e, B0, e+B1], 13-15 [e, B0, e+B1, B0+B2].
    "boundary": a sublayer of block k reads
    [e, B0, .., B_{k-1}], plus the partial from the block's second sublayer on.

    sources="states" swaps every delta for the stream at the same place: a block method's sublayer of block k
    reads [e, h~_{tau_1}, .., h~_{tau_k}], plus h~_l from the block's second sublayer on; a fine-grained
    one's sublayer l reads [e, h~_1, .., h~_l].
    """
    every = frozenset(range(1, 2 * n_layers))  # commit each output before the next sublayer reads
    blocks = block_starts(n_layers, n_blocks, block_split)
    paper = block_source == "paper"
    delta_block = Policy(read="add", boundaries=blocks, sources=sources, block_source=block_source,
                         commit_after_read=paper, include_partial=include_partial and not paper,
                         reads_from=int(paper and not null_source), sources_from=int(paper),
                         null_source=null_source)
    policies = {
        "baseline": Policy(read="none"),
        "attnres": Policy(read="replace", boundaries=blocks, sources=sources, null_source=null_source,
                          final_read=True),
        "full_attnres": Policy(read="replace", boundaries=every, sources=sources, null_source=null_source,
                               final_read=True),
        "delta": Policy(read="add", boundaries=every, sources=sources, null_source=null_source),
        "delta_block": delta_block,
    }
    return policies[residual]


class DepthState:
    """The routing state of one forward pass, driven by the model's sublayer loop:

        state = DepthState(policy, routers, e, route, eps)
        for each sublayer f_l with pre-norm n_l:  state.add(f_l(state.input(n_l)))
        y = state.output(final_norm)

    It keeps the ordinary residual stream h~ (the sum of the embedding and every output so far), the
    committed sources, and the partial: the sum of outputs since the last commit (None when empty).
    `observer`, if given, is called as observer(sublayer_index, sources, router) before each read (eval.py
    records routing weights this way); it must not modify anything.
    """

    def __init__(self, policy: Policy, routers: Routers, embedding: Tensor, route, eps: float, observer=None):
        self.policy, self.route, self.eps, self.observer = policy, route, eps, observer
        self.routers = list(routers)          # every receiver's Router (rows of the stacked parameters)
        self.h = embedding                    # (B, T, d) h~_0 = e
        self.sources = [embedding]            # s_0 = e
        self.committed_stack: Tensor | None = None   # sources stacked, as far as a read needed them (stacked)
        self.partial: Tensor | None = None    # sum of outputs since the last commit
        self.l = 0                            # index of the next sublayer
        self.tracks_sources = policy.read != "none"

    def reads(self) -> bool:
        """Whether sublayer l reads its sources."""
        return self.policy.read != "none" and self.l >= self.policy.reads_from

    def router(self) -> Router:
        """The router of sublayer l (or of the final read, after the last sublayer)."""
        return self.routers[self.l - self.policy.reads_from]

    def new_source(self) -> Tensor:
        """The source the current partial block would become if it were committed now."""
        if self.policy.sources == "states":
            return self.h                     # h~ now: the cumulative state
        if self.policy.block_source == "paper":
            return self.h - self.sources[-1]  # Fig. 3: hidden - deltas[-1] (not a boundary difference)
        return self.partial                   # = h~_now - h~_{last boundary}, summed without cancellation

    def candidates(self, router: Router) -> list[Tensor]:
        """The sources `router` reads now: committed ones, the partial, the null source."""
        srcs = list(self.sources) if self.l >= self.policy.sources_from else []
        if self.partial is not None and self.policy.include_partial:
            srcs.append(self.new_source())
        if self.policy.null_source:
            srcs.append(torch.zeros_like(self.h) if router.null is None else router.null.expand_as(self.h))
        return srcs

    def read(self, router: Router) -> Tensor:
        sources = self.candidates(router)
        if self.observer is not None:
            self.observer(self.l, sources, router)
        if self.route is depth_route:     # the reference, on the committed sources stacked as they come (stacked)
            read = recomputed_read if torch.compiler.is_compiling() else depth_read
            return read(self.stacked(sources), router.query, router.norm_weight, self.eps).to(sources[0].dtype)
        return self.route(sources, router.query, router.norm_weight, self.eps)

    def stacked(self, sources: list[Tensor]) -> Tensor:
        """A read's sources stacked, (N, B, T, d): the committed ones are `committed_stack`, which grows by one
        concatenation per commit, and only the partial and the null source are stacked per read. The same values as
        torch.stack(sources); but where each read stacks its own sources, a compiled graph writes every source into
        every later read's stack, through a view per (read, source): O(L^2) views for the host to make each step."""
        k = len(self.sources) if self.l >= self.policy.sources_from else 0   # sources[:k] are the committed ones
        if k == 0:
            return torch.stack(sources)
        stack = self.committed_stack
        have = 0 if stack is None else stack.shape[0]
        if have < k:
            new = torch.stack(self.sources[have:k])
            stack = self.committed_stack = new if stack is None else torch.cat([stack, new])
        return torch.cat([stack, torch.stack(sources[k:])]) if len(sources) > k else stack

    def commit_block(self) -> None:
        """At a boundary the partial becomes a committed source."""
        if self.l in self.policy.boundaries and self.partial is not None:
            self.sources.append(self.new_source())
            self.partial = None

    def commit(self) -> None:
        """Before sublayer l reads (unless the policy commits after the read: then add() does)."""
        if not self.policy.commit_after_read:
            self.commit_block()

    def input(self, norm: nn.Module | None = None) -> Tensor:
        """The input of sublayer l, passed through the sublayer's pre-norm n_l if one is given (the kernel
        path fuses the read with that norm). One branch per use of the read."""
        self.commit()
        if not self.reads():
            x = self.h                                    # baseline (or a sublayer before reads_from): h~_l
        elif self.policy.read == "replace":
            x = self.read(self.router())                  # AttnRes: h^_l = r_l
        elif self.router().gate is None:
            x = self.h + self.read(self.router())         # Eq. 2: h^_l = h~_l + r_l
        else:
            router = self.router()
            x = self.h + router.gate * self.read(router)  # gated Eq. 2: h^_l = h~_l + γ_l r_l
        return x if norm is None else norm(x)

    def add(self, v: Tensor) -> None:
        """Hand over sublayer l's output v_l: h~_{l+1} = h~_l + v_l (never h^_l + v_l)."""
        if self.policy.commit_after_read:
            self.commit_block()               # h~ is still the stream at the boundary: v_l is not in the block
        self.h = self.h + v
        if self.tracks_sources:
            self.partial = v if self.partial is None else self.partial + v
        self.l += 1

    def output(self, norm: nn.Module | None = None) -> Tensor:
        """The input of the final norm (or its output, if `norm` is given): the stream, or a final read over
        every source (AttnRes)."""
        x = self.read(self.router()) if self.policy.final_read else self.h
        return x if norm is None else norm(x)
