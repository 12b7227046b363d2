"""The sweeps' plots: validation curves over seeds, PPL against the number of blocks, PPL change by depth and per
grid point, and the routing weights of attnres against delta_block."""
from __future__ import annotations

import os

import numpy as np

from experiments.plan import Section
from infra.routing_analysis import plot_routing


def plot_curves(section: Section, figures: dict, path: str, plt) -> bool:
    """Validation loss over steps, mean and min-max band over seeds, per row; and its second half zoomed."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, names in section.rows:
        curves = [np.array(figures[n]["curve"]) for n in names if figures.get(n)]
        if not curves or len({len(c) for c in curves}) > 1:
            continue
        steps, losses = curves[0][:, 0], np.stack([c[:, 1] for c in curves])   # (seeds, points)
        for ax in axes:
            line, = ax.plot(steps, losses.mean(0), "o-", ms=3, label=f"{label} ({len(curves)} seeds)")
            ax.fill_between(steps, losses.min(0), losses.max(0), color=line.get_color(), alpha=0.2)
    drawn = bool(axes[0].lines)
    if drawn:
        half = axes[0].lines[0].get_xdata()[len(axes[0].lines[0].get_xdata()) // 2]
        tail = [y for line in axes[1].lines for x, y in zip(line.get_xdata(), line.get_ydata()) if x >= half]
        axes[1].set(xlim=(half, None), ylim=(min(tail) - 0.01, max(tail) + 0.01), title="second half, zoomed")
        axes[0].set(title=f"{section.title.split(':')[0]}: validation loss, mean and min-max over seeds")
        for ax in axes:
            ax.set(xlabel="step", ylabel="val loss (nats/token)")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def plot_blocks(blocks: list[dict], reference: dict, seed_std: dict[str, float], path: str, plt) -> None:
    """Table 4: PPL against the number of sources, one seed; bars are Table 1's seed std of the method."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    sources = [r["sources"] for r in blocks]
    ax.errorbar(sources, [r["val_ppl"] for r in blocks], yerr=[seed_std.get(r["residual"], 0.0) for r in blocks],
                fmt="o-", capsize=3, label="delta_block with K blocks (K + 1 sources), then delta; seed 0\n"
                                             "bars: Table 1's std over seeds")
    ax.annotate("delta (fine-grained)", (sources[-1], blocks[-1]["val_ppl"]), fontsize=8,
                textcoords="offset points", xytext=(-90, 8))
    ax.axhline(reference["val_ppl"], ls="--", color="gray", label="baseline, seed 0")
    ax.set(xscale="log", xlabel="most sources read (K + 1 for K blocks; 2L fine-grained)",
           ylabel="val PPL", title="PPL vs number of blocks")
    ax.set_xticks(sources, [str(x) for x in sources])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def half_width(row: dict) -> float:
    """The 95 % interval's half-width of a row's paired change (0 for one seed or the baseline itself)."""
    return (row.get("change") or {}).get("half_width") or 0.0


def plot_depth(sections: list[list[dict]], path: str, plt) -> None:
    """Each routed method's PPL change vs the baseline (paired by seed: mean and 95 % interval) against the number
    of layers."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    labels = [r["label"] for r in sections[0][1:]]
    for i, label in enumerate(labels):
        points = sorted((r["n_layers"], r["ppl_change_pct"], half_width(r), len(r["runs"]))
                        for rows in sections for r in rows if r["label"] == label)
        if len(points) != len(sections):
            raise ValueError(f"{label!r} is in {len(points)} of the {len(sections)} depth sections")
        layers, change, std, seeds = map(np.array, zip(*points))
        ax.errorbar(layers + 0.4 * (i - (len(labels) - 1) / 2), change, yerr=std, fmt="o-", capsize=3,
                    label=f"{label} ({seeds.min()} seeds)")
    ax.axhline(0.0, ls="--", color="gray", label="baseline")
    depths = sorted({r["n_layers"] for rows in sections for r in rows})
    ax.set_xticks(depths, [str(x) for x in depths])
    ax.set(xlabel="layers (same width, steps and data)", ylabel="val PPL vs baseline (%), mean and 95 % interval",
           title="PPL change vs the baseline by depth (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_grid(section: Section, rows: list[dict], path: str, plt) -> None:
    """The paired PPL change vs the baseline of every point of a grid section, mean and 95 % interval, with each
    seed's value; additive points blue, replacement orange, the authors' variant grey."""
    points = [r for r in rows if r["label"] != "baseline"]
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.42 * len(points)))
    for y, r in enumerate(points):
        color = "0.5" if "authors'" in r["label"] else ("C0" if r["residual"] in ("delta", "delta_block") else "C1")
        ax.errorbar(r["ppl_change_pct"], y, xerr=half_width(r), fmt="o", color=color, capsize=3)
        ax.plot(r["ppl_change_pct_seeds"], [y] * len(r["ppl_change_pct_seeds"]), "x", color=color, alpha=0.5)
    ax.set_yticks(range(len(points)), [r["label"] for r in points], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(0.0, color="gray", lw=0.5)
    layers = f", {points[0]['n_layers']} layers" if points else ""
    ax.set(xlabel="val PPL vs the baseline, paired by seed (%): mean and 95 % interval (o), seeds (x)",
           title=f"{section.title.split(':')[0]}{layers}: additive blue, replacement orange")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(sections: list[Section], rows: dict[str, list[dict]], figures: dict, out: str) -> list[str]:
    """The plots the sections ask for: val_loss.png ("curves"; val_loss_<i>.png for a later one), blocks.png,
    grid.png ("grid"; grid_<i>.png for a later one),
    depth.png (every "depth" section in one), and routing_*.png (attnres vs delta_block of the first section)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    curves = [s for s in sections if "curves" in s.plots]
    for i, section in enumerate(curves):
        path = os.path.join(out, "val_loss.png" if i == 0 else f"val_loss_{i}.png")
        if plot_curves(section, figures, path, plt):
            paths.append(path)
    seed_std = {r["residual"]: r["val_ppl_std"] for r in rows[sections[0].title] if len(r["runs"]) > 1}
    for section in sections:
        blocks = [r for r in rows.get(section.title, []) if r["label"] != "baseline"]
        if "blocks" in section.plots and blocks:
            paths.append(os.path.join(out, "blocks.png"))
            plot_blocks(blocks, rows[section.title][0], seed_std, paths[-1], plt)
    grids = [s for s in sections if "grid" in s.plots and len(rows.get(s.title, [])) > 1]
    for i, section in enumerate(grids):
        paths.append(os.path.join(out, "grid.png" if i == 0 else f"grid_{i}.png"))
        plot_grid(section, rows[section.title], paths[-1], plt)
    depth = [rows.get(s.title, []) for s in sections if "depth" in s.plots]
    finished = set.intersection(*({r["label"] for r in d} for d in depth)) if depth else set()
    depth = [[r for r in d if r["label"] in finished] for d in depth]   # methods finished at every depth
    if depth and len(depth[0]) > 1 and depth[0][0]["label"] == "baseline":
        paths.append(os.path.join(out, "depth.png"))
        plot_depth(depth, paths[-1], plt)

    routed = {label: figures[names[0]]["routing"] for label, names in sections[0].rows
              if label in ("attnres", "delta_block") and figures.get(names[0])}
    if len(routed) == 2:
        paths += plot_routing(routed, os.path.join(out, "routing"))
    return paths
