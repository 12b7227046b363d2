"""Loss curves of one or several training runs, read from their log.jsonl: training and validation loss against
steps and against tokens trained on, one PNG (and the points drawn, as JSON beside it).

    python -m experiments.curves out/tiny_delta_block                          # -> out/tiny_delta_block/curves.png
    python -m experiments.curves out/tiny_baseline out/tiny_delta_block --out=results/tiny_curves.png
"""
from __future__ import annotations

import argparse
import json
import os

from experiments.runner import read_log
from infra import cli


def curves(out_dir: str) -> dict:
    """{"train": [(step, tokens, loss)], "val": [(step, tokens, val_loss)]} of one run's log (skipped steps
    left out); a resumed run's log holds both attempts, and the later entry of a step wins."""
    entries = read_log(out_dir)
    if not entries:
        raise cli.NotFoundError(f"{out_dir}: no log.jsonl with entries (a train.py out_dir holds one)")
    train, val = {}, {}
    for e in entries:
        if "loss" in e and not e.get("skipped"):
            train[e["step"]] = (e["step"], e.get("tokens"), e["loss"])
        if "val_loss" in e:
            val[e["step"]] = (e["step"], e.get("tokens"), e["val_loss"])
    return {"train": sorted(train.values()), "val": sorted(val.values())}


def plot(runs: dict[str, dict], path: str) -> None:
    """Two panels, loss against steps and against tokens; a solid line per run's training loss and its
    validation loss as dots of the same colour. Runs whose log has no token counts (older logs) are drawn
    against steps only."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, run in runs.items():
        for ax, x in zip(axes, (0, 1)):
            train = [p for p in run["train"] if p[x] is not None]
            val = [p for p in run["val"] if p[x] is not None]
            if not train and not val:
                continue
            line, = ax.plot([p[x] for p in train], [p[2] for p in train], "-", lw=1.2, label=f"{name} train")
            ax.plot([p[x] for p in val], [p[2] for p in val], "o", ms=4, color=line.get_color(), label=f"{name} val")
    for ax, xlabel in zip(axes, ("step", "tokens")):
        ax.set(xlabel=xlabel, ylabel="loss (nats/token)")
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments.curves", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="train.py out_dir folders (each holds log.jsonl)")
    parser.add_argument("--out", help="the PNG to write (default: curves.png in the first run's folder)")
    args = parser.parse_args(argv)
    runs = {os.path.normpath(r): curves(r) for r in args.runs}
    path = args.out or os.path.join(args.runs[0], "curves.png")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    plot(runs, path)
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(runs, f, indent=1)
    print(f"wrote {path}: " + "; ".join(f"{name}: {len(r['train'])} training and {len(r['val'])} validation points"
                                        for name, r in runs.items()))
    return runs


if __name__ == "__main__":
    cli.run(main)
