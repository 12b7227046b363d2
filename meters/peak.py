"""Peak memory of a training step on one GPU at the 1044M shape, per method, projected on the meta device.

    python -m meters.peak                          # 1044M, 4 and 8 blocks, 4 steps of 4 x 1024 tokens
    python -m meters.peak --steps 6 --json out.json

It runs train.py's step (one micro-batch of 4 x 1024 tokens: the paper's 32 sequences on 8 GPUs) a few times
on the meta device, where tensors have shapes and dtypes but no data: `model.Model` and AdamW are built
there, then forward under autocast (the loss as train.py's), backward, clip_grad_norm_, optimizer.step() and
zero_grad(set_to_none=True). Routing takes the kernel path (kernel="triton", as on a GPU) with every Triton
launch skipped (depth_kernels.observers.skipped_launches). `MemoryTracker`, a TorchDispatchMode, sees every op's
outputs: each distinct storage counts its bytes once (views and in-place results share their input's
storage), from the op that made it until it dies (a weak reference to the storage says when). So parameters,
gradients (autograd allocates them through the dispatcher, on the calling thread for meta tensors), AdamW's
exp_avg and exp_avg_sq, activations and temporaries all count, and the peak is the largest total seen. Live
bytes after each step show a leak: a step that keeps anything alive grows them.

GPU dtypes. torch.autocast does not cast meta tensors, so `EmulatedAutocast`, a TorchFunctionMode, does to
the forward what CUDA autocast does to this model, above autograd, so that autograd saves what it saves under
autocast: matmul-class ops and attention get bf16 inputs, a leaf fp32 weight's bf16 copy is cached while the
context lasts (saved until backward, as under autocast), softmax-class ops get fp32 inputs. Parameters,
embedding and stream stay fp32; sublayer outputs and logits are bf16. Attention runs as the flash kernel a
GPU picks for bf16 inputs (it saves q, k, v, the output and a (B, H, T) fp32 log-sum-exp; on meta tensors
SDPA would take the math path and keep the (B, H, T, T) scores). RMSNorm modules run as compiled ones would
(the paper configs compile them): they save their input and a (B, T, 1) fp32 rstd.

What differs from a GPU run (torch.cuda.max_memory_allocated), and which way:
- left out, so a GPU holds more: the caching allocator's rounding and fragmentation (and nvidia-smi shows the
  reserved, not the allocated, bytes), the CUDA context and the cuBLAS, flash-attention and NCCL workspaces
  (made outside the dispatcher), and DDP's gradient buckets (4 bytes per parameter with DDP's default
  gradient_as_bucket_view=False: the report adds them in a column of their own);
- attention and the MLP run eager, so they save what eager autograd saves (a bf16 copy of the sublayer's
  input per projection, every SwiGLU intermediate); the paper configs compile them, and inductor's saved set
  is smaller, so a GPU holds less;
- AdamW runs its single-tensor path (fused AdamW has no meta kernel): its temporaries (two of one parameter's
  size, the embedding's at most) count, though the fused AdamW train.py uses on a GPU makes none.
torch.distributed._tools.mem_tracker.MemTracker works on meta tensors too and finds the same peaks, but its
module hooks keep some of the routing's tensors alive after a step, which would hide the leaks looked for here.
"""
from __future__ import annotations

import argparse
import gc
import json
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from depth_kernels.observers import skipped_launches
from meters.traffic import SHAPE_1044M, TOKENS_1044M
from model import Model, ModelConfig, RMSNorm
from router import METHODS

BLOCKED = ("attnres", "delta_block")          # the methods whose memory depends on n_blocks
# the paper's peak memory per GPU, GB (1044M on 8 x H100, its own implementation, not this one)
PAPER_GB = {"baseline": 22.5, "attnres": 31.6, "full_attnres": 52.0, "delta_block": 28.4, "delta": 77.7}
PHASES = ("forward", "backward", "optimizer")


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the storages that ops make on `device`: each counted once, while it lives."""

    def __init__(self, device: str = "meta"):
        super().__init__()
        self.device = torch.device(device)
        self.storages: dict[int, tuple[int, weakref.ref]] = {}   # id(storage) -> (bytes, weak reference)
        self.live = self.peak = 0
        self.phase = "setup"
        self.phase_peak: dict[str, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self.storages.pop(key)[0]

    def see(self, t: Tensor) -> None:
        """Count t's storage if it is new (or has grown); it stops counting when it is freed."""
        if not isinstance(t, Tensor) or t.device != self.device:
            return
        storage = t.untyped_storage()                 # one Python object per storage while the storage lives
        key, n = id(storage), storage.nbytes()
        old = self.storages.get(key)
        ref = old[1] if old else weakref.ref(storage, lambda _, key=key: self._free(key))
        self.storages[key] = (n, ref)
        self.live += n - (old[0] if old else 0)
        self.peak = max(self.peak, self.live)
        self.phase_peak[self.phase] = max(self.phase_peak.get(self.phase, 0), self.live)

    def reset_peak(self) -> None:
        self.peak, self.phase_peak = self.live, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.see(t)
        return out


