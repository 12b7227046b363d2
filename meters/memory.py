"""Saved-for-backward memory of one training step, per method, relative to the baseline. Deterministic, CPU.

    python -m meters.memory

Activation memory is what autograd keeps between forward and backward. We count it exactly: every tensor
saved for backward passes through torch.autograd.graph.saved_tensors_hooks; we add up the bytes of the unique
storages behind them (a tensor saved by several ops, or several views of one buffer, count once), leaving out
the parameters (every method keeps those anyway). The model has the 1044M configuration's proportions
(36 layers, 8 blocks, d_ff = 4 d, 5 query heads per KV head) with a small width, vocabulary and sequence. The
routing kernels' launches are skipped (depth_kernels.observers.skipped_launches): what autograd saves is decided by
the Python around them, never by the values they write (the kernel path's count at seq_len 32 is the same to the
byte with them run in Triton's interpreter, which takes some 6 minutes on a CPU, against 2 s). The baseline is the
plain model.

meters/peak.py projects the whole peak of training steps (parameters, gradients, AdamW states, activations
and temporaries) at the 1044M shape itself, on the meta device.
"""
from __future__ import annotations

import argparse

import torch

from depth_kernels.observers import skipped_launches
from model import Model, ModelConfig
from router import METHODS

SCALED_1044M = dict(vocab_size=256, d_model=160, n_layers=36, n_heads=5, n_kv_heads=1, head_dim=32, d_ff=640,
                    n_blocks=8)
TARGETS = {"delta_block": 1.05, "delta": 1.25}   # kernel path, relative to the baseline


def saved_bytes(model: Model, idx: torch.Tensor) -> int:
    """Bytes of the unique non-parameter storages saved for backward by one forward pass and the loss, the routing
    kernels' launches skipped (their outputs are left unwritten: only the storages are counted)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        # Kept alive by the graph, so no address is reused while we count; detached, since the tensor itself (an
        # op's output has the op as grad_fn) would be a reference cycle through an autograd node, which Python's
        # collector cannot see: the abandoned graph, and the kernel path's groups with it, would never be freed.
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), skipped_launches():
        logits = model(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
    return sum(storages.values())


def measure(methods: tuple[str, ...] = METHODS, kernels: tuple[str, ...] = ("reference", "triton"),
            batch: int = 1, seq_len: int = 64, device: str | None = None, **overrides) -> dict[str, dict[str, int]]:
    """{kernel: {method: saved bytes}} for a step on `batch` x `seq_len` tokens of the scaled 1044M model, on
    `device` (default: CUDA if there is one, else the CPU)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    idx = torch.randint(0, SCALED_1044M["vocab_size"], (batch, seq_len), generator=torch.Generator().manual_seed(0))
    results: dict[str, dict[str, int]] = {}
    for kernel in kernels:
        results[kernel] = {}
        for method in methods:
            torch.manual_seed(0)
            model = Model(ModelConfig(**{**SCALED_1044M, **overrides, "residual": method, "kernel": kernel}))
            results[kernel][method] = saved_bytes(model.to(device), idx.to(device))
    return results


def report(results: dict[str, dict[str, int]], n_tokens: int, n_layers: int) -> str:
    base = results["reference"]["baseline"]
    lines = [f"saved for backward, relative to the baseline ({base / n_tokens / n_layers:,.0f} bytes per token "
             f"per layer, {base / 2 ** 20:.1f} MiB in all, {n_tokens} tokens, {n_layers} layers, fp32)",
             f"{'method':<14}" + "".join(f"{k:>12}" for k in results) + f"{'target':>10}"]
    for method in results["reference"]:
        target = f"<= {TARGETS[method]:.2f}" if method in TARGETS else ""
        lines.append(f"{method:<14}" + "".join(f"{r[method] / base:>11.3f}x" for r in results.values())
                     + f"{target:>10}")
    return "\n".join(lines)


def run(batch: int = 1, seq_len: int = 64) -> None:
    """Print the table: the reference path and the kernel path (its launches skipped, so on any device)."""
    results = measure(batch=batch, seq_len=seq_len)
    print(report(results, batch * seq_len, SCALED_1044M["n_layers"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    run(args.batch, args.seq_len)


if __name__ == "__main__":
    main()
