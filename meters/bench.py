"""Benchmarks of depth routing: host time, kernel bandwidth, whole-model speed and memory.

    python -m meters.bench --host        # any machine: host time per routed read, the launch skipped

On a GPU these are phases of the GPU check (`bash scripts/gpu_check.sh`, scripts/gpu_check.py), each in its
own process under a time cap:
1. host_times: CPU time a routed read spends before its launch (building and uploading the address table,
   allocating outputs, Triton's launcher), forward and backward, N = 9 and 73 sources (Delta Block's and
   Delta AttnRes's largest reads at 36 layers), measured with the launch skipped;
2. bench_routing: forward and forward+backward time of the kernels and of the reference at the 1044M shape
   (d = 1280, 4 x 1024 tokens, bf16), the bytes each launch moves (counted from its arguments, as
   meters/traffic.py does), the achieved bandwidth, and its fraction of a measured device-to-device copy
   and of the nominal peak;
3. kernel_bandwidth: every routing kernel one training step of a 1044M model launches, timed by the profiler
   on the device (the kernel alone: no host time of Triton's launcher in it), its bytes counted as
   meters/traffic.py counts them: achieved bandwidth per kernel kind and its fraction of the
   measured copy;
4. bench_model: training steps of configs/1044m_*.py on random tokens (bf16 autocast, fused AdamW, 4 x 1024
   tokens per step, per-sublayer torch.compile as the configs ask): tokens/s, peak memory and allocated
   memory at a middle step and at the last, so memory that grows over the run shows; then a few steps under
   the profiler: GPU time per step beside the wall time, and the fraction of the step the GPU waits.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
import triton

from infra import distributed
from infra.config import TrainConfig, load_config
from meters import traffic
from depth_kernels.depth_route import depth_route, route_backward, route_forward
from depth_kernels.launch import source_table
from depth_kernels.observers import Launch, observe_launches, skipped_launches
from meters.traffic import ByteCounter
from model import Model, ModelConfig
from router import depth_route as reference
from infra.runlog import device_time_by_name, flops_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, TOKENS = 1280, (4, 1024)
N_SOURCES = (9, 25, 49, 73)
HOST_N = (9, 73)
MODEL_CONFIGS = ("1044m_baseline", "1044m_delta_block", "1044m_delta")
KERNEL_CONFIGS = MODEL_CONFIGS[1:]       # the methods that launch routing kernels
WARMUP_STEPS = 2                         # step 1 compiles the sublayers and allocates AdamW's state
PROFILE_STEPS = 3                        # steps under the profiler after the timed ones (its overhead is the host's)
# nominal HBM bandwidth (bytes/s) by device name; a measured device-to-device copy is reported beside it
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12,
                     "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100-SXM4-40GB": 1.555e12}


def routing_inputs(n: int, device: str, tokens: tuple[int, int] = TOKENS, d: int = D):
    """n bf16 sources (B, T, d) after an fp32 embedding, as under autocast; query, norm weight; dL/dr."""
    sources = [torch.randn(*tokens, d, device=device, dtype=torch.float32 if i == 0 else torch.bfloat16)
               for i in range(n)]
    query = torch.randn(d, device=device) * 0.1
    norm_weight = torch.ones(d, device=device)
    return sources, query, norm_weight, torch.randn(*tokens, d, device=device)


def host_times(device: str = "cpu", repeats: int = 200) -> dict[int, dict[str, float]]:
    """Median microseconds of CPU per routed read at each N in HOST_N, with every launch skipped: forward = building the
    table + route_forward, backward = route_backward (as depth_kernels.depth_route.DepthRoute runs them)."""
    results = {}
    with skipped_launches():
        for n in HOST_N:
            sources, query, norm_weight, grad = routing_inputs(n, device, tokens=(1, 16))
            lse = torch.zeros(16, device=device)
            table = source_table(sources)
            calls = {"forward": lambda: route_forward(source_table(sources), query, norm_weight, 1e-6),
                     "backward": lambda: route_backward(table, query, norm_weight, 1e-6, grad, lse)}
            results[n] = {}
            for name, call in calls.items():
                for _ in range(20):
                    call()
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - start)
                results[n][f"{name}_us"] = 1e6 * statistics.median(times)
    return results


def nominal_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in NOMINAL_BANDWIDTH.items() if key in name), None)


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write): what the memory system delivers in practice."""
    x = torch.empty(2 ** 30, dtype=torch.bfloat16, device="cuda")
    seconds = triton.testing.do_bench(lambda: x.clone()) / 1e3
    return 2 * x.numel() * x.element_size() / seconds


