"""Routing analysis: the weights every receiving sublayer gives its sources over held-out text, summarised
(max weight, normalised entropy, embedding weight) and plotted (eval.py --routing).

The weights are recorded through the model's routing_observer, which changes nothing in the forward pass.
Plots: PREFIX_depth.png (max weight and normalised entropy by depth) and PREFIX_matrix.png (receiver x
source, mean weights).
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
from tqdm import tqdm

from infra import cli
from infra.shards import DataError, windows
from model import Model
from router import depth_weights


def receiver_name(index: int, n_layers: int) -> str:
    """Receiver l < 2L is layer l // 2's attention (even) or MLP (odd); 2L is AttnRes's final read."""
    return "final" if index == 2 * n_layers else f"L{index // 2} {'attn' if index % 2 == 0 else 'mlp'}"


class RoutingRecorder:
    """The model's routing_observer: per receiver, the routing weights summed over every token seen.

    Weights are recomputed from the sources the receiver is about to read with router.depth_weights, the
    same function the reference routing uses; nothing in the forward pass is touched.
    """

    def __init__(self, model: Model):
        self.eps = model.cfg.norm_eps
        self.sums: dict[int, torch.Tensor] = {}        # receiver -> (N,) sum over tokens of a_i
        self.max_sums: dict[int, float] = {}           # receiver -> sum over tokens of max_i a_i
        self.entropy_sums: dict[int, float] = {}       # receiver -> sum over tokens of H(a) / log N
        self.tokens: dict[int, int] = {}

    @torch.no_grad()
    def __call__(self, index: int, sources: list[torch.Tensor], router) -> None:
        values = torch.stack(sources).float()                                          # (N, B, T, d)
        w = depth_weights(values, router.query.float(), router.norm_weight.float(), self.eps)  # (N, B, T)
        w = w.flatten(1).double()                                                      # (N, B*T)
        n = w.shape[0]
        entropy = -(w * w.clamp_min(1e-30).log()).sum(0) / math.log(max(n, 2))                # (B*T,)
        self.sums[index] = self.sums.get(index, 0) + w.sum(1).cpu()
        self.max_sums[index] = self.max_sums.get(index, 0.0) + w.max(0).values.sum().item()
        self.entropy_sums[index] = self.entropy_sums.get(index, 0.0) + entropy.sum().item()
        self.tokens[index] = self.tokens.get(index, 0) + w.shape[1]

    def summary(self, model: Model) -> list[dict]:
        """Per receiver: the mean weights over tokens and their max, normalised entropy H/log N (1 = uniform;
        None for a single source), and embedding weight, plus the per-token max and entropy averaged."""
        out = []
        for index in sorted(self.sums):
            mean = (self.sums[index] / self.tokens[index])                             # (N,) sums to 1
            n = mean.numel()
            entropy = -(mean * mean.clamp_min(1e-30).log()).sum().item() / math.log(n) if n > 1 else None
            out.append({"index": index, "name": receiver_name(index, model.cfg.n_layers), "n_sources": n,
                        "uniform": 1 / n, "null_source": model.policy.null_source, "weights": mean.tolist(),
                        "max_weight": mean.max().item(), "entropy": entropy, "embedding_weight": mean[0].item(),
                        "token_max_weight": self.max_sums[index] / self.tokens[index],
                        "token_entropy": self.entropy_sums[index] / self.tokens[index] if n > 1 else None})
        return out


