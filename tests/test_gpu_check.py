"""The GPU check (scripts/gpu_check.py) without a GPU: the phases' order and caps against the budget; the dry
run records every phase, rewrites its JSON after each one, keeps what ran when it is killed, records a failing
phase and one over its cap and goes on; the tests phase names each failure as it happens; the profiler figures
the model and kernel phases record; the PASS/FAIL lines; the multi-GPU phase's data and train.py command."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from infra import shards
from infra.config import load_config
from scripts import gpu_check, gpu_multi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDER = [*gpu_check.PHASES, *gpu_check.MULTI_GPU]
CPU = ("environment", "traffic", "host")
UP_TO_TRAFFIC = ORDER[:ORDER.index("traffic") + 1]     # what a dry run has recorded when traffic starts


def command(out, *extra) -> list[str]:
    return [sys.executable, "-m", "scripts.gpu_check", "--dry-run", f"--out={out}", "--repeats=5", *extra]


def env(tmp_path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}


def wait_for(path, condition, proc, timeout=90):
    """The first state of the JSON at `path` that satisfies condition, polling while proc runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(path):
            with open(path) as f:
                record = json.load(f)        # written atomically: never half a file
            if condition(record):
                return record
        time.sleep(0.05)
    pytest.fail(f"the JSON never reached the state waited for (exit status {proc.poll()})")


def test_phases_run_what_a_cut_short_run_must_keep_first_within_the_budget():
    """The 1044M model phases right after the environment, then the CUDA tests, then per-kernel bandwidth; the
    phases' caps sum to at most the budget, and the budget is under 8 minutes; one table says it all."""
    assert ORDER[:6] == ["environment", "model_1044m_baseline", "model_1044m_delta_block", "model_1044m_delta",
                         "tests", "kernel_bandwidth"]
    assert set(ORDER[6:]) == {"traffic", "host", "routing", "multi_gpu_ddp", "multi_gpu_fsdp"}
    assert sum(gpu_check.PHASES.values()) <= gpu_check.BUDGET_S < 8 * 60
    assert all(cap > 0 for cap in gpu_check.PHASES.values())
    assert [row[0] for row in gpu_check.PHASE_TABLE] == list(gpu_check.PHASES)
    listed = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--list"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    assert [line.split()[:2] for line in listed.splitlines()[:len(ORDER)]] == [
        [name, str(cap)] for name, cap in {**gpu_check.PHASES, **gpu_check.MULTI_GPU}.items()]
    script = open(os.path.join(ROOT, "scripts", "gpu_check.sh")).read()
    assert "PHASE_TABLE" in script and not any(f"{name} " in script for name in ("traffic", "kernel_bandwidth"))


@pytest.mark.parametrize("line, name", [
    ("[gw1] [ 12%] FAILED tests/test_kernels.py::test_kernel_matches_reference[1-64-fp32] \n",
     "tests/test_kernels.py::test_kernel_matches_reference[1-64-fp32]"),
    ("tests/test_memory.py::test_x[a-b] FAILED                     [ 50%]\n", "tests/test_memory.py::test_x[a-b]"),
    ("FAILED tests/test_kernels.py::test_dispatch - AssertionError: x\n", "tests/test_kernels.py::test_dispatch"),
    ("ERROR tests/test_whole_run.py::test_y - RuntimeError\n", "tests/test_whole_run.py::test_y"),
    ("[gw0] [ 10%] PASSED tests/test_kernels.py::test_dispatch \n", None),
    ("tests/test_kernels.py::test_dispatch_FAILED_name PASSED\n", None)])
def test_a_failed_tests_name_is_read_from_its_line(line, name):
    assert gpu_check.failed_test(line) == name


def test_the_tests_phase_runs_every_test_and_names_each_failure(tmp_path, monkeypatch):
    """Run through the phase's own command (pytest on TEST_WORKERS processes), on a file of 2 failing tests and
    3 passing ones: it does not stop at the first failure, and both failures are in the record, which was
    saved with them while the phase ran."""
    tests = tmp_path / "test_two_fail.py"
    tests.write_text("import pytest\n\n\n@pytest.mark.parametrize('i', range(5))\n"
                     "def test_i(i):\n    assert i % 2 == 0\n")
    monkeypatch.setattr(gpu_check, "CUDA_TESTS", (str(tests),))
    args = gpu_check.parse_args(["--dry-run"])
    args.work, saved = str(tmp_path), []
    record = {"phases": {}}
    entry = gpu_check.run_phase("tests", 120, args, record, lambda: saved.append(json.loads(json.dumps(record))))
    assert entry["status"] == "failed" and entry["returncode"] == 1, entry["output_tail"][-2000:]
    # pytest names a file outside its root by a relative path: compare what follows the last "/"
    assert sorted(f.rsplit("/", 1)[-1] for f in entry["failures"]) == [f"{tests.name}::test_i[{i}]" for i in (1, 3)]
    assert "2 failed, 3 passed" in entry["summary"]
    assert any(s["phases"]["tests"].get("failures") for s in saved if s["phases"]["tests"]["status"] == "running")
    check = gpu_check.checks({"phases": {"tests": entry}})[0]
    assert check["result"] == "FAIL" and "test_i[1]" in check["detail"] and "test_i[3]" in check["detail"]


