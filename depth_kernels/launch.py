"""How the routing kernels are launched: address tables, the device, registers per SM, row tiles.

- A source read through an address table is an integer to the compiler, which then knows nothing of its
  alignment. `source_table` (or a `SourceList`, which checks sources one at a time as they are committed) makes
  every source contiguous and 16-byte aligned (copying the rare view that is not) and uploads the addresses in
  one copy; the kernels say so with tl.multiple_of, which turns their source loads into 128-bit loads. Host
  work is O(N) per table (its dtype order), and a forward read's table serves its backward.
- Every launch goes through `launch`, which runs the kernel on the tensors' device unless an observer of the
  meters takes it (depth_kernels/observers.py).
- `register_budget` is the per-thread register limit a kernel is built with, from how many of its programs
  should share an SM (each kernel module says, in PROGRAMS_PER_SM, and why).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from depth_kernels.interpreter import interpreting
from depth_kernels.observers import IO, intercepted

DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


ALIGN = 16   # bytes: every address the kernels read through a table is a multiple of this (128-bit loads)
H100_SMS = 132        # streaming multiprocessors assumed where no CUDA device says (the meta device)


def launch(kernel: triton.JITFunction, grid: int, io: IO, device: torch.device, args: dict) -> None:
    """Launch kernel[(grid,)](**args) on `device`. io() -> (reads, writes): what the launch reads (tensors or
    SourceTables, with how many times) and writes, asked only when an observer is watching. args is a dict, not
    keywords: a call with some 60 keywords costs several us in Python's argument parsing (twice a receiver)."""
    if intercepted(kernel, grid, args, io):
        return
    if device.type == "cuda":
        with torch.cuda.device(device):   # Triton launches on the current device, not the tensors'
            kernel[(grid,)](**args)
    elif device.type == "cpu" and not interpreting():
        raise RuntimeError("the Triton kernels got CPU tensors: set TRITON_INTERPRET=1 before importing triton "
                           "to run them on CPU, or use kernel='reference'")
    else:
        kernel[(grid,)](**args)


def aligned(t: Tensor) -> Tensor:
    """t itself if it is contiguous and 16-byte aligned, else a contiguous copy (a fresh allocation is)."""
    if t.is_contiguous() and t.data_ptr() % ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@dataclass(slots=True)
class SourceTable:
    """The sources of one read as the kernels see them: contiguous and 16-byte aligned (a copy of any that is
    not), ordered by dtype (the n_a of sources[0]'s dtype first), and their addresses on the device, uploaded
    in one copy. Built once per forward read; its backward reuses it."""
    tensors: list[Tensor]       # in table order
    order: list[int]            # table position -> index in the caller's list of sources
    n_a: int
    addresses: Tensor           # (N,) int64, on the sources' device

    def dtype(self, group: int) -> tl.dtype:
        return DTYPES[self.tensors[0 if group == 0 else -1].dtype]

    def dtype_args(self) -> dict:
        """The kernels' A_DTYPE and B_DTYPE: the dtypes of the table's two runs of sources."""
        return dict(A_DTYPE=self.dtype(0), B_DTYPE=self.dtype(1))

    def in_caller_order(self, values: list) -> list:
        out = [None] * len(values)
        for position, i in enumerate(self.order):
            out[i] = values[position]
        return out


