"""The GPU check: what one H100 or H200 says about the routing kernels and the 1044M models, in under 8 minutes.

    bash scripts/gpu_check.sh [OUT.json]                      # = python -m scripts.gpu_check [--out OUT.json]
    python -m scripts.gpu_check --dry-run --out /tmp/dry.json   # any machine: the phases that need no GPU
    python -m scripts.gpu_check --multi-gpu                   # also train.py under torchrun (2+ GPUs)
    python -m scripts.gpu_check --list                        # the phases, their caps and what each records

Every phase runs in its own process (sys.executable -m scripts.gpu_check --phase NAME, or pytest) under its
cap: one that overruns is killed with its process group and recorded as "timed out", one that exits non-zero
as "failed", and the check goes on. The run is bounded by --budget (470 s): a phase gets at most what is
left, none starts once it is spent. The phases, their order, caps and what each records are PHASE_TABLE below
(`python -m scripts.gpu_check --list` prints it); the caps sum to the budget. The order puts first what a
run cut short must not lose: the 1044M training phases, then every CUDA test, then per-kernel bandwidth, then
what a CPU or a later run can give again (the traffic predictions, host time, the routing microbenchmark). The
multi-GPU phases come after the budget, outside it.

Without a CUDA device (or with --dry-run) the GPU phases are "skipped" and the host time is the CPU's. The
JSON (default results/gpu/<GPU name>.json) is rewritten atomically before and after every phase, so a crash
or a kill keeps what ran: the GPU name and versions, then "phases": {name: {"status": "ok" | "failed" |
"timed out" | "skipped" (with "reason") | "running" (when killed in it), "seconds", "cap_s", results...,
"output_tail"}}, then "checks". The checks are regression checks: each routed config's tokens/s relative to
the baseline >= what meters.traffic predicts for this GPU - 0.05; flat memory (peak at step 20 <= 1.02 x
peak at step 5, allocated after step 20 within 1% of after step 5); the CUDA tests pass. The project's goals
(0.97x and 0.85x tokens/s, 1.05x and 1.25x peak memory) are printed beside. Exit status 1 if a phase failed
or timed out or a check FAILed; Ctrl-C or SIGTERM ends the running phase and writes the JSON first.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from scripts.gpu_multi import multi_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_CONFIGS = ("1044m_baseline", "1044m_delta_block", "1044m_delta")    # as meters/bench.py
CUDA_TESTS = ("tests/test_kernels.py", "tests/test_memory.py", "tests/test_whole_run.py")
# The one phase table: (name, cap in seconds, what it records), in the order the phases run. The model phases'
# 55 s: a cold start, the sublayers' compile and 20 + 3 steps took 23-27 s a config on an H200; the tests' 165 s:
# the three files took 142 s there on 4 processes; kernel_bandwidth's one step per config, 10 s.
PHASE_TABLE = (
    ("environment", 15, "GPU name and count, torch, Triton, CUDA and Python versions, the commit"),
    *((f"model_{c}", 55, f"meters.bench.bench_model('{c}'): tokens/s, peak and allocated memory at "
       "steps 5 and 20; then 3 steps under torch.profiler: GPU ms per step (the device's kernel time) beside the "
       "wall ms per step, and the fraction of the step the GPU waits") for c in MODEL_CONFIGS),
    ("tests", 165, f"pytest {' '.join(CUDA_TESTS)} on the real compiler: every test (no stop at a failure), each "
     "failure's name recorded as it happens"),
    ("kernel_bandwidth", 45, "meters.bench.kernel_bandwidth: each routing kernel of one 1044M training "
     "step, its device time from the profiler (the kernel alone), bytes and bandwidth against a measured copy"),
    ("traffic", 30, "meters.traffic.measure() on CPU: the bytes per token routing adds to each 1044M "
     "config and the tokens/s ratio it predicts on H100 and H200 (regime \"autocast\")"),
    ("host", 20, "CPU time per routed read before its launch, and per 1044M-depth step (meters.host)"),
    ("routing", 30, "meters.bench.bench_routing: routing time, bandwidth against a measured copy"),
)
PHASES = {name: cap for name, cap, _ in PHASE_TABLE}                    # name -> cap (s)
MULTI_GPU = {"multi_gpu_ddp": 300, "multi_gpu_fsdp": 300}
MULTI_GPU_WHAT = "train.py configs/1044m_delta_block.py under torchrun (--multi-gpu, 2+ devices): its log lines"
CPU_PHASES = ("environment", "traffic", "host")
BUDGET_S = 470                 # under 8 minutes with the phases' start-up (each cap includes its own)
TEST_WORKERS = 4               # pytest-xdist processes for the tests phase, tests dealt one at a time
FAILURE = re.compile(r"(\S+\.py::\S+) (?:FAILED|ERROR)|(?:FAILED|ERROR) (\S+\.py::\S+)")
ENV_KEYS = ("gpu", "device_count", "cuda_available", "torch", "triton", "cuda", "python", "executable",
            "commit", "dirty")
GOALS = {"1044m_delta_block": (0.97, 1.05), "1044m_delta": (0.85, 1.25)}  # tokens/s, peak memory vs baseline
MARGIN = 0.05                  # measured tokens/s ratio may sit this far below the prediction
PEAK_GROWTH, ALLOCATED_DRIFT = 0.02, 0.01   # flat memory: peak at the last step vs the mark, allocated after
TAIL_CHARS = 4000


def write_json(path: str, obj: dict) -> None:
    """Write to a temporary file beside path, then rename: a reader never sees a half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------ the phases

