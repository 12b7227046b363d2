"""The 1044M training kernels' predicted speed on an H200, from their compiled sm_90 code, and its calibration.

    python -m meters.speed             # per kernel: grid, programs per SM, iterations, per-iteration
                                                    # instructions and barriers, predicted time and share of the copy
                                                    # bandwidth; then predicted against measured (H200)
    python -m meters.speed --jobs 1    # compile in one process (default: one per CPU)
    python -m meters.speed --traffic [--blocks 4] [--json out.json]   # meters.traffic's
                                                    # report with its "compiled" ratio: every launch timed so

Every launch of one training step of configs/1044m_delta.py and configs/1044m_delta_block.py (4 x 1024 tokens, bf16
autocast, as the configs run) is found on the meta device (meters.traffic.dry_step), with the bytes it
moves; its specialisation is compiled for sm_90 (meters/aot.py, whose compile at d = 1280 reads the
machine code: meters/sass.py) and timed by meters/occupancy.py's model. The calibration
compares the predictions with one H200's measurements of the kernels of commit ae83ce1
(results/gpu/h200_ae83ce1/kernels.json): the profiler's per-call mean where it gives one, else Nsight Compute's one
launch, predicted for that launch (the CUDA-event means of that file include Triton's host-side launch, 2-3x the
short kernels' own time).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import inspect
import json
import multiprocessing
import os
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from typing import Iterator

from depth_kernels.observers import Launch
from meters import aot, sass, traffic
from meters.occupancy import COPY_BANDWIDTH, SMS, launch_seconds, occupancy
from meters.traffic import ByteCounter, dry_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("1044m_delta", "1044m_delta_block")
TOKENS = (4, 1024)
MEASURED = os.path.join(ROOT, "results", "gpu", "h200_ae83ce1", "kernels.json")
# their group_read and receiver_read, and the tiles.py they import as measured_tiles, verbatim but for imports
MEASURED_KERNELS = os.path.join(ROOT, "results", "gpu", "h200_ae83ce1", "kernels")
# what the measured kernels take from today's depth_kernels/launch.py that sets their compiled code and launch
# shape (launching itself, the observers' plumbing, may change)
LAUNCH_CONFIGURATION = ("SourceTable", "source_table", "aligned", "cdiv", "register_budget", "row_tiles", "row_split",
                        "wave", "slab_of", "slot_view", "slots", "_sm_count")
TOLERANCE = 1.5             # the calibration's bound on predicted / measured, either way


def launch_configuration_digest() -> str:
    """sha256 of LAUNCH_CONFIGURATION's source in today's launch.py."""
    from depth_kernels import launch
    code = "".join(inspect.getsource(getattr(launch, name)) for name in LAUNCH_CONFIGURATION)
    return hashlib.sha256(code.encode()).hexdigest()


def measured_sources_unchanged() -> bool:
    """Whether the measured kernels' copies and today's launch configuration are what kernels.json recorded when
    they were measured: the calibration compares the model with the code the H200 ran only while they are."""
    with open(MEASURED) as f:
        recorded = json.load(f)
    files = all(hashlib.sha256(open(os.path.join(ROOT, path), "rb").read()).hexdigest() == digest
                for path, digest in recorded["sources"].items())
    return files and recorded.get("launch_configuration") == launch_configuration_digest()


def training_launches(config: str) -> list[tuple[Launch, int]]:
    """(launch, bytes it moves) for every kernel launch of one training step of configs/<config>.py at TOKENS."""
    from meters.bench import model_config
    cfg = dataclasses.replace(model_config(config)[0], kernel="triton")
    counter = ByteCounter()
    dry_step(cfg, TOKENS, counter)
    return [(launch, moved) for launch, (moved, _) in zip(counter.launches, counter.kernels)]


@contextlib.contextmanager
def measured_kernels() -> Iterator[None]:
    """The model's path runs the phase-1 and receiver modules that the H200 measured (kept verbatim in
    MEASURED_KERNELS with the tiles.py they import; launch.py's part is checked unchanged by
    measured_sources_unchanged) in
    place of today's, so that the calibration compares the model with the code it measured, whatever the kernels
    are now. Their specialisations share names with today's: time them with a compiled dict of their own."""
    from depth_kernels import grouped_state, groups
    modules = {}
    for name in ("measured_tiles", "group_read", "receiver_read"):
        module = name if name.startswith("measured_") else f"measured_{name}"    # the copies import measured_tiles
        spec = importlib.util.spec_from_file_location(module, os.path.join(MEASURED_KERNELS, f"{name}.py"))
        modules[name] = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # dataclasses look it up
        spec.loader.exec_module(modules[name])
    patches = [(grouped_state, name, modules["group_read"]) for name in ("group_forward", "group_backward")]
    patches += [(grouped_state, name, modules["receiver_read"])
                for name in ("Inputs", "Read", "receiver_backward", "receiver_forward")]
    patches += [(groups, "receivers_per_pass", modules["group_read"])]
    patches += [(groups, name, modules["receiver_read"]) for name in ("ReadGrads", "backward_wave")]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, measured in patches:
            setattr(module, name, getattr(measured, name))
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def measured_calibration() -> list[dict]:
    """calibration() of the measured kernels (measured_kernels), compiled here at the 1044M shapes."""
    compiled: dict[str, aot.Compiled] = {}
    with measured_kernels():
        predicted = {config: predict(config, compiled) for config in CONFIGS}
    with open(MEASURED) as f:
        return calibration(predicted, json.load(f))