class SourceList:
    """Sources validated and aligned one at a time, as a forward pass commits them, so that each read's table
    (`table(lo, hi)`: sources[lo:hi]) costs little: the model's path builds a table per group and per receiver over
    sources committed earlier (depth_kernels/grouped_state.py). Each source's address is written once, as it comes, into
    one array; a table whose sources are already in dtype order (the model's always are: the embedding, then
    sublayer outputs of one dtype) is a slice of it on the device, and what was appended since the last upload
    goes up in one copy."""

    def __init__(self, capacity: int = 16):
        self.tensors: list[Tensor] = []     # aligned, in commit order
        self.dtypes: list[torch.dtype] = []
        self.changes: list[int] = []        # the i where dtypes[i] != dtypes[i - 1]: a table's dtype runs at a glance
        self.capacity = capacity            # of the first address array (it doubles when full)
        self.host_addresses: Tensor | None = None     # (capacity,) int64: each source's (pinned for a GPU's)
        self.host_view = None                         # a numpy view of it: an item written costs no torch call
        self.device_addresses: Tensor | None = None   # the same on the sources' device (on a CPU: host_addresses)
        self.uploaded = 0                             # device_addresses[:uploaded] are current

    def append(self, s: Tensor) -> None:
        """Check s against the first source (shape, device, a dtype the kernels take) and keep it aligned."""
        i = len(self.tensors)
        if i == 0:
            if s.dim() != 3:
                raise ValueError(f"sources must be (B, T, d); got a source of shape {tuple(s.shape)}")
        else:
            first = self.tensors[0]
            if s.shape != first.shape or s.device != first.device:
                raise ValueError(f"sources[{i}] is {tuple(s.shape)} on {s.device}; every source must match "
                                 f"sources[0]: {tuple(first.shape)} on {first.device}")
        if s.dtype not in DTYPES:
            raise ValueError(f"the depth-routing kernels take sources of dtype {', '.join(map(str, DTYPES))}; "
                             f"got {s.dtype} (the reference router.depth_route takes any float dtype)")
        s = aligned(s)
        if self.host_view is None or i == len(self.host_view):    # (numpy's len: Tensor.__len__ costs a us)
            self._grow(s.device)
        self.host_view[i] = s.data_ptr()
        if i and s.dtype != self.dtypes[-1]:
            self.changes.append(i)
        self.tensors.append(s)
        self.dtypes.append(s.dtype)

    def _grow(self, device: torch.device) -> None:
        """Room for `capacity` addresses, then twice as many, the ones written so far copied; earlier tables keep
        the arrays they are slices of."""
        old = self.host_addresses
        host = torch.zeros(self.capacity if old is None else 2 * len(old), dtype=torch.int64,
                           pin_memory=device.type == "cuda")
        if old is not None:
            host[:len(old)] = old
        self.host_addresses, self.host_view = host, host.numpy()
        self.device_addresses = torch.empty_like(host, device=device) if device.type == "cuda" else host
        self.uploaded = 0 if device.type == "cuda" else len(host)

    def table(self, lo: int = 0, hi: int | None = None) -> SourceTable:
        """The table of sources[lo:hi]: ordered by dtype (at most two), addresses uploaded in one copy."""
        hi = len(self.tensors) if hi is None else hi
        if hi <= lo:
            raise ValueError("depth_route needs at least one source")
        changes = [i for i in self.changes if lo < i < hi]
        if len(changes) <= 1:                     # one or two runs of dtypes: in dtype order, a slice of the addresses
            n_a = changes[0] - lo if changes else hi - lo
            if self.uploaded < hi:
                up = slice(self.uploaded, hi)
                self.device_addresses[up].copy_(self.host_addresses[up], non_blocking=True)
                self.uploaded = hi
            return SourceTable(self.tensors[lo:hi], list(range(hi - lo)), n_a, self.device_addresses[lo:hi])
        dtypes = self.dtypes[lo:hi]
        if len(set(dtypes)) > 2:
            raise ValueError("the sources mix 3 dtypes; the kernels read at most two")
        dtype_a = dtypes[0]
        n_a = dtypes.count(dtype_a)
        order = sorted(range(len(dtypes)), key=lambda i: dtypes[i] != dtype_a)     # stable: dtype_a's first
        tensors = [self.tensors[lo + i] for i in order]
        device = tensors[0].device
        addresses = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, pin_memory=device.type == "cuda")
        return SourceTable(tensors, order, n_a, addresses.to(device, non_blocking=True))


