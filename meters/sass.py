"""Read a compiled routing kernel's sm_90 machine code (SASS): its loops, what one pass of each does, and how many
passes a launch makes (meters/speed.py times the 1044M training kernels with it).

A kernel's speed is set by what its innermost loops do per iteration, which the PTX does not show (the cross-warp
reductions, their barriers and shared-memory traffic appear only after ptxas). The Triton wheel ships NVIDIA's
disassembler (nvdisasm), which reads the cubin that meters/aot.py compiles; with line info (-g) every
instruction names the Python line it came from. So:

- a loop is a backward branch (BRA to an earlier address); its body is the code between the target and the branch,
  and loops nest by containment. The branch carries the line of the Python `for` it closes;
- a region is a loop body less the loops nested in it, or the code outside every loop. Per region: instructions by
  class (`CLASSES`), barriers (BAR), shared-memory instructions (LDS/STS/ATOMS/LDSM, and the shuffles of warp
  reductions counted apart), global bytes per thread loaded, stored and copied asynchronously (LDG/STG/LDGSTS with
  their .64/.128 widths); instructions under the never-true predicate (@!PT) and NOPs are left out;
- a region's passes per program: the product of its loop's and its enclosing loops' trip counts, each the length
  of the `range(...)` its `for` statement writes, evaluated with the launch's arguments (a helper's parameter
  through the argument its kernel passes, e.g. tiles.add_slots(lo, hi) <- dsum_lo, dsum_hi). A loop the compiler
  unrolled is two loops closing the same `for`: the longer runs trips // k passes (k: how many times longer it
  is), the shorter the trips % k left over.

Every instruction of a region counts on every pass: branches inside a loop (a receiver group past the last) are
taken as executed, an upper bound the 1044M shapes meet (full groups).
"""
from __future__ import annotations

import ast
import functools
import linecache
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field

import triton

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "depth_kernels")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
NVDISASM = os.path.join(BIN, "nvdisasm")
CUOBJDUMP = os.path.join(BIN, "cuobjdump")
# instruction classes, by the opcode's first word
CLASSES = {"BAR": "barrier", "LDS": "shared", "STS": "shared", "ATOMS": "shared", "LDSM": "shared",
           "SHFL": "shuffle", "LDG": "load", "STG": "store", "RED": "store", "ATOMG": "store", "LDGSTS": "async",
           "MUFU": "mufu", "DEPBAR": "wait", "LDGDEPBAR": "wait"}
_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
_INSTR = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P[0-9T]\s+)?([A-Z0-9_.]+)([^;]*);")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Instruction:
    address: int
    opcode: str               # with modifiers: LDG.E.128
    operands: str
    where: tuple[str, int]    # (Python file, line) the instruction came from
    target: str | None = None  # a branch's label


@dataclass
class Region:
    """A loop body less its nested loops (or, with loop None, the code outside every loop)."""
    loop: tuple[str, int] | None        # the Python `for` it closes: (file, line)
    enclosing: list[tuple[str, int]]    # the loops around it, outermost first
    classes: dict = field(default_factory=dict)   # {class: instructions}
    bytes: dict = field(default_factory=dict)     # {"load" | "store" | "async": bytes per thread per pass}
    code: list = field(default_factory=list)      # its Instructions, in address order
    unroll: int = 1       # Python iterations per pass (a loop the compiler unrolled)
    remainder: int = 0    # > 0: the leftover iterations of a loop unrolled this many times, one per pass

    @property
    def instructions(self) -> int:
        return sum(self.classes.values())


def disassemble(cubin: bytes) -> str:
    """nvdisasm's SASS of a cubin, with line info."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([NVDISASM, "-c", "-g", path], capture_output=True, text=True, check=True).stdout


def resources(cubin: bytes) -> dict[str, int]:
    """{"registers", "shared"} per thread and per block as the cubin holds them (cuobjdump -res-usage): what a
    GPU allocates, after Triton's maxnreg."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([CUOBJDUMP, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:\d+ SHARED:(\d+)", out)
    if not found:
        raise ValueError(f"cuobjdump -res-usage names no registers: {out[-300:]!r}")
    return {"registers": int(found.group(1)), "shared": int(found.group(2))}