def _training_specs() -> dict[str, tuple]:
    specs = {}
    for config in CONFIGS:
        specs.update(aot.specialisations([launch for launch, _ in training_launches(config)]))
    return specs


def _compile_names(names: list[str]) -> list[aot.Compiled]:
    """Compile the named specialisations (found again in this process: they do not pickle)."""
    specs = _training_specs()
    return [aot.compile_one(name, specs[name]) for name in names]


def compile_training(jobs: int = 1) -> dict[str, aot.Compiled]:
    """{specialisation: Compiled} of every kernel the configs' training steps launch (machine code read), in
    `jobs` processes."""
    names = list(_training_specs())
    if jobs <= 1:
        return {c.name: c for c in _compile_names(names)}
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = [pool.submit(_compile_names, names[i::jobs]) for i in range(jobs) if names[i::jobs]]
        return {c.name: c for p in parts for c in p.result()}


def launch_time(launch: Launch, moved: int, compiled: dict[str, aot.Compiled]) -> dict:
    """One launch timed from its compiled code: occupancy.launch_seconds's figures, with its grid, programs that
    fit on an SM, registers, iterations of its innermost loop per program and that loop's instructions, barriers and
    shared-memory accesses. compiled: {specialisation: Compiled with code}; a specialisation missing there is
    compiled (at any width: its machine code is read) and added."""
    (name, spec), = aot.specialisations([launch]).items()
    if name not in compiled or compiled[name].code is None:
        compiled[name] = aot.compile_one(name, spec, read_code=True)
    c = compiled[name]
    code, path = c.code, inspect.getsourcefile(launch.kernel.fn)
    programs = max(1, min(code["resident"], -(-launch.grid // SMS)))
    passes = sass.launch_passes(code, {**launch.args, "num_programs": launch.grid}, path, programs)
    in_flight = occupancy(launch, programs=programs).bytes_in_flight
    inner = sass.innermost(code)
    return {"grid": launch.grid, "resident": code["resident"], "registers": code["registers"],
            "iterations": max(p.passes for p in passes), "instructions": inner["instructions"],
            "barriers": inner["classes"].get("barrier", 0), "shared": inner["classes"].get("shared", 0),
            "shuffles": inner["classes"].get("shuffle", 0), "bytes": moved,
            **launch_seconds(passes, launch.grid, c.num_warps, code["resident"], moved, in_flight)}


def predict(config: str, compiled: dict[str, aot.Compiled]) -> list[dict]:
    """launch_time of every launch of a training step of configs/<config>.py, with its kernel's name and which
    launch of that kernel it is (from 1). compiled: as launch_time's (aot.compile_all at d = 1280, or
    compile_training)."""
    rows, count = [], defaultdict(int)
    for launch, moved in training_launches(config):
        kernel = launch.kernel.fn.__name__
        count[kernel] += 1
        rows.append({"kernel": kernel, "launch": count[kernel], **launch_time(launch, moved, compiled)})
    return rows


class Timer:
    """launch, bytes -> predicted seconds from the compiled code (meters/traffic.py's kernel time),
    compiling each specialisation once."""

    def __init__(self, compiled: dict[str, aot.Compiled] | None = None):
        self.compiled = {} if compiled is None else compiled

    def __call__(self, launch: Launch, moved: int) -> float:
        return launch_time(launch, moved, self.compiled)["seconds"]


def by_kernel(rows: list[dict]) -> dict[str, dict]:
    """predict()'s launches summed per kernel: launches, bytes, seconds, of_copy (bytes / seconds / the copy
    bandwidth), the fewest programs per SM, the grids, the most iterations per program, the innermost loop's
    instructions and barriers per iteration (the kernel's first launch), and the bound of most of its time."""
    out = {}
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        mine = [r for r in rows if r["kernel"] == kernel]
        seconds, moved = sum(r["seconds"] for r in mine), sum(r["bytes"] for r in mine)
        bounds = defaultdict(float)
        for r in mine:
            bounds[r["bound"]] += r["seconds"]
        out[kernel] = {"launches": len(mine), "bytes": moved, "seconds": seconds,
                       "of_copy": moved / seconds / COPY_BANDWIDTH,
                       "programs_per_sm": min(r["programs_per_sm"] for r in mine),
                       "resident": min(r["resident"] for r in mine), "grid": sorted({r["grid"] for r in mine}),
                       "iterations": max(r["iterations"] for r in mine), "instructions": mine[0]["instructions"],
                       "barriers": mine[0]["barriers"], "shared": mine[0]["shared"],
                       "registers": mine[0]["registers"], "bound": max(bounds, key=bounds.get)}
    return out


def calibration(predicted: dict[str, list[dict]], measured: dict) -> list[dict]:
    """Per kernel and config: predicted and measured ms and their ratio. predicted: {config: predict()}; measured:
    results/gpu/h200_ae83ce1/kernels.json. The profiler's per-call mean against the predicted mean; else Nsight
    Compute's launch against the prediction for that launch."""
    out = []
    for config, rows in predicted.items():
        for kernel, m in measured["configs"][config].items():
            mine = [r for r in rows if r["kernel"] == kernel]
            if m["profiler_ms_per_launch"]:
                what, ms = "profiler mean", m["profiler_ms_per_launch"]
                pred = 1e3 * sum(r["seconds"] for r in mine) / len(mine)
            else:
                what, ms = f"ncu launch {m['ncu']['launch']}", m["ncu"]["ms"]
                pred = 1e3 * next(r["seconds"] for r in mine if r["launch"] == m["ncu"]["launch"])
            out.append({"kernel": kernel, "config": config, "measured": what, "predicted_ms": pred, "measured_ms": ms,
                        "ratio": pred / ms})
    return out


def table(kernels: dict[str, dict[str, dict]]) -> str:
    """The per-kernel figures of by_kernel for each config, one line each."""
    lines = [f"{'config':<18}{'kernel':<15}{'grid':>10}{'prog/SM':>8}{'regs':>5}{'iters':>7}{'instr/it':>9}"
             f"{'bar/it':>7}{'shared/it':>10}{'ms/step':>9}{'of copy':>8}  bound"]
    for config, found in kernels.items():
        for kernel, k in found.items():
            grid = "/".join(map(str, k["grid"]))
            lines.append(f"{config:<18}{kernel:<15}{grid:>10}{k['programs_per_sm']:>8}{k['registers']:>5}"
                         f"{k['iterations']:>7}{k['instructions']:>9}{k['barriers']:>7}{k['shared']:>10}"
                         f"{1e3 * k['seconds']:>9.3f}{k['of_copy']:>8.1%}  {k['bound']}")
    return "\n".join(lines)


def calibration_table(rows: list[dict]) -> str:
    lines = [f"{'kernel':<15}{'config':<19}{'predicted ms':>13}{'measured ms':>12}{'ratio':>7}  measured as"]
    lines += [f"{r['kernel']:<15}{r['config']:<19}{r['predicted_ms']:>13.3f}{r['measured_ms']:>12.3f}"
              f"{r['ratio']:>7.2f}  {r['measured']}" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiler processes (default: one per CPU)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--traffic", action="store_true",
                        help="run meters.traffic (the other options are its) with every launch timed")
    args, rest = parser.parse_known_args()
    if args.traffic:
        traffic.main(rest + (["--json", args.json] if args.json else []), Timer())
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs}: allowed values are integers >= 1")
    compiled = compile_training(args.jobs)
    predicted = {config: predict(config, compiled) for config in CONFIGS}
    kernels = {config: by_kernel(rows) for config, rows in predicted.items()}
    print(table(kernels))
    rows = measured_calibration()
    print("\nthe kernels of commit ae83ce1, predicted against one H200's measurements (results/gpu/h200_ae83ce1)")
    print(calibration_table(rows))
    problems = aot.speed_problems(kernels)
    print(f"\nspeed rule (>= {aot.MIN_OF_COPY:.0%} of the copy bandwidth, >= {aot.MIN_PROGRAMS} programs per SM): "
          + ("; ".join(problems) if problems else "every training kernel passes"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": kernels, "calibration": rows, "problems": problems}, f, indent=2)


if __name__ == "__main__":
    main()
