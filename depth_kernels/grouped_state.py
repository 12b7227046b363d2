"""The model's fast routing path: depth reads grouped by the sources they share, fused with the pre-norm.

The reference (router.DepthState) computes, per receiving sublayer, x = h~ + g r (additive, Eq. 2) or x = r
(replacement) and y = RMSNorm(x), and autograd saves and sums whatever every op needs. `GroupedDepthState`
runs the same policy with the kernels of depth_kernels/group_read.py:

- receivers are grouped (depth_kernels/groups.py's `plan_groups`): a Delta Block or AttnRes block is a group;
  fine-grained methods, which commit a source before every sublayer, take groups of `fine_group_size`
  consecutive receivers;
- at a group's start one autograd node (`GroupRead`, depth_kernels/group_read.py) reads the committed sources once for
  all of the group's receivers (phase 1) and keeps, per receiver, r_C (in the sources' dtype) and lse_C;
- each receiver is one node (`ReceiverRead`) that finishes its read (phase 2) over its own sources (outputs
  committed since the group began; the partial block as h~ - base, never stored; a null source as a flag) and
  returns y = RMSNorm(x) directly; its backward recomputes r, x and the norm;
- gradients of sources never pass through autograd per receiver: every kernel adds its sources' gradients in
  place into one accumulator per source (`GradBank`), and only the first node that read a source in the forward
  (the last to run backward) returns that accumulator to autograd, once. The partial block's gradient goes to h~
  in each receiver and, negated, to its base: summed over the group and returned once by the group's node;
- where a sublayer output v_l is the next receiver's newest source (fine-grained methods), that receiver's node
  also makes the stream's add h~_{l+1} = h~_l + v_l (docs/kernels.md#the-streams-add-inside-the-receivers says why).

model.Model picks this state (model.uses_kernel) for CUDA tensors or when ModelConfig.kernel == "triton".
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from depth_kernels.group_backward import group_backward
from depth_kernels.group_read import group_forward
from depth_kernels.groups import GradBank, Group, commits_before, fine_group_size, plan_groups
from depth_kernels.launch import SourceList, aligned, slot_view, slots
from depth_kernels.receiver_read import Inputs, Read, receiver_backward, receiver_forward
from depth_kernels.tiles import NULL_LEARNED, NULL_NONE, NULL_ZERO
from router import DepthState


def _take(ctx) -> tuple:
    """What a node's forward left for its backward (ctx.held: its group or receiver, and the bank), removed from
    its context: once its backward has run, nothing of the step stays alive through the node (the graph object
    lives on while the loss tensor does)."""
    held = ctx.__dict__.pop("held", None)
    if held is None:
        raise RuntimeError("the kernel path's depth routing runs one backward per forward (retain_graph=True is "
                           "not supported): use kernel='reference' to back-propagate twice")
    return held


@functools.cache   # torch.promote_types dispatches as an aten op (a few us a call, three a receiver)
def promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.promote_types(a, b)


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t.to(dtype), without Tensor.to's argument parsing (a few us a call, twice a receiver) where t has it."""
    return t if t.dtype == dtype else t.to(dtype)