def parse(sass: str) -> tuple[list[Instruction], dict[str, int]]:
    """(instructions in address order, {label: address}) of one kernel's SASS."""
    instructions, labels, pending, where = [], {}, [], ("", 0)
    for text in sass.splitlines():
        if m := _LINE.search(text):
            where = (m.group(1), int(m.group(2)))
        elif m := _LABEL.match(text):
            pending.append(m.group(1))
        elif m := _INSTR.search(text):
            address = int(m.group(1), 16)
            labels.update({label: address for label in pending})
            pending = []
            if (m.group(2) or "").strip() == "@!PT" or m.group(3) == "NOP":
                continue                  # never executed (a scheduling placeholder) or padding
            target = _TARGET.search(m.group(4))
            instructions.append(Instruction(address, m.group(3), m.group(4), where,
                                            target.group(1) if target else None))
    return instructions, labels


def _width(opcode: str) -> int:
    """Bytes per thread one global transfer moves: LDG.E.128 16, LDG.E.64 8, LDG.E 4, LDG.E.U16 2."""
    return next((_WIDTH[p] for p in opcode.split(".")[1:] if p in _WIDTH), 4)


def regions(sass: str) -> list[Region]:
    """The kernel's regions: the code outside every loop first, then each loop's own body."""
    instructions, labels = parse(sass)
    loops = sorted(((labels[i.target], i.address, i.where) for i in instructions
                    if i.opcode.startswith("BRA") and i.target in labels and labels[i.target] < i.address),
                   key=lambda loop: (loop[0], -loop[1]))
    found = [Region(None, [])] + [Region(where, []) for _, _, where in loops]
    for region, (start, end, _) in zip(found[1:], loops):
        region.enclosing = [w for s, e, w in loops if s <= start and end <= e and (s, e) != (start, end)]
    for i in instructions:
        inside = [k for k, (s, e, _) in enumerate(loops) if s <= i.address <= e]
        region = found[1 + min(inside, key=lambda k: loops[k][1] - loops[k][0])] if inside else found[0]
        kind = CLASSES.get(i.opcode.split(".")[0], "other")
        region.classes[kind] = region.classes.get(kind, 0) + 1
        region.code.append(i)
        if kind in ("load", "store", "async"):
            region.bytes[kind] = region.bytes.get(kind, 0) + _width(i.opcode)
    _mark_unrolled(found[1:])
    return found


def _mark_unrolled(loops: list[Region]) -> None:
    """Loops that close the same Python `for` in the same enclosing loops are one loop the compiler unrolled: the
    shortest runs one iteration a pass (the remainder), each other one as many as it is longer (rounded)."""
    groups = {}
    for r in loops:
        groups.setdefault((r.loop, tuple(r.enclosing)), []).append(r)
    for group in groups.values():
        if len(group) > 1:
            one = min(group, key=lambda r: r.instructions)
            for r in group:
                r.unroll = max(1, round(r.instructions / one.instructions)) if r is not one else 1
            one.remainder = max(r.unroll for r in group)


# ------------------------------------------------------------------------------------------- trip counts

@functools.cache
def _tree(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read())


def _here(path: str, kernel_path: str) -> str:
    """The file a line record names, as it is in this checkout. Triton caches compiled code by the sources' hash,
    so the records may name the folder of another checkout that compiled the same sources: the file is looked up
    by name beside the kernel, then in the fast path's package."""
    for folder in (os.path.dirname(kernel_path), PACKAGE):
        if os.path.exists(found := os.path.join(folder, os.path.basename(path))):
            return found
    raise ValueError(f"compiled code names {path}, found neither beside {kernel_path} nor in {PACKAGE}")


