"""Saved-for-backward memory (meters/memory.py): the kernel path meets its targets relative to the
baseline, and the counter sees what it must (stacked sources on the reference path, unique storages counted once).
Peak memory of training steps (meters/peak.py): live bytes stay flat from step to step, a leak shows, the
tracker's counts are exact on a hand-checked case, and the 1044M shape's peaks meet the targets."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # must be set before triton decorates the kernels

import torch.nn.functional as F  # noqa: E402

from meters.memory import SCALED_1044M, TARGETS, measure, saved_bytes  # noqa: E402
from meters.peak import (EmulatedAutocast, MemoryTracker, forward_backward, growth, project,  # noqa: E402
                                      train_step)
from meters.traffic import SHAPE_1044M, TOKENS_1044M  # noqa: E402
from model import Model, ModelConfig  # noqa: E402
from router import METHODS  # noqa: E402


def test_kernel_path_meets_the_memory_targets():
    """Delta Block <= 1.05x and Delta AttnRes <= 1.25x the plain baseline's saved bytes (36 layers, 8 blocks)."""
    base = measure(methods=("baseline",), kernels=("reference",), seq_len=32)["reference"]["baseline"]
    lean = measure(methods=tuple(TARGETS), kernels=("triton",), seq_len=32)["triton"]
    reference = measure(methods=("delta_block",), kernels=("reference",), seq_len=32)["reference"]
    for method, target in TARGETS.items():
        assert lean[method] / base <= target, (method, lean[method] / base)
    # the reference stacks the sources at every read and saves the partial block at every sublayer
    assert reference["delta_block"] / base > 1.5


class Stub(torch.nn.Module):
    """logits = f(x) @ w for a fixed activation x (1, 8, 64): f is the identity, or x * x (which saves x twice)."""

    def __init__(self, square: bool):
        super().__init__()
        self.square = square
        self.w = torch.nn.Parameter(torch.randn(64, 64))
        self.x = torch.randn(1, 8, 64, requires_grad=True)

    def forward(self, idx):
        return ((self.x * self.x) if self.square else self.x) @ self.w


def test_saved_bytes_counts_unique_storages_without_parameters():
    idx = torch.zeros(1, 8, dtype=torch.long)
    plain, square = saved_bytes(Stub(False), idx), saved_bytes(Stub(True), idx)
    # x * x saves x twice (one storage) and the matmul saves x * x: one more (1, 8, 64) fp32 tensor, not two
    assert square - plain == 8 * 64 * 4
    assert plain < 64 * 64 * 4          # the weight (16 KiB) is a parameter, not counted
    model = Model(ModelConfig(**{**SCALED_1044M, "n_layers": 2, "n_blocks": 1}))
    one, two = saved_bytes(model, idx), saved_bytes(model, torch.zeros(2, 8, dtype=torch.long))
    assert 1.9 < two / one <= 2.0       # activations scale with the tokens


# ------------------------------------------------------- peak memory of training steps (meters/peak.py)

SMALL = dict(vocab_size=257, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=256, n_blocks=2)
TOKENS = (2, 16)


def test_live_bytes_after_each_step_are_flat_for_every_method():
    """The kernel path keeps nothing of a step once it is over: after every step only the parameters and
    AdamW's exp_avg and exp_avg_sq are alive (3 x 4 bytes per parameter), before the collector runs too."""
    for method in METHODS:
        r = project(ModelConfig(**SMALL, residual=method, kernel="triton"), TOKENS, steps=2)
        live = [(s["live"], s["live_after_gc"]) for s in r["steps"]]
        assert live == [(12 * r["params"], 12 * r["params"])] * 2, (method, live)


class _Holds(torch.autograd.Function):
    """The identity, with a list on its context: a tensor made later and put in the list leads through its
    graph back to this node, a cycle through autograd's C++ graph that Python's collector cannot see (the
    kernel path's gradient accumulators once held the forward's sources this way)."""

    @staticmethod
    def forward(ctx, x, held):
        ctx.held = held
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def leaking_step(model, optimizer, tokens, tracker):
    """train_step, with the first MLP's output (B, T, d) bf16 doubled into a list that its own node holds."""
    mlp = model.layers[0].mlp
    plain = type(mlp).forward

    def forward(x):
        held = []
        v = _Holds.apply(plain(mlp, x), held)
        held.append(v * 2)
        return v

    mlp.forward = forward
    train_step(model, optimizer, tokens, tracker)


