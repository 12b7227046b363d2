"""How the model's path groups its receivers, and what a group's receivers share (depth_kernels/grouped_state.py uses
them): the plan of groups (`commits_before`, `plan_groups`, `fine_group_size` for fine-grained methods), the
gradient bank (one accumulator per committed source, which every kernel adds into in place) and a `Group`'s
tables and buffers (phase 1's state and log-sum-exps, the hand-off between its receivers' backwards and its own).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from depth_kernels.group_backward import receivers_per_pass
from depth_kernels.launch import SourceTable, slots
from depth_kernels.receiver_read import ReadGrads, backward_wave
from router import Policy, Router


def fine_group_size(n_sublayers: int, d: int) -> int:
    """Receivers per group when every output is a source (n = n_sublayers of them, each of b bytes a row).
    Phase 1 reads each committed source once forward and once backward, where it also reads and writes its
    gradient accumulator: 4 b per source and group, about n^2 / (2 G) such visits over the depth's n / G groups.
    Each receiver reads its own sources (on average (G - 1) / 2 of them) once forward and twice backward, where
    it adds into their accumulators: 5 b each, n (G - 1) / 2 in all. The sum 2 b n^2 / G + 5 b n (G - 1) / 2 is
    smallest at G = sqrt(4 n / 5): 8 at 36 layers (72 sublayers, 7.6). No more than phase 1's backward takes in
    one pass (group_backward.receivers_per_pass), which would read the sources and accumulators again."""
    return max(2, min(round(math.sqrt(4 * n_sublayers / 5)), receivers_per_pass(d)))


def commits_before(policy: Policy, n_sublayers: int) -> list[bool]:
    """For each receiver (the reading sublayers, then the final read): whether a source is committed between
    the previous receiver's read and its own (router.DepthState's commit and commit_after_read)."""
    shift = int(policy.commit_after_read)   # committed after the boundary sublayer reads: seen from the next one
    return [l - shift in policy.boundaries for l in range(policy.reads_from, n_sublayers + int(policy.final_read))]


def plan_groups(commits: list[bool], group_size: int) -> list[int]:
    """The group of each receiver: a new group starts at a commit once the current one has seen
    group_size - 1 commits since it began (group_size 1: at every commit)."""
    plan, group, since = [], 0, 0
    for i, commit in enumerate(commits):
        if commit and i > 0:
            if since >= group_size - 1:
                group, since = group + 1, 0
            else:
                since += 1
        plan.append(group)
    return plan


class GradBank:
    """One gradient accumulator per committed source of a forward pass: a buffer of slots per dtype, made at
    the first backward kernel that needs it (the list of sources is complete by then). A source's slot is its
    position among the sources of its dtype, so a table of consecutive sources maps to consecutive slots.

    The bank records each source's dtype, never the source itself: every node of the pass holds the bank, and
    a source made later than a node leads, through its autograd graph, back to that node; holding it would
    make a reference cycle through the graph that Python's collector cannot see (each step's state would stay
    alive for good)."""

    def __init__(self, embedding: Tensor):
        self.like = embedding                       # shape and device: made before every node, so no cycle
        self.dtypes: list[torch.dtype] = []         # of sources[k], in commit order
        self.position: list[int] = []               # of sources[k] among the sources of its dtype
        self.counts: dict[torch.dtype, int] = {}    # sources per dtype
        self.buffers: dict[torch.dtype, Tensor] = {}
        self.views: dict[torch.dtype, tuple[Tensor, ...]] = {}   # (B, T, d) views of the buffers' slots

    def add(self, source: Tensor) -> None:
        """Record the next committed source."""
        dtype = source.dtype
        self.position.append(self.counts.get(dtype, 0))
        self.counts[dtype] = self.position[-1] + 1
        self.dtypes.append(dtype)

    def pointers(self, table: SourceTable | None, first: int) -> tuple[Tensor, Tensor, int, int]:
        """(acc_a, acc_b, off_a, off_b) for a table of sources[first:...] (the kernels' accumulator arguments)."""
        if not self.buffers:
            self.buffers = {dtype: slots(n, self.like, dtype) for dtype, n in self.counts.items()}
            numel, shape = self.like.numel(), self.like.shape    # every slot's view, made at once
            self.views = {dtype: b[:, :numel].view(b.shape[0], *shape).unbind(0) for dtype, b in self.buffers.items()}
        if table is None:
            any_buffer = next(iter(self.buffers.values()))
            return any_buffer, any_buffer, 0, 0
        ends = [(0, table.n_a), (table.n_a, len(table.tensors))]
        out = []
        for start, end in ends:
            if start == end:
                out.append((out[0][0] if out else next(iter(self.buffers.values())), 0))
                continue
            k0, k1 = first + table.order[start], first + table.order[end - 1]
            assert self.position[k1] - self.position[k0] == end - start - 1, "table sources are not consecutive"
            out.append((self.buffers[self.dtypes[k0]], self.position[k0]))
        return out[0][0], out[1][0], out[0][1], out[1][1]

    def grad(self, k: int) -> Tensor:
        return self.views[self.dtypes[k]][self.position[k]]


@dataclass(slots=True)
class Group:
    """What one group's receivers share: phase 1's tables and buffers, and what their backwards leave for it."""
    index: int
    last: bool                        # the last group: the first whose backward runs (writes accumulators)
    first_receiver: int
    routers: list[Router]
    table: SourceTable                # the committed sources C = sources[:n_committed]
    n_committed: int
    base: Tensor                      # h~ at the group's start: the partial block's base for its receivers
    eps: float
    state_dtype: torch.dtype = None   # r_C's: the sources' (GroupRead's output, never kept here: see GroupRead)
    saved_r: Tensor | None = None     # (R, slab) the read-outs of receivers that keep theirs for their backward
    queries: Tensor = None            # (R, d) the receivers' queries, key-norm weights, gates ((R,) or None)
    norm_weights: Tensor = None       # and their sublayers' pre-norm weights (R, d), stacked (detached) once for
    gates: Tensor | None = None       # all the group's kernels, forward and backward
    prenorm_weights: Tensor = None
    lse_c: Tensor = None              # (R, M)
    lse: Tensor = None                # (R, M) the receivers' full log-sum-exp
    go: Tensor | None = None          # (R, slab) dL/dr per receiver, written by their backwards
    D: Tensor | None = None           # (R, M) go . r
    dbase: Tensor | None = None       # (R, slab) -dL/d(partial) of receivers whose base is `base`
    dbase_slots: list[int] = field(default_factory=list)
    dbase_summed: bool = False        # the group's first receiver (whose h~ is `base`) added them to its dh
    du: Tensor | None = None          # (R, programs, d) the receivers' per-program partial sums of du
    dw: Tensor | None = None          # (R, programs, d) and of their pre-norm weights' gradients
    dgate: Tensor | None = None       # (R, programs) and of dgate
    written: list[int] = field(default_factory=list)   # the slots whose backward ran (wrote go, D, du, dgate)

    def backward_buffers(self, like: Tensor) -> None:
        if self.go is None:
            n = len(self.routers)
            self.go = slots(n, like, self.state_dtype)
            self.D = torch.empty_like(self.lse)
            if self.dbase_slots:
                self.dbase = slots(n, like, self.state_dtype)
            M, d = like.numel() // like.shape[-1], like.shape[-1]
            programs = backward_wave(M, d, like.device)[0]
            self.du, self.dw = torch.empty(2, n, programs, d, dtype=torch.float32, device=like.device)  # one alloc
            self.dgate = torch.empty(n, programs, dtype=torch.float32, device=like.device)

    # The hand-off between the group's two kinds of node: each receiver's backward (they run first) leaves its
    # go, D and partial-block gradient here, and GroupRead's backward takes them.

    def receiver_grads(self, spec: Receiver, h: Tensor, base: Tensor | None,
                       accumulators: tuple[Tensor, Tensor, int, int], dv: Tensor | None = None) -> ReadGrads:
        """Where receiver `spec`'s backward writes: its go and D slots; -dL/d(partial) into its slot of the
        group's dbase when its base is the group's (else a tensor of its own, returned by its node); for the
        group's first receiver, whose h~ is that base, the other receivers' slots to add to its dh; dv: its
        newest source's accumulator where its kernels make the stream's add (ReadGrads.dv)."""
        self.backward_buffers(h)
        dbase, dbase_slot = None, 0
        if base is not None:
            dbase, dbase_slot = (self.dbase, spec.slot) if spec.base_to_group else (slots(1, base), 0)
        dsum = None
        if spec.sums_group and self.dbase_slots:
            lo, hi = min(self.dbase_slots), max(self.dbase_slots) + 1
            if hi - lo == len(self.dbase_slots):
                dsum, self.dbase_summed = (self.dbase, lo, hi), True
        self.written.append(spec.slot)
        return ReadGrads(accumulators, spec.accumulate, self.go, self.D, dbase, dbase_slot, self.du, self.dw,
                         self.dgate, dsum, dv)

    def receivers_sums(self) -> tuple[Tensor, Tensor, Tensor]:
        """The receivers' own parts of du (R, d), their pre-norm weights' gradients (R, d) and dgate (R,), summed
        over their programs (zero for a receiver whose backward did not run: its output was not used)."""
        if len(self.written) < len(self.routers):
            missing = [i for i in range(len(self.routers)) if i not in self.written]
            self.du[missing], self.dw[missing], self.dgate[missing] = 0.0, 0.0, 0.0
        return self.du.sum(1), self.dw.sum(1), self.dgate.sum(1)

    def base_grad(self, like: Tensor) -> Tensor | None:
        """The group base's gradient from its receivers' partials, unless the first receiver already added it."""
        if not self.dbase_slots or self.dbase_summed:
            return None
        return self.dbase[self.dbase_slots, :like.numel()].sum(0).view(like.shape).to(self.base.dtype)

    def release(self) -> None:
        """After the group's backward, the last to use them: its sources and buffers go."""
        self.table = self.base = self.lse_c = self.lse = self.go = self.D = self.dbase = self.du = self.dgate = None
        self.dw = self.queries = self.norm_weights = self.gates = self.prenorm_weights = self.saved_r = None
