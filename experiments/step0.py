"""The step-0 loss jump of fine-tuning (the paper's Sec. 3.5 and Table 5), measured on a small pretrained model.

    python -m experiments.step0                          # into runs/finetune_step0 (a few minutes on one core)
    python -m experiments.step0 --out results/finetune_step0   # the committed figures

The paper narrates that converting a pretrained Qwen3-0.6B to AttnRes makes the loss jump from 2.8 to 3.96 at
step 0, and that Delta Block does not. Here the same conversion is measured: a baseline of the sweep's model
(configs/sweep_l12.py, 800 steps, seed 0) is pretrained, written as a Hugging Face Qwen3 folder
(infra/hf_qwen3.save_hf_qwen3) and read back into each routed method with fresh routers (load_hf_qwen3, as
finetune.py reads the released checkpoint), and finetune.step0_check gives the validation loss of the
pretrained and the converted model on the same held-out windows before any step, and their largest logit
difference. Nothing is trained after the conversion: the jump is what the first step starts from. The routers'
queries start at zero, as the paper states, or, where a label says "random queries", at N(0, 0.02) as the
authors' fine-tuning script draws them (one seeded draw, ROUTER_SEED).

Writes OUT/step0.json (one entry per conversion) and OUT/step0.png (the jump per conversion).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import finetune
from experiments.runner import final_record, train_one
from infra import checkpoint, corpus, files
from infra.config import load_config
from infra.hf_qwen3 import load_hf_qwen3, save_hf_qwen3
from infra import trained

CONFIG = "configs/sweep_l12.py"
RANDOM_QUERIES = {"query_init_std": 0.02}   # the authors' fine-tuning routers: an nn.Linear(d, 1) at N(0, 0.02)
ROUTER_SEED = 0                              # the random queries' draw, so that reruns give the same figures
# label -> the ModelConfig routing fields of the conversion (finetune.ROUTING_KEYS, query_init_std); L = 12 layers
# here. N = L is one reading of the paper's Qwen3-0.6B runs (Table 2's N = 28); the authors' fine-tuning script
# defaults to 4 blocks. Queries are zero (the paper's statement) unless named, or gate=True (N(0, 0.02)).
CONVERSIONS = {
    "attnres, a block per layer (N = L)": {"residual": "attnres", "n_blocks": 12},
    "attnres, 4 blocks": {"residual": "attnres", "n_blocks": 4},
    "attnres, a block per layer (N = L), random queries": {"residual": "attnres", "n_blocks": 12, **RANDOM_QUERIES},
    "attnres, 4 blocks, random queries": {"residual": "attnres", "n_blocks": 4, **RANDOM_QUERIES},
    "full_attnres": {"residual": "full_attnres"},
    "delta_block, a block per layer (N = L), null source": {"residual": "delta_block", "n_blocks": 12,
                                                            "null_source": True},
    "delta_block, the authors' sources, null source": {"residual": "delta_block", "n_blocks": 12,
                                                       "block_source": "paper", "null_source": True},
    "delta_block, 4 blocks": {"residual": "delta_block", "n_blocks": 4},
    "delta_block, a block per layer (N = L), null source, random queries": {
        "residual": "delta_block", "n_blocks": 12, "null_source": True, **RANDOM_QUERIES},
    "delta_block, 4 blocks, random queries": {"residual": "delta_block", "n_blocks": 4, **RANDOM_QUERIES},
    "delta_block, gate=True": {"residual": "delta_block", "n_blocks": 12, "gate": True},
    "delta": {"residual": "delta"},
}


def pretrain(out: str) -> str:
    """The pretrained baseline's run folder (trained once; a finished run with its checkpoint is reused)."""
    run_dir = os.path.join(out, "pretrained")
    if final_record(run_dir) is None or not checkpoint.checkpoint_paths(run_dir):
        train_one([CONFIG, "--residual=baseline", "--seed=0", f"--out_dir={run_dir}"], run_dir, threads=1)
    return run_dir


def measure(hf_dir: str, overrides: dict) -> dict:
    """finetune.step0_check of the pretrained folder converted with `overrides`, on the sweep's held-out text."""
    _, cfg = load_config([CONFIG])
    cfg.data = corpus.data_dir(cfg.data)
    torch.manual_seed(ROUTER_SEED)        # the routers' init: only random queries draw (gate=True's included)
    model = load_hf_qwen3(hf_dir, **overrides)
    entry = finetune.step0_check(model, cfg, torch.device("cpu"))
    return {**entry, "overrides": overrides, "query_init_std": model.cfg.query_std,
            "jump": entry["val_loss_converted"] - entry["val_loss_pretrained"]}


def plot(results: dict, path: str) -> None:
    import matplotlib  # only the plot needs it, and without a display
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    jumps = [results[k]["jump"] for k in labels]
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.45 * len(labels)))
    ax.barh(range(len(labels)), jumps, color=["C3" if j > 0.01 else "C0" for j in jumps])
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0.0, color="gray", lw=0.5)
    base = next(iter(results.values()))["val_loss_pretrained"]
    ax.set(xlabel=f"val loss converted - pretrained at step 0 (pretrained: {base:.3f} nats)",
           title="Step-0 loss jump per conversion of a pretrained baseline")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join("runs", "finetune_step0"), help="output folder")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    start = time.time()
    run_dir = pretrain(args.out)
    model, _ = trained.load_model(run_dir)
    hf_dir = os.path.join(args.out, "pretrained_hf")
    save_hf_qwen3(model, hf_dir)
    results = {}
    for label, overrides in CONVERSIONS.items():
        results[label] = measure(hf_dir, overrides)
        r = results[label]
        print(f"{label:68s} q~N(0, {r['query_init_std']:g}) val loss {r['val_loss_pretrained']:.4f} -> "
              f"{r['val_loss_converted']:.4f} "
              f"(jump {r['jump']:+.4f}) | max |logit diff| {r['init_max_abs_logit_diff']:.2e}")
    files.write_json(os.path.join(args.out, "step0.json"),
                     {"config": CONFIG, "pretrained": final_record(run_dir), "conversions": results})
    plot(results, os.path.join(args.out, "step0.png"))
    print(f"wrote {args.out}/step0.json, {args.out}/step0.png | {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
