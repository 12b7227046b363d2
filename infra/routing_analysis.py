"""Routing analysis: the weights every receiving sublayer gives its sources over held-out text, and how alike
those sources look to the receiver's keys (eval.py --routing).

Weights, per receiver, averaged over tokens: the per-token max weight and normalised entropy H(a) / log N (the
headline figures: 0 = one-hot, 1 = uniform, N = the receiver's number of sources), the weight on the
embedding, and the token-averaged weights themselves. The entropy of the token-averaged weights is only an
upper bound on the per-token one (H is concave): routing that is one-hot on every token, but on a different
source per token, has mean weights that look uniform. It is kept, named `mean_weights_entropy`, next to
`mean_weights_max`.

Redundancy (the paper's Sec. 2.2, Fig. 2): the mean pairwise cosine similarity of the keys
RMSNorm_{g_l}(s_i) the receiver's static query sees, for its sources as the method reads them ("sources"), as
changes of the stream ("deltas": e, outputs or block sums, the partial) and, on the same forward, as the
cumulative states at the same places ("states": h~_0 .. h~_l fine-grained; h~ at the block boundaries and the
current h~_l for blocks). Similar keys are hard for a static query to tell apart.

Everything is recorded through the model's routing_observer, which changes nothing in the forward pass.
Plots: PREFIX_depth.png (max weight and entropy by depth), PREFIX_matrix.png (receiver x source, mean
weights), PREFIX_similarity.png (similarity by depth, deltas vs states) and PREFIX_similarity_matrix.png
(the deepest receiver's source x source similarities).
"""
from __future__ import annotations

import itertools
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from infra import cli
from infra.shards import DataError, windows
from model import Model
from router import Policy, depth_weights, rms_norm

VIEWS = ("sources", "deltas", "states")


def receiver_name(index: int, n_layers: int) -> str:
    """Receiver l < 2L is layer l // 2's attention (even) or MLP (odd); 2L is AttnRes's final read."""
    return "final" if index == 2 * n_layers else f"L{index // 2} {'attn' if index % 2 == 0 else 'mlp'}"