def test_the_profilers_figures_per_kernel_and_per_step():
    """device_time_by_name sums one device's events by name (here the CPU's, as a GPU's kernels are summed);
    step_profile divides by the steps and sets the GPU's time beside the wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from meters import bench
    from infra import runlog
    x = torch.randn(64, 64)
    events = bench.profiled(lambda: (x @ x, x @ x), 3, activities=[ProfilerActivity.CPU])
    kinds = runlog.device_time_by_name(events, DeviceType.CPU)
    assert kinds["aten::mm"]["calls"] == 6 and kinds["aten::mm"]["ms"] > 0
    assert list(kinds) == sorted(kinds, key=lambda k: -kinds[k]["ms"])
    assert runlog.device_time_by_name(events) == {}          # no CUDA activity was profiled
    profile = bench.step_profile([], 2, wall_ms_per_step=10.0)
    assert profile == {"steps": 2, "gpu_ms_per_step": 0.0, "wall_ms_per_step": 10.0, "gpu_idle_fraction": 1.0,
                       "top_kernels": {}}


def test_dry_run_records_every_phase_and_writes_after_each(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.Popen(command(out), cwd=ROOT, env=env(tmp_path), stdout=subprocess.PIPE, text=True)
    # mid-run, the JSON already holds the environment and says which phase runs
    early = wait_for(out, lambda r: r["phases"].get("traffic", {}).get("status") == "running", proc)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout[-3000:]
    assert list(early["phases"]) == UP_TO_TRAFFIC and early["phases"]["environment"]["status"] == "ok"
    record = json.loads(out.read_text())
    assert list(record)[:3] == ["gpu", "device_count", "cuda_available"]
    assert record["torch"] == torch.__version__ and record["python"] and len(record["commit"]) == 40
    assert list(record["phases"]) == ORDER
    for name, phase in record["phases"].items():
        if name in CPU:
            assert phase["status"] == "ok", (name, phase)
            assert 0 < phase["seconds"] <= phase["cap_s"]
        else:
            assert phase["status"] == "skipped", (name, phase)
    assert record["phases"]["tests"]["reason"] in ("no CUDA device", "--dry-run")
    assert "--multi-gpu" in record["phases"]["multi_gpu_ddp"]["reason"]
    predicted = record["phases"]["traffic"]["configs"]
    for config in ("1044m_delta_block", "1044m_delta"):
        assert predicted[config]["bytes_per_token"] > 0
        assert set(predicted[config]["predicted_ratio"]) == {"H100", "H200"}
    for device in ("H100", "H200"):   # Delta AttnRes moves more bytes than Delta Block: slower, as predicted
        block, attnres = (predicted[c]["predicted_ratio"][device] for c in ("1044m_delta_block", "1044m_delta"))
        assert 0 < attnres < block < 1
    host = record["phases"]["host"]
    assert host["device"] == "cpu" and set(host["us"]) == {"9", "73"}
    assert all(t["forward_us"] > 0 and t["backward_us"] > 0 for t in host["us"].values())
    assert {c["result"] for c in record["checks"]} == {"not run"}
    assert "== traffic: ok" in stdout


def test_a_failing_phase_and_one_over_its_cap_are_recorded_and_the_check_goes_on(tmp_path):
    out = tmp_path / "check.json"
    run = subprocess.run(command(out, "--fail-phase=environment", "--cap=traffic=0.3", "--fail-phase=host"),
                         cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stdout[-3000:]
    phases = json.loads(out.read_text())["phases"]
    assert list(phases) == ORDER
    assert phases["environment"]["status"] == "failed" and "on purpose" in phases["environment"]["error"]
    traffic = phases["traffic"]      # torch alone takes longer than 0.3 s to import: killed at its cap
    assert traffic["status"] == "timed out" and traffic["cap_s"] == 0.3 and traffic["seconds"] < 5
    assert phases["host"]["status"] == "failed"
    assert phases["tests"] == {"status": "skipped", "reason": "the environment phase did not finish", "seconds": 0}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_check_leaves_the_phases_before_it(tmp_path, sig):
    out = tmp_path / "check.json"
    proc = subprocess.Popen(command(out, "--fail-phase=environment"), cwd=ROOT, env=env(tmp_path),
                            stdout=subprocess.DEVNULL, start_new_session=True)
    running = wait_for(out, lambda r: r["phases"].get("traffic", {}).get("status") == "running", proc)
    worker = running["phases"]["traffic"]["pid"]
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
    finally:
        if sig == signal.SIGKILL:             # the killed check could not end its phase's process: we do
            os.killpg(worker, signal.SIGKILL)
    record = json.loads(out.read_text())
    assert list(record["phases"]) == UP_TO_TRAFFIC
    assert record["phases"]["environment"]["status"] == "failed"
    if sig == signal.SIGKILL:
        assert record["phases"]["traffic"]["status"] == "running"
    else:                                     # SIGTERM: the check ends its phase and says so
        assert proc.returncode == 143
        assert record["phases"]["traffic"] == {"status": "failed", "error": "interrupted (SIGTERM)"}
        assert process_group_ends(worker, timeout_s=30), "the phase's process group outlived the check"


def process_group_ends(pgid: int, timeout_s: float) -> bool:
    """Whether process group pgid is gone within timeout_s (a loaded machine reaps a killed group slowly)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def model_phase(tokens_per_s, peak=(10e9, 10e9), allocated=(5e9, 5e9), steps=20, mark=5):
    at = {str(s): {"tokens_per_s": tokens_per_s, "peak_memory_bytes": p, "allocated_bytes": a}
          for s, p, a in zip((mark, steps), peak, allocated)}
    return {"status": "ok", "steps": steps, "mark": mark, "at_step": at}


