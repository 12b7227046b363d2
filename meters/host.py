"""Host time of the model's routing path per training step: the Python and autograd work a GPU would wait on.

    python -m meters.host                    # 36 layers (the 1044M depth), 8 blocks, every method
    python -m meters.host --json out.json

A training step (forward, loss, backward) of the real model at the 1044M depth, with tiny tensors (d = 64, 1 x 16
tokens: the tensor work is negligible) and every Triton launch skipped (depth_kernels.observers.skipped_launches),
runs on the CPU; its time is host time, counted as the process's CPU time (one thread), so that time a shared
machine gives to other work is not counted. Routing's host time is a method's step minus the baseline's (the
baseline pays for its own sublayers, norms and autograd). Median of `repeats` steps after warm-up. The C library's
allocator is told to keep freed memory (glibc's mallopt): as a GPU's caching allocator does, so that the pages of a
step's buffers are not handed back to the system and faulted in again at the next step (a cost a GPU run never pays,
which on this machine made steps of one model differ by a few ms from process to process). Left out: Triton's own
launcher (binding the arguments and the driver call, some tens of microseconds per launch on a GPU machine), so the
count of launches per step is printed beside; and on a GPU, allocations and the address tables' copies are
asynchronous, which the CPU's are not. The budget the project sets: at most 10 % of a 1044M micro-step of 4 x 1024
tokens, about 65 ms of H100 work, so 6.5 ms.

    python -m meters.host --step               # the whole optimizer step, per compiled region
    python -m meters.host --step --instructions # with callgrind's instruction counts beside

`--step` measures what train.py's loop does per step (train.forward_backward, clipping, the optimizer, the loss
and norm read back), built as train.py builds it (train._build), for each method under each choice of compiled
regions (REGIONS: eager, compiled sublayers, the whole forward compiled: distributed.compile_model), each region in
a process of its own (measure_regions). The compiled regions' own kernels are skipped as the routing kernels are
(skipped_compiled_kernels; on a CPU their C++ kernels would otherwise do the arithmetic a GPU does) and counted: on
a GPU each is a launch, which the host pays for unless CUDA graphs replay the region. So are the optimizer's and
clipping's multi-tensor operations (skipped_multi_tensor_ops: on a CPU a loop of one operation per tensor, on a
GPU a few launches a call). Instruction counts (valgrind's callgrind, the steps alone: instrumentation is switched
on around them) do not move with the machine's load, as CPU time does.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import torch
import torch._inductor.config
import torch.nn.functional as F

from depth_kernels.observers import skipped_launches
from infra import distributed, runlog
from infra.config import TrainConfig
from model import Model, ModelConfig

SHAPE = dict(vocab_size=64, d_model=64, n_layers=36, n_heads=1, n_kv_heads=1, head_dim=64, d_ff=128, n_blocks=8)
# --step's: narrower, since on a CPU the whole step's tensor work is done where a GPU's would be (the compiled
# region's kernels, AdamW's and clipping's arithmetic: at d = 64 a quarter of the baseline's step)
STEP_SHAPE = dict(SHAPE, d_model=16, head_dim=16, d_ff=32)
METHODS = ("baseline", "attnres", "full_attnres", "delta", "delta_block")
BUDGET_S = 6.5e-3


def keep_freed_memory() -> bool:
    """Ask glibc's malloc never to trim freed memory back to the system nor to map large blocks apart (mallopt
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD): freed blocks are reused, as by a GPU's caching allocator. False where
    the C library has no mallopt (not glibc): steps then pay page faults now and then."""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_TRIM_THRESHOLD, 1 << 30)) and bool(mallopt(M_MMAP_THRESHOLD, 1 << 25))   # glibc's max


class Stepper:
    """One method's model at the meter's shape, stepped (forward, loss, backward) with every launch skipped."""

    def __init__(self, residual: str, shape: dict = SHAPE, tokens: tuple[int, int] = (1, 16)):
        keep_freed_memory()
        torch.manual_seed(0)
        self.model = Model(ModelConfig(**shape, residual=residual, kernel="triton"))
        self.idx = torch.randint(0, shape["vocab_size"], tokens)
        self.launches = 0

    def step(self) -> float:
        """Host seconds (CPU time) of one training step."""
        with skipped_launches() as launches:
            start = time.process_time()
            F.cross_entropy(self.model(self.idx).flatten(0, 1), self.idx.flatten()).backward()
            self.model.zero_grad(set_to_none=True)
            seconds = time.process_time() - start
        self.launches = len(launches)
        return seconds


def step_time(residual: str, repeats: int = 10, shape: dict = SHAPE, tokens: tuple[int, int] = (1, 16)) -> dict:
    """{"seconds": median host seconds of one forward + backward, "launches": kernel launches per step}."""
    stepper = Stepper(residual, shape, tokens)
    times = [stepper.step() for _ in range(repeats + 2)][2:]          # two warm-up steps
    return {"seconds": statistics.median(times), "launches": stepper.launches}


def take_turns(steppers: dict, repeats: int, announce: bool = False) -> dict[str, list[float]]:
    """{name: host seconds of its `repeats` steps}: the steppers take turns, a step each per round, after two
    warm-up rounds (the compiles). The objects alive after the warm-up (every stepper's model, graphs and compiled
    code) are then moved out of the garbage collector's sight, as train.py does after its first step
    (runlog.freeze_heap), so that a collection during a step scans what that step left and not the other steppers'
    models, which a training process of one model does not hold."""
    for round in range(2):
        for name, stepper in steppers.items():
            stepper.step()
            if announce and round == 0:
                print(f"{name}: compiled and stepped once", file=sys.stderr, flush=True)
    times: dict[str, list[float]] = {name: [] for name in steppers}
    with contextlib.ExitStack() as held:
        runlog.freeze_heap(held)
        for _ in range(repeats):
            for name, stepper in steppers.items():
                times[name].append(stepper.step())
    return times


def measure(methods: tuple[str, ...] = METHODS, repeats: int = 10, shape: dict = SHAPE) -> dict[str, dict]:
    """Per method: host seconds per step (median), routing's share and launches per step. The methods take turns,
    a step each per round, and routing's share is the median over rounds of the method's step minus the
    baseline's in the same round: a shared machine's slow spells hit both sides of each difference."""
    torch.set_num_threads(1)
    names = ("baseline", *[m for m in methods if m != "baseline"])
    steppers = {m: Stepper(m, shape) for m in names}
    times = take_turns(steppers, repeats)
    base = times["baseline"]
    return {m: {"seconds": statistics.median(t), "launches": steppers[m].launches,
                "routing_seconds": statistics.median(a - b for a, b in zip(t, base))} for m, t in times.items()}


# What torch.compile takes as one region, and the kernel setting that goes with it: the whole forward compiles as
# one graph on the reference routing path (the kernel path's reads break a traced graph at each read).
REGIONS = {"eager": dict(kernel="triton"),
           "sublayers": dict(kernel="triton", compile=True, compile_regions="sublayers"),
           "model": dict(kernel="reference", compile=True, compile_regions="model")}


@contextlib.contextmanager
def skipped_compiled_kernels() -> Iterator[list[str]]:
    """Every kernel of the compiled regions loaded so far (inductor's generated modules: on a CPU their C++
    kernels, on a GPU their Triton launches) replaced, within the block, by a no-op that lists its name: as
    skipped_launches does for the routing kernels, so that a compiled region's step counts its host work (the
    generated code's Python: allocations, views, size checks, the calls themselves) and not its kernels' work,
    which a GPU does. The outputs are then never written: the step's values are garbage, as with skipped_launches
    (the meter's TrainStep lets the NaN guard skip such steps without stopping)."""
    from torch._inductor.codecache import PyCodeCache
    names: list[str] = []
    kept: list[tuple[object, str, object]] = []
    for module in list(PyCodeCache.modules):
        for name in kernel_names(module.__file__):
            kept.append((module, name, getattr(module, name)))
            setattr(module, name, lambda *args, _name=name, **kwargs: names.append(_name))
    try:
        yield names
    finally:
        for module, name, kernel in kept:
            setattr(module, name, kernel)


# The multi-tensor operations of the optimizer step and of clipping (torch's foreach and fused AdamW): on a GPU
# each call is a few launches over all of its tensors (multi_tensor_apply); on a CPU, a loop that dispatches one
# operation per tensor: host work a GPU run never does (13 of attnres's 83 M instructions a step at 36 layers).
MULTI_TENSOR_OPS = ("_foreach_add_", "_foreach_sub_", "_foreach_mul_", "_foreach_norm", "_fused_adamw_", "_fused_adam_")


@contextlib.contextmanager
def skipped_multi_tensor_ops() -> Iterator[list[str]]:
    """Within the block, torch's MULTI_TENSOR_OPS replaced by no-ops that list their names, as
    skipped_compiled_kernels does for the compiled kernels: each call is counted as a launch. _foreach_norm still
    returns a scalar per tensor, as a GPU's does: views of one new (n,) tensor."""
    names: list[str] = []

    def skipped(name: str):
        def op(tensors, *args, **kwargs):
            names.append(name)
            return list(torch.empty(len(tensors)).unbind()) if name == "_foreach_norm" else None
        return op
    kept = {name: getattr(torch, name) for name in MULTI_TENSOR_OPS}
    try:
        for name in kept:
            setattr(torch, name, skipped(name))
        yield names
    finally:
        for name, op in kept.items():
            setattr(torch, name, op)


@functools.cache   # a generated module's file never changes: read once, not at every step
def kernel_names(path: str) -> tuple[str, ...]:
    """The names of the kernels a generated module (inductor's wrapper, at `path`) defines."""
    with open(path) as f:
        return tuple(re.findall(r"^(\w+) = async_compile\.\w+\(", f.read(), re.MULTILINE))


class Batches:
    """The loader train.forward_backward reads: the same (x, y) every time."""

    def __init__(self, vocab_size: int, tokens: tuple[int, int]):
        self.x = torch.randint(0, vocab_size, tokens)
        self.y = torch.roll(self.x, -1, dims=1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y


class TrainStep:
    """One method's optimizer step as train.py takes it on a GPU, at STEP_SHAPE, with every launch skipped:
    train._optimizer_step with the fused AdamW the GPU gets (its NaN guard on the device), the device read
    (train._read_figures) at the steps train.py reads it."""

    def __init__(self, residual: str, regions: str, shape: dict | None = None, tokens: tuple[int, int] = (1, 16),
                 backend: str = "inductor"):
        keep_freed_memory()
        settings = dict(REGIONS[regions])
        model_cfg = ModelConfig(**(shape or STEP_SHAPE), residual=residual, kernel=settings.pop("kernel"))
        # max_bad_steps: the skipped kernels leave the step's values garbage, and the guard skips those steps
        self.cfg = TrainConfig(device="cpu", batch_size=tokens[0], seq_len=tokens[1], compile_backend=backend,
                               adamw="fused", max_bad_steps=2 ** 62, **settings)
        self.ctx = distributed.Context(rank=0, world_size=1, device=torch.device("cpu"), owns_group=False)
        import train                       # the training script's own pieces, as its loop calls them
        self.train = train
        _, self.model, self.optimizer = train._build(model_cfg, self.cfg, self.ctx, None, None)
        self.run = train.Run.starting(self.ctx.device, self.optimizer)
        self.batches = Batches(model_cfg.vocab_size, tokens)
        self.stop = distributed.StopRequest(announce=False)       # never entered: no signal handlers
        self.launches = self.compiled_kernels = self.multi_tensor_ops = self.taken = 0

    def step(self) -> float:
        """Host seconds (CPU time) of one step: forward and backward, clipping, the optimizer, the read when due."""
        run, train = self.run, self.train
        multi_tensor_ops = skipped_multi_tensor_ops() if self.taken else contextlib.nullcontext([])  # 1st: trains
        with skipped_launches() as launches, skipped_compiled_kernels() as kernels, multi_tensor_ops as multi_tensor:
            start = time.process_time()
            train._optimizer_step(run, self.cfg, self.ctx, self.model, self.optimizer, self.batches, 1)
            if run.read_due(self.cfg):
                train._read_figures(run, self.cfg, self.ctx, lambda record, line: None, self.stop)
            seconds = time.process_time() - start
        self.launches, self.multi_tensor_ops = len(launches), len(multi_tensor)
        self.compiled_kernels, self.taken = len(kernels) + len(multi_tensor), self.taken + 1
        return seconds


def measure_steps(methods: tuple[str, ...] = METHODS, regions: tuple[str, ...] = tuple(REGIONS),
                  repeats: int = 10, shape: dict = STEP_SHAPE, backend: str = "inductor") -> dict[str, dict]:
    """{"method/regions": {"seconds": median host seconds of a whole step, "launches" of the routing kernels,
    "compiled_kernels": calls of the compiled regions' kernels and multi-tensor operations}}, all skipped; the
    steppers take turns, a step each per round, so that a slow spell of a shared machine is spread over all of them."""
    torch.set_num_threads(1)
    steppers = {f"{m}/{r}": TrainStep(m, r, shape, backend=backend) for m in methods for r in regions}
    times = take_turns(steppers, repeats, announce=True)
    return {name: {"seconds": statistics.median(t), "launches": steppers[name].launches,
                   "compiled_kernels": steppers[name].compiled_kernels} for name, t in times.items()}


def measure_regions(repeats: int = 10, regions: tuple[str, ...] = tuple(REGIONS),
                    shape: dict = STEP_SHAPE) -> dict[str, dict]:
    """measure_steps per compiled region, each in a process of its own in which every method takes turns. With
    every region in one process, the routed methods' steps with compiled sublayers measured 16 to 21 ms slower than
    with that region alone, the baseline's 6 to 8 ms (same code, same machine): the regions' compiled code and
    models disturb each other's figures."""
    results: dict[str, dict] = {}
    for region in regions:
        child = subprocess.run([sys.executable, "-m", "meters.host", "--step-region", region, "--repeats",
                                str(repeats), "--shape", json.dumps(shape)], check=True, stdout=subprocess.PIPE,
                               text=True, cwd=_ROOT)
        results.update(json.loads(child.stdout.splitlines()[-1]))
    return results


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


AVX2_CACHE = os.path.join(tempfile.gettempdir(), "meters-host-avx2")    # instructions(): inductor's code for AVX2


def instructions(method: str, regions: str, steps: int = 3, shape: dict = STEP_SHAPE) -> int:
    """Instructions per whole step (callgrind), counted over `steps` steps after two warm-up steps, in a
    process of its own run under valgrind."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise RuntimeError("--instructions needs valgrind's callgrind (valgrind, callgrind_control) on the PATH")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        # valgrind runs no AVX-512: inductor's C++ is built for AVX2 (x86-64-v3), in a cache of its own, kept
        # between counts and filled by the same process run natively first (under valgrind, building the 36-layer
        # whole forward took tens of minutes; from the cache it is traced only)
        env = {**os.environ, "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3", "TORCHINDUCTOR_CACHE_DIR": AVX2_CACHE}
        child = [sys.executable, "-m", "meters.host", "--counted", method, regions, "--shape", json.dumps(shape)]
        subprocess.run(child + ["--steps", "0"], check=True, capture_output=True, text=True, env=env)
        subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                        *child, "--steps", str(steps)], check=True, capture_output=True, text=True, env=env)
        with open(out) as f:
            total = next(int(line.split()[1]) for line in f if line.startswith("totals:"))
    return total // steps


def _counted(method: str, regions: str, steps: int, shape: dict) -> None:
    """The child of instructions(): warm up, then `steps` steps with callgrind's instrumentation on (none: the
    native run that fills the cache)."""
    torch.set_num_threads(1)
    torch._inductor.config.cpp.simdlen = 256                          # AVX2's vectors, as the march above
    stepper = TrainStep(method, regions, shape)
    stepper.step(), stepper.step()
    if not steps:
        return
    control = ["callgrind_control", "-i"]
    subprocess.run(control + ["on", str(os.getpid())], check=True, capture_output=True)
    for _ in range(steps):
        stepper.step()
    subprocess.run(control + ["off", str(os.getpid())], check=True, capture_output=True)


def main_steps(args: argparse.Namespace) -> None:
    """--step: the whole step per method and compiled regions, with --instructions callgrind's counts."""
    results = measure_regions(repeats=args.repeats)
    if args.instructions:
        for name, r in results.items():
            r["instructions"] = instructions(*name.split("/"))
    print(f"host time per optimizer step as train.py takes it on a GPU, {STEP_SHAPE['n_layers']} layers, d = "
          f"{STEP_SHAPE['d_model']}, {STEP_SHAPE['n_blocks']} "
          f"blocks, launches skipped; regions: {', '.join(f'{k} {v}' for k, v in REGIONS.items())}")
    print(f"{'method':<14}" + "".join(f"{r + ' ms':>16}" for r in REGIONS)
          + "".join(f"{r + ' launches':>20}" for r in REGIONS)
          + ("".join(f"{r + ' Minstr':>18}" for r in REGIONS) if args.instructions else ""))
    for method in METHODS:
        rows = [results[f"{method}/{r}"] for r in REGIONS]
        print(f"{method:<14}" + "".join(f"{1e3 * r['seconds']:>16.1f}" for r in rows)
              + "".join(f"{r['launches'] + r['compiled_kernels']:>20}" for r in rows)
              + ("".join(f"{r['instructions'] / 1e6:>18.1f}" for r in rows) if args.instructions else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": STEP_SHAPE, "regions": REGIONS, "machine": runlog.machine(), "threads": 1,
                       "repeats": args.repeats, "commit": _commit(), "results": results}, f, indent=2)


def _commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=_ROOT)
    return found.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--step", action="store_true", help="the whole optimizer step, per compiled region")
    parser.add_argument("--instructions", action="store_true", help="with --step: callgrind's instruction counts")
    parser.add_argument("--step-region", choices=tuple(REGIONS), help=argparse.SUPPRESS)
    parser.add_argument("--counted", nargs=2, metavar=("METHOD", "REGIONS"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=json.loads, default=STEP_SHAPE, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.counted:
        return _counted(*args.counted, args.steps, args.shape)
    if args.step_region:          # measure_regions' child: the figures as the last line of its output
        return print(json.dumps(measure_steps(regions=(args.step_region,), repeats=args.repeats,
                                              shape=args.shape)))
    if args.instructions and not args.step:
        parser.error("--instructions counts the whole step: add --step")
    if args.step:
        return main_steps(args)
    results = measure(repeats=args.repeats)
    print(f"host time per training step, {SHAPE['n_layers']} layers, {SHAPE['n_blocks']} blocks, launches skipped "
          f"(budget for routing: {1e3 * BUDGET_S:.1f} ms)")
    print(f"{'method':<14}{'step ms':>9}{'routing ms':>12}{'launches':>10}")
    for method, r in results.items():
        flag = "" if method == "baseline" or r["routing_seconds"] <= BUDGET_S else "  over budget"
        print(f"{method:<14}{1e3 * r['seconds']:>9.1f}{1e3 * r['routing_seconds']:>12.1f}{r['launches']:>10}{flag}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": SHAPE, "budget_s": BUDGET_S, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
