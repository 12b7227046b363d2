"""Occupancy of the routing kernels on an H100/H200 (sm_90), from their launch settings: what each kernel keeps in
flight, and the share of the memory bandwidth that lets it reach.

A kernel streams at bandwidth only if the SMs keep enough loads in flight (Little's law: bytes in flight = bandwidth
x latency; on an H100 3.35 TB/s x ~600 ns is about 2 MB over 132 SMs, some 16 KB per SM). Per kernel launch:

- programs per SM: the kernel module's PROGRAMS_PER_SM (its register budget is built for it, and
  meters/aot.py checks the compiled registers allow it), fewer when the grid has fewer programs;
- rows in flight per program: the rows of one tile (BLOCK_M; the phase-1 kernels read one token row per
  program);
- bytes in flight per SM: programs x rows x what a row keeps loading at once: one row of every per-row input
  (the stream, a base, dy, phase 1's state or go of the group's receivers: issued together), times ROW_STAGES
  where the row loop itself is pipelined (a receiver's backward with no sources of its own: the next rows'
  inputs load while one is reduced), plus STAGES rows of the sources the address table streams (the software
  pipeline's depth), with their gradient accumulators when the loop adds into them;
- masked lanes: a row is one tile of BLOCK_D = next_pow2(d) lanes, or a split row of BLOCK_D + BLOCK_T lanes
  (depth_kernels.launch.row_split), of which 1 - d / lanes do nothing.

Bytes in flight bound a launch's memory time in the speed model below (Little's law), which times a launch from its
compiled code (meters/speed.py applies it; meters/traffic.py's predicted step uses it).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton

from depth_kernels import depth_route, group_backward, group_read, receiver_read
from depth_kernels.launch import H100_SMS, SourceTable
from depth_kernels.observers import Launch

LATENCY_S = 600e-9          # a global load's latency under load on sm_90 (HBM3)
MIN_IN_FLIGHT = 16 * 1024   # bytes per SM the checks ask for: 3.35 TB/s x 600 ns / 132 SMs is about 15 KB
MAX_MASKED = 0.20           # the checks' bound on lanes that compute nothing
PROGRAMS_PER_SM = {**depth_route.PROGRAMS_PER_SM, **group_read.PROGRAMS_PER_SM, **group_backward.PROGRAMS_PER_SM}
ONE_ROW = ("_group_fwd", "_group_logits", "_group_weights", "_group_bwd")   # a token row at a time


def programs_per_sm(kernel: str, num_warps: int) -> int:
    """How many programs of a kernel are meant to share an SM: its module's PROGRAMS_PER_SM, or for the
    receivers a share of receiver_read.WARPS_PER_SM warps (each module says why)."""
    if kernel in receiver_read.ROW_LANES:
        return receiver_read.programs_per_sm(num_warps)
    return PROGRAMS_PER_SM[kernel]


@dataclass
class Occupancy:
    kernel: str
    d: int
    programs_per_sm: int
    rows_in_flight: int       # per program: the rows of one tile
    bytes_in_flight: int      # per SM
    masked: float             # fraction of each row operation's lanes that are padding

    def problems(self) -> list[str]:
        found = []
        if self.bytes_in_flight < MIN_IN_FLIGHT:
            found.append(f"{self.bytes_in_flight / 1024:.1f} KB in flight per SM < {MIN_IN_FLIGHT // 1024} KB")
        if self.masked > MAX_MASKED:
            found.append(f"{self.masked:.1%} of lanes masked > {MAX_MASKED:.0%}")
        return found


def _row_bytes(t, M: int, d: int) -> float:
    """Bytes per token row of a per-row input ((B, T, d), or slots of R such rows); 0 for anything smaller
    (a query, a norm weight, per-row scalars)."""
    return t.numel() * t.element_size() / M if t.numel() >= M * d else 0.0


def occupancy(launch: Launch, sms: int = H100_SMS, full_grid: bool = False, programs: int | None = None) -> Occupancy:
    """What one launch keeps in flight (the module docstring's model). full_grid: as if the grid filled every
    SM (a check of the launch settings, whatever the tokens); programs: per SM, if not the module's design."""
    name, args = launch.kernel.fn.__name__, launch.args
    M, d, lanes = args["M"], args["d"], args.get("BLOCK_D", args["d"]) + args.get("BLOCK_T", 0)   # head + tail
    programs = programs or programs_per_sm(name, args.get("num_warps", 4))
    programs = max(1, programs if full_grid else min(programs, triton.cdiv(launch.grid, sms)))
    tables = [t for t, _ in launch.reads if isinstance(t, SourceTable)]
    streamed = tables[0].tensors[-1].element_size() * d if tables else 0     # a source row (bf16 under autocast)
    if tables and args.get("accumulate", 0):
        streamed *= 2                     # + each source's gradient accumulator, of its dtype, read and added to
    row = sum(_row_bytes(t, M, d) for t, _ in launch.reads    # accumulators (read and written) stream with
              if not isinstance(t, SourceTable) and not any(t is w for w in launch.writes))   # their sources
    rows = 1 if name in ONE_ROW else args["BLOCK_M"]
    in_flight = programs * rows * (args.get("ROW_STAGES", 1) * row + args.get("STAGES", 1) * streamed)
    in_flight /= args.get("NC", 1)     # phase 1's backward: a program takes one chunk of the NC of every row
    return Occupancy(name, d, programs, rows, int(in_flight), 1 - d / lanes)


# ------------------------------------------------------------------------- the compiled code's speed (sm_90)
# The time a launch takes, from what its compiled loops do per iteration (meters/sass.py reads them) and
# how many iterations each program walks. One pass of the P programs resident on an SM over a region of the code
# (a loop body, or the code outside loops) takes the larger of
#   issue:   instructions x warps x P / SCHEDULERS cycles (each scheduler issues one warp instruction a cycle);
#   latency: one warp's in-order chain over the region (sass.chain_cycles): an instruction issues when the values it
#            reads are ready, each class with its LATENCY_CYCLES, a shared-memory access or shuffle also waiting for
#            the same instruction of the other warps on the SM to pass the shared-memory pipe (SHARED_PIPE_CYCLES
#            each), a barrier for everything before it. A program's warps meet at every barrier, so it cannot run
#            ahead of that chain; only other programs (P > 1) fill the waits, which the issue term then counts.
# A program's time is the sum over regions of its passes x that, and the busiest SM runs ceil(grid / SMS) programs,
# P at a time. The launch takes the larger of that and its memory time: the bytes it moves from and to DRAM
# (meters/traffic.py counts them) at the copy bandwidth of the SMs it occupies, or at what its bytes in
# flight sustain (Little's law: in flight / LATENCY_S per SM). Its predicted share of the copy bandwidth is its
# bytes / its time / COPY_BANDWIDTH.
SMS = 132                  # H200 SXM (Nsight Compute: "# SMs"); the H100 SXM has as many
CLOCK_HZ = 1.98e9          # SM clock Nsight Compute saw in the calibration runs (results/gpu/h200_ae83ce1)
SCHEDULERS = 4             # warp schedulers per sm_90 SM, one instruction per cycle each (Hopper tuning guide)
COPY_BANDWIDTH = 4.23e12   # bytes/s of a device-to-device copy on the H200 (results/gpu/h200_ae83ce1)
REGISTERS_PER_SM, THREADS_PER_SM, BLOCKS_PER_SM, SHARED_PER_SM = 65536, 2048, 32, 228 * 1024
SHARED_RESERVED = 1024     # bytes per block the driver keeps (Nsight Compute: "Driver Shared Memory Per Block")
# cycles one warp waits before an instruction that depends on one of this class issues; sm_90 figures from
# microbenchmarks (Luo et al. 2024, "Benchmarking and Dissecting the Nvidia Hopper GPU Architecture": shared
# memory ~30 cycles, shuffles through the same crossbar), NVIDIA's 4-cycle dependent-issue latency of the FP32 and
# integer pipes, a global load LATENCY_S (outside the software pipeline, whose waits sass.chain_cycles counts ready)
LATENCY_CYCLES = {"other": 4, "wait": 4, "store": 4, "async": 4, "load": round(LATENCY_S * CLOCK_HZ), "mufu": 16,
                  "shuffle": 30, "shared": 30, "barrier": 20}
# cycles of the SM's shared-memory pipe per warp's 32-bit access or shuffle: 128 bytes a cycle, no bank conflicts
SHARED_PIPE_CYCLES = 1.0


def programs_resident(registers: int, shared: int, num_warps: int) -> int:
    """Programs of a kernel an SM holds at once: registers (allocated 8 per thread at a time), shared memory (plus
    the driver's reserve per block), threads and blocks."""
    threads = 32 * num_warps
    by_registers = REGISTERS_PER_SM // (threads * -(-registers // 8) * 8)
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED)
    return max(0, min(by_registers, by_shared, THREADS_PER_SM // threads, BLOCKS_PER_SM))


@dataclass
class Pass:
    """One region of a compiled kernel as a launch runs it."""
    passes: int           # per program
    instructions: int
    latency_cycles: int   # one warp's chain, its SM's warps crowding the shared-memory pipe


def pass_seconds(p: Pass, warps: int, programs: int) -> tuple[float, str]:
    """(seconds, "issue" or "latency") for one pass of `programs` resident programs of `warps` warps."""
    issue = p.instructions * warps * programs / SCHEDULERS
    return max(issue, p.latency_cycles) / CLOCK_HZ, "issue" if issue > p.latency_cycles else "latency"


def launch_seconds(passes: list[Pass], grid: int, warps: int, resident: int, moved: float, in_flight: float) -> dict:
    """{"seconds", "bound" ("issue", "latency" or "memory"), "programs_per_sm", "rounds", "program_seconds"} of a
    launch of `grid` programs, `resident` of which fit on an SM, that moves `moved` bytes with `in_flight` bytes
    in flight per SM (occupancy())."""
    if resident < 1:
        raise ValueError("no program of this kernel fits on an SM (registers or shared memory)")
    per_sm = -(-grid // SMS)
    programs = min(resident, per_sm)
    rounds = -(-per_sm // programs)
    timed = [(p.passes * t, bound) for p in passes for t, bound in [pass_seconds(p, warps, programs)]]
    program = sum(t for t, _ in timed)
    busy = min(grid, SMS)
    memory = moved / min(COPY_BANDWIDTH * busy / SMS, busy * max(in_flight, 1.0) / LATENCY_S)
    compute = rounds * program
    bound = "memory" if memory > compute else max(timed)[1] if timed else "none"
    return {"seconds": max(compute, memory), "bound": bound, "programs_per_sm": programs, "rounds": rounds,
            "program_seconds": program}
