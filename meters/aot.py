"""Compile the depth-routing kernels for an H100/H200 (sm_90) on any machine, and read what the compiler made.

    python -m meters.aot                   # every specialisation the model launches at d = 768 ... 4096
    python -m meters.aot --json out.json   # also save the table
    python -m meters.aot --jobs 1          # in one process (default: one per CPU)

The pinned Triton wheel compiles for sm_90 without a GPU and ships NVIDIA's assembler (ptxas). The specialisations
compiled are exactly those a GPU run launches: the model runs one training step on the meta device
(meters.traffic.dry_step) for every method and routing option (and depth_kernels.depth_route.depth_route,
the public read, runs forward and backward), and each launch's arguments are bound as Triton's launcher binds them on a
GPU (integers equal to 1 or divisible by 16, 16-byte aligned pointers: the launchers guarantee the alignment). For each
specialisation it reports registers per thread and spill bytes (`ptxas -v`), shared memory, and the width of every
global load and store in the PTX: a source read at bandwidth is moved in 128-bit transfers (`ld.global.v4.b32`,
`st.global.v4.b32`, or a 16-byte `cp.async` of the software pipeline), never element by element
(`ld.global.b16` is 2 bytes).

At d = SASS_WIDTH (1044M's) each specialisation's machine code is read as well (meters/sass.py: loops,
instructions, barriers and shared-memory accesses per iteration), which meters/speed.py times.

`check` holds the rules the GPU-readiness test (tests/test_gpu_ready.py) enforces; `speed_problems` the speed rule
over the 1044M training kernels.
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import re
import subprocess
import tempfile
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from depth_kernels import depth_route
from depth_kernels.launch import register_budget
from depth_kernels.observers import Launch, observe_launches
from meters import sass
from meters.occupancy import Occupancy, occupancy
from meters.occupancy import programs_per_sm as occupancy_programs
from meters.traffic import REGIMES, ByteCounter, dry_step
from model import ModelConfig

TARGET = GPUTarget("cuda", 90, 32)          # H100 / H200, 32 threads per warp
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
PAPER_WIDTHS = (768, 1024, 1280, 2048, 4096)  # d of the 220M, 533M / 0.6B, 1044M, (Qwen3-1.7B) and 8B configs
SHARED_PER_SM = 228 * 1024
SASS_WIDTH = 1280           # the width whose machine code is read: the 1044M model's
MIN_OF_COPY = 0.60          # the speed rule: a training kernel's predicted share of the copy bandwidth at 1044M ...
MIN_PROGRAMS = 2            # ... and programs per SM (one program's barriers leave nothing to fill their waits)
# every routing option the model has, so every kernel variant it can launch is compiled
VARIANTS = [dict(residual="attnres"), dict(residual="full_attnres", null_source=True), dict(residual="delta"),
            dict(residual="delta", null_source=True, gate=True), dict(residual="delta_block"),
            dict(residual="delta_block", block_source="paper"), dict(residual="delta_block", include_partial=False),
            dict(residual="delta_block", null_source=True, gate=True),
            dict(residual="delta_block", null_source=True, learned_null=True)]
_BITS = {"8": 8, "16": 16, "32": 32, "64": 64}


@dataclass
class Compiled:
    name: str               # kernel name and what makes the specialisation distinct
    num_warps: int
    registers: int
    spill_bytes: int
    shared_bytes: int
    accesses: dict          # {bits: count} of global loads, stores and cp.async copies in the PTX
    occupancy: dict         # meters/occupancy.py's figures for a full grid, programs per SM by registers
    code: dict | None = None  # at d = SASS_WIDTH: sass.read()'s loops and per-iteration counts of the cubin


def model_launches(d: int, tokens: tuple[int, int] = (2, 64)) -> list[Launch]:
    """Every kernel launch of one training step, for every routing variant and dtype regime, at width d."""
    shape = dict(vocab_size=64, d_model=d, n_layers=4, n_heads=d // 64, n_kv_heads=d // 256 or 1, head_dim=64,
                 d_ff=4 * d, n_blocks=2, kernel="triton")
    launches = []
    for param_dtype, output_dtype in REGIMES.values():
        for variant in VARIANTS:
            counter = ByteCounter()
            dry_step(ModelConfig(**shape, **variant), tokens, counter, param_dtype, output_dtype)
            launches += counter.launches
    return launches


def api_launches(d: int, tokens: tuple[int, int] = (2, 64)) -> list[Launch]:
    """The launches of the public depth_kernels.depth_route.depth_route, forward and backward, over an fp32 source
    and eight bf16 ones (as under autocast) and over bf16 sources only, at width d."""
    launches = []
    with observe_launches(lambda launch: launches.append(launch) or True):
        for first in (torch.float32, torch.bfloat16):
            sources = [torch.empty(*tokens, d, device="meta", dtype=first if i == 0 else torch.bfloat16,
                                   requires_grad=True) for i in range(9)]
            query, norm_weight = (torch.empty(d, device="meta", requires_grad=True) for _ in range(2))
            out = depth_route.depth_route(sources, query, norm_weight)
            torch.autograd.grad(out, [*sources, query, norm_weight], torch.empty_like(out))
    return launches


def _bind(launch: Launch, backend):
    """What Triton's launcher makes of these arguments on a GPU: (signature, constexprs, attrs, options)."""
    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(**launch.args)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.args, bound, specialization, options)
    return signature, constexprs, attrs, options


