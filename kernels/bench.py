"""Benchmark of the depth-routing kernels and of whole-model training per method (a script, not a test).

    python -m kernels.bench                      # on a GPU: both benchmarks, JSON to kernels/bench_results.json
    TRITON_INTERPRET=1 python -m kernels.bench   # on a CPU: the saved-memory accounting only (kernels/memory.py)

On a GPU it measures
1. routing at the 1044M shape (d=1280, 4x1024 tokens, bf16, N sources up to 73 = Delta AttnRes's last read):
   forward and forward+backward time of the kernel, the reference and torch.compile of the reference, and the
   kernel's achieved memory bandwidth (bytes it must move / time) as a fraction of the device's peak;
2. whole-model training (1044M widths, bf16 autocast, AdamW, 4x1024 tokens per step, fewer layers with
   --layers if memory requires): tokens/s and peak memory of each method relative to the baseline.
Targets: Delta Block >= 0.97x and Delta AttnRes >= 0.85x the baseline's tokens/s; <= 1.05x and <= 1.25x its
peak memory; the routing kernels at >= 70% of peak bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import torch
import triton

from kernels import memory

D, TOKENS = 1280, (4, 1024)
N_SOURCES = (9, 25, 49, 73)
# nominal HBM bandwidth (bytes/s) by device name; a measured device-to-device copy is reported beside it
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12,
                     "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100-SXM4-40GB": 1.555e12}
SPEED_TARGETS = {"delta_block": 0.97, "delta": 0.85}
MEMORY_TARGETS = {"delta_block": 1.05, "delta": 1.25}
BANDWIDTH_TARGET = 0.70


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def nominal_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in NOMINAL_BANDWIDTH.items() if key in name), None)


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write): what the memory system delivers in practice."""
    x = torch.empty(2 ** 30, dtype=torch.bfloat16, device="cuda")
    seconds = triton.testing.do_bench(lambda: x.clone()) / 1e3
    return 2 * x.numel() * x.element_size() / seconds


def bench_routing(nominal: float | None, measured: float) -> list[dict]:
    from kernels.depth_route import depth_route
    from router import depth_route as reference
    compiled = torch.compile(reference)
    rows = []
    for n in N_SOURCES:
        sources = [torch.randn(*TOKENS, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(n)]
        query = torch.randn(D, device="cuda", requires_grad=True)
        norm_weight = torch.ones(D, device="cuda", requires_grad=True)
        grad = torch.randn(*TOKENS, D, device="cuda", dtype=torch.bfloat16)
        row = {"n_sources": n}
        for name, fn in (("kernel", depth_route), ("reference", reference), ("compiled_reference", compiled)):
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
        # the bytes the kernels cannot avoid: forward reads N sources and writes r; backward reads the N
        # sources twice (softmax term, then gradients) and the incoming gradient, and writes N gradients
        elt, m = 2, TOKENS[0] * TOKENS[1]
        fwd_bytes, bwd_bytes = (n + 1) * m * D * elt, (3 * n + 1) * m * D * elt
        row["kernel_fwd_bandwidth"] = fwd_bytes / (row["kernel_fwd_ms"] / 1e3)
        row["kernel_fwd_bwd_bandwidth"] = (fwd_bytes + bwd_bytes) / (row["kernel_fwd_bwd_ms"] / 1e3)
        for key in ("fwd", "fwd_bwd"):
            bw = row[f"kernel_{key}_bandwidth"]
            row[f"kernel_{key}_of_copy_bandwidth"] = bw / measured
            row[f"kernel_{key}_of_peak"] = bw / (nominal or measured)   # the copy when the spec is unknown
        rows.append(row)
        print(f"N={n:3d} | fwd ms kernel {row['kernel_fwd_ms']:.3f} ref {row['reference_fwd_ms'] or float('nan'):.3f} "
              f"compiled {row['compiled_reference_fwd_ms'] or float('nan'):.3f} | fwd+bwd ms kernel "
              f"{row['kernel_fwd_bwd_ms']:.3f} ref {row['reference_fwd_bwd_ms'] or float('nan'):.3f} compiled "
              f"{row['compiled_reference_fwd_bwd_ms'] or float('nan'):.3f} | kernel fwd "
              f"{row['kernel_fwd_bandwidth'] / 1e9:.0f} GB/s ({100 * row['kernel_fwd_of_peak']:.0f}% of peak)")
        del sources
        torch.cuda.empty_cache()
    return rows


def bench_model(method: str, n_layers: int, steps: int, kernel: str) -> dict:
    from model import Model, ModelConfig
    cfg = ModelConfig(vocab_size=151936, d_model=D, n_layers=n_layers, n_heads=20, n_kv_heads=4, head_dim=64,
                      d_ff=4 * D, n_blocks=min(8, n_layers), residual=method, kernel=kernel)
    torch.manual_seed(0)
    model = Model(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, cfg.vocab_size, TOKENS, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        for _ in range(3):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=36, help="layers of the whole-model benchmark")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per method")
    parser.add_argument("--kernel", default="auto", help="ModelConfig.kernel for the whole-model benchmark")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "bench_results.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: saved-memory accounting only (python -m kernels.memory)")
        memory.run()
        return
    name = torch.cuda.get_device_name()
    nominal, measured = nominal_bandwidth(name), copy_bandwidth()
    print(f"{name} | nominal bandwidth {nominal / 1e12 if nominal else float('nan'):.2f} TB/s | "
          f"measured copy {measured / 1e12:.2f} TB/s | torch {torch.__version__} | triton {triton.__version__}")
    routing = bench_routing(nominal, measured)
    print(f"whole model: 1044M widths, {args.layers} layers, {TOKENS[0]}x{TOKENS[1]} tokens/step, bf16 autocast, "
          f"kernel={args.kernel}")
    models = {m: bench_model(m, args.layers, args.steps, args.kernel) for m in memory.METHODS}
    base = models["baseline"]
    for method, r in models.items():
        if r["tokens_per_s"] is None or base["tokens_per_s"] is None:
            print(f"{method:<14} {r.get('error', 'baseline failed')}")
            continue
        r["speed_vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["memory_vs_baseline"] = r["peak_memory_bytes"] / base["peak_memory_bytes"]
        print(f"{method:<14} {r['tokens_per_s']:>9,.0f} tok/s ({r['speed_vs_baseline']:.3f}x) | peak "
              f"{r['peak_memory_bytes'] / 1e9:.1f} GB ({r['memory_vs_baseline']:.3f}x)")
    checks = {f"{m} speed >= {t}": models[m].get("speed_vs_baseline", 0) >= t for m, t in SPEED_TARGETS.items()}
    checks |= {f"{m} memory <= {t}": models[m].get("memory_vs_baseline", float("inf")) <= t
               for m, t in MEMORY_TARGETS.items()}
    worst = min(r["kernel_fwd_bwd_of_peak"] for r in routing)
    checks[f"routing fwd+bwd bandwidth >= {BANDWIDTH_TARGET:.0%} of peak"] = worst >= BANDWIDTH_TARGET
    for check, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {check}")
    with open(args.out, "w") as f:
        json.dump({"gpu": name, "torch": torch.__version__, "triton": triton.__version__, "commit": commit(),
                   "layers": args.layers, "tokens": TOKENS, "kernel": args.kernel,
                   "nominal_bandwidth": nominal, "copy_bandwidth": measured,
                   "routing": routing, "models": models, "targets": checks}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
