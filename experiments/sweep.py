"""The paper's comparisons in miniature, with seed error bars and at equal wall-clock, on a 2-core CPU.

    python -m experiments.sweep                      # every run into runs/sweep (79 runs, about 6.5 core-hours), then
                                                     # its table compared with the committed results/sweep
                                                     # (runs/sweep/compare.md)
    python -m experiments.sweep --out results/sweep  # the same into the committed folder (what was published)
    python -m experiments.sweep --report_only        # rewrite the table, JSON and plots from the finished runs
    python -m experiments.sweep --depth              # the depth sweep into runs/depth_sweep (80 runs, ~10 core-hours)

One model (configs/sweep_l12.py: 12 layers, d = 64, byte-level Shakespeare) and seven comparisons:
  Table 1   baseline, attnres, full_attnres, delta, delta_block, delta_block with the paper's sources;
            equal steps, 3 seeds each (seed s gives every method the same backbone init and data order);
  Table 4   delta_block with 1, 2, 4, 6, 12 blocks and delta (the fine-grained end), seed 0;
  wall      baseline, delta, delta_block with the same time_budget_s (the baseline's equal-steps wall time),
            5 seeds; each method's cosine schedule is as long as the steps its Table 1 run made in that time;
  init      delta_block's query init (zero or N(0, 0.02)) with and without gate=True, 3 seeds;
  grid      sources (deltas or states) x use (replacement or additive) x granularity, 3 seeds, with the
            factorial effects (report.factorial);
  recipe    delta_block with each of two of the authors' recipe choices (init scale, decay), 3 seeds;
  precision delta_block with the whole model in bf16 against fp32, with its own baseline, 5 seeds.
--depth trains another plan: the paper's depth claim (AttnRes falls behind the baseline at 36 layers, additive
routing does not) on configs/sweep_depth.py (d = 32): baseline, attnres, delta_block and delta at 36 and at 12
layers, equal steps, 8 seeds each, and the grid's block points (boundary states) at 36; its plots add depth.png
(the paired PPL change vs the baseline by depth).
Two runs train at once, one thread each (--jobs, --threads); runs shared between tables are trained once.
A run whose log.jsonl has its final record is skipped, so an interrupted sweep continues where it stopped.
Writes OUT/runs/<run>/ (log.jsonl, stdout.txt, routing.json, checkpoint), OUT/results.json, OUT/table.md and
OUT/*.png. Training is deterministic for a given seed, torch build and thread count, so the equal-steps rows of a
rerun on the same kind of machine should match the committed table to the last digit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from experiments.plan import depth_plan, full_plan
from experiments.report import compare, compare_markdown, summarise
from experiments.runner import clock, execute


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", action="store_true", help="the depth sweep (36 and 12 layers) instead of the tables")
    p.add_argument("--out", help="results folder (default runs/sweep or runs/depth_sweep); runs go to OUT/runs/<name>")
    p.add_argument("--compare", help="a results.json to compare the table with (default: the committed "
                   "results/sweep or results/depth_sweep; '' for none); written to OUT/compare.md")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once (one process each)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--budget_s", type=float, help="equal wall-clock budget (default: the baseline's wall time)")
    p.add_argument("--report_only", action="store_true", help="write the table, JSON and plots; train nothing")
    p.add_argument("--no_triton", action="store_true", help="skip the kernel path's memory count")
    args = p.parse_args(argv)
    if args.compare and not os.path.isfile(args.compare):
        p.error(f"--compare: no results file at {args.compare}")
    plan = depth_plan() if args.depth else full_plan()
    args.out = args.out or os.path.join("runs", plan.name)
    args.compare = plan.committed if args.compare is None else args.compare
    start = time.time()
    failed = [] if args.report_only else execute(plan.runs, args.out, args.jobs, args.threads, args.budget_s)
    torch.set_num_threads(max(1, args.jobs * args.threads))
    results = summarise(plan, args.out, not args.no_triton, time.time() - start,
                        "python -m experiments.sweep " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {os.path.join(args.out, 'results.json')}, {os.path.join(args.out, 'table.md')}, "
          f"{', '.join(results['plots'])} | {clock(time.time() - start)}")
    mine = os.path.join(args.out, "results.json")
    if args.compare and not os.path.isfile(args.compare):
        print(f"no committed sweep at {args.compare} to compare with")
    elif args.compare and not os.path.samefile(args.compare, mine):
        with open(args.compare) as f:
            old = json.load(f)
        rows = compare(results, old)
        text = (compare_markdown(rows, results, old, args.compare) if rows else
                f"no finished row to compare with {args.compare} yet\n")
        with open(os.path.join(args.out, "compare.md"), "w") as f:
            f.write(text)
        print(text, end="")
    if failed:
        print(f"failed runs: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