# CUDA autocast's lists, as far as this model's forward reaches them
_LOWER = {F.linear, torch.matmul, Tensor.matmul, torch.mm, Tensor.mm, torch.bmm, Tensor.bmm, torch.addmm,
          Tensor.addmm, torch.baddbmm, Tensor.baddbmm, torch.einsum}
_FP32 = {F.softmax, torch.softmax, Tensor.softmax, F.log_softmax, torch.log_softmax, Tensor.log_softmax,
         F.cross_entropy, F.nll_loss}


class EmulatedAutocast(TorchFunctionMode):
    """What torch.autocast("cuda", dtype) does to this model's forward, for tensors on any device (meta)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.dtype = dtype
        self.cache: dict[int, tuple[Tensor, Tensor]] = {}   # id(leaf weight) -> (weight, its cast), until the end

    def __exit__(self, *exc):
        self.cache.clear()
        return super().__exit__(*exc)

    def cast(self, x, dtype: torch.dtype):
        """x in dtype if autocast would cast it (floating, not fp64), a leaf weight's cast from the cache."""
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.dtype in (dtype, torch.float64):
            return x
        if not (dtype == self.dtype and x.dtype == torch.float32 and x.is_leaf and x.requires_grad
                and not x._is_view()):
            return x.to(dtype)
        if id(x) not in self.cache:
            self.cache[id(x)] = (x, x.to(dtype))      # holding x: its id names no other tensor meanwhile
        return self.cache[id(x)][1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        dtype = self.dtype if func in _LOWER else torch.float32 if func in _FP32 else None
        if dtype is not None:
            args, kwargs = tree_map(lambda x: self.cast(x, dtype), (args, kwargs))
        return func(*args, **kwargs)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                  is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
        """SDPA on bf16 q (B, H, T, hd), k, v (B, Hkv, T, hd) as the flash kernel (which takes GQA as it is)."""
        q, k, v = (self.cast(t, self.dtype) for t in (q, k, v))
        if attn_mask is not None or dropout_p:
            return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                  enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=scale)[0]