def specialisations(launches: list[Launch]) -> dict[str, tuple]:
    """Distinct compiled kernels among the launches: {description: (fn, signature, constexprs, attrs, options,
    the first launch that made it)}."""
    backend = make_backend(TARGET)
    found = {}
    for launch in launches:
        signature, constexprs, attrs, options = _bind(launch, backend)
        consts = {launch.kernel.arg_names[path[0]]: v for path, v in constexprs.items()}
        flags = " ".join(f"{k}={getattr(v, 'name', v)}" for k, v in consts.items())
        pointers = " ".join(f"{k}={v[1:]}" for k, v in signature.items() if v.startswith("*") and v != "*i64")
        key = f"{launch.kernel.fn.__name__} {flags} warps={options.num_warps} | {pointers}"
        found.setdefault(key, (launch.kernel, signature, constexprs, attrs, options, launch))
    return found


def _ptx_accesses(ptx: str) -> Counter:
    """{bits: count} of the global memory transfers in PTX: ld/st.global (vector width x element size) and
    cp.async global -> shared copies (their byte count)."""
    widths = Counter()
    for vec, bits in re.findall(r"\b(?:ld|st)\.global(?:\.[a-z0-9_:]+)*?(?:\.v(\d))?\.[bfsu](8|16|32|64)\b", ptx):
        widths[int(vec or 1) * _BITS[bits]] += 1
    for size in re.findall(r"cp\.async\.c[ag]\.shared\.global(?:\.[a-z0-9_:]+)*\s*\[[^\]]*\],\s*\[[^\]]*\],\s*"
                           r"(0x[0-9a-f]+|\d+)", ptx):
        widths[8 * int(size, 0)] += 1
    return widths