def _range_of(path: str, line: int) -> ast.Call:
    """The range(...) call of the `for` statement at a Python line."""
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.For) and node.lineno == line and isinstance(node.iter, ast.Call):
            return node.iter
    raise ValueError(f"{path}:{line} is no `for ... in range(...)`: {linecache.getline(path, line).strip()!r}")


def _helper_argument(path: str, line: int, name: str, kernel_path: str) -> ast.expr | None:
    """The expression a kernel passes for parameter `name` of the helper function around path:line."""
    helper = next((f for f in ast.walk(_tree(path)) if isinstance(f, ast.FunctionDef)
                   and f.lineno <= line <= f.end_lineno and name in [a.arg for a in f.args.args]), None)
    if helper is None:
        return None
    index = [a.arg for a in helper.args.args].index(name)
    for call in ast.walk(_tree(kernel_path)):
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == helper.name and len(call.args) > index:
            return call.args[index]
    return None


def _value(node: ast.expr, args: dict, where: tuple[str, int], kernel_path: str) -> int:
    """An integer expression of a loop bound, with the launch's arguments for its names."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        if isinstance(args.get(node.id), int):
            return args[node.id]
        passed = _helper_argument(_here(where[0], kernel_path), where[1], node.id, kernel_path)
        if passed is not None:
            return _value(passed, args, ("", 0), kernel_path)
        raise ValueError(f"loop bound {node.id!r} at {where[0]}:{where[1]} is not an integer argument of the launch")
    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("program_id", "num_programs"):
        # a persistent loop over program_id, + num_programs, ...: the first program's, which has the most
        return 0 if node.func.attr == "program_id" else args["num_programs"]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)):
        a, b = _value(node.left, args, where, kernel_path), _value(node.right, args, where, kernel_path)
        return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b, ast.FloorDiv: a // max(b, 1)}[type(node.op)]
    raise ValueError(f"loop bound {ast.unparse(node)!r} at {where[0]}:{where[1]}: not an integer expression")


def trips(loop: tuple[str, int], args: dict, kernel_path: str) -> int:
    """Iterations of the Python loop at `loop` = (file, line) for a launch with arguments `args`."""
    call = _range_of(_here(loop[0], kernel_path), loop[1])
    bounds = [_value(a, args, loop, kernel_path) for a in call.args[:3]]
    start, stop, step = (0, bounds[0], 1) if len(bounds) == 1 else (*bounds, 1)[:3]
    return max(0, -(-(stop - start) // step))


def passes(region: Region, args: dict, kernel_path: str) -> int:
    """How many times one program runs a region: its loop's passes (trips, over its unroll factor, or what an
    unrolled loop leaves over) times its enclosing loops' trips."""
    n = 1
    for loop in region.enclosing:
        n *= trips(loop, args, kernel_path)
    if region.loop:
        own = trips(region.loop, args, kernel_path)
        n *= own % region.remainder if region.remainder else own // region.unroll
    return n


_REGISTER = re.compile(r"\b(U?R\d+|U?P\d)\b")
_NO_DESTINATION = ("store", "barrier", "async", "wait")


def _registers(operand: str, span: int = 1) -> list[str]:
    """Registers an operand names; a destination of a 64- or 128-bit transfer spans 2 or 4 of them."""
    found = _REGISTER.findall(operand)
    if span > 1 and found and found[0][0] in "RU":
        base = found[0]
        number = int(re.sub(r"\D", "", base))
        return [f"{base.rstrip('0123456789')}{number + k}" for k in range(span)]
    return found