def test_checks_hold_speed_to_the_prediction_and_memory_flat():
    traffic = {c: {"predicted_ratio": {"H100": 0.90, "H200": 0.95}} for c in ("1044m_delta_block", "1044m_delta")}
    record = {"gpu": "NVIDIA H200", "phases": {
        "tests": {"status": "failed", "summary": "1 failed, 40 passed"}, "traffic": {"configs": traffic},
        "model_1044m_baseline": model_phase(100.0),
        "model_1044m_delta_block": model_phase(91.0, peak=(10e9, 10.1e9)),            # 0.91 >= 0.95 - 0.05
        "model_1044m_delta": model_phase(89.0, allocated=(5e9, 5.2e9))}}               # 0.89 < 0.90
    checks = gpu_check.checks(record)
    assert [c["check"].split()[0] for c in checks] == ["CUDA", "1044m_delta_block", "1044m_delta", "1044m_baseline",
                                                       "1044m_delta_block", "1044m_delta"]
    assert [c["result"] for c in checks] == ["FAIL", "PASS", "FAIL", "PASS", "PASS", "FAIL"]
    record["gpu"] = "NVIDIA A100-SXM4-80GB"   # meters.traffic predicts nothing for it: not run, not PASS
    speed = [c for c in gpu_check.checks(record) if "tokens/s" in c["check"]]
    assert {c["result"] for c in speed} == {"not run"}


def test_multi_gpu_data_is_uint32_for_qwen3_and_the_command_parses(tmp_path):
    vocab = load_config([os.path.join(ROOT, gpu_multi.MULTI_GPU_CONFIG)])[0].vocab_size
    data = gpu_multi.random_shards(str(tmp_path / "data"), vocab, windows=16)
    header = shards.read_header(os.path.join(data, "train_000000.bin"))
    assert vocab == 151936 and header["dtype"].itemsize == 4 and header["vocab_size"] == vocab
    loader = shards.ShardLoader(data, "val", 4, 1024, world_size=2, step_batch=8)
    x, _ = loader.next_batch()
    assert x.shape == (4, 1024) and int(x.max()) >= 2 ** 16    # ids beyond uint16 survive
    cmd = gpu_multi.multi_gpu_command("fsdp", 2, data, str(tmp_path / "out"), 5)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc_per_node=2" in cmd
    model_cfg, cfg = load_config(cmd[cmd.index("train.py") + 1:])      # every override is a real field
    assert (cfg.parallel, cfg.max_steps, cfg.batch_size, cfg.micro_batch_size) == ("fsdp", 5, 8, 4)
    assert model_cfg.residual == "delta_block" and cfg.data == data


@pytest.mark.parametrize("bad, message", [("--cap=nosuch=3", "PHASE one of environment"),
                                          ("--cap=tests=-1", "SECONDS > 0"),
                                          ("--mark=30", "need 2 < mark < steps")])
def test_bad_options_say_what_is_allowed(bad, message):
    run = subprocess.run([sys.executable, "-m", "scripts.gpu_check", bad], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and message in run.stderr