def source_steps(table: SourceTable, block: int) -> dict:
    """Phase 1's sources a step in each of the table's runs (A_STEP, B_STEP: a block of `block` bf16 sources, or one
    fp32 or fp16 source, which its kernels take as three bf16 parts) and C_MAX, the table's length rounded up to a
    power of two, 16 at least (its addresses are loaded once a program)."""
    steps = {f"{run}_STEP": block if table.dtype(k) == tl.bfloat16 else 1 for k, run in enumerate("AB")}
    return dict(steps, C_MAX=max(16, triton.next_power_of_2(len(table.tensors))))


def source_table(sources: list[Tensor]) -> SourceTable:
    """Validate the sources in one pass (shape, device, dtype, at most two dtypes) and build their table (none:
    SourceList.table says so)."""
    found = SourceList()
    for s in sources:
        found.append(s)
    return found.table()


def register_budget(num_warps: int, programs_per_sm: int) -> int:
    """Registers per thread that let `programs_per_sm` programs of num_warps warps share an SM (65,536
    registers per SM on sm_90; 255 at most). Passed to ptxas as the kernel's limit: left alone, ptxas caps some
    of these kernels at 128 and spills rather than use what one program per SM may."""
    return min(255, 65536 // (programs_per_sm * 32 * num_warps))


@functools.cache   # a pure function of its arguments, asked at every launch
def row_split(d: int, min_tail: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_T): a row of d lanes as one tile of next_pow2(d) lanes (BLOCK_T = 0), or, where d is not
    a power of two, as a head tile of the largest power of two below d and a tail tile over the row's last
    BLOCK_T = max(next_pow2(d - BLOCK_D), min_tail) columns, the ones the head holds masked off in it (a
    tail narrower than min_tail lanes would be moved in transfers narrower than 32 bits, which the copy
    engine's cp.async cannot stage). Split only where the two tiles are narrower than the one: d = 1280 is
    1024 + 512 lanes (16.7 % masked, one tile 37.5 %); 768 with a 512-lane tail stays one 1024-lane tile."""
    whole = triton.next_power_of_2(d)
    if whole == d:
        return d, 0
    head = whole // 2
    tail = max(triton.next_power_of_2(d - head), min_tail)
    return (head, tail) if head + tail < whole else (whole, 0)


def row_tiles(d: int, num_warps: int) -> dict[str, int]:
    """The kernels' BLOCK_D and BLOCK_T for rows of width d on num_warps warps (row_split). On a GPU the tail
    has at least two lanes per thread for a row's vectors (a query, a norm weight: one row), so that 16-bit
    values move in 32-bit transfers (a warp's is one whole 128-byte line); in the interpreter, where transfers
    do not matter, at least a quarter tile, so that the tests see a tail that overlaps the head (d = 80: 64 +
    32)."""
    min_tail = triton.next_power_of_2(d) // 4 if interpreting() else 2 * 32 * num_warps
    head, tail = row_split(d, min_tail)
    return dict(BLOCK_D=head, BLOCK_T=tail)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive integers (triton.cdiv costs microseconds per call on the host path)."""
    return -(-a // b)


def slab_of(numel: int) -> int:
    """Elements between consecutive (B, T, d) slots of a buffer: numel rounded up to 16 (16-byte aligned)."""
    return cdiv(numel, 16) * 16


def slots(n: int, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An (n, slab) buffer of slots shaped like `like`."""
    return torch.empty(n, slab_of(like.numel()), dtype=dtype or like.dtype, device=like.device)


def slot_view(buffer: Tensor, i: int, like: Tensor) -> Tensor:
    return buffer[i, :like.numel()].view(like.shape)


def wave(n_tiles: int, programs_per_sm: int, device: torch.device) -> tuple[int, int]:
    """(programs, tiles per program) for a kernel over n_tiles row tiles that sums partial results per
    program: one wave of programs (the SMs times the kernel's programs per SM), so the partial sums stay few."""
    if interpreting():
        return n_tiles, 1
    tiles = cdiv(n_tiles, _sm_count(device) * programs_per_sm)
    return cdiv(n_tiles, tiles), tiles


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return H100_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