class GroupRead(torch.autograd.Function):
    """Phase 1 of a group. Inputs: the group's base h~; its receivers' queries, key-norm weights and sublayers'
    pre-norm weights stacked in one (3 R, d) and its gates in one (R,) (or None): autograd's stack hands each
    router and norm its row of the gradients, which this node returns once for the group, phase 1's part and the
    receivers' own, which their backwards leave in the group; then the committed sources this node owns.
    Output: the r_C buffer (R, slab), which every receiver of the group takes as an input, so this node's
    backward runs after theirs. The output's grad_fn is this node, whose context holds the group: so the group
    never holds the output (that would be a reference cycle through the graph)."""

    @staticmethod
    def forward(ctx, group: Group, bank: GradBank, owned: list[int], base: Tensor, params: Tensor,
                gates: Tensor | None, *sources: Tensor) -> Tensor:
        ctx.set_materialize_grads(False)
        ctx.held, ctx.owned = (group, bank), owned
        like = group.table.tensors[0]
        M, R = like.numel() // like.shape[-1], len(group.routers)
        # (R, d) each, for every kernel of the group, forward and backward
        group.queries, group.norm_weights, group.prenorm_weights = params.detach().view(3, R, -1).unbind(0)
        group.gates = None if gates is None else gates.detach()
        state = slots(R, like, group.state_dtype)
        group.lse_c = torch.empty(R, M, dtype=torch.float32, device=like.device)
        group.lse = torch.empty_like(group.lse_c)
        group_forward(group.table, group.queries, group.norm_weights, group.eps, state, group.lse_c)
        return state

    @staticmethod
    def backward(ctx, _):
        group, bank = _take(ctx)
        queries, norm_weights = group.queries, group.norm_weights
        like = group.table.tensors[0]
        group.backward_buffers(like)
        du = group_backward(group.table, queries, norm_weights, group.eps, group.go, group.D, group.lse,
                            bank.pointers(group.table, 0), accumulate=not group.last)
        du_own, dw, dgate = group.receivers_sums()
        du += du_own                      # the committed sources' part (phase 1) + the receivers' own
        dparams = torch.empty((3, *du.shape), dtype=queries.dtype, device=du.device)   # the stack's gradient
        dq, dg, dprenorm = dparams.unbind(0)
        torch.mul(du, norm_weights, out=dq)   # e = rstd s . (w * g), rounded once into the parameters' dtype
        torch.mul(du, queries, out=dg)
        dprenorm.copy_(dw)
        dgate = None if group.gates is None else _cast(dgate, group.gates.dtype)
        grads = (None, None, None, group.base_grad(like), dparams.view(-1, du.shape[-1]), dgate,
                 *[bank.grad(k) for k in ctx.owned])
        group.release()
        return grads


@dataclass(slots=True)
class Receiver:
    """One receiver's read: its group and slot, its own sources (sources[first:...]) and how it mixes."""
    group: Group
    first: int
    owned: list[int]
    accumulate: bool                  # False only for the very last receiver: its backward runs first
    base_to_group: bool               # its partial's base is the group's: the group returns the base's gradient
    sums_group: bool                  # the group's first receiver, whose h~ is the group's base
    read: Read                        # the kernels' view of it (its tensors are the node's Inputs)

    @property
    def slot(self) -> int:            # its row of the group's buffers
        return self.read.slot


def learned_null_grads(null: Tensor, query: Tensor, norm_weight: Tensor, eps: float, go: Tensor, D: Tensor,
                       lse: Tensor) -> tuple[Tensor, Tensor]:
    """The learned null source n's gradient and its term of du, from a receiver's go (M, d), D and lse (M,):
    the softmax backward of a source that is the same vector n at every row,
    dn = sum_rows a go + (sum_rows dz rstd) u - (sum_rows dz rstd) z rstd n / d and du += (sum_rows dz rstd) n,
    with a = exp(z - lse), dz rstd = a (go . n - D) rstd (a few (M,) and (d,) ops: an option, not the paper's)."""
    n, u = null.float(), query.float() * norm_weight.float()
    rstd = torch.rsqrt(n.pow(2).mean() + eps)
    z = (n @ u) * rstd
    a = torch.exp(z - lse)                                                 # (M,)
    go = go.float()
    dz_rstd = a * (go @ n - D) * rstd
    c = dz_rstd.sum()
    return a @ go + c * u - c * z * rstd / n.numel() * n, c * n