def chain_cycles(region: Region, latency: dict[str, int], crowd: int = 1, pipe: float = 1.0) -> int:
    """Cycles one warp takes over a region when nothing else issues: in order, each instruction one cycle after the
    one before, or when the registers it reads are ready (the writer's issue + latency[class]); a barrier waits for
    everything before it, and the warp for the barrier. A shared-memory access or shuffle also waits for `crowd`
    warps' same instruction to pass the shared-memory pipe, `pipe` cycles per 32-bit access each. Waits of the
    software pipeline (DEPBAR) count as ready: the pipeline's loads were issued STAGES - 1 iterations before, and
    the memory term of the model times them."""
    ready, now, done = {}, 0, 0
    for i in region.code:
        kind = CLASSES.get(i.opcode.split(".")[0], "other")
        operands = i.operands.split(",")
        outputs = 2 if kind == "shuffle" else 1             # SHFL Pdst, Rdst, ...
        writes = [] if kind in _NO_DESTINATION or i.opcode.startswith(("BRA", "EXIT", "STS", "RED", "ATOMS")) \
            else [r for op in operands[:outputs]
                  for r in _registers(op, _width(i.opcode) // 4 if kind in ("load", "shared") else 1)]
        reads = [r for op in operands[outputs if writes else 0:] for r in _registers(op)]
        start = max([now + 1] + [ready.get(r, 0) for r in reads] + ([done] if kind == "barrier" else []))
        wait = latency[kind]
        if kind in ("shared", "shuffle"):     # the crowd's same instruction through the pipe first
            wait += int(crowd * pipe * max(1, _width(i.opcode) // 4 if kind == "shared" else 1))
        for r in writes:
            ready[r] = start + wait
        done = max(done, start + wait)
        now = start + (wait - 1 if kind == "barrier" else 0)    # the warp waits at a barrier
    return max(now, done)


def latency_cycles(region: Region, crowd: int = 1) -> int:
    """One warp's chain over a region (chain_cycles) with occupancy.LATENCY_CYCLES."""
    from meters.occupancy import LATENCY_CYCLES, SHARED_PIPE_CYCLES
    return chain_cycles(region, LATENCY_CYCLES, crowd, SHARED_PIPE_CYCLES)


def read(cubin: bytes, num_warps: int, shared: int) -> dict:
    """What meters/aot.py keeps of a kernel's SASS (JSON-able): {"registers", "resident" (programs an
    SM holds), "regions": [{"loop", "enclosing", "instructions", "classes", "bytes", "chain": {P: one warp's
    chain cycles with P programs resident}}]}."""
    from meters.occupancy import programs_resident
    registers = resources(cubin)["registers"]
    resident = programs_resident(registers, shared, num_warps)
    return {"registers": registers, "resident": resident, "regions": [
        {"loop": r.loop, "enclosing": r.enclosing, "instructions": r.instructions, "classes": r.classes,
         "bytes": r.bytes, "unroll": r.unroll, "remainder": r.remainder,
         "chain": {p: latency_cycles(r, num_warps * p) for p in range(1, max(resident, 1) + 1)}}
        for r in regions(disassemble(cubin))]}


def launch_passes(code: dict, args: dict, kernel_path: str, programs: int) -> list:
    """occupancy.Pass per region of a kernel read() for a launch with arguments `args`, `programs` per SM."""
    from meters.occupancy import Pass
    out = []
    for r in code["regions"]:
        region = Region(tuple(r["loop"]) if r["loop"] else None, [tuple(e) for e in r["enclosing"]],
                        unroll=r["unroll"], remainder=r["remainder"])
        chain = {int(p): c for p, c in r["chain"].items()}
        out.append(Pass(passes(region, args, kernel_path), r["instructions"], chain[min(programs, max(chain))]))
    return out


def innermost(code: dict) -> dict:
    """The region a program spends its iterations in: of the most deeply nested loops, the longest."""
    loops = [r for r in code["regions"] if r["loop"]]
    if not loops:
        return code["regions"][0]
    deepest = max(len(r["enclosing"]) for r in loops)
    return max((r for r in loops if len(r["enclosing"]) == deepest), key=lambda r: r["instructions"])
