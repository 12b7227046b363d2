"""Occupancy of the routing kernels on an H100/H200 (sm_90), from their launch settings: what each kernel keeps in
flight, and the share of the memory bandwidth that lets it reach.

A kernel streams at bandwidth only if the SMs keep enough loads in flight (Little's law: bytes in flight = bandwidth
x latency; on an H100 3.35 TB/s x ~600 ns is about 2 MB over 132 SMs, some 16 KB per SM). Per kernel launch:

- programs per SM: the kernel module's PROGRAMS_PER_SM (its register budget is built for it, and
  depth_kernels/tools/aot.py checks the compiled registers allow it), fewer when the grid has fewer programs;
- rows in flight per program: the rows of one tile (BLOCK_M; the phase-1 kernels read one token row per
  program);
- bytes in flight per SM: programs x rows x what a row keeps loading at once: one row of every per-row input
  (the stream, a base, dy, phase 1's state or go of the group's receivers: issued together), times ROW_STAGES
  where the row loop itself is pipelined (a receiver's backward with no sources of its own: the next rows'
  inputs load while one is reduced), plus STAGES rows of the sources the address table streams (the software
  pipeline's depth), with their gradient accumulators when the loop adds into them;
- masked lanes: a row is one tile of BLOCK_D = next_pow2(d) lanes, or a split row of BLOCK_D + BLOCK_T lanes
  (depth_kernels.launch.row_split), of which 1 - d / lanes do nothing.

The bandwidth model (depth_kernels/tools/traffic.py uses it): a kernel reaches MAX_EFFICIENCY of the peak bandwidth if
its SMs keep at least LATENCY x peak / SMs bytes in flight, and proportionally less below that.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton

from depth_kernels import depth_route, group_read, receiver_read
from depth_kernels.launch import H100_SMS, Launch, SourceTable

LATENCY_S = 600e-9          # a global load's latency under load on sm_90 (HBM3), the model's one constant
MAX_EFFICIENCY = 0.80       # the share of peak bandwidth a well-fed streaming kernel reaches
MIN_IN_FLIGHT = 16 * 1024   # bytes per SM the checks ask for: 3.35 TB/s x 600 ns / 132 SMs is about 15 KB
MAX_MASKED = 0.20           # the checks' bound on lanes that compute nothing
PROGRAMS_PER_SM = {**depth_route.PROGRAMS_PER_SM, **group_read.PROGRAMS_PER_SM, **receiver_read.PROGRAMS_PER_SM}
ONE_ROW = ("_group_fwd", "_group_bwd")   # one token row per program (the receivers' rows are what they hold)


@dataclass
class Occupancy:
    kernel: str
    d: int
    programs_per_sm: int
    rows_in_flight: int       # per program: the rows of one tile
    bytes_in_flight: int      # per SM
    masked: float             # fraction of each row operation's lanes that are padding

    def efficiency(self, peak_bandwidth: float, sms: int = H100_SMS) -> float:
        """The share of peak bandwidth this kernel reaches under the module's model."""
        need = LATENCY_S * peak_bandwidth / sms
        return MAX_EFFICIENCY * min(1.0, self.bytes_in_flight / need)

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
    M, d = args["M"], args["d"]
    # a split row: head + tail; phase 1's rows: chunks of BK columns
    lanes = args["BLOCK_D"] + args.get("BLOCK_T", 0) if "BLOCK_D" in args else triton.cdiv(d, args["BK"]) * args["BK"]
    programs = programs or PROGRAMS_PER_SM[name]
    programs = max(1, programs if full_grid else min(programs, triton.cdiv(launch.grid, sms)))
    tables = [t for t, _ in launch.reads if isinstance(t, SourceTable)]
    streamed = tables[0].tensors[-1].element_size() * d if tables else 0     # a source row (bf16 under autocast)
    if tables and args.get("accumulate", 0):
        streamed *= 2                     # + each source's gradient accumulator, of its dtype, read and added to
    row = sum(_row_bytes(t, M, d) for t, _ in launch.reads    # accumulators (read and written) stream with
              if not isinstance(t, SourceTable) and not any(t is w for w in launch.writes))   # their sources
    rows = 1 if name in ONE_ROW else args["BLOCK_M"]
    in_flight = programs * rows * (args.get("ROW_STAGES", 1) * row + args["STAGES"] * streamed)
    return Occupancy(name, d, programs, rows, int(in_flight), 1 - d / lanes)