def launch_bytes(fn) -> int:
    """Bytes the kernel launches of fn() read and write, counted from their arguments
    (meters/traffic.py)."""
    counter = ByteCounter()

    def count(launch: Launch) -> bool:
        counter.launch(launch)
        return False                      # count, and launch
    with observe_launches(count):
        fn()
    return sum(counter.bytes.values())


def bench_routing(nominal: float | None, copy: float, save: Callable[[list], None] | None = None) -> list[dict]:
    """One row per N in N_SOURCES (times, bytes, bandwidth), handed to save(rows) as each is done."""
    rows = []
    for n in N_SOURCES:
        sources, query, norm_weight, grad = routing_inputs(n, "cuda")
        for t in (*sources, query, norm_weight):
            t.requires_grad_()
        row = {"n_sources": n}
        for name, fn in (("kernel", depth_route), ("reference", reference)):
            def fwd():
                with torch.no_grad():
                    fn(sources, query, norm_weight)

            def fwd_bwd():
                torch.autograd.grad(fn(sources, query, norm_weight), [*sources, query, norm_weight], grad)
            try:
                row[f"{name}_fwd_ms"] = triton.testing.do_bench(fwd)
                row[f"{name}_fwd_bwd_ms"] = triton.testing.do_bench(fwd_bwd)
            except torch.OutOfMemoryError:
                row[f"{name}_fwd_ms"] = row[f"{name}_fwd_bwd_ms"] = None
                torch.cuda.empty_cache()
        row["fwd_bytes"] = launch_bytes(lambda: depth_route(sources, query, norm_weight))
        row["fwd_bwd_bytes"] = launch_bytes(lambda: torch.autograd.grad(
            depth_route(sources, query, norm_weight), [*sources, query, norm_weight], grad))
        for key in ("fwd", "fwd_bwd"):
            bandwidth = row[f"{key}_bytes"] / (row[f"kernel_{key}_ms"] / 1e3)
            row[f"kernel_{key}_bandwidth"] = bandwidth
            row[f"kernel_{key}_of_copy"] = bandwidth / copy
            row[f"kernel_{key}_of_peak"] = bandwidth / (nominal or copy)   # the copy when the spec is unknown
        rows.append(row)
        if save:
            save(rows)
        print(f"N={n:3d} | ms fwd kernel {row['kernel_fwd_ms']:.3f} ref {row['reference_fwd_ms'] or float('nan'):.3f}"
              f" | fwd+bwd kernel {row['kernel_fwd_bwd_ms']:.3f} ref {row['reference_fwd_bwd_ms'] or float('nan'):.3f}"
              f" | kernel {row['kernel_fwd_bandwidth'] / 1e9:.0f} / {row['kernel_fwd_bwd_bandwidth'] / 1e9:.0f} GB/s "
              f"({100 * row['kernel_fwd_of_peak']:.0f}% / {100 * row['kernel_fwd_bwd_of_peak']:.0f}% of peak)")
        del sources
        torch.cuda.empty_cache()
    return rows