def test_a_leaking_step_shows_growing_live_bytes():
    kept = TOKENS[0] * TOKENS[1] * SMALL["d_model"] * 2          # one (B, T, d) bf16 tensor per step
    for method in ("baseline", "delta"):
        r = project(ModelConfig(**SMALL, residual=method, kernel="triton"), TOKENS, steps=3, step=leaking_step)
        live = [s["live_after_gc"] for s in r["steps"]]
        steps = [b - a for a, b in zip(live, live[1:])]
        assert growth(r) == sum(steps) > 0
        if method == "baseline":
            assert steps == [kept, kept]       # exactly the kept tensor: its graph's saved tensors were freed
        else:                                  # and what the routing's nodes keep outside their saved tensors
            assert all(s >= kept for s in steps), steps


def test_tracker_counts_a_linear_and_an_adamw_step_exactly():
    tracker = MemoryTracker("meta")
    with tracker:
        with torch.device("meta"):
            linear = torch.nn.Linear(8, 4)                      # weight (4, 8) and bias (4,): 36 fp32
        optimizer = torch.optim.AdamW(linear.parameters(), foreach=False)
        params = 36 * 4
        assert tracker.live == params
        x = torch.empty(2, 8, device="meta")                    # 64 bytes
        view = x.view(4, 4).t()
        x.add_(1).mul_(2)
        assert tracker.live == params + 64                      # views and in-place results: the same storage
        y = linear(view.t().reshape(2, 8))                      # (2, 4): 32 bytes
        loss = y.sum()                                          # 4 bytes
        assert tracker.live == params + 64 + 32 + 4
        loss.backward()                                         # + the gradients; the seed dL/dL (4) came and went
        assert (tracker.live, tracker.peak) == (params + 100 + params, params + 100 + params + 4)
        del x, y, loss
        assert tracker.live == 2 * params + 64                  # x lives on in its view
        del view
        assert tracker.live == 2 * params
        tracker.reset_peak()
        optimizer.step()                                        # exp_avg, exp_avg_sq: 2 x 144 (step is on the CPU)
        assert tracker.live == 4 * params
        # the single-tensor update of the weight makes sqrt(exp_avg_sq) and its quotient (4, 8) before freeing both
        assert tracker.peak == 4 * params + 2 * 128
        optimizer.zero_grad(set_to_none=True)
        assert tracker.live == 3 * params


def test_emulated_autocast_casts_like_cuda_autocast():
    tracker = MemoryTracker("meta")
    with tracker:
        w = torch.empty(16, 8, device="meta", requires_grad=True)
        x = torch.empty(2, 8, device="meta")
        before = tracker.live
        with EmulatedAutocast():
            y, z = F.linear(x, w), x @ w.t()
            assert (y.dtype, z.dtype) == (torch.bfloat16, torch.bfloat16)
            # the weight is cast once (cached, 16 x 8 x 2), x once per op (2 x 8 x 2 each), outputs 2 x 16 x 2
            assert tracker.live - before == 256 + 2 * 32 + 2 * 64
            q = torch.empty(2, 4, 32, 16, device="meta", requires_grad=True)
            kv = torch.empty(2, 2, 32, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
            out = F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
            assert out.dtype == torch.bfloat16 and "Flash" in type(out.grad_fn).__name__   # no (T, T) scores


def test_peak_relative_to_the_baseline_at_the_1044m_shape():
    """The targets are for saved activations (meters/memory.py, fp32 throughout) and do not bound the whole
    peak by themselves: here sublayer activations are bf16 while the routing's first group keeps fp32 state
    (which makes routing's share larger), and the routing's backward buffers (gradient accumulators, a group's
    go and D) may make a peak of their own; the parameters, gradients, bf16 weight copies and logits, the same
    in every method, make the share smaller. So we assert the targets on the whole peak at the shape they are
    for (fewer layers give lower ratios: the logits' memory does not grow with depth), on the first step's
    forward and backward: without AdamW's states, the smallest common part, the ratio is largest."""
    def fwd_bwd(model, optimizer, tokens, tracker):   # the first step's peak is in backward
        forward_backward(model, tokens, tracker)

    peaks = {}
    for method in ("baseline", *TARGETS):
        cfg = ModelConfig(**{**SHAPE_1044M, "n_blocks": 4}, residual=method, kernel="triton")
        peaks[method] = project(cfg, TOKENS_1044M, steps=1, step=fwd_bwd)["steps"][0]["peak"]
    for method, target in TARGETS.items():
        assert 1 < peaks[method] / peaks["baseline"] <= target, (method, peaks[method] / peaks["baseline"])
