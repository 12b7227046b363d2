"""Host time of the model's routing path per training step: the Python and autograd work a GPU would wait on.

    python -m depth_kernels.tools.host                    # 36 layers (the 1044M depth), 8 blocks, every method
    python -m depth_kernels.tools.host --json out.json

A training step (forward, loss, backward) of the real model at the 1044M depth, with tiny tensors (d = 64, 1 x 16
tokens: the tensor work is negligible) and every Triton launch skipped (depth_kernels.launch.skipped_launches), runs on
the CPU; its time is host time, counted as the process's CPU time (one thread), so that time a shared machine gives
to other work is not counted. Routing's host time is a method's step minus the baseline's (the baseline pays for
its own sublayers, norms and autograd). Median of `repeats` steps after warm-up. The C library's allocator is
told to keep freed memory (glibc's mallopt): as a GPU's caching allocator does, so that the pages of a step's
buffers are not handed back to the system and faulted in again at the next step (a cost a GPU run never pays,
which on this machine made steps of one model differ by a few ms from process to process). Left out: Triton's own
launcher (binding the arguments and the driver call, some tens of microseconds per launch on a GPU machine), so
the count of launches per step is printed beside; and on a GPU, allocations and the address tables' copies are
asynchronous, which the CPU's are not. The budget the project sets: at most 10 % of a 1044M micro-step of 4 x
1024 tokens, about 65 ms of H100 work, so 6.5 ms.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import statistics
import time

import torch
import torch.nn.functional as F

from depth_kernels.launch import skipped_launches
from model import Model, ModelConfig

SHAPE = dict(vocab_size=64, d_model=64, n_layers=36, n_heads=1, n_kv_heads=1, head_dim=64, d_ff=128, n_blocks=8)
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


def measure(methods: tuple[str, ...] = METHODS, repeats: int = 10, shape: dict = SHAPE) -> dict[str, dict]:
    """Per method: host seconds per step (median), routing's share and launches per step. The methods take turns,
    a step each per round, and routing's share is the median over rounds of the method's step minus the
    baseline's in the same round: a shared machine's slow spells hit both sides of each difference."""
    torch.set_num_threads(1)
    names = ("baseline", *[m for m in methods if m != "baseline"])
    steppers = {m: Stepper(m, shape) for m in names}
    times: dict[str, list[float]] = {m: [] for m in names}
    for round in range(repeats + 2):                                  # two warm-up rounds
        for m in names:
            seconds = steppers[m].step()
            if round >= 2:
                times[m].append(seconds)
    base = times["baseline"]
    return {m: {"seconds": statistics.median(t), "launches": steppers[m].launches,
                "routing_seconds": statistics.median(a - b for a, b in zip(t, base))} for m, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
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