def _ptxas(ptx: str) -> tuple[int, int]:
    """(registers per thread, spill store + load bytes) from `ptxas -v` for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([PTXAS, "-v", "--regAllocOptLevel=2", f"--gpu-name=sm_{TARGET.arch}a", path,
                              "-o", path + ".o"],
                             capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    return registers, spills


def compile_one(name: str, spec: tuple, read_code: bool | None = None) -> Compiled:
    """One specialisation compiled for sm_90 and read; its machine code too with read_code (default: at
    d = SASS_WIDTH)."""
    fn, signature, constexprs, attrs, options, launch = spec
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    registers, spills = _ptxas(kernel.asm["ptx"])
    threads = 32 * options.num_warps
    by_registers = 65536 // (threads * -(-registers // 8) * 8)        # registers are allocated 8 at a time
    by_shared = SHARED_PER_SM // kernel.metadata.shared if kernel.metadata.shared else 32
    fits = max(1, min(by_registers, by_shared, 2048 // threads))
    full = occupancy(launch, full_grid=True, programs=min(fits, programs_per_sm(name, options.num_warps)))
    code = sass.read(kernel.asm["cubin"], options.num_warps, kernel.metadata.shared) \
        if (launch.args.get("d") == SASS_WIDTH if read_code is None else read_code) else None
    return Compiled(name, options.num_warps, registers, spills, kernel.metadata.shared,
                    dict(_ptx_accesses(kernel.asm["ptx"])), vars(full), code)


def programs_per_sm(name: str, num_warps: int) -> int:
    """How many programs of a kernel are meant to share an SM (each kernel module says, with the reason)."""
    return occupancy_programs(name.split()[0], num_warps)


def register_bound(num_warps: int, programs: int = 2) -> int:
    """Registers per thread that let `programs` programs of num_warps warps share an SM (255 at most)."""
    return register_budget(num_warps, programs)


def check(c: Compiled) -> list[str]:
    """What keeps a compiled kernel from streaming at bandwidth on sm_90; empty when nothing does.

    - no spills; registers and shared memory that let the kernel's programs per SM share an SM;
    - at most two global accesses narrower than 32 bits (scalar parameters, such as a bf16 gate): a 16-bit
      source read element by element has dozens;
    - tiles move in 128-bit transfers: at most 16 transfers of 32 bits (per-row scalars: lse, D) and at least
      one of 128 bits (64-bit transfers are the address table's entries and pairs of per-row scalars). A
      split row (depth_kernels.launch.row_split) has two tiles of two layouts, and its per-row scalars are loaded
      for each: 32 there; and its tail of 16-bit values moves in 32-bit transfers by design (two lanes per
      thread, a warp's transfer one whole 128-byte line), so a kernel with a split row and a 16-bit tensor is
      not held to a count of them."""
    problems = []
    programs = programs_per_sm(c.name, c.num_warps)
    if c.spill_bytes:
        problems.append(f"spills {c.spill_bytes} bytes")
    if c.registers > register_bound(c.num_warps, programs):
        problems.append(f"{c.registers} registers > {register_bound(c.num_warps, programs)} ({programs} "
                        f"program(s) of {c.num_warps} warps per SM)")
    if c.shared_bytes > SHARED_PER_SM // programs:
        problems.append(f"{c.shared_bytes} bytes of shared memory > {SHARED_PER_SM // programs} ({programs} "
                        "program(s) per SM)")
    narrow = {bits: n for bits, n in c.accesses.items() if bits < 32}
    if sum(narrow.values()) > 2:
        problems.append(f"global accesses narrower than 32 bits: {narrow}")
    split = re.search(r"BLOCK_T=[1-9]", c.name)
    tail_of_16_bit = split and re.search(r"=(bf16|fp16)\b", c.name)
    narrow_32 = f"{c.accesses.get(32, 0)} 32-bit global accesses: a tile is read element by element"
    if c.accesses.get(32, 0) > (32 if split else 16) and not tail_of_16_bit and not stated_reason(c, narrow_32):
        problems.append(narrow_32)
    if not c.accesses.get(128):
        problems.append("no 128-bit global transfer")
    return problems + [p for p in Occupancy(**c.occupancy).problems() if not stated_reason(c, p)]


# Occupancy rules a kernel cannot meet, each with its reason (printed by the command, and by the test's failure)
MASKED_REASON = ("Triton's tiles are powers of two, so a row whose width is not is split into a head and a tail tile "
                 "(depth_kernels.launch.row_split), and the tail has at least two lanes per thread so that 16-bit "
                 "values move in 32-bit transfers: on 8 warps that is 512 lanes, and at d = 768 a 512-lane head and "
                 "tail are no narrower than one 1024-lane tile, a quarter of it padding")


RECEIVER_REASON = ("one receiver streams only its own row inputs (few or no sources of its own), a row per program on "
                   "as few warps as hold it without spilling and 8 warps an SM (receiver_read.WARPS_PER_SM): more "
                   "rows spill, so it may keep less than 16 KB in flight; its backward's row loop is "
                   "pipelined (ROW_STAGES) only where no source loop is nested in it (Triton pipelines innermost "
                   "loops), which is where the check holds it to 16 KB")


NARROW_REASON = ("phase 1's forward holds R_BLOCK receivers' sums of one row; at d <= 1024 a row of 16-bit sources is "
                 "2 KB or less, and the 8 stages 16 KB would take read per-row scalars in more 32-bit pieces than "
                 "the transfer rule allows: 6 stages, 9 to 12 KB (two programs per SM on 8 warps would be the fix)")


SHARES_REASON = ("phase 1's backward reads, a row and block, the column chunks' shares of the block's logits "
                 "(_group_logits' buffer: a (chunks, 8, 16) tile each of Z and G, and the squares), the row's D and "
                 "lse (8 each, M apart) and the weights made of them: small tiles whose per-thread parts the software "
                 "pipeline stages in 4-byte copies; the sources, their accumulators and go move in 128-bit transfers")


def stated_reason(c: Compiled, problem: str) -> str | None:
    """The stated reason a compiled kernel may break an occupancy rule or the transfer rule, or None."""
    d = c.occupancy["d"]
    if "masked" in problem and d & (d - 1) and c.occupancy["masked"] < 1 / 3:   # a third or more: never
        return MASKED_REASON
    if "in flight" in problem and c.name.startswith("_receiver") and not re.search(r"ROW_STAGES=[2-9]", c.name):
        return RECEIVER_REASON
    if "in flight" in problem and c.name.startswith("_group_fwd") and d <= 1024:
        return NARROW_REASON
    if "32-bit global accesses" in problem and c.name.startswith(("_group_weights ", "_group_bwd ")):
        return SHARES_REASON
    return None


# Speed rules a training kernel at 1044M may break, each with its reason: {kernel name: reason}. None today.
SPEED_REASONS: dict[str, str] = {}


def speed_problems(kernels: dict[str, dict[str, dict]]) -> list[str]:
    """What keeps the 1044M training kernels from streaming, from their compiled code: {config: {kernel: figures}}
    as meters.speed.by_kernel gives them -> one line per kernel predicted under MIN_OF_COPY of the copy
    bandwidth or run with fewer than MIN_PROGRAMS programs per SM, unless SPEED_REASONS covers the kernel."""
    problems = []
    for config, found in kernels.items():
        for name, k in found.items():
            if name in SPEED_REASONS:
                continue
            if k["of_copy"] < MIN_OF_COPY:
                problems.append(f"{config} {name}: predicted {k['of_copy']:.1%} of the copy bandwidth < "
                                f"{MIN_OF_COPY:.0%} ({k['bound']}-bound, {k['instructions']} instructions and "
                                f"{k['barriers']} barriers per iteration)")
            if k["programs_per_sm"] < MIN_PROGRAMS:
                problems.append(f"{config} {name}: {k['programs_per_sm']} program(s) per SM < {MIN_PROGRAMS} "
                                f"(grid {k['grid']} on 132 SMs, {k['resident']} fit by registers and shared memory)")
    return problems


def _compile_part(d: int, part: int, parts: int) -> list[Compiled]:
    """Every parts-th specialisation at width d from the part-th (each process finds the launches itself: the
    specialisations hold compiler objects that do not pickle, and finding them takes a second or two)."""
    found = list(specialisations(model_launches(d) + api_launches(d)).items())
    return [compile_one(name, spec) for name, spec in found[part::parts]]


def compile_all(widths: tuple[int, ...] = PAPER_WIDTHS, jobs: int = 1) -> dict[int, list[Compiled]]:
    """Every specialisation the model and the public depth_route launch, compiled, for each width, in `jobs`
    processes: Triton's compiler is single-threaded, and 490 specialisations take some 12 minutes of one core
    when its cache is empty (a fresh machine)."""
    if jobs <= 1:
        return {d: _compile_part(d, 0, 1) for d in widths}
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = {d: [pool.submit(_compile_part, d, i, jobs) for i in range(jobs)] for d in widths}
        results = {d: [p.result() for p in futures] for d, futures in parts.items()}
    # back in order: the i-th specialisation is the (i // jobs)-th of part i % jobs
    return {d: [c for round_ in itertools.zip_longest(*lists) for c in round_ if c is not None]
            for d, lists in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=list(PAPER_WIDTHS))
    parser.add_argument("--json", help="also write the table to this file")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiler processes (default: one per CPU)")
    args = parser.parse_args()
    if not os.path.exists(PTXAS):
        raise SystemExit(f"this Triton wheel has no ptxas at {PTXAS}")
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs}: allowed values are integers >= 1")
    results = compile_all(tuple(args.widths), args.jobs)
    failed = 0
    for d, compiled in results.items():
        for c in compiled:
            problems = check(c)
            failed += bool(problems)
            accesses = " ".join(f"{bits}b:{n}" for bits, n in sorted(c.accesses.items()))
            bound = register_bound(c.num_warps, programs_per_sm(c.name, c.num_warps))
            o = c.occupancy
            stated = "; ".join(p for p in Occupancy(**o).problems() if stated_reason(c, p))
            print(f"d={d:<5} {c.registers:>3} regs (<= {bound}) {c.spill_bytes:>4} B spilled "
                  f"{c.shared_bytes:>6} B shared | {accesses:<28} | {o['programs_per_sm']} prog/SM x "
                  f"{o['rows_in_flight']} rows, {o['bytes_in_flight'] / 1024:5.1f} KB in flight, "
                  f"{o['masked']:5.1%} masked | {'; '.join(problems) or 'ok'}"
                  + (f" (stated: {stated})" if stated else "") + f" | {c.name}")
    print(f"stated reasons: masked lanes at d = 768 (under a third): {MASKED_REASON}; receivers under 16 KB in flight: "
          f"{RECEIVER_REASON}; phase 1's forward at d <= 1024: {NARROW_REASON}; phase 1's backward's 32-bit "
          f"transfers: {SHARES_REASON}")
    print(f"{sum(map(len, results.values()))} specialisations, {failed} with problems")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({d: [vars(c) for c in compiled] for d, compiled in results.items()}, f, indent=2)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