def profiled(step: Callable[[], None], steps: int, activities=None):
    """The profiler's events of `steps` calls of step() (synchronized before and after)."""
    from torch.profiler import ProfilerActivity, profile
    activities = activities or [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return prof.events()


def step_profile(events, steps: int, wall_ms_per_step: float, top: int = 10) -> dict:
    """GPU time per step (the sum of every device event's time: kernels and copies, on one stream they do not
    overlap) beside the wall time per step measured without the profiler, the fraction of the step the GPU
    waits (1 - gpu / wall: on the host, launches, syncs), and the `top` kernels by time per step."""
    kinds = device_time_by_name(events)
    gpu_ms = sum(k["ms"] for k in kinds.values()) / steps
    return {"steps": steps, "gpu_ms_per_step": gpu_ms, "wall_ms_per_step": wall_ms_per_step,
            "gpu_idle_fraction": max(0.0, 1 - gpu_ms / wall_ms_per_step),
            "top_kernels": {name: {"calls_per_step": k["calls"] / steps, "ms_per_step": k["ms"] / steps}
                            for name, k in list(kinds.items())[:top]}}


def environment() -> dict:
    """The GPU (name, count), the versions and the commit a check's figures belong to."""
    def git(*command: str) -> str | None:
        try:
            return subprocess.run(["git", *command], capture_output=True, text=True, check=True,
                                  cwd=ROOT).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None
    cuda = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name() if cuda else None, "device_count": torch.cuda.device_count(),
            "cuda_available": cuda, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "executable": sys.executable,
            "commit": git("rev-parse", "HEAD") or "unknown",
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def model_config(config: str, layers: int | None = None) -> tuple[ModelConfig, TrainConfig]:
    """configs/<config>.py, optionally with fewer layers (and at most as many blocks)."""
    model_cfg, cfg = load_config([os.path.join(ROOT, "configs", f"{config}.py")])
    if layers:
        model_cfg = dataclasses.replace(model_cfg, n_layers=layers, n_blocks=min(model_cfg.n_blocks, layers))
    return model_cfg, cfg


def traffic_predictions(layers: int | None = None) -> dict:
    """meters/traffic.py's figures for each of KERNEL_CONFIGS as bench_model runs it (TOKENS, regime
    "autocast": fp32 parameters and stream, bf16 sublayer outputs): the bytes per token routing adds to the
    baseline, and the tokens/s ratio to the baseline predicted on every device meters.traffic knows."""
    out = {"regime": "autocast", "tokens": TOKENS, "mfu": traffic.MFU,
           "bandwidth_efficiency": traffic.BANDWIDTH_EFFICIENCY, "configs": {}}
    for config in KERNEL_CONFIGS:
        model_cfg, _ = model_config(config, layers)
        shape = {k: v for k, v in dataclasses.asdict(model_cfg).items() if k not in ("residual", "kernel")}
        methods = {"baseline": {"residual": "baseline"}, model_cfg.residual: {"residual": model_cfg.residual}}
        moved = traffic.measure(shape, TOKENS, methods, regime="autocast")[model_cfg.residual]["bytes_per_token"]
        fpt = flops_per_token(model_cfg, TOKENS[1])
        ratios = {device: traffic.predicted_ratio(moved, fpt, device) for device in traffic.DEVICES}
        out["configs"][config] = {"residual": model_cfg.residual, "n_layers": model_cfg.n_layers,
                                  "n_blocks": model_cfg.n_blocks, "bytes_per_token": moved,
                                  "flops_per_token": fpt, "predicted_ratio": ratios}
        print(f"{config:<18} routing adds {moved / 1e6:.3f} MB per token; predicted tokens/s vs baseline "
              + ", ".join(f"{d} {r:.3f}x" for d, r in ratios.items()))
    return out


def build_model(config: str, layers: int | None = None, compile: bool | None = None) -> tuple[Model, TrainConfig]:
    """configs/<config>.py's model, built on the GPU as train.py builds it (optionally with fewer layers), its
    sublayers compiled if the config says so (or as `compile` says)."""
    model_cfg, cfg = model_config(config, layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Model(model_cfg)
    if cfg.compile if compile is None else compile:
        distributed.compile_sublayers(model)
    return model, cfg


def training_step(model: Model, opt: torch.optim.Optimizer | None, idx: torch.Tensor) -> None:
    """Forward under bf16 autocast, loss, backward, the optimizer step (if any); gradients freed."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(idx)
    F.cross_entropy(logits.float().flatten(0, 1), idx.flatten()).backward()
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)


def kernel_bandwidth(config: str, copy: float, layers: int | None = None) -> dict[str, dict]:
    """Per routing kernel, what one training step of configs/<config>.py launches: launches, bytes (counted from
    the launches' arguments as meters/traffic.py counts them), ms (the profiler's device time of
    the kernel alone, no host time in it), achieved bandwidth and its fraction of `copy` (bytes/s). Sublayers
    run eagerly: they do not change the kernels."""
    model, _ = build_model(config, layers, compile=False)
    idx = torch.randint(0, model.cfg.vocab_size, TOKENS, device="cuda")
    training_step(model, None, idx)       # the kernels' first launches compile them
    counter, kinds = ByteCounter(), {}

    def count(launch: Launch) -> bool:
        k = kinds.setdefault(launch.kernel.fn.__name__, {"launches": 0, "bytes": 0})
        counter.bytes.clear()
        counter.launch(launch)
        counter.launches.clear()          # keep no tensor alive past its step
        k["launches"] += 1
        k["bytes"] += sum(counter.bytes.values())
        return False                      # count, and launch
    with observe_launches(count):
        events = profiled(lambda: training_step(model, None, idx), 1)
    timed = device_time_by_name(events)
    for name, k in kinds.items():
        # a kernel the profiler did not see (it should see every one) has no time: NaN, not a made-up figure
        k["ms"] = timed.get(name, {}).get("ms", float("nan"))
        k["profiled_calls"] = timed.get(name, {}).get("calls", 0)
        k["bandwidth"] = k["bytes"] / (k["ms"] / 1e3)
        k["of_copy"] = k["bandwidth"] / copy
        print(f"{config:<18} {name:<14} {k['launches']:4d} launches {k['ms']:8.3f} ms {k['bytes'] / 1e9:7.3f} GB "
              f"{k['bandwidth'] / 1e9:6.0f} GB/s ({100 * k['of_copy']:.0f}% of copy)")
    del model
    torch.cuda.empty_cache()
    return kinds


def bench_model(config: str, steps: int = 20, mark: int = 5, layers: int | None = None,
                save: Callable[[dict], None] | None = None, profile_steps: int = PROFILE_STEPS) -> dict:
    """`steps` training steps of configs/<config>.py on random tokens. At_step[mark] and at_step[steps]:
    tokens/s over the steps since the previous figure (steps 1..WARMUP_STEPS not timed), peak memory
    (max_memory_allocated since the model was built) and memory allocated after the step; also
    memory_allocated after every step. Flat memory: the last step's figures equal the mark's. Then
    `profile_steps` more steps under torch.profiler: "profile" (step_profile), the GPU's time per step beside
    the wall time of the timed steps."""
    if not WARMUP_STEPS < mark < steps:
        raise ValueError(f"bench_model: need {WARMUP_STEPS} < mark < steps; got mark={mark}, steps={steps}")
    model, cfg = build_model(config, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, model.cfg.vocab_size, TOKENS, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    result = {"config": config, "tokens": TOKENS, "layers": model.cfg.n_layers, "compile": cfg.compile,
              "steps": steps, "mark": mark, "at_step": {}, "allocated_after_step": []}
    since, t0 = 0, 0.0
    for i in range(1, steps + 1):
        training_step(model, opt, idx)
        result["allocated_after_step"].append(torch.cuda.memory_allocated())
        if i in (WARMUP_STEPS, mark, steps):
            torch.cuda.synchronize()
            now = time.perf_counter()
            if i > WARMUP_STEPS:
                at = {"tokens_per_s": (i - since) * TOKENS[0] * TOKENS[1] / (now - t0),
                      "peak_memory_bytes": torch.cuda.max_memory_allocated(),
                      "allocated_bytes": result["allocated_after_step"][-1]}
                result["at_step"][str(i)] = at
                print(f"{config:<18} step {i:3d} | {at['tokens_per_s']:9,.0f} tok/s | peak "
                      f"{at['peak_memory_bytes'] / 1e9:.2f} GB | allocated {at['allocated_bytes'] / 1e9:.2f} GB")
            since, t0 = i, now
            if save:
                save(result)
    if profile_steps:
        last = result["at_step"][str(steps)]
        wall_ms = 1e3 * TOKENS[0] * TOKENS[1] / last["tokens_per_s"]
        result["profile"] = step_profile(profiled(lambda: training_step(model, opt, idx), profile_steps),
                                         profile_steps, wall_ms)
        p = result["profile"]
        print(f"{config:<18} GPU {p['gpu_ms_per_step']:.1f} ms per step of {wall_ms:.1f} ms wall: the GPU waits "
              f"{100 * p['gpu_idle_fraction']:.0f}% of the step")
        if save:
            save(result)
    del model, opt
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", action="store_true", help="host time per routed read (any machine)")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per figure")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    if not args.host:
        raise SystemExit("python -m meters.bench runs --host only; the GPU benchmarks are phases of "
                         "`bash scripts/gpu_check.sh`")
    host = host_times("cpu", args.repeats)
    for n, t in host.items():
        print(f"host time per routed read, N={n}: forward {t['forward_us']:.1f} us, backward {t['backward_us']:.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"host_us": host, "host_device": "cpu"}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
