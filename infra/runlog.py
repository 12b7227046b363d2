"""What a training run reports: rank 0's console line, its JSONL log (`out_dir/log.jsonl`) and an optional
Weights & Biases run, and the figures they carry besides the loss (MFU, peak memory)."""
from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import resource
import subprocess

import torch

from infra import cli
from infra.config import TrainConfig
from model import ModelConfig


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token for MFU, the PaLM / nanoGPT convention: 6 per weight of every matmul
    (forward 2, backward 4; the embedding lookup is free, the LM head is not) plus 12 * L * H * hd * T for
    attention scores and values. Norms and depth routing (O(N d) per sublayer) are not counted."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)   # q, o; k, v
    mlp = 3 * cfg.d_model * cfg.d_ff
    matmul_weights = cfg.n_layers * (attn + mlp) + cfg.d_model * cfg.vocab_size
    return 6 * matmul_weights + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def duration(seconds: float) -> str:
    """A time left as a person reads it: 45s, 12m05s, 3h07m."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux -> GB


class Logger:
    """Rank 0's console line, JSONL log and optional wandb run; other ranks log nothing."""

    def __init__(self, cfg: TrainConfig, enabled: bool, config: dict):
        self.enabled, self.wandb = enabled, None
        self.tokens_per_step = cfg.batch_size * cfg.seq_len     # every entry also says the tokens trained on
        if not enabled:
            return
        os.makedirs(cfg.out_dir, exist_ok=True)
        self.file = open(os.path.join(cfg.out_dir, "log.jsonl"), "a")
        # every start (a resumed run's too) says where it trains: runs compare only within one machine and commit
        self.file.write(json.dumps({"provenance": provenance()}) + "\n")
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                raise cli.MissingPackageError("wandb=True but wandb is not installed: pip install wandb, or drop "
                                              "--wandb") from None
            self.wandb = wandb.init(project=cfg.wandb_project, config=config, dir=cfg.out_dir)

    def __call__(self, entry: dict, line: str | None = None) -> None:
        if not self.enabled:
            return
        if line:
            print(line, flush=True)
        entry = {"step": entry["step"], "tokens": entry["step"] * self.tokens_per_step, **entry}
        self.file.write(json.dumps(entry) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(entry, step=entry["step"])

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()


def machine() -> dict:
    """What a measurement ran on: platform, Python, the CPU's model name, cores, the ISA level torch's CPU
    kernels dispatch to (AVX2, AVX512, ...: the same seed trains to different digits on different levels) and
    torch."""
    cpu = "unknown"
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cores": os.cpu_count(), "isa": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}


def git(*args: str) -> str:
    """git's answer in the repository this file belongs to; "" where there is no git or no repository."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=root).stdout.strip()
    except OSError:
        return ""


def provenance() -> dict:
    """What one run trained on: machine(), torch's threads, and the commit of the code (dirty: whether tracked
    files differed from it). Two runs are compared only where these agree."""
    commit = git("rev-parse", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {**machine(), "threads": torch.get_num_threads(), "commit": commit, "dirty": dirty}


def device_time_by_name(events, device_type=None) -> dict[str, dict]:
    """{name: {"calls", "ms"}} of the profiler events that ran on `device_type` (default: CUDA): on a GPU each
    is one kernel's (or copy's) execution, timed by the device itself, so no host time (Triton's Python
    launcher, the observers) is in it. Sorted by time, longest first."""
    device_type = torch.autograd.DeviceType.CUDA if device_type is None else device_type
    kinds: dict[str, dict] = {}
    for event in events:
        if event.device_type == device_type:
            k = kinds.setdefault(event.name, {"calls": 0, "ms": 0.0})
            k["calls"] += 1
            k["ms"] += event.time_range.elapsed_us() / 1e3
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]["ms"]))


class GpuBusy:
    """The GPU's busy time in one step per log interval: that step runs under the profiler (CUDA activity only),
    and its kernels' and copies' device times are summed (on one stream they do not overlap). Beside the
    interval's wall time per step it says how much of a step the GPU waits for the host. The profiled step pays
    the profiler's start, stop and a synchronisation in its wall time: with log_interval 20 a few % of the
    interval's. On a CPU nothing is measured (ms stays None)."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self.ms: float | None = None
        self._profile = None

    def start(self, measured: bool) -> None:
        if self.enabled and measured:
            from torch.profiler import ProfilerActivity, profile
            self._profile = profile(activities=[ProfilerActivity.CUDA])
            self._profile.__enter__()

    def stop(self) -> None:
        if self._profile is not None:
            torch.cuda.synchronize()
            self._profile.__exit__(None, None, None)
            self.ms = sum(k["ms"] for k in device_time_by_name(self._profile.events()).values())
            self._profile = None


def freeze_heap(held: contextlib.ExitStack) -> None:
    """Once per run (train.py calls it after every step; it acts at the first): every object alive now (the model,
    the compiled graphs and code: millions at the 1044M depth) moved out of the garbage collector's sight until
    `held` closes at the run's end (gc.freeze), so that a collection scans what the steps leave. Otherwise every
    few dozen steps a full collection walks them all: once in 30 steps of full_attnres with the whole forward
    compiled, 318 ms (meters.host's step at 36 layers; 10.6 ms a step on average)."""
    if gc.get_freeze_count():
        return
    gc.collect()
    gc.freeze()
    held.callback(gc.unfreeze)
