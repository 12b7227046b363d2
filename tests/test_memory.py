"""Saved-for-backward memory (kernels/memory.py): the kernel path meets its targets relative to the baseline,
and the counter sees what it must (stacked sources on the reference path, unique storages counted once)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # must be set before triton decorates the kernels

from kernels.memory import SCALED_1044M, TARGETS, measure, saved_bytes  # noqa: E402
from model import Model, ModelConfig  # noqa: E402


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
