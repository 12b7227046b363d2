"""The memory traffic depth routing adds to one training step, per method, and the speed it predicts.

    python -m meters.traffic                  # the 1044M shape: 36 layers, d = 1280, 8 blocks,
                                                           # 4 x 1024 tokens
    python -m meters.traffic --json out.json  # also save the figures
    python -m meters.speed --traffic [...]    # the same with the "compiled" ratio (compiles the kernels)

Routing is memory-bound (O(N d) work per token and sublayer on O(N d) bytes), so the bytes it moves are its
cost. They are counted, not estimated, from what the code actually runs: one forward and backward of the
real `model.Model` on the meta device (shapes and dtypes, no data, no GPU), where
- every kernel launch is seen by `depth_kernels.observers.observe_launches` (the tensors it reads, with how many
  times, and writes) and skipped;
- every torch op is seen by a TorchDispatchMode: it reads its tensor arguments and writes its outputs (views
  and allocations move nothing; a broadcast tensor counts its distinct elements once);
- the sublayers (attention, MLP) and the LM head are stubs that move nothing: they are the same in every
  method, and the paper configs compile them;
- the RMSNorm modules are counted as compiled (the paper configs compile them, distributed.compile_sublayers):
  forward reads x and writes y, backward reads x and dy and writes dx, each once.
Routing's bytes are the step's bytes minus the baseline's. Dtypes follow train.py on one GPU or with DDP:
fp32 parameters, embedding and residual stream, bf16 sublayer outputs (autocast).

The time model: the baseline step takes flops_per_token / (MFU x peak FLOP/s); routing adds, serially (nothing
overlaps it), either all its bytes at a flat BANDWIDTH_EFFICIENCY of the peak bandwidth ("flat"), or its kernels
at the time their compiled code is predicted to take on an H200 (meters/speed.py: the launches'
instructions, barriers and shared-memory accesses per loop iteration and their iterations, calibrated against
measured H200 times) and its torch ops at BANDWIDTH_EFFICIENCY ("compiled"). The predicted tokens/s ratio is
t_baseline / (t_baseline + t_routing). Every assumption is printed with the figures.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from depth_kernels.launch import SourceTable
from depth_kernels.observers import Launch, observe_launches
from meters.bound import lower_bound
from meters.occupancy import Occupancy, occupancy
from typing import Callable
from model import Model, ModelConfig, RMSNorm
from infra.runlog import flops_per_token

SHAPE_1044M = dict(vocab_size=151936, d_model=1280, n_layers=36, n_heads=20, n_kv_heads=4, head_dim=64,
                   d_ff=5120, n_blocks=8)
TOKENS_1044M = (4, 1024)                     # per GPU micro-batch of the paper's 1044M runs
METHODS = {                                  # label -> ModelConfig overrides
    "baseline": dict(residual="baseline"),
    "attnres": dict(residual="attnres"),
    "full_attnres": dict(residual="full_attnres"),
    "delta": dict(residual="delta"),
    "delta_block": dict(residual="delta_block"),
}
# dense bf16 tensor-core FLOP/s and HBM bytes/s from the vendor's data sheets (SXM parts)
DEVICES = {"H100": (989.4e12, 3.35e12), "H200": (989.4e12, 4.8e12)}
MFU = 0.40                    # the baseline's model FLOPs utilisation: a fast, well-tuned run
BANDWIDTH_EFFICIENCY = 0.80   # the fraction of peak bandwidth torch ops (and, "flat", routing's kernels) reach
OUTPUT_DTYPE = torch.bfloat16
# (parameter dtype, sublayer output dtype): train.py on one GPU or with DDP (autocast: fp32 parameters,
# embedding and stream); with FSDP2 (bf16 parameters: everything bf16)
REGIMES = {"autocast": (torch.float32, OUTPUT_DTYPE), "bf16": (torch.bfloat16, OUTPUT_DTYPE)}


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor covers (a stride-0 broadcast dimension counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


_WRITE_ONLY = {"copy_", "fill_", "zero_"}   # their first argument is written, not read


class ByteCounter(TorchDispatchMode):
    """Counts the bytes every op reads and writes, by (phase, name); kernel launches through `launch`."""

    def __init__(self):
        super().__init__()
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.launches: list[Launch] = []
        self.kernels: list[tuple[int, Occupancy]] = []   # (bytes moved, occupancy) of each launch
        self.phase = "forward"

    def add(self, name: str, n: int) -> None:
        self.bytes[(self.phase, name)] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name.startswith(("empty", "new_empty")) or name in ("detach", "alias"):
            return out
        kwargs = dict(kwargs or {})
        kwargs.pop("out", None)               # an out= variant's `out` is its output (written), not an input
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if name in _WRITE_ONLY:
            inputs = inputs[1:]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.add(f"torch {name}", sum(map(_distinct_bytes, inputs)) + sum(map(_distinct_bytes, outputs)))
        return out

    def launch(self, launch: Launch) -> bool:
        self.launches.append(launch)
        reads = [(s, times) for t, times in launch.reads for s in (t.tensors if isinstance(t, SourceTable) else [t])]
        moved = sum(_distinct_bytes(t) * times for t, times in reads) + sum(map(_distinct_bytes, launch.writes))
        moved += sum(8 * len(t.tensors) for t, _ in launch.reads if isinstance(t, SourceTable))   # the addresses
        self.add(f"kernel {launch.kernel.fn.__name__}", moved)
        self.kernels.append((moved, occupancy(launch)))
        return True                               # meta tensors: nothing to launch


class _Stub(torch.autograd.Function):
    """A sublayer or head that moves nothing: (B, T, d) in, a fresh tensor of `shape` and `dtype` out (the
    dtype autocast gives a matmul's output)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        ctx.like = (x.shape, x.dtype)
        return x.new_empty(shape, dtype=dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype = ctx.like
        return grad.new_empty(shape, dtype=dtype), None, None


class _CompiledNorm(torch.autograd.Function):
    """RMSNorm as one fused kernel would move it: forward reads x and writes y, backward reads x and dy and
    writes dx (the weight's gradient is a (d,) reduction, left out)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counter: ByteCounter) -> torch.Tensor:
        ctx.x, ctx.counter = x, counter
        y = x.new_empty(x.shape)
        counter.add("compiled RMSNorm", 2 * _distinct_bytes(x))
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        ctx.counter.add("compiled RMSNorm", 2 * _distinct_bytes(ctx.x) + _distinct_bytes(dy))
        return dy.new_empty(ctx.x.shape, dtype=ctx.x.dtype), None


def _stub(model: Model, counter: ByteCounter, output_dtype: torch.dtype) -> None:
    """Replace the sublayers and the head by stubs and the norms by compiled-norm counters, on this instance."""
    vocab = model.cfg.vocab_size
    for layer in model.layers:
        layer.self_attn.forward = lambda x, rope, cache=None: _Stub.apply(x, x.shape, output_dtype)
        layer.mlp.forward = lambda x: _Stub.apply(x, x.shape, output_dtype)
    model.lm_head.forward = lambda y: _Stub.apply(y, (*y.shape[:-1], vocab), output_dtype)
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.forward = lambda x: _CompiledNorm.apply(x, counter)


def dry_step(cfg: ModelConfig, tokens: tuple[int, int], counter: ByteCounter,
             param_dtype: torch.dtype = torch.float32, output_dtype: torch.dtype = OUTPUT_DTYPE) -> None:
    """One forward + backward of `cfg` on `tokens` (batch, seq_len) on the meta device, the sublayers and head
    stubbed (their outputs in output_dtype), every op and launch shown to `counter` (launches skipped)."""
    with torch.device("meta"):
        model = Model(cfg).to(param_dtype)
    idx = torch.zeros(tokens, dtype=torch.int64, device="meta")
    _stub(model, counter, output_dtype)
    with observe_launches(counter.launch), counter:
        logits = model(idx)
        counter.phase = "backward"
        logits.backward(torch.empty_like(logits))


def count_step(cfg: ModelConfig, tokens: tuple[int, int], regime: str = "autocast") -> ByteCounter:
    """One forward + backward of `cfg` on `tokens` (batch, seq_len), counted: .bytes by (phase, name), .kernels."""
    counter = ByteCounter()
    dry_step(cfg, tokens, counter, *REGIMES[regime])
    return counter


Timer = Callable[[Launch, int], float]   # (launch, bytes it moves) -> predicted seconds (speed.Timer)


def kernel_seconds(counter: ByteCounter, n_tokens: int, timer: Timer) -> float:
    """Seconds per token the step's kernel launches take, each as `timer` predicts it."""
    return sum(timer(launch, moved) for launch, (moved, _) in zip(counter.launches, counter.kernels)) / n_tokens


def measure(shape: dict = SHAPE_1044M, tokens: tuple[int, int] = TOKENS_1044M, methods: dict = METHODS,
            kernel: str = "triton", regime: str = "autocast", timer: Timer | None = None) -> dict[str, dict]:
    """{method: {"bytes_per_token", "forward", "backward", "kernel_bytes_per_token", "lower_bound", "by_name"}} of
    what routing adds to the baseline; with a timer, also "kernel_seconds_per_token" (kernel_seconds)."""
    n_tokens = tokens[0] * tokens[1]
    cfgs = {label: ModelConfig(**shape, **overrides, kernel=kernel) for label, overrides in methods.items()}
    counters = {label: count_step(cfg, tokens, regime) for label, cfg in cfgs.items()}
    base = counters["baseline"].bytes
    results = {}
    for label, counter in counters.items():
        extra = Counter(counter.bytes)
        extra.subtract(base)
        per_phase = {p: sum(v for (ph, _), v in extra.items() if ph == p) / n_tokens for p in ("forward", "backward")}
        kernels = sum(v for (_, name), v in extra.items() if name.startswith("kernel "))
        results[label] = {"bytes_per_token": sum(extra.values()) / n_tokens, **per_phase,
                          "kernel_bytes_per_token": kernels / n_tokens,
                          **({"kernel_seconds_per_token": kernel_seconds(counter, n_tokens, timer)} if timer else {}),
                          "lower_bound": lower_bound(cfgs[label], *REGIMES[regime]),
                          "by_name": {f"{p} {n}": v / n_tokens for (p, n), v in extra.most_common() if v}}
    return results


def predicted_ratio(routing_bytes_per_token: float, flops_per_token: float, device: str,
                    kernel: tuple[float, float] | None = None) -> float:
    """Predicted tokens/s relative to the baseline on `device`: routing's bytes at BANDWIDTH_EFFICIENCY of the
    peak, or, with kernel = (the kernels' bytes, their predicted seconds: kernel_seconds), the kernels at that and
    the rest (torch ops) at BANDWIDTH_EFFICIENCY."""
    flops, bandwidth = DEVICES[device]
    t_base = flops_per_token / (MFU * flops)
    if kernel is None:
        t_route = routing_bytes_per_token / (BANDWIDTH_EFFICIENCY * bandwidth)
    else:
        kernel_bytes, kernel_s = kernel
        t_route = kernel_s + (routing_bytes_per_token - kernel_bytes) / (BANDWIDTH_EFFICIENCY * bandwidth)
    return t_base / (t_base + t_route)


COMPILED_DEVICE = "H200"     # the device speed.py's model of the compiled code is calibrated on


def compiled_ratio(result: dict, flops_per_token: float) -> float:
    """predicted_ratio on COMPILED_DEVICE of one measure() result made with a timer: its kernels at their
    predicted times."""
    return predicted_ratio(result["bytes_per_token"], flops_per_token, COMPILED_DEVICE,
                           (result["kernel_bytes_per_token"], result["kernel_seconds_per_token"]))


REGIME_NAMES = {"autocast": "fp32 parameters and stream, bf16 sublayer outputs "
                            "(the precision rule: infra/distributed.py)",
                "bf16": "bf16 parameters, stream and outputs (the whole model cast to bf16, as the authors' code)"}
GOALS = {"delta_block": (1.3e6, 0.97), "delta": (7.5e6, 0.85)}     # MB per token above the baseline, tok/s ratio
ABOVE_BOUND = ("the grouped schedule's own bytes (meters/bound.py): phase 1's state written and read by "
               "each receiver (and read again backward), go and D written back for phase 1's backward, each later "
               "group reading the committed sources and reading and writing their gradient accumulators (in the "
               "sources' dtype) again, phase 1's backward passes over R_BLOCK receivers at a time, the receivers' own "
               "sources read twice backward, autograd's sums into the stream gradient")


def report(results: dict[str, dict], cfg: ModelConfig, tokens: tuple[int, int], regime: str, top: int = 6) -> str:
    fpt = flops_per_token(cfg, tokens[1])
    lines = [f"routing traffic of one training step: {cfg.n_layers} layers, d = {cfg.d_model}, {cfg.n_blocks} blocks, "
             f"{tokens[0]} x {tokens[1]} tokens, {REGIME_NAMES[regime]}",
             f"assumptions: baseline {fpt / 1e9:.2f} GFLOP per token (runlog.flops_per_token) at MFU {MFU:.0%}; "
             f"routing not overlapped; flat: every byte at {BANDWIDTH_EFFICIENCY:.0%} of peak bandwidth; compiled "
             f"({COMPILED_DEVICE}): each kernel launch at the time its compiled code is predicted to take "
             f"(meters/speed.py), torch ops at {BANDWIDTH_EFFICIENCY:.0%}; " +
             "; ".join(f"{k} {f / 1e12:.0f} TFLOP/s, {b / 1e12:.2f} TB/s" for k, (f, b) in DEVICES.items()),
             "MB per token above the baseline: today's, the lower bound and the floor of an in-order schedule "
             "(bound + hand-offs: meters/bound.py), the goal; predicted tokens/s vs the baseline",
             f"{'method':<14}{'today':>8}{'forward':>9}{'backward':>9}{'bound':>8}{'floor':>8}{'goal':>7}"
             + "".join(f"{k + ' flat':>11}" for k in DEVICES) + f"{COMPILED_DEVICE + ' compiled':>15}{'goal':>7}"]
    for label, r in results.items():
        goal = GOALS.get(label)
        compiled = f"{compiled_ratio(r, fpt):>14.3f}x" if "kernel_seconds_per_token" in r else f"{'-':>15}"
        flat = "".join(f"{predicted_ratio(r['bytes_per_token'], fpt, k):>10.3f}x" for k in DEVICES)
        lines.append(f"{label:<14}{r['bytes_per_token'] / 1e6:>8.3f}{r['forward'] / 1e6:>9.3f}"
                     f"{r['backward'] / 1e6:>9.3f}{r['lower_bound']['bytes_per_token'] / 1e6:>8.3f}"
                     f"{r['lower_bound']['floor'] / 1e6:>8.3f}"
                     f"{f'{goal[0] / 1e6:.2f}' if goal else '':>7}{flat}{compiled}"
                     f"{f'{goal[1]:.2f}x' if goal else '':>7}")
    lines.append(f"where the bytes go (MB per token, the {top} largest items per method); above the bound: "
                 + ABOVE_BOUND)
    for label, r in results.items():
        if label == "baseline":
            continue
        items = ", ".join(f"{name} {v / 1e6:.3f}" for name, v in list(r["by_name"].items())[:top])
        b = r["lower_bound"]
        lines.append(f"  {label}: bound {b['sources'] / 1e6:.3f} sources + {b['partial'] / 1e6:.3f} partial "
                     f"blocks, floor + {b['handoffs'] / 1e6:.3f} hand-offs | {items}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, timer: Timer | None = None) -> None:
    """The command; with a timer (`python -m meters.speed --traffic`: speed.Timer) also the
    "compiled" ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", default="triton", choices=("triton", "reference"),
                        help="the routing path to count: the kernels (as on a GPU) or the reference")
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 4],
                        help="block counts (8: the meters' habit; 4: the 1044M configs')")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    results = {}
    for regime in REGIMES:
        for blocks in args.blocks:
            shape = {**SHAPE_1044M, "n_blocks": blocks}
            cfg = ModelConfig(**shape)
            fpt = flops_per_token(cfg, TOKENS_1044M[1])
            found = results.setdefault(regime, {})[blocks] = measure(shape, kernel=args.kernel, regime=regime,
                                                                       timer=timer)
            print(report(found, cfg, TOKENS_1044M, regime) + "\n")
            for r in found.values():
                r["predicted_ratio"] = {k: predicted_ratio(r["bytes_per_token"], fpt, k) for k in DEVICES}
                if timer:
                    r["predicted_ratio_compiled"] = {COMPILED_DEVICE: compiled_ratio(r, fpt)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": SHAPE_1044M, "tokens": TOKENS_1044M, "kernel": args.kernel, "mfu": MFU,
                       "bandwidth_efficiency": BANDWIDTH_EFFICIENCY, "devices": DEVICES, "goals": GOALS,
                       "regimes": results}, f, indent=2)


if __name__ == "__main__":
    main()