class ReceiverRead(torch.autograd.Function):
    """Phase 2 of one receiver, mixed and normalised: y = RMSNorm_w(h~ + gate r) or RMSNorm_w(r). Its query,
    key-norm weight, gate and pre-norm weight w are the group's (GroupRead takes them, stacks them for every
    kernel of the group and returns their gradients once per group)."""

    @staticmethod
    def forward(ctx, spec: Receiver, bank: GradBank, h: Tensor, base: Tensor | None, state: Tensor,
                null: Tensor | None, *owned: Tensor) -> Tensor:
        read = spec.read                  # with read.stream, h is h~_l and owned[-1] v_l: the kernel makes h~_{l+1}
        y_dtype = promote(read.prenorm_weights.dtype, read.x_dtype)
        y, h = receiver_forward(read, Inputs(h, base, state, null), y_dtype, owned[-1] if read.stream else None)
        # a saved r stands in for the state
        ctx.save_for_backward(h, base, None if read.saved_r is not None else state, null)
        ctx.held = (spec, bank)
        return (y, h) if read.stream else y     # h~_{l+1}, an output

    @staticmethod
    def backward(ctx, dy: Tensor, dh_stream: Tensor | None = None):
        inputs = Inputs(*ctx.saved_tensors)
        spec, bank = _take(ctx)
        group, read, h, base, null = spec.group, spec.read, inputs.h, inputs.base, inputs.null
        # with read.stream the kernel sums the read's and the stream's dL/dh~_{l+1} into dh, added to v_l's gradient
        accumulators = bank.pointers(read.table, spec.first)          # (the bank's buffers made at the first)
        dv, stream = (bank.grad(spec.owned[-1]), aligned(dh_stream)) if read.stream else (None, None)
        grads = group.receiver_grads(spec, h, base, accumulators, dv)
        dh = receiver_backward(read, inputs, aligned(dy), grads, stream)
        dnull, dbase = None, None
        if null is not None:              # the learned null's gradient, from what the kernel left for phase 1
            go = slot_view(group.go, spec.slot, h).view(read.M, -1)
            dnull, du_null = learned_null_grads(null, group.queries[spec.slot], group.norm_weights[spec.slot],
                                                read.eps, go, group.D[spec.slot], group.lse[spec.slot])
            group.du[spec.slot, 0] += du_null
            dnull = _cast(dnull, null.dtype)
        if base is not None and not spec.base_to_group:   # else the group's node returns the base's gradient
            dbase = slot_view(grads.dbase, 0, base)
        return (None, None, dh, dbase, None, dnull, *[bank.grad(k) for k in spec.owned])