def stream_views(policy: Policy, sources: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """A receiver's sources (N tensors (B, T, d)) as the method reads them, as deltas and as states, without
    the null source (a zero or learned vector, no part of the stream; it is always the last source).

    Boundary deltas (the five methods' default) decompose the stream, so the states are their running sums:
    [e, B_0, .., B_{k-1}, partial] -> [h~_0, h~_{tau_1}, .., h~_{tau_k}, h~_l], and fine-grained
    [e, v_0, .., v_{l-1}] -> [h~_0, .., h~_l]. The paper's Fig. 3 sources S_k = H_k - S_{k-1} give the
    boundary states H_k = S_k + S_{k-1}; sources="states" are the states, and their differences the deltas.
    """
    own = list(sources[:-1] if policy.null_source else sources)
    if policy.sources == "states":
        return {"sources": own, "deltas": own[:1] + [b - a for a, b in zip(own, own[1:])], "states": own}
    if policy.block_source == "paper":
        states = own[:1] + [b + a for a, b in zip(own, own[1:])]              # H_0 = S_0 = e, H_k = S_k + S_{k-1}
        return {"sources": own, "deltas": states[:1] + [b - a for a, b in zip(states, states[1:])],
                "states": states}
    return {"sources": own, "deltas": own, "states": list(itertools.accumulate(own))}


def key_similarity(sources: list[torch.Tensor], norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Sum over tokens of the cosine similarities of every pair of keys k_i = RMSNorm_g(s_i): sources N tensors
    (B, T, d), norm_weight (d,) -> (N, N) float64 (the diagonal counts the tokens whose key is not zero)."""
    keys = rms_norm(torch.stack(sources).float(), norm_weight.float(), eps).flatten(1, -2)   # (N, B*T, d)
    unit = F.normalize(keys, dim=-1)                                                      # a zero key stays 0
    return torch.einsum("imd,jmd->ij", unit, unit).double()                              # (N, N)


def mean_off_diagonal(matrix: torch.Tensor) -> float | None:
    """The mean of the N (N - 1) off-diagonal entries of an (N, N) matrix; None for N < 2."""
    n = matrix.shape[0]
    return None if n < 2 else ((matrix.sum() - matrix.diagonal().sum()) / (n * (n - 1))).item()


class RoutingRecorder:
    """The model's routing_observer: per receiver, sums over every token seen of the routing weights, their
    per-token max and normalised entropy, and the key similarities of each view (stream_views).

    Weights are recomputed from the sources the receiver is about to read with router.depth_weights, the
    same function the reference routing uses; nothing in the forward pass is touched.
    """

    def __init__(self, model: Model):
        self.eps, self.policy = model.cfg.norm_eps, model.policy
        self.sums: dict[int, torch.Tensor] = {}        # receiver -> (N,) sum over tokens of a_i
        self.max_sums: dict[int, float] = {}           # receiver -> sum over tokens of max_i a_i
        self.entropy_sums: dict[int, float] = {}       # receiver -> sum over tokens of H(a) / log N
        self.tokens: dict[int, int] = {}
        self.similarity: dict[int, dict[str, torch.Tensor]] = {}   # receiver -> view -> (N', N') sums

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
        done: dict[int, torch.Tensor] = {}             # id(list) -> its similarities: views may share a list
        sums = self.similarity.setdefault(index, {})
        for view, srcs in stream_views(self.policy, sources).items():
            if len(srcs) >= 2:
                done.setdefault(id(srcs), key_similarity(srcs, router.norm_weight, self.eps).cpu())
                sums[view] = sums.get(view, 0) + done[id(srcs)]

    def summary(self, model: Model) -> list[dict]:
        """Per receiver: per-token max weight and normalised entropy averaged over tokens (entropy None for a
        single source), the mean weights with their max and entropy, the embedding weight, and the mean
        pairwise key similarity of each view (None with fewer than two stream sources)."""
        out = []
        for index in sorted(self.sums):
            tokens = self.tokens[index]
            mean = self.sums[index] / tokens                                           # (N,) sums to 1
            n = mean.numel()
            mean_entropy = -(mean * mean.clamp_min(1e-30).log()).sum().item() / math.log(n) if n > 1 else None
            sims = {view: m / tokens for view, m in self.similarity.get(index, {}).items()}
            out.append({"index": index, "name": receiver_name(index, model.cfg.n_layers), "n_sources": n,
                        "uniform": 1 / n, "null_source": model.policy.null_source, "weights": mean.tolist(),
                        "max_weight": self.max_sums[index] / tokens,
                        "entropy": self.entropy_sums[index] / tokens if n > 1 else None,
                        "mean_weights_max": mean.max().item(), "mean_weights_entropy": mean_entropy,
                        "embedding_weight": mean[0].item(),
                        **{f"similarity_{view}": mean_off_diagonal(sims[view]) if view in sims else None
                           for view in VIEWS},
                        "similarity_matrix": {view: m.tolist() for view, m in sims.items()}})
        return out


def max_weight_x_n(receivers: list[dict]) -> float | None:
    """The per-token max weight relative to a uniform read, max weight × N (1 uniform, N one-hot), averaged over
    receivers with two or more sources: the max weight alone falls with N, so it does not compare methods whose
    receivers see different numbers of sources."""
    routed = [r["max_weight"] * r["n_sources"] for r in receivers if r["n_sources"] > 1]
    return float(np.mean(routed)) if routed else None


def _means(receivers: list[dict]) -> dict:
    """Means over receivers with at least two sources (a single source always gets weight 1), and for the
    similarities over receivers with at least two stream sources."""
    routed = [r for r in receivers if r["n_sources"] > 1]
    out = {k if k.startswith("mean_") else f"mean_{k}": float(np.mean([r[k] for r in routed])) for k in
           ("max_weight", "entropy", "mean_weights_max", "mean_weights_entropy", "embedding_weight")}
    out["mean_max_weight_x_n"] = max_weight_x_n(receivers)
    for view in VIEWS:
        values = [r[f"similarity_{view}"] for r in receivers if r[f"similarity_{view}"] is not None]
        out[f"mean_similarity_{view}"] = float(np.mean(values)) if values else None
    return out


@torch.no_grad()
def routing_analysis(model: Model, token_arrays: list[np.ndarray], seq_len: int, n_windows: int = 16,
                     batch_size: int = 8) -> dict:
    """Record routing weights and key similarities over the first n_windows held-out windows."""
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
    return {"residual": model.cfg.residual, "n_layers": model.cfg.n_layers, "tokens": len(chunks) * seq_len,
            **_means(receivers), "receivers": receivers}


# -------------------------------------------------------------------------------------------------- plots

def _pyplot():
    import matplotlib  # imported here: only the plots need it, and without a display (the Agg backend)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _receiver_ticks(axes, runs: dict[str, dict]) -> None:
    longest = max(runs.values(), key=lambda run: len(run["receivers"]))["receivers"]
    for ax in axes:
        ax.set_xticks([r["index"] for r in longest], [r["name"] for r in longest], rotation=90, fontsize=7)


def _save(fig, path: str, plt, tight: bool = True) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_routing(runs: dict[str, dict], prefix: str) -> list[str]:
    """PNG plots for {label: routing_analysis(...)}, runs side by side on shared axes -> the file paths."""
    plt = _pyplot()
    fig, (ax_max, ax_ent) = plt.subplots(1, 2, figsize=(12, 4.2), sharex=True)
    for (label, run), color in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        rs = run["receivers"]
        x = [r["index"] for r in rs]
        ax_max.plot(x, [r["max_weight"] for r in rs], "o-", color=color, label=f"{label}: per-token max")
        ax_max.plot(x, [r["mean_weights_max"] for r in rs], "--", color=color, alpha=0.6,
                    label=f"{label}: max of the mean weights")
        ax_max.step(x, [r["uniform"] for r in rs], ":", where="mid", color=color, label=f"{label}: uniform 1/N")
        none = lambda v: np.nan if v is None else v  # noqa: E731
        ax_ent.plot(x, [none(r["entropy"]) for r in rs], "o-", color=color, label=f"{label}: per token")
        ax_ent.plot(x, [none(r["mean_weights_entropy"]) for r in rs], "--", color=color, alpha=0.6,
                    label=f"{label}: of the mean weights (an upper bound)")
    ax_ent.axhline(1.0, ls=":", color="gray", label="uniform")
    _receiver_ticks((ax_max, ax_ent), runs)
    ax_max.set(title="max routing weight, averaged over tokens", xlabel="receiving sublayer", ylim=(0, 1.05))
    ax_ent.set(title="normalised entropy H(a) / log N, averaged over tokens", xlabel="receiving sublayer",
               ylim=(0, 1.05))
    ax_max.legend(fontsize=7)
    ax_ent.legend(fontsize=7)
    return [_save(fig, prefix + "_depth.png", plt), _plot_matrix(runs, prefix + "_matrix.png", plt)]


def _plot_matrix(runs: dict[str, dict], path: str, plt) -> str:
    """Receiver x source mean weights, one panel per run."""
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
    return _save(fig, path, plt, tight=False)


def plot_similarity(runs: dict[str, dict], prefix: str) -> list[str]:
    """Fig. 2 in the spirit of the paper: per receiver, the mean pairwise key similarity of the deltas and of
    the states (and of the method's own sources where they are neither), one panel per run; then the deepest
    receiver's source x source similarities -> the file paths."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(1.0 + 4.2 * len(runs), 4.2), sharey=True, squeeze=False)
    styles = {"deltas": ("o-", "C0"), "states": ("s--", "C3"), "sources": (":", "k")}
    for ax, (label, run) in zip(axes[0], runs.items()):
        rs = [r for r in run["receivers"] if r["similarity_deltas"] is not None]
        for view, (style, color) in styles.items():
            if view == "sources" and all(r["similarity_sources"] in (r["similarity_deltas"], r["similarity_states"])
                                         for r in rs):
                continue                                             # the sources are the deltas or the states
            ax.plot([r["index"] for r in rs], [r[f"similarity_{view}"] for r in rs], style, color=color, ms=4,
                    label=f"{view}: mean {run[f'mean_similarity_{view}']:.2f}")
        ax.axhline(0.0, color="gray", lw=0.5)
        ax.set(title=f"{label} ({run['residual']})", xlabel="receiving sublayer", ylim=(-0.2, 1.02))
        ax.legend(fontsize=8)
        _receiver_ticks([ax], {label: run})
    axes[0][0].set_ylabel("mean pairwise cos(RMSNorm_g(s_i), RMSNorm_g(s_j))")
    paths = [_save(fig, prefix + "_similarity.png", plt)]
    fig, axes = plt.subplots(2, len(runs), figsize=(1.0 + 3.4 * len(runs), 6.6), squeeze=False)
    for col, (label, run) in enumerate(runs.items()):
        deepest = max(run["receivers"], key=lambda r: len(r["similarity_matrix"].get("deltas", [])))
        for row, view in enumerate(("deltas", "states")):
            image = axes[row][col].imshow(np.array(deepest["similarity_matrix"][view]), vmin=-1, vmax=1,
                                          cmap="RdBu_r")
            axes[row][col].set(title=f"{label}, {deepest['name']}: {view}", xlabel="source", ylabel="source")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="mean cosine similarity of the keys")
    paths.append(_save(fig, prefix + "_similarity_matrix.png", plt, tight=False))
    return paths
