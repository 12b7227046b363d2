"""Benchmarks of depth routing (a script, not a test): host time, kernel bandwidth, whole-model speed.

    python -m kernels.bench --host        # any machine: host time per routed read, the launch stubbed out
    python -m kernels.bench               # on a GPU: all three, JSON to kernels/bench_results.json
    python -m kernels.bench --tests       # on a GPU: the CUDA tests first, into the same JSON
                                          # (scripts/gpu_check.sh runs this)

1. host: CPU time a routed read spends before its launch (building and uploading the address table,
   allocating outputs, Triton's launcher), forward and backward, N = 9 and 73 sources (Delta Block's and
   Delta AttnRes's largest reads at 36 layers), measured with the launch skipped;
2. routing (GPU): forward and forward+backward time of the kernels and of the reference at the 1044M shape
   (d = 1280, 4 x 1024 tokens, bf16), the bytes each launch moves (counted from its arguments, as
   kernels/traffic.py does), the achieved bandwidth, and its fraction of a measured device-to-device copy and
   of the nominal peak;
3. model (GPU): training steps of configs/1044m_{baseline,delta_block,delta}.py on random tokens (bf16
   autocast, AdamW, 4 x 1024 tokens per step, per-sublayer torch.compile as the configs ask): tokens/s and
   peak memory relative to the baseline.
Targets: Delta Block >= 0.97x and Delta AttnRes >= 0.85x the baseline's tokens/s; <= 1.05x and <= 1.25x its
peak memory; the routing kernels at >= 70% of peak bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch
import triton

import distributed
from config import load_config
from kernels.depth_route import depth_route, route_backward, route_forward
from kernels.launch import Launch, observe_launches, source_table
from kernels.traffic import ByteCounter
from model import Model
from router import depth_route as reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, TOKENS = 1280, (4, 1024)
N_SOURCES = (9, 25, 49, 73)
HOST_N = (9, 73)
MODEL_CONFIGS = ("1044m_baseline", "1044m_delta_block", "1044m_delta")
# nominal HBM bandwidth (bytes/s) by device name; a measured device-to-device copy is reported beside it
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12,
                     "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100-SXM4-40GB": 1.555e12}
SPEED_TARGETS = {"1044m_delta_block": 0.97, "1044m_delta": 0.85}
MEMORY_TARGETS = {"1044m_delta_block": 1.05, "1044m_delta": 1.25}
BANDWIDTH_TARGET = 0.70


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def routing_inputs(n: int, device: str, tokens: tuple[int, int] = TOKENS, d: int = D):
    """n bf16 sources (B, T, d) after an fp32 embedding, as under autocast; query, norm weight; dL/dr."""
    sources = [torch.randn(*tokens, d, device=device, dtype=torch.float32 if i == 0 else torch.bfloat16)
               for i in range(n)]
    query = torch.randn(d, device=device) * 0.1
    norm_weight = torch.ones(d, device=device)
    return sources, query, norm_weight, torch.randn(*tokens, d, device=device)


def host_times(device: str = "cpu", repeats: int = 200) -> dict[int, dict[str, float]]:
    """Median microseconds of CPU per routed read at each N in HOST_N, with every launch skipped: forward =
    building the table + route_forward, backward = route_backward (as kernels.depth_route.DepthRoute runs them)."""
    results = {}
    with observe_launches(lambda launch: True):
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
    """Bytes the kernel launches of fn() read and write, counted from their arguments (kernels/traffic.py)."""
    counter = ByteCounter()

    def count(launch: Launch) -> bool:
        counter.launch(launch)
        return False                      # count, and launch
    with observe_launches(count):
        fn()
    return sum(counter.bytes.values())


def bench_routing(nominal: float | None, copy: float) -> list[dict]:
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
        print(f"N={n:3d} | ms fwd kernel {row['kernel_fwd_ms']:.3f} ref {row['reference_fwd_ms'] or float('nan'):.3f}"
              f" | fwd+bwd kernel {row['kernel_fwd_bwd_ms']:.3f} ref {row['reference_fwd_bwd_ms'] or float('nan'):.3f}"
              f" | kernel {row['kernel_fwd_bandwidth'] / 1e9:.0f} / {row['kernel_fwd_bwd_bandwidth'] / 1e9:.0f} GB/s "
              f"({100 * row['kernel_fwd_of_peak']:.0f}% / {100 * row['kernel_fwd_bwd_of_peak']:.0f}% of peak)")
        del sources
        torch.cuda.empty_cache()
    return rows


def bench_model(config: str, steps: int, layers: int | None, compile: bool) -> dict:
    """Tokens/s and peak memory of `steps` training steps of configs/<config>.py on random tokens."""
    overrides = [f"--n_layers={layers}", f"--n_blocks={min(8, layers)}"] if layers else []
    model_cfg, cfg = load_config([os.path.join(ROOT, "configs", f"{config}.py"), *overrides])
    torch.manual_seed(0)
    model = Model(model_cfg).cuda()
    if compile:
        distributed.compile_sublayers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, model_cfg.vocab_size, TOKENS, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        for _ in range(3):                # compilation and allocator warm-up
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        result = {"tokens_per_s": steps * TOKENS[0] * TOKENS[1] / seconds,
                  "peak_memory_bytes": torch.cuda.max_memory_allocated()}
    except torch.OutOfMemoryError:
        result = {"tokens_per_s": None, "peak_memory_bytes": None, "error": "out of memory"}
    del model, opt
    torch.cuda.empty_cache()
    return result


CUDA_TESTS = ("tests/test_kernels.py", "tests/test_memory.py", "tests/test_gpu_ready.py")


def run_tests() -> dict:
    """The tests that run on the GPU when there is one (the kernels compiled for real, not interpreted)."""
    run = subprocess.run(["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS], cwd=ROOT,
                         capture_output=True, text=True)
    print(run.stdout[-2000:])
    return {"files": CUDA_TESTS, "returncode": run.returncode, "summary": run.stdout.strip().splitlines()[-1:],
            "output_tail": (run.stdout + run.stderr)[-6000:]}


def versions() -> dict:
    return {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "commit": commit(), "cuda": torch.version.cuda}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", action="store_true", help="host time per routed read only (any machine)")
    parser.add_argument("--tests", action="store_true", help="run the CUDA tests first and record their outcome")
    parser.add_argument("--layers", type=int, default=None, help="layers of the whole-model runs (default: 36)")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per config")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run the sublayers eagerly")
    parser.add_argument("--out", default=os.path.join(ROOT, "kernels", "bench_results.json"))
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    tests = run_tests() if args.tests else None
    host = host_times("cuda" if cuda and not args.host else "cpu")
    for n, t in host.items():
        print(f"host time per routed read, N={n}: forward {t['forward_us']:.1f} us, backward {t['backward_us']:.1f} us")
    record = {**versions(), "tests": tests, "host_us": host, "host_device": "cuda" if cuda and not args.host else "cpu"}
    if not args.host:
        if not cuda:
            raise SystemExit("no CUDA device: only `python -m kernels.bench --host` runs here")
        name = torch.cuda.get_device_name()
        nominal, copy = nominal_bandwidth(name), copy_bandwidth()
        print(f"{name} | nominal bandwidth {nominal / 1e12 if nominal else float('nan'):.2f} TB/s | measured copy "
              f"{copy / 1e12:.2f} TB/s | torch {torch.__version__} | triton {triton.__version__}")
        routing = bench_routing(nominal, copy)
        models = {c: bench_model(c, args.steps, args.layers, args.compile) for c in MODEL_CONFIGS}
        base = models[MODEL_CONFIGS[0]]
        for config, r in models.items():
            if r["tokens_per_s"] is None or base["tokens_per_s"] is None:
                print(f"{config:<20} {r.get('error', 'baseline failed')}")
                continue
            r["speed_vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["memory_vs_baseline"] = r["peak_memory_bytes"] / base["peak_memory_bytes"]
            print(f"{config:<20} {r['tokens_per_s']:>9,.0f} tok/s ({r['speed_vs_baseline']:.3f}x) | peak "
                  f"{r['peak_memory_bytes'] / 1e9:.1f} GB ({r['memory_vs_baseline']:.3f}x)")
        checks = {f"{c} speed >= {t}": models[c].get("speed_vs_baseline", 0) >= t for c, t in SPEED_TARGETS.items()}
        checks |= {f"{c} memory <= {t}": models[c].get("memory_vs_baseline", float("inf")) <= t
                   for c, t in MEMORY_TARGETS.items()}
        worst = min(r["kernel_fwd_bwd_of_peak"] for r in routing)
        checks[f"routing fwd+bwd bandwidth >= {BANDWIDTH_TARGET:.0%} of peak"] = worst >= BANDWIDTH_TARGET
        for check, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'}  {check}")
        record |= {"gpu": name, "nominal_bandwidth": nominal, "copy_bandwidth": copy, "tokens": TOKENS,
                   "layers": args.layers or 36, "compile": args.compile, "routing": routing, "models": models,
                   "targets": checks}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