class BlockDelta(torch.autograd.Function):
    """A block's delta B = h~_now - h~_start in the sources' dtype in one pass (the fp32 difference rounded once,
    exactly (h~_now - h~_start).to(dtype)), and its gradient to both ends in one pass each: 10 d bytes forward
    where a subtraction and a cast move 18 d, 12 d backward where a cast and a negation move 14 d."""

    @staticmethod
    def forward(ctx, h: Tensor, start: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.dtypes = (h.dtype, start.dtype)
        return torch.sub(h, start, out=torch.empty_like(h, dtype=dtype))

    @staticmethod
    def backward(ctx, grad: Tensor):
        up, down = (torch.empty_like(grad, dtype=dtype) for dtype in ctx.dtypes)
        return torch.mul(grad, 1.0, out=up), torch.mul(grad, -1.0, out=down), None


# Plain Function.apply: calling torch's private engine apply directly saved about 5 us a call here (80 calls a
# 1044M step, 0.4 ms, under 1 % of the step's host time), too little for a private API.
_group_read, _receiver_read, _block_delta = GroupRead.apply, ReceiverRead.apply, BlockDelta.apply


class GroupedDepthState(DepthState):
    """router.DepthState with grouped, fused reads (when given the sublayer's pre-norm). It keeps no running
    partial block: the partial is h~ - block_start where a read or a commit needs it. `norms`: every sublayer's
    pre-norm, then the final norm (the norm each read is given, known before: a group stacks its receivers' norm
    weights at its start, as it stacks their queries)."""

    unadded: Tensor | None = None     # v_l, which the next receiver's node adds to h~_l (add)

    def __init__(self, *args, norms: list[nn.Module], group_size: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.norms = norms
        n_sublayers = len(self.routers) + self.policy.reads_from - int(self.policy.final_read)
        commits = commits_before(self.policy, n_sublayers)
        # fine-grained: a source committed before every sublayer's read (a final read finds none new: it reads
        # the last output as the partial)
        fine = all(commits[1:n_sublayers - self.policy.reads_from])
        size = group_size or (fine_group_size(n_sublayers, self.h.shape[-1]) if fine else 1)
        self.plan = plan_groups(commits, size)
        for receiver in range(self.policy.sources_from - self.policy.reads_from):
            self.plan[receiver] = -1      # reads only the null source: the reference's few torch ops, no group
        self.members: dict[int, list[int]] = {}   # group -> its receivers
        for receiver, g in enumerate(self.plan):
            self.members.setdefault(g, []).append(receiver)
        first = {members[0] for members in self.members.values()}
        last = len(self.plan) - int(self.policy.final_read)      # the final read commits nothing
        self.adders = {r for r, g in enumerate(self.plan[:last]) if g >= 0 and commits[r] and r not in first} \
            if self.observer is None and not self.policy.commit_after_read and self.policy.sources == "deltas" \
            and self.policy.block_source == "boundary" else set()    # receivers whose node makes h~ (add)
        self.bank = GradBank(self.h)
        self.bank.add(self.h)
        # the committed sources, checked and aligned as they come: tables of them cost little
        self.source_list = SourceList(capacity=1 + sum(commits))
        self.source_list.append(self.h)
        self.M = self.h.numel() // self.h.shape[-1]   # rows of every (B, T, d) tensor of the pass
        self.block_start = self.h         # (B, T, d) h~ at the last commit
        self.group: Group | None = None
        self.group_output: Tensor | None = None   # the current group's r_C buffer, as GroupRead returned it
        self.claimed = 0                  # sources[:claimed] have their gradient returned by some node
        self.outputs_since_commit: list[Tensor] = []

    # The stream's add h~_{l+1} = h~_l + v_l is made by the next receiver's node where v_l is its newest own
    # source (`adders`; docs/kernels.md#the-streams-add-inside-the-receivers); any other reader of h~ meanwhile
    # (the h property) has it made as usual.

    def settled(self) -> Tensor:
        """h~, an output still to add added now, as autograd adds (for any reader but the receiver that adds it)."""
        if self.unadded is not None:
            self._h, self.unadded = self._h + self.unadded, None
        return self._h

    def _set_h(self, value: Tensor) -> None:
        self._h = value

    h = property(settled, _set_h)

    def add(self, v: Tensor) -> None:
        if self.policy.commit_after_read:
            self.commit_block()
        h = self.h
        if self.l + 1 - self.policy.reads_from in self.adders and not self.outputs_since_commit:
            self.unadded = v              # v_l alone will be the next source: the next receiver's node adds it
        else:
            self.h = h + v
        if self.tracks_sources:
            self.partial = v              # marks a non-empty partial block; its value is h~ - block_start
            self.outputs_since_commit.append(v)
        self.l += 1

    def new_source(self) -> Tensor:
        if self.policy.sources == "states" or self.policy.block_source == "paper":
            return super().new_source()
        if len(self.outputs_since_commit) == 1:                      # one output: the source is that output
            return self.outputs_since_commit[0]
        return _block_delta(self.h, self.block_start, self.outputs_since_commit[-1].dtype)

    def commit_block(self) -> None:
        n = len(self.sources)
        super().commit_block()
        if len(self.sources) > n:
            self.bank.add(self.sources[-1])
            self.source_list.append(self.sources[-1])
            # with v_l still to add, the receiver that adds it sets the block's start, h~_{l+1}
            self.block_start, self.outputs_since_commit = self._h if self.unadded is None else None, []

    def _claim(self, indices: range) -> list[int]:
        """The sources among `indices` that no earlier node reads: the reading node returns their gradients. Every
        node reads up to the newest source, so the sources read so far are sources[:claimed]."""
        assert indices.start <= self.claimed and indices.stop == len(self.sources), "a read skips a source"
        new = list(range(self.claimed, indices.stop))
        self.claimed = max(self.claimed, indices.stop)
        return new

    def _group_of(self, receiver: int) -> Group:
        if self.group is None or self.plan[receiver] != self.group.index:
            members = self.members[self.plan[receiver]]
            routers = [self.routers[i] for i in members]
            committed = list(self.sources)
            table = self.source_list.table(0, len(committed))
            group = Group(self.plan[receiver], self.plan[receiver] == self.plan[-1], members[0], routers, table,
                          len(committed), self.block_start, self.eps, state_dtype=table.tensors[-1].dtype)
            owned = self._claim(range(len(committed)))
            # the group's output is kept here, never on the group: the group is in the node's context, and a
            # tensor whose grad_fn is that node would close a cycle no collector sees
            # stacked here, where autograd records the stack: its backward splits the group's gradients per router
            # and norm. (3 R, d): the queries, the key-norm weights, the pre-norm weights
            params = torch.stack([r.query for r in routers] + [r.norm_weight for r in routers]
                                 + [self.norms[self.policy.reads_from + i].weight for i in members])
            gates = torch.cat([r.gate for r in routers]) if routers[0].gate is not None else None   # (R,)
            self.group_output = _group_read(group, self.bank, owned, self.block_start, params, gates,
                                            *[committed[k] for k in owned])
            self.group = group
        return self.group

    def _read(self, norm: nn.Module, add: bool) -> Tensor:
        adds = self.unadded is not None   # this receiver's node adds v_l, its newest source, to the stream (add)
        h = self._h                       # h~_l if it adds, else h~
        h_dtype = promote(h.dtype, self.unadded.dtype) if adds else h.dtype
        router = self.router()
        receiver = self.l - self.policy.reads_from
        if norm is not self.norms[self.l]:
            raise ValueError(f"sublayer {self.l} is read with a norm other than norms[{self.l}] given to the state")
        if self.observer is not None:
            self.observer(self.l, self.candidates(router), router)
        group = self._group_of(receiver)
        own = self.sources[group.n_committed:]
        owned = self._claim(range(group.n_committed, len(self.sources)))
        base = None
        if self.partial is not None and self.policy.include_partial:   # the partial's source is h~ - base
            if self.policy.sources == "states":
                base = torch.zeros_like(h)                                 # the current state h~ itself
            else:
                base = self.sources[-1] if self.policy.block_source == "paper" else self.block_start
        base_to_group = base is group.base
        if base_to_group:
            group.dbase_slots.append(receiver - group.first_receiver)
        r_dtype = self.sources[0].dtype
        x_dtype = r_dtype
        if add:
            x_dtype = promote(h_dtype, r_dtype if router.gate is None else promote(router.gate.dtype, r_dtype))
        table = self.source_list.table(group.n_committed) if own else None
        # A receiver whose backward would read the state and its own sources again keeps its forward's r (one row in
        # r_dtype, written and read: 2 rows of r_dtype) where that moves fewer bytes: with fp32 r (the embedding's
        # dtype under autocast) and bf16 sources from 4 sources of its own, with one dtype throughout from 2. r as
        # it was mixed (rounded to r_dtype: exact where r_dtype is fp32), so its D = go . r is that of the mixed r
        saves_r = table is not None and 2 * r_dtype.itemsize < group.state_dtype.itemsize + sum(
            t.element_size() for t in table.tensors)
        if saves_r and group.saved_r is None:
            group.saved_r = slots(len(group.routers), h, r_dtype)
        learned_null = router.null if self.policy.null_source else None
        null = NULL_NONE if not self.policy.null_source else NULL_ZERO if learned_null is None else NULL_LEARNED
        slot = receiver - group.first_receiver
        read = Read(table=table, lse_c=group.lse_c, lse=group.lse, slot=slot, queries=group.queries,
                    norm_weights=group.norm_weights, prenorm_weights=group.prenorm_weights, gates=group.gates,
                    null=null.value, eps=self.eps, norm_eps=norm.eps, add=add, r_dtype=r_dtype, x_dtype=x_dtype,
                    has_state=True, has_base=base is not None, M=self.M, d=h.shape[-1], h_dtype=h_dtype,
                    device=h.device, saved_r=group.saved_r if saves_r else None, stream=adds)
        assert not adds or (base is None and owned[-1] == len(self.sources) - 1), "v_l is not the newest own source"
        spec = Receiver(group, group.n_committed, owned, receiver != len(self.routers) - 1, base_to_group,
                        receiver == group.first_receiver and h is group.base, read)
        out = _receiver_read(spec, self.bank, h, base, self.group_output, learned_null,
                             *[self.sources[k] for k in owned])
        if not adds:
            return out
        y, h = out                        # h~_{l+1}, made by the node
        self.unadded, self._h, self.block_start = None, h, h
        return y

    # Reads hold Python state across autograd nodes (groups, the gradient bank) and launch kernels through
    # address tables: a graph traced around the whole model breaks here instead of tracing them.
    @torch.compiler.disable
    def input(self, norm: nn.Module | None = None) -> Tensor:
        if norm is None or not self.reads() or self.l < self.policy.sources_from:
            self.settled()                # before the commit: the block's start is then h~
            return super().input(norm)
        self.commit()
        return self._read(norm, add=self.policy.read == "add")

    @torch.compiler.disable
    def output(self, norm: nn.Module | None = None) -> Tensor:
        if norm is None or not self.policy.final_read:
            return super().output(norm)
        return self._read(norm, add=False)