class _CompiledNorm(torch.autograd.Function):
    """RMSNorm as its compiled graph keeps it: x (..., d) in, y in promote(weight, x) dtype out; saves x and
    the (..., 1) fp32 rstd (the normalised x is recomputed in backward)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        rstd = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight)


def compile_norms(model: Model) -> None:
    """Every RMSNorm module of this instance runs as _CompiledNorm (the kernel path's fused reads use the
    norm's weight directly and are unaffected)."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.forward = lambda x, weight=m.weight: _CompiledNorm.apply(x, weight)


def build(cfg: ModelConfig) -> tuple[Model, torch.optim.AdamW]:
    """The model and its AdamW (train.py's betas; weight decay groups change no memory) on the meta device."""
    with torch.device("meta"):
        model = Model(cfg)
    compile_norms(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    return model, optimizer


def forward_backward(model: Model, tokens: tuple[int, int], tracker: MemoryTracker) -> Tensor:
    """train.py's forward (under autocast) and backward on one micro-batch of `tokens` (batch, seq_len)."""
    x = torch.zeros(tokens, dtype=torch.int64, device="meta")
    tracker.phase = "forward"
    with EmulatedAutocast():
        loss = F.cross_entropy(model(x).float().flatten(0, 1), x.flatten())   # train.loss_fn's
    tracker.phase = "backward"
    loss.backward()
    return loss


def train_step(model: Model, optimizer: torch.optim.Optimizer, tokens: tuple[int, int],
               tracker: MemoryTracker) -> None:
    """train.py's step on one micro-batch (no accumulation), each phase named in the tracker."""
    loss = forward_backward(model, tokens, tracker)          # alive until the step ends, as in train.py
    tracker.phase = "optimizer"
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # distributed.clip_grad_norm on one process
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del loss


Step = Callable[[Model, torch.optim.Optimizer, tuple[int, int], MemoryTracker], None]


def project(cfg: ModelConfig, tokens: tuple[int, int] = TOKENS_1044M, steps: int = 4,
            step: Step = train_step) -> dict:
    """{"params", "steps": [{"peak", phase peaks, "live", "live_after_gc"}, ...]} of `steps` training steps
    of `cfg` on the meta device. Live bytes are read after each step with the collector off (so a cycle that
    only the collector would free still counts), then after gc.collect()."""
    if steps < 1:
        raise ValueError(f"steps={steps}: allowed values are integers >= 1")
    tracker = MemoryTracker("meta")
    enabled = gc.isenabled()
    gc.disable()                   # the collector running mid-step would make live bytes depend on when it ran
    gc.freeze()                    # and the objects from before (torch's, the caller's) need no scanning
    try:
        with skipped_launches(), tracker:
            model, optimizer = build(cfg)
            records = []
            for _ in range(steps):
                tracker.reset_peak()
                step(model, optimizer, tokens, tracker)
                live = tracker.live
                gc.collect()
                records.append({"peak": tracker.peak, **{p: tracker.phase_peak.get(p, 0) for p in PHASES},
                                "live": live, "live_after_gc": tracker.live})
            n_params = model.num_params()
            del model, optimizer
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()
    return {"params": n_params, "steps": records}


def measure(shape: dict = SHAPE_1044M, tokens: tuple[int, int] = TOKENS_1044M, blocks: tuple[int, ...] = (4, 8),
            methods: tuple[str, ...] = METHODS, steps: int = 4) -> dict[str, dict]:
    """{label: project(...)} per method, kernel path; the blocked methods once per n_blocks ("delta_block K=4")."""
    results = {}
    for method in methods:
        for n_blocks in (blocks if method in BLOCKED else blocks[:1]):
            label = f"{method} K={n_blocks}" if method in BLOCKED else method
            cfg = ModelConfig(**{**shape, "n_blocks": n_blocks}, residual=method, kernel="triton")
            results[label] = project(cfg, tokens, steps)
    return results


def report(results: dict[str, dict], shape: dict, tokens: tuple[int, int]) -> str:
    gb = 1e9
    base = max(s["peak"] for s in results["baseline"]["steps"])
    lines = [f"peak memory of a training step on one GPU, projected on the meta device: {shape['n_layers']} layers, "
             f"d = {shape['d_model']}, vocab {shape['vocab_size']:,}, {tokens[0]} x {tokens[1]} tokens, kernel path, "
             "fp32 parameters and AdamW states, bf16 autocast (GB = 1e9 bytes)",
             f"{'method':<18}{'step':>5}{'peak':>8}{'forward':>9}{'backward':>10}{'optim':>8}{'live':>8}"
             f"{'after gc':>10}{'vs base':>9}{'+DDP':>8}{'paper':>7}"]
    for label, r in results.items():
        ddp = 4 * r["params"]                   # DDP's gradient buckets: one fp32 copy of the gradients
        paper = PAPER_GB[label.split()[0]]
        peak = max(s["peak"] for s in r["steps"])
        for i, s in enumerate(r["steps"]):
            tail = (f"{peak / base:>8.3f}x{(peak + ddp) / gb:>8.2f}{paper:>7.1f}" if i == 0 else "")
            lines.append(f"{label if i == 0 else '':<18}{i + 1:>5}{s['peak'] / gb:>8.2f}"
                         + "".join(f"{s[p] / gb:>{w}.2f}" for p, w in zip(PHASES, (9, 10, 8)))
                         + f"{s['live'] / gb:>8.2f}{s['live_after_gc'] / gb:>10.2f}" + tail)
    lines.append("vs base: the method's peak over its steps / the baseline's; +DDP: that peak plus DDP's gradient "
                 "buckets (4 bytes per parameter); paper: the paper's peak per GPU (8 x H100), its own implementation")
    return "\n".join(lines)


def growth(result: dict) -> int:
    """Bytes by which live memory after the last step exceeds that after the first (which made AdamW's
    states), before or after the collector ran, whichever is more: 0 for steps that keep nothing."""
    return max(result["steps"][-1][key] - result["steps"][0][key] for key in ("live", "live_after_gc"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps per method (>= 2 shows growth)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8], help="n_blocks for attnres, delta_block")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: allowed values are integers >= 1")
    if not all(1 <= k <= SHAPE_1044M["n_layers"] for k in args.blocks):
        parser.error(f"--blocks {args.blocks}: allowed values are 1..{SHAPE_1044M['n_layers']}")
    results = measure(blocks=tuple(args.blocks), steps=args.steps)
    print(report(results, SHAPE_1044M, TOKENS_1044M))
    leaks = {label: growth(r) for label, r in results.items() if growth(r)}
    print("live bytes after each step: flat for every method" if not leaks else
          "LIVE BYTES GROW FROM STEP TO STEP: " + ", ".join(f"{k} +{v:,} bytes" for k, v in leaks.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": SHAPE_1044M, "tokens": TOKENS_1044M, "paper_gb": PAPER_GB, "methods": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