def run_group(cmd: list[str], timeout: float, prefix: str, started=lambda pid: None,
              on_line=lambda line: None) -> tuple[int | None, str]:
    """Run cmd in a process group of its own, echoing its output with `prefix` (and handing each line to
    on_line); kill the whole group (compile workers, torchrun's ranks) when it exits, at `timeout` seconds, or
    on an interrupt. -> (return code, None if it was killed at the timeout; the tail of its output)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=400)

    def echo() -> None:
        for line in proc.stdout:
            print(f"[{prefix}] {line}", end="", flush=True)
            tail.append(line)
            on_line(line)
    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    started(proc.pid)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        with contextlib.suppress(ProcessLookupError):      # the group is gone when nothing in it is left
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=5)
    return rc, "".join(tail)[-TAIL_CHARS:]


def phase_command(name: str, args: argparse.Namespace, result: str, host_device: str) -> list[str]:
    if name in args.fail_phase:
        return [sys.executable, "-c", f"raise RuntimeError('phase {name} failed on purpose (--fail-phase)')"]
    if name == "tests":     # -v: each test's outcome as it ends, so a run cut short still names its failures
        return [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", str(TEST_WORKERS),
                "--dist", "load", *CUDA_TESTS]
    return [sys.executable, "-m", "scripts.gpu_check", "--phase", name, "--result", result, "--work", args.work,
            f"--steps={args.steps}", f"--mark={args.mark}", f"--repeats={args.repeats}",
            f"--multi-steps={args.multi_steps}", f"--host-device={host_device}",
            *([f"--layers={args.layers}"] if args.layers else [])]


def run_phase(name: str, cap: float, args: argparse.Namespace, record: dict, save) -> dict:
    """Run one phase under `cap` seconds -> its entry: status, seconds, cap_s, what it recorded, output tail."""
    result = os.path.join(args.work, f"{name}.json")
    host_device = "cuda" if record.get("cuda_available") and not args.dry_run else "cpu"
    start = time.monotonic()

    failures: list[str] = []

    def running(pid: int) -> None:
        record["phases"][name] = {"status": "running", "pid": pid, "cap_s": cap}
        save()

    def on_line(line: str) -> None:       # the tests' failures, saved as they come
        found = failed_test(line) if name == "tests" else None
        if found and found not in failures:
            failures.append(found)
            record["phases"][name]["failures"] = list(failures)
            save()
    rc, tail = run_group(phase_command(name, args, result, host_device), cap, name, running, on_line)
    entry = {"status": "ok" if rc == 0 else "timed out" if rc is None else "failed",
             "seconds": round(time.monotonic() - start, 1), "cap_s": cap}
    lines = tail.strip().splitlines()
    if rc not in (0, None):
        entry["error"] = lines[-1] if lines else f"exit status {rc}"
    if name == "tests":
        entry |= {"files": CUDA_TESTS, "returncode": rc, "summary": lines[-1] if lines else "",
                  "failures": failures}
    return entry | read_json(result) | {"output_tail": tail}


def failed_test(line: str) -> str | None:
    """The test a pytest output line reports as failed or erroring (-v's per-test line, with or without
    xdist's worker prefix, or the short summary's), else None."""
    match = FAILURE.search(line)
    return match and (match.group(1) or match.group(2))


def skip_reason(name: str, args: argparse.Namespace, record: dict, left: float) -> str | None:
    if name.startswith("multi_gpu_"):
        if not args.multi_gpu:
            return "not asked for (--multi-gpu)"
        if (record.get("device_count") or 0) < 2:
            return f"needs 2+ CUDA devices, found {record.get('device_count') or 0}"
    elif left < 1:
        return f"the total budget of {args.budget:.0f} s was spent"
    if name not in CPU_PHASES:
        if record.get("cuda_available") is None:
            return "the environment phase did not finish"
        if not record.get("cuda_available"):
            return "no CUDA device"
        if args.dry_run:
            return "--dry-run"
    return None


def out_path(args: argparse.Namespace, record: dict) -> str:
    name = record.get("gpu") or ("unknown" if record.get("cuda_available") is None else "no_gpu")
    return args.out or os.path.join(ROOT, "results", "gpu", f"{name.replace(' ', '_')}.json")


def run_all(args: argparse.Namespace, record: dict) -> None:
    """Every phase in order, the record written (to out_path) before and after each."""
    def save() -> None:           # to the default path only once the environment phase has named the GPU
        record["checks"] = checks(record)
        if args.out or record["phases"].get("environment", {}).get("status", "running") != "running":
            write_json(out_path(args, record), record)
    start = time.monotonic()
    for name, cap in {**PHASES, **MULTI_GPU}.items():
        cap = args.caps.get(name, cap)
        left = args.budget - (time.monotonic() - start)
        reason = skip_reason(name, args, record, left)
        if reason:
            record["phases"][name] = {"status": "skipped", "reason": reason, "seconds": 0}
            print(f"== {name}: skipped: {reason}", flush=True)
        else:
            cap = cap if name in MULTI_GPU else min(cap, left)
            try:
                entry = run_phase(name, cap, args, record, save)
            except KeyboardInterrupt as e:
                record["phases"][name] = {"status": "failed", "error": f"interrupted ({str(e) or 'SIGINT'})"}
                save()
                raise
            if name == "environment":
                record |= {k: entry.pop(k) for k in ENV_KEYS if k in entry}
            record["phases"][name] = entry
            print(f"== {name}: {entry['status']} in {entry['seconds']:.0f} s (cap {cap:.0f} s)"
                  + (f": {entry['error']}" if "error" in entry else ""), flush=True)
        save()


# ------------------------------------------------------------------------------------------ the checks

def _ratio(phases: dict, config: str, key: str) -> float | None:
    """config's figure at its last step relative to the baseline's, if both ran to the end."""
    def last(c: str) -> dict | None:
        p = phases.get(f"model_{c}", {})
        return p.get("at_step", {}).get(str(p.get("steps"))) if p.get("status") == "ok" else None
    mine, base = last(config), last(MODEL_CONFIGS[0])
    return mine[key] / base[key] if mine and base else None


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3f}x"


def checks(record: dict) -> list[dict]:
    """The PASS/FAIL lines ("not run" where a phase they need did not run to its end)."""
    phases, out = record["phases"], []

    def add(check: str, ok: bool | None, detail: str) -> None:
        out.append({"check": check, "result": "not run" if ok is None else "PASS" if ok else "FAIL",
                    "detail": detail})
    tests = phases.get("tests", {})
    ran = tests.get("status") in ("ok", "failed", "timed out")
    failures = tests.get("failures") or []
    add("CUDA tests pass", tests["status"] == "ok" if ran else None, (tests.get("summary") or tests.get("status", ""))
        + (f"; failed: {', '.join(failures)}" if failures else ""))
    traffic = phases.get("traffic", {}).get("configs", {})
    for config, (speed_goal, memory_goal) in GOALS.items():
        ratios = traffic.get(config, {}).get("predicted_ratio", {})
        device = next((d for d in ratios if d in (record.get("gpu") or "")), None)
        speed, memory = _ratio(phases, config, "tokens_per_s"), _ratio(phases, config, "peak_memory_bytes")
        ok = None if speed is None or device is None else speed >= ratios[device] - MARGIN
        predicted = (f"{ratios[device]:.3f}x on {device}" if device else
                     ", ".join(f"{d} {r:.3f}x" for d, r in ratios.items()) or "not computed")
        detail = (f"measured {_x(speed)}, predicted {predicted} | goal {speed_goal}x; peak memory {_x(memory)} "
                  f"(goal <= {memory_goal}x)")
        add(f"{config} tokens/s vs baseline >= predicted - {MARGIN}", ok, detail)
    for config in MODEL_CONFIGS:
        p = phases.get(f"model_{config}", {})
        at = p.get("at_step", {})
        mark, last = at.get(str(p.get("mark"))), at.get(str(p.get("steps")))
        ok, detail = None, "did not run to its end"
        if p.get("status") == "ok" and mark and last:
            growth = last["peak_memory_bytes"] / mark["peak_memory_bytes"] - 1
            drift = last["allocated_bytes"] / mark["allocated_bytes"] - 1
            ok = growth <= PEAK_GROWTH and abs(drift) <= ALLOCATED_DRIFT
            detail = (f"peak {100 * growth:+.2f}% (<= {100 * PEAK_GROWTH:.0f}%), allocated {100 * drift:+.2f}% "
                      f"(within {100 * ALLOCATED_DRIFT:.0f}%) from step {p['mark']} to step {p['steps']}")
        add(f"{config} memory flat over the run", ok, detail)
    return out


# ------------------------------------------------------------------------------- inside a phase's process

def run_worker(args: argparse.Namespace) -> None:
    """One phase, in its own process: its figures go to args.result, rewritten as they come."""
    from meters import bench, host

    def save(result: dict) -> None:
        write_json(args.result, result)
    name = args.phase
    if name == "environment":
        result = bench.environment()
        print(f"{result['gpu'] or 'no CUDA device'} | torch {result['torch']} | triton {result['triton']} | "
              f"CUDA {result['cuda']} | python {result['python']} | commit {result['commit']}")
    elif name == "traffic":
        result = bench.traffic_predictions(args.layers)
    elif name == "routing":
        import torch
        nominal, copy = bench.nominal_bandwidth(torch.cuda.get_device_name()), bench.copy_bandwidth()
        result = {"nominal_bandwidth": nominal, "copy_bandwidth": copy}
        print(f"measured copy {copy / 1e12:.2f} TB/s, nominal {nominal / 1e12 if nominal else float('nan'):.2f} TB/s")
        result["rows"] = bench.bench_routing(nominal, copy, save=lambda rows: save({**result, "rows": rows}))
    elif name == "kernel_bandwidth":
        result = {"copy_bandwidth": bench.copy_bandwidth(), "configs": {}}
        for config in bench.KERNEL_CONFIGS:
            result["configs"][config] = bench.kernel_bandwidth(config, result["copy_bandwidth"], args.layers)
            save(result)
    elif name == "host":
        result = {"device": args.host_device, "us": bench.host_times(args.host_device, args.repeats),
                  "model_step": host.measure(repeats=min(args.repeats, 10))}      # this CPU, launches skipped
        print("; ".join(f"N={n}: forward {t['forward_us']:.1f} us, backward {t['backward_us']:.1f} us"
                        for n, t in result["us"].items()) + f" ({args.host_device}); routing's host ms per 1044M-depth "
              "step: " + ", ".join(f"{m} {1e3 * r['routing_seconds']:.1f}" for m, r in result["model_step"].items()))
    elif name.startswith("model_"):
        result = bench.bench_model(name[len("model_"):], args.steps, args.mark, args.layers, save)
    else:
        result = multi_gpu(name[len("multi_gpu_"):], args, save)
    save(result)


# ------------------------------------------------------------------------------------------ the command

def phase_cap(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    if name not in (*PHASES, *MULTI_GPU) or not seconds.replace(".", "", 1).isdigit() or not float(seconds) > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected PHASE=SECONDS with SECONDS > 0 and PHASE one of "
                                         + ", ".join((*PHASES, *MULTI_GPU)))
    return name, float(seconds)


def phase_list() -> str:
    """PHASE_TABLE and the multi-GPU phases as text: name, cap, what."""
    rows = [*PHASE_TABLE, *((name, cap, MULTI_GPU_WHAT) for name, cap in MULTI_GPU.items())]
    width = max(len(name) for name, _, _ in rows)
    return "\n".join(f"{name:<{width}} {cap:4d} s  {what}" for name, cap, what in rows) + (
        f"\nbudget {BUDGET_S} s for all but the multi-GPU phases (caps sum to {sum(PHASES.values())} s)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = (*PHASES, *MULTI_GPU)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="the JSON file (default: results/gpu/<GPU name>.json)")
    p.add_argument("--list", action="store_true", help="print the phases, their caps and what each records")
    p.add_argument("--dry-run", action="store_true", help="skip the phases that need a GPU")
    p.add_argument("--multi-gpu", action="store_true", help="also train.py under torchrun, ddp and fsdp")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all single-GPU phases")
    p.add_argument("--cap", dest="caps", action="append", default=[], type=phase_cap, metavar="PHASE=SECONDS",
                   help="a phase's cap, instead of its default")
    p.add_argument("--fail-phase", action="append", default=[], choices=names, metavar="PHASE",
                   help="make PHASE fail on purpose (to see a failure recorded and the check go on)")
    p.add_argument("--steps", type=int, default=20, help="training steps per 1044M config")
    p.add_argument("--mark", type=int, default=5, help="the step whose memory the last step's must equal")
    p.add_argument("--layers", type=int, default=None, help="layers of the 1044M models (default: 36)")
    p.add_argument("--repeats", type=int, default=200, help="timed calls per host-time figure")
    p.add_argument("--multi-steps", type=int, default=5, help="train.py steps per multi-GPU mode")
    p.add_argument("--phase", choices=names, help=argparse.SUPPRESS)      # run one phase (in its own process)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--host-device", default="cpu", choices=("cpu", "cuda"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 2 < args.mark < args.steps:
        p.error(f"--mark={args.mark} --steps={args.steps}: need 2 < mark < steps (steps 1-2 warm up)")
    args.caps = dict(args.caps)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print(phase_list())
        return 0
    if args.phase:
        run_worker(args)          # imports torch: only phase processes do
        return 0

    def interrupt(signum, frame):               # SIGTERM as Ctrl-C: the phase's group is killed, the JSON written
        raise KeyboardInterrupt(signal.Signals(signum).name)
    signal.signal(signal.SIGTERM, interrupt)
    record = {**dict.fromkeys(ENV_KEYS), "dry_run": args.dry_run, "budget_s": args.budget,
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "phases": {}, "checks": []}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as args.work:
        try:
            run_all(args, record)
        except KeyboardInterrupt as e:
            print(f"interrupted: wrote {out_path(args, record)}")
            return 143 if str(e) == "SIGTERM" else 130
    for c in record["checks"]:
        print(f"{c['result']:<8} {c['check']} | {c['detail']}")
    print(f"wrote {out_path(args, record)}")
    bad = [n for n, p in record["phases"].items() if p["status"] in ("failed", "timed out")]
    return 1 if bad or any(c["result"] == "FAIL" for c in record["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