@torch.no_grad()
def routing_analysis(model: Model, token_arrays: list[np.ndarray], seq_len: int, n_windows: int = 16,
                     batch_size: int = 8) -> dict:
    """Record routing weights over the first n_windows held-out windows. The means over receivers use those
    with at least two sources (a single source always gets weight 1)."""
    if model.policy.read == "none":
        raise cli.UsageError(f"residual={model.cfg.residual!r} has no depth routing to analyse")
    chunks = [w for arr in token_arrays for w in windows(np.asarray(arr), seq_len) if len(w) == seq_len + 1]
    chunks = chunks[:n_windows]
    if not chunks:
        raise DataError(f"the data has no window of {seq_len + 1} tokens to analyse")
    device = next(model.parameters()).device
    recorder = RoutingRecorder(model)
    model.routing_observer = recorder
    try:
        for i in tqdm(range(0, len(chunks), batch_size), desc="routing", unit="batch", disable=None):
            model(torch.from_numpy(np.stack(chunks[i:i + batch_size])[:, :-1].astype(np.int64)).to(device))
    finally:
        model.routing_observer = None
    receivers = recorder.summary(model)
    routed = [r for r in receivers if r["n_sources"] > 1]
    return {"residual": model.cfg.residual, "n_layers": model.cfg.n_layers, "tokens": len(chunks) * seq_len,
            "mean_max_weight": float(np.mean([r["max_weight"] for r in routed])),
            "mean_entropy": float(np.mean([r["entropy"] for r in routed])),
            "mean_embedding_weight": float(np.mean([r["embedding_weight"] for r in routed])),
            "receivers": receivers}


def plot_routing(runs: dict[str, dict], prefix: str) -> list[str]:
    """PNG plots for {label: routing_analysis(...)}, runs side by side on shared axes -> the file paths."""
    import matplotlib  # imported here: only the plots need it, and without a display (the Agg backend)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [prefix + "_depth.png", prefix + "_matrix.png"]
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    fig, (ax_max, ax_ent) = plt.subplots(1, 2, figsize=(12, 4.2), sharex=True)
    for (label, run), color in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        rs = run["receivers"]
        x = [r["index"] for r in rs]
        ax_max.plot(x, [r["max_weight"] for r in rs], "o-", color=color, label=f"{label}: max of mean weights")
        ax_max.plot(x, [r["token_max_weight"] for r in rs], "--", color=color, alpha=0.6,
                    label=f"{label}: per-token max, averaged")
        ax_max.step(x, [r["uniform"] for r in rs], ":", where="mid", color=color, label=f"{label}: uniform 1/N")
        ax_ent.plot(x, [np.nan if r["entropy"] is None else r["entropy"] for r in rs], "o-", color=color, label=label)
    ax_ent.axhline(1.0, ls=":", color="gray", label="uniform")
    longest = max(runs.values(), key=lambda run: len(run["receivers"]))["receivers"]
    for ax in (ax_max, ax_ent):
        ax.set_xticks([r["index"] for r in longest], [r["name"] for r in longest], rotation=90, fontsize=7)
    ax_max.set(title="max routing weight", xlabel="receiving sublayer", ylim=(0, 1.05))
    ax_ent.set(title="normalised entropy H(a) / log N of the mean weights", xlabel="receiving sublayer",
               ylim=(0, 1.05))
    ax_max.legend(fontsize=7)
    ax_ent.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    n_rows = max(len(run["receivers"]) for run in runs.values())
    n_cols = max(r["n_sources"] for run in runs.values() for r in run["receivers"])
    fig, axes = plt.subplots(1, len(runs), figsize=(1.2 + 3.6 * len(runs), 0.5 + 0.3 * n_rows),
                             sharex=True, sharey=True, squeeze=False)
    for ax, (label, run) in zip(axes[0], runs.items()):
        matrix = np.full((n_rows, n_cols), np.nan)                   # (receivers, sources); NaN = no such source
        for row, r in enumerate(run["receivers"]):
            w = r["weights"]
            if r["null_source"]:                                     # the zero source goes to the last column
                matrix[row, :len(w) - 1], matrix[row, -1] = w[:-1], w[-1]
            else:
                matrix[row, :len(w)] = w
        image = ax.imshow(matrix, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set(title=f"{label} ({run['residual']})", xlabel="source (0 = embedding)")
    longest = max(runs.values(), key=lambda run: len(run["receivers"]))["receivers"]  # row l is receiver l
    axes[0][0].set_yticks(range(n_rows), [r["name"] for r in longest])
    axes[0][0].set_ylabel("receiving sublayer")
    fig.colorbar(image, ax=axes[0].tolist(), label="mean routing weight")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
