"""Phase 2 of grouped depth routing (depth_kernels/group_read.py derives it): one receiver finishes its read and applies
its sublayer's pre-norm in the same kernel.

- `_receiver_fwd`: the online softmax started from phase 1's state (lse_C, r_C), over the receiver's own
  sources (table), the partial block h - base and a null source (zero, or the receiver's learned vector);
  then x = h + gate r (additive) or r (replacement) and y = RMSNorm_w(x), written directly, with the lse.
- `_receiver_bwd`: recomputes r, x and the norm; dy -> dx -> go = dL/dr; the own sources' gradients into their
  accumulators, the partial block's into dh and (negated) into its base's; go and D = go . r for phase 1's
  backward; per-program partial sums of du, the pre-norm weight's and the gate's gradients.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from depth_kernels.interpreter import interpreting
from depth_kernels.launch import DTYPES, SourceTable, cdiv, launch, register_budget, row_tiles, slab_of, slot_view, wave
from depth_kernels.tiles import (NULL_LEARNED, NULL_NONE, accumulate_grad, add_slots, folded_query, grad_source,
                                 logit, mix, mix_source, null_source, read_table, row_add, row_axpy, row_cols,
                                 row_colsum, row_div, row_dot, row_dot2, row_load, row_masks, row_mul, row_offsets,
                                 row_own, row_round, row_scale, row_store, row_sub, row_vector, row_zeros,
                                 softmax_step, source_grad, start_state)

# ------------------------------------------------------------------------------------------------ kernels

@triton.jit(do_not_specialize=["n_a", "n_b", "slot", "has_gate"])
def _receiver_fwd(table, n_a, n_b, state_ptr, lse_c_ptr, slot, slab,  # own sources (a table); phase 1's state, slot
                  h_ptr, base_ptr, null_ptr, v_ptr,               # h~ (or h~_l and v_l), base, null; the
                  q_ptr, g_ptr, gate_ptr, has_gate, w_ptr,        # group's parameters, (R, d) and (R,)
                  y_ptr, lse_ptr, r_ptr, hout_ptr, M, d, eps, norm_eps,   # what it writes; sizes
                  A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr,
                  HAS_STATE: tl.constexpr, HAS_DIFF: tl.constexpr, ADD: tl.constexpr, NULL: tl.constexpr,
                  HAS_TABLE: tl.constexpr, R_SAVED: tl.constexpr, STREAM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr):
    """Receiver `slot` of a group: its read over [phase 1's state] + table sources [+ h - base] [+ a null
    source: zero, or the learned vector at null_ptr], mixed and normalised: y = RMSNorm_w(x), and the full lse
    at lse_ptr + slot M; its query, key-norm, pre-norm weight and gate are row `slot` of the group's. With STREAM,
    h = h~_l + v_l is made here, to hout_ptr (docs/kernels.md#the-streams-add-inside-the-receivers)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols, own = row_cols(d, BLOCK_D, BLOCK_T)
    masks = row_masks(row_ok, own)
    offs = row_offsets(rows.to(tl.int64)[:, None] * d, cols)
    u = folded_query(q_ptr + slot * d, g_ptr + slot * d, cols, own)   # row `slot` of the group's (R, d)
    m, l, acc = start_state(state_ptr, lse_c_ptr, slot, slab, rows, row_ok, offs, masks, cols, M, HAS_STATE,
                            BLOCK_M)
    if HAS_TABLE:
        m, l, acc = read_table(table, n_a, n_b, offs, masks, u, d, eps, m, l, acc, A_DTYPE, B_DTYPE, STAGES)
    h = row_zeros(BLOCK_M, cols)
    if ADD or HAS_DIFF or STREAM:
        h = row_load(h_ptr, offs, masks)
    if STREAM:                            # h~_{l+1} = h~_l + v_l, rounded as autograd's add rounds it
        h = row_round(row_add(h, row_load(v_ptr, offs, masks)), hout_ptr.dtype.element_ty)
        row_store(hout_ptr, offs, h, masks)
    if HAS_DIFF:                          # the partial block h - base
        p = row_sub(h, row_load(base_ptr, offs, masks))
        m, l, acc = softmax_step(m, l, acc, p, logit(p, u, d, eps)[0])
    if NULL != NULL_NONE:                 # the null source: zero, or learned (at null_ptr)
        n, z_n = null_source(null_ptr, NULL, u, cols, own, d, eps)
        m, l, acc = softmax_step(m, l, acc, n, tl.zeros((BLOCK_M,), tl.float32) + z_n)
    tl.store(lse_ptr + slot.to(tl.int64) * M + rows, m + tl.log(l), mask=row_ok)
    r = row_round(row_div(acc, l), R_DTYPE)
    if R_SAVED:                           # for the backward, in place of the state and the table's second read
        row_store(r_ptr + slot.to(tl.int64) * slab, offs, r, masks)
    gate = tl.load(gate_ptr + slot, mask=has_gate != 0, other=1.0).to(tl.float32)   # 1.0: h + 1.0 r is h + r
    x = mix(h, r, gate, ADD, X_DTYPE)
    xn = row_round(row_scale(x, tl.rsqrt(row_dot(x, x) / d + norm_eps)), X_DTYPE)
    row_store(y_ptr, offs, row_mul(row_vector(w_ptr + slot * d, cols, own), xn), masks)


@triton.jit(do_not_specialize=["n_a", "n_b", "slot", "has_gate", "off_a", "off_b", "dbase_slot", "dsum_lo", "dsum_hi",
                             "tiles", "accumulate"])
def _receiver_bwd(table, n_a, n_b, state_ptr, lse_c_ptr, slot, slab,               # as the forward's, and r_ptr:
                  h_ptr, base_ptr, null_ptr, r_ptr, lse_ptr,                      # the forward's r (R_SAVED)
                  q_ptr, g_ptr, gate_ptr, has_gate, w_ptr,
                  dy_ptr, dhs_ptr, dh_ptr, dbase_ptr, dbase_slot, dv_ptr,         # dL/dy, the stream's dL/dh; out
                  acc_a_ptr, acc_b_ptr, off_a, off_b, accumulate,                 # its own sources' accumulators
                  dsum_ptr, dsum_lo, dsum_hi, go_ptr, D_ptr,                      # slots into dh; for phase 1
                  du_ptr, dw_ptr, dgate_ptr, tiles, M, d, eps, norm_eps,          # per-program partial sums; sizes
                  A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, R_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr,
                  HAS_STATE: tl.constexpr, HAS_DIFF: tl.constexpr, ADD: tl.constexpr, SUMS: tl.constexpr,
                  NULL: tl.constexpr, HAS_TABLE: tl.constexpr, R_SAVED: tl.constexpr, STREAM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr,
                  ROW_STAGES: tl.constexpr):
    """Backward of `_receiver_fwd` for `tiles` row tiles per program: dh (with SUMS + slots dsum_lo..dsum_hi - 1:
    the group's other receivers' -dL/d(partial), since this h is their base), -dL/d(partial) at slot dbase_slot,
    the table sources' gradients, go = dL/dr and D = go . r, and per-program partial sums of du, dw and dgate in
    row `slot` of the group's (R, programs, d) and (R, programs) buffers. With R_SAVED r is the forward's, not
    recomputed; with STREAM dh (the stream's part + the read's) is also added to v_l's at dv_ptr."""
    pid = tl.program_id(0)
    cols, own = row_cols(d, BLOCK_D, BLOCK_T)
    u = folded_query(q_ptr + slot * d, g_ptr + slot * d, cols, own)
    gate = tl.load(gate_ptr + slot, mask=has_gate != 0, other=1.0).to(tl.float32)
    if NULL == NULL_LEARNED:              # the learned null's logit (its vector is read per row: registers)
        z_n = null_source(null_ptr, NULL, u, cols, own, d, eps)[1]
    du = row_zeros(1, cols)
    dw = row_zeros(1, cols)
    dgate = tl.zeros((BLOCK_M,), tl.float32)
    for t in tl.range(0, tiles, num_stages=ROW_STAGES):   # pipelined when nothing below loops (ROW_STAGES > 1)
        rows = (pid * tiles + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        masks = row_masks(row_ok, own)
        offs = row_offsets(rows.to(tl.int64)[:, None] * d, cols)
        lse = tl.load(lse_ptr + slot.to(tl.int64) * M + rows, mask=row_ok, other=float("inf"))  # rows past M:
        # every weight exp(z - lse) is 0, so nothing there overflows into the sums over rows
        h = row_zeros(BLOCK_M, cols)
        p = row_zeros(BLOCK_M, cols)
        if ADD or HAS_DIFF:
            h = row_load(h_ptr, offs, masks)
        if HAS_DIFF:
            p = row_sub(h, row_load(base_ptr, offs, masks))
        if R_SAVED:                       # the forward's r, as it was mixed (rounded to R_DTYPE)
            r = row_load(r_ptr + slot.to(tl.int64) * slab, offs, masks)
        else:                             # the read-out again: r = exp(lse_C - lse) r_C + sum_i exp(z_i - lse) s_i
            m, _, r = start_state(state_ptr, lse_c_ptr, slot, slab, rows, row_ok, offs, masks, cols, M, HAS_STATE,
                                  BLOCK_M)
            r = row_scale(r, tl.exp(m - lse))
            if HAS_TABLE:
                for i in tl.range(0, n_a, num_stages=STAGES):
                    r = mix_source(table, i, A_DTYPE, offs, masks, u, d, eps, lse, r)
                for i in tl.range(n_a, n_a + n_b, num_stages=STAGES):
                    r = mix_source(table, i, B_DTYPE, offs, masks, u, d, eps, lse, r)
            if HAS_DIFF:                  # (+ the partial block's term, + a learned null's)
                r = row_axpy(tl.exp(logit(p, u, d, eps)[0] - lse), p, r)
            if NULL == NULL_LEARNED:
                r = row_axpy(tl.exp(z_n - lse), row_vector(null_ptr, cols, own), r)
        r_mixed = row_round(r, R_DTYPE)
        # the norm's backward: y = w xn, xn = x rstd  ->  dx = rstd (gy - xn (gy . xn) / d), gy = dy w
        x = mix(h, r_mixed, gate, ADD, X_DTYPE)
        rstd_x = tl.rsqrt(row_dot(x, x) / d + norm_eps)
        xn = row_scale(x, rstd_x)
        dy = row_load(dy_ptr, offs, masks)
        dw = row_colsum(dw, row_mul(dy, row_round(xn, X_DTYPE)))
        gy = row_mul(dy, row_vector(w_ptr + slot * d, cols, own))   # w read per row: one row's registers
        dx = row_scale(row_axpy(-row_dot(gy, xn) / d, xn, gy), rstd_x)
        if ADD:                           # x = h + gate r: dL/dh = dx, dL/dr = gate dx
            dh = dx
            dr = row_scale(dx, tl.zeros((BLOCK_M,), tl.float32) + gate)
        else:
            dh = row_zeros(BLOCK_M, cols)
            dr = dx
        if HAS_STATE:                     # go as phase 1's backward will read it, used alike here: the
            dr = row_round(dr, go_ptr.dtype.element_ty)   # softmax backward's go . s_i - D is consistent
        D, dxr = row_dot2(dr, r, dx, r_mixed)   # D = dr . r, and dgate's dx . r (additive) in the same reduction
        if ADD:
            dgate += dxr
        if HAS_DIFF:                      # d(h - base): + to h, - to base
            dp, dz_rstd = source_grad(p, dr, u, lse, D, d, eps)
            du = row_colsum(du, row_scale(p, dz_rstd))
            dh = row_add(dh, dp)
            row_store(dbase_ptr + dbase_slot.to(tl.int64) * slab, offs, row_sub(row_zeros(BLOCK_M, cols), dp),
                      masks)
        if SUMS and not HAS_TABLE:        # no source loop follows: the group's slots join dh before its one store
            dh = add_slots(dh, dsum_ptr, dsum_lo, dsum_hi, slab, offs, masks)
        if STREAM and ADD:                # dL/dh = the read's (rounded as stored) + the stream's, as autograd sums
            dh = row_add(row_round(dh, dh_ptr.dtype.element_ty), row_load(dhs_ptr, offs, masks))
        if ADD or HAS_DIFF or SUMS:
            row_store(dh_ptr, offs, dh, masks)
        if HAS_STATE:                     # for phase 1's backward
            row_store(go_ptr + slot.to(tl.int64) * slab, offs, dr, masks)
            tl.store(D_ptr + slot.to(tl.int64) * M + rows, D, mask=row_ok)
        if HAS_TABLE:
            for i in tl.range(0, n_a, num_stages=STAGES):
                du = grad_source(table, i, A_DTYPE, offs, masks, dr, u, lse, D, d, eps, du,
                                 acc_a_ptr + (off_a + i).to(tl.int64) * slab, accumulate)
            for i in tl.range(n_a, n_a + n_b, num_stages=STAGES):
                du = grad_source(table, i, B_DTYPE, offs, masks, dr, u, lse, D, d, eps, du,
                                 acc_b_ptr + (off_b + i - n_a).to(tl.int64) * slab, accumulate)
        if SUMS and HAS_TABLE:            # last, when few registers are live: dh += the group's slots
            tl.debug_barrier()            # dh stored above by this program's threads, now read back
            dh = add_slots(row_load(dh_ptr, offs, masks), dsum_ptr, dsum_lo, dsum_hi, slab, offs, masks)
            row_store(dh_ptr, offs, dh, masks)
        if STREAM:                        # last, as above: v_l's gradient += dL/dh (its table term is in)
            tl.debug_barrier()            # v_l's accumulator (and dh) stored above by this program's threads
            accumulate_grad(dv_ptr, row_load(dh_ptr, offs, masks), offs, masks, 1)
    part = slot * tl.num_programs(0) + pid        # this receiver's row of the group's (R, programs) partials
    row_store(du_ptr + part.to(tl.int64) * d, row_offsets(0, cols), du, row_own(own))
    row_store(dw_ptr + part.to(tl.int64) * d, row_offsets(0, cols), dw, row_own(own))
    tl.store(dgate_ptr + part, tl.sum(dgate, axis=0))


# ------------------------------------------------------------------------------------------ launching

# A row of a receiver's read is held by as few warps as hold it without spilling (docs/kernels.md#phase-1-and-phase-2):
# at d = 1280 one forward, two backward, so that a row's dot products reduce within a warp or between two; an SM
# holds WARPS_PER_SM warps of several programs, each with 255 registers (meters/aot.py checks them).
WARPS_PER_SM = 8
ROW_LANES = {"_receiver_fwd": 1280, "_receiver_bwd": 640}   # a row's lanes per warp, at most
ROW_STAGES = 2   # the backward's next row's inputs load while one is reduced, where nothing loops in its row loop


def programs_per_sm(num_warps: int) -> int:
    """How many programs of a receiver kernel of num_warps warps share an SM (WARPS_PER_SM warps)."""
    return max(1, WARPS_PER_SM // num_warps)


def row_warps(kernel: str, d: int, heavy: bool = False) -> int:
    """Warps holding a row of width d (ROW_LANES); twice as many (at most WARPS_PER_SM) for a heavy backward."""
    warps = triton.next_power_of_2(cdiv(d, ROW_LANES[kernel]))
    return min(WARPS_PER_SM, 2 * warps if heavy else warps)


@functools.cache   # a pure function of its arguments, asked at every launch
def _receiver_config(M: int, d: int, backward: bool, heavy: bool = False) -> dict:
    """A row per program on row_warps warps (rows split where d is not a power of two: launch.row_tiles); source
    loops 3 stages deep forward, 2 backward. heavy: a backward that recomputes its read-out beside the partial block
    (from its own sources, with a learned null, or mixed by replacement) or, in 16 bits, beside the stream's add:
    on two warps these spill (meters/aot.py compiles every one)."""
    if interpreting():
        return dict(BLOCK_M=min(triton.next_power_of_2(M), 256), **row_tiles(d, 4), STAGES=1, num_warps=4)
    kernel = "_receiver_bwd" if backward else "_receiver_fwd"
    warps = row_warps(kernel, d, heavy and backward)
    return dict(BLOCK_M=1, **row_tiles(d, warps), STAGES=2 if backward else 3, num_warps=warps,
                maxnreg=register_budget(warps, programs_per_sm(warps)))


class Inputs(NamedTuple):
    """A read's tensors that its autograd node saves for its backward (so saved-tensor hooks see them)."""
    h: Tensor                         # (B, T, d) the stream h~ (and the partial block's minuend)
    base: Tensor | None               # the partial block h~ - base's base, or None
    state: Tensor | None              # (R, slab) phase 1's r_C, or None (none committed, or r kept: Read.saved_r)
    null: Tensor | None               # (d,) a learned null source, or None


@dataclass(frozen=True)
class Launches:
    """What a read's launches take that its kind fixes: non-tensor arguments and configuration, grid, programs."""
    forward: dict
    backward: dict
    grid: int
    programs: int


@functools.cache   # the same receiver asks again at every step: a pure function of the kind of read
def _launches(n_a: int, n_b: int, a_dtype: tl.dtype, b_dtype: tl.dtype, slot: int, slab: int, M: int, d: int,
              has_gate: bool, null: int, eps: float, norm_eps: float, r_dtype: tl.dtype, x_dtype: tl.dtype,
              has_state: bool, has_base: bool, add: bool, has_table: bool, r_saved: bool, stream: bool,
              device: torch.device) -> Launches:
    shared = dict(n_a=n_a, n_b=n_b, A_DTYPE=a_dtype, B_DTYPE=b_dtype, slot=slot, slab=slab,
                  has_gate=int(has_gate), NULL=null, M=M, d=d, eps=eps, norm_eps=norm_eps, R_DTYPE=r_dtype,
                  X_DTYPE=x_dtype, HAS_STATE=has_state, HAS_DIFF=has_base, ADD=add, HAS_TABLE=has_table,
                  R_SAVED=r_saved, STREAM=stream)
    heavy = not r_saved and (has_base and (has_table or null == NULL_LEARNED or not add)
                             or stream and has_table and r_dtype.primitive_bitwidth == 16)
    forward, backward = _receiver_config(M, d, backward=False), _receiver_config(M, d, True, heavy)
    programs, tiles = backward_wave(M, d, device)   # the group's buffers' programs: a heavy one's may take two waves
    return Launches(dict(shared, **forward), dict(shared, **backward, tiles=tiles), cdiv(M, forward["BLOCK_M"]),
                    programs)


@dataclass(slots=True)
class Read:
    """One receiver's read, as both of its kernels take it, less its Inputs. M = B T rows of width d; the group's
    buffers hold one slot (row) per receiver of the group, R in all."""
    table: SourceTable | None         # the receiver's own sources (committed since its group began), or none
    lse_c: Tensor                     # (R, M) phase 1's log-sum-exp
    lse: Tensor                       # (R, M) the full log-sum-exp: written forward, read backward
    slot: int                         # this receiver's row of the state, lse_c and lse
    queries: Tensor                   # (R, d) the group's w_l: row `slot` is this receiver's
    norm_weights: Tensor              # (R, d) the group's g_l
    prenorm_weights: Tensor           # (R, d) the group's sublayers' pre-norm weights
    gates: Tensor | None              # (R,) the group's gamma_l, or None
    null: int                         # the null source: NULL_NONE, NULL_ZERO or NULL_LEARNED (Inputs.null)
    eps: float                        # the routing keys' RMSNorm eps
    norm_eps: float                   # the pre-norm's eps
    add: bool                         # additive (x = h + gate r) or replacement (x = r)
    r_dtype: torch.dtype              # r and x are rounded where the reference rounds them
    x_dtype: torch.dtype
    has_state: bool                   # reads phase 1's state (and hands go, D back to it)
    has_base: bool                    # reads the partial block h - base
    M: int                            # rows (B T) of the step's (B, T, d) tensors
    d: int
    h_dtype: torch.dtype              # the stream's
    device: torch.device
    saved_r: Tensor | None = None     # (R, slab) the group's kept read-outs r (in r_dtype; row `slot`), or None
    stream: bool = False              # its kernels make h = h~_l + v_l and its gradient (GroupedDepthState.add)

    launches: Launches = field(init=False, repr=False)   # what its two launches take that its kind fixes

    def __post_init__(self) -> None:                  # every read launches: made at once (no cached_property's lock)
        table, M, d = self.table, self.M, self.d
        n_a, n_b = (table.n_a, len(table.tensors) - table.n_a) if table is not None else (0, 0)
        a, b = (table.dtype(0), table.dtype(1)) if table is not None else (DTYPES[self.h_dtype],) * 2
        self.launches = _launches(n_a, n_b, a, b, self.slot, slab_of(M * d), M, d, self.gates is not None,
                                  self.null, self.eps, self.norm_eps, DTYPES[self.r_dtype], DTYPES[self.x_dtype],
                                  self.has_state, self.has_base, self.add, table is not None,
                                  self.saved_r is not None, self.stream, self.device)

    def args(self, static: dict, i: Inputs) -> dict:
        """A launch's keyword arguments: its static ones and the read's tensors (placeholders its flags keep unread)."""
        h = i.h
        return {**static, "table": h if self.table is None else self.table.addresses,   # h: never read
                "state_ptr": h if i.state is None else i.state, "lse_c_ptr": self.lse_c, "h_ptr": h,
                "base_ptr": h if i.base is None else i.base, "q_ptr": self.queries, "g_ptr": self.norm_weights,
                "gate_ptr": self.queries if self.gates is None else self.gates, "w_ptr": self.prenorm_weights,
                "lse_ptr": self.lse, "null_ptr": self.queries if i.null is None else i.null,
                "r_ptr": h if self.saved_r is None else self.saved_r}

    def reads(self, i: Inputs, backward: bool) -> list:
        """What a kernel reads (for observers): backward, the table twice and the state, or the table and a saved r."""
        h, saved = i.h, backward and self.saved_r is not None
        reads = [(self.table, 1 + (backward and not saved))] if self.table is not None else []
        reads += [(slot_view(self.saved_r, self.slot, h), 1)] if saved else []
        reads += [(slot_view(i.state, self.slot, h), 1)] if i.state is not None and not saved else []
        reads_h = self.add or i.base is not None or (self.stream and not backward)   # the stream's add reads h~_l
        return reads + ([(h, 1)] if reads_h else []) + ([(i.base, 1)] if i.base is not None else [])


@dataclass(slots=True)
class ReadGrads:
    """Where a receiver's backward writes: its own sources' gradient accumulators (acc_a, acc_b, off_a, off_b:
    depth_kernels/groups.py's GradBank.pointers), written or added to; go and D slots for phase 1's backward
    (None without a state); slot dbase_slot of dbase (slots shaped like h) for -dL/d(partial); dsum = (buffer,
    lo, hi): slots lo..hi-1 of buffer added to dh (the group's other partials, when h is their base); du and dw
    (R, programs, d) and dgate (R, programs): the group's buffers of per-program partial sums (backward_wave),
    row `slot` this receiver's."""
    accumulators: tuple[Tensor, Tensor, int, int]
    accumulate: bool
    go: Tensor | None
    D: Tensor | None
    dbase: Tensor | None
    dbase_slot: int
    du: Tensor
    dw: Tensor
    dgate: Tensor
    dsum: tuple[Tensor, int, int] | None = None
    dv: Tensor | None = None          # (B, T, d) v_l's accumulator, where dL/dh joins (Read.stream)


def backward_wave(M: int, d: int, device: torch.device) -> tuple[int, int]:
    """(programs, row tiles per program) of the receiver backward at M rows of width d, one wave of its programs
    (a heavy one's, on twice the warps, two): its per-program partial sums are (programs, d)."""
    cfg = _receiver_config(M, d, backward=True)
    return wave(cdiv(M, cfg["BLOCK_M"]), programs_per_sm(cfg["num_warps"]), device)


def receiver_forward(read: Read, i: Inputs, y_dtype: torch.dtype, v: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(y, h): y = RMSNorm_w(h + gate r) (add) or RMSNorm_w(r), r over [the state's slot] + the table's sources
    [+ h - base] [+ the null source]; writes lse[slot]. h is i.h, or with read.stream h~_l + v_l (i.h, v)."""
    h = i.h
    y = torch.empty_like(h, dtype=y_dtype)
    made = torch.empty_like(h, dtype=read.h_dtype) if read.stream else h
    launches = read.launches

    def io() -> tuple[list, list]:
        saved = [slot_view(read.saved_r, read.slot, h)] if read.saved_r is not None else []
        stream = ([(v, 1)], [made]) if read.stream else ([], [])
        return read.reads(i, backward=False) + stream[0], [y, read.lse[read.slot]] + saved + stream[1]

    args = read.args(launches.forward, i)
    args.update(y_ptr=y, v_ptr=h if v is None else v, hout_ptr=made)
    launch(_receiver_fwd, launches.grid, io, h.device, args)
    return y, made


def receiver_backward(read: Read, i: Inputs, dy: Tensor, out: ReadGrads,
                      dh_stream: Tensor | None = None) -> Tensor | None:
    """Backward of receiver_forward into `out` (ReadGrads). Returns dh (None when h is unused); the partial sums
    of du, dw and dgate are left in out.du, out.dw and out.dgate for the group. A learned null's own gradient
    and its du term are left to grouped_state.learned_null_grads, from go, D and lse. With read.stream, dh_stream
    (the stream's part of dL/dh) joins dh, which is also added to v_l's gradient at out.dv."""
    h, table, slot, launches = i.h, read.table, read.slot, read.launches
    uses_h = read.add or read.has_base or out.dsum is not None
    dh = torch.empty_like(h) if uses_h else None
    if read.stream and not uses_h:        # dL/dh is the stream's part alone: the kernel reads it as dh
        dh = dh_stream
    dsum_ptr, dsum_lo, dsum_hi = out.dsum if out.dsum is not None else (h, 0, 0)
    acc_a, acc_b, off_a, off_b = out.accumulators

    def io() -> tuple[list, list]:
        n_a, n_b = launches.backward["n_a"], launches.backward["n_b"]
        grads = [acc_a[off_a:off_a + n_a, :h.numel()], acc_b[off_b:off_b + n_b, :h.numel()]]
        reads = read.reads(i, backward=True) + [(dy, 1), (read.lse[slot], 1)]
        reads += [(g, 1) for g in grads] if out.accumulate else []
        reloads = out.dsum is not None and table is not None   # dh stored, read back and summed with the slots
        reads += [(dsum_ptr[dsum_lo:dsum_hi, :h.numel()], 1)] if out.dsum is not None else []
        reads += [(dh, 1)] if reloads else []
        if read.stream:                   # the stream's part [into dh], then dL/dh read into v_l's accumulator
            reads += [(dh_stream, 1)] + ([(dh, 1)] if uses_h else []) + [(out.dv, 1)]
        writes = grads + [out.du[slot], out.dw[slot], out.dgate[slot]] + ([out.dv] if read.stream else [])
        writes += ([dh] * (1 + reloads) if uses_h else [])
        writes += [slot_view(out.dbase, out.dbase_slot, h)] if read.has_base else []
        return reads, writes + ([slot_view(out.go, slot, h), out.D[slot]] if read.has_state else [])

    args = read.args(launches.backward, i)
    args.update(dy_ptr=dy, acc_a_ptr=acc_a, acc_b_ptr=acc_b, off_a=off_a, off_b=off_b, dh_ptr=h if dh is None else dh,
                dbase_ptr=h if out.dbase is None else out.dbase, dbase_slot=out.dbase_slot,
                go_ptr=h if out.go is None else out.go, D_ptr=read.lse if out.D is None else out.D, dsum_ptr=dsum_ptr,
                dsum_lo=dsum_lo, dsum_hi=dsum_hi, du_ptr=out.du, dw_ptr=out.dw, dgate_ptr=out.dgate,
                accumulate=int(out.accumulate), SUMS=out.dsum is not None,
                ROW_STAGES=ROW_STAGES if table is None and out.dsum is None else 1,
                dhs_ptr=h if dh_stream is None else dh_stream, dv_ptr=h if out.dv is None else out.dv)
    launch(_receiver_bwd, launches.programs, io, h.device, args)
    return dh
