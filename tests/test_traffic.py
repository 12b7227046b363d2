"""The traffic meter (kernels/tools/traffic.py) counts what a hand count gives on tiny cases: torch ops read their
arguments and write their outputs (views and allocations move nothing, a broadcast counts once), kernel
launches move the tensors they describe, and the meter's routing bytes are a step's minus the baseline's."""
import torch

from kernels.depth_route import depth_route
from kernels.launch import observe_launches
from kernels.tools.traffic import METHODS, ByteCounter, count_step, measure, predicted_ratio
from model import ModelConfig


def test_torch_ops_count_their_arguments_and_outputs():
    a, b = torch.ones(4, 16, device="meta"), torch.ones(4, 16, device="meta")
    w = torch.ones(16, device="meta")
    counter = ByteCounter()
    with counter:
        c = a + b                          # reads 2 x 256 B, writes 256 B
        d = a * w                          # a 256 B, w 64 B (broadcast: once), writes 256 B
        c.view(64).transpose(0, 0)         # views: nothing
        torch.empty_like(c)                # an allocation: nothing
        d.copy_(c)                         # reads c, writes d: 2 x 256 B
    assert counter.bytes == {("forward", "torch add"): 768, ("forward", "torch mul"): 576,
                             ("forward", "torch copy_"): 512}


def test_kernel_launches_count_the_tensors_they_move():
    """depth_route over 3 bf16 sources (1 x 4 x 16): forward reads the sources (3 x 128 B), query and norm
    weight (2 x 64 B) and the table (3 x 8 B) and writes r (128 B) and the lse (16 B); backward reads the
    sources twice, dL/dr, lse, query and norm weight and the table, and writes 3 gradients, its one program's
    du partial sum (64 B: d = 16 is one BLOCK_D) and nothing else."""
    sources = [torch.empty(1, 4, 16, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    query, norm_weight = (torch.empty(16, device="meta", requires_grad=True) for _ in range(2))
    counter = ByteCounter()
    with observe_launches(counter.launch):
        out = depth_route(sources, query, norm_weight)
        counter.phase = "backward"
        torch.autograd.grad(out, sources, torch.empty(1, 4, 16, device="meta", dtype=torch.bfloat16))
    assert counter.bytes[("forward", "kernel _route_fwd")] == 3 * 128 + 2 * 64 + 3 * 8 + 128 + 16
    programs = counter.launches[-1].grid
    assert counter.bytes[("backward", "kernel _route_bwd")] == (
        2 * 3 * 128 + 128 + 16 + 2 * 64 + 3 * 8 + 3 * 128 + programs * 16 * 4)


def test_routing_bytes_are_the_step_minus_the_baseline():
    shape = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=1, n_kv_heads=1, head_dim=64, d_ff=128,
                 n_blocks=2)
    results = measure(shape, (1, 8), {"baseline": METHODS["baseline"], "delta_block": METHODS["delta_block"]})
    base = count_step(ModelConfig(**shape, residual="baseline", kernel="triton"), (1, 8))
    step = count_step(ModelConfig(**shape, residual="delta_block", kernel="triton"), (1, 8))
    assert results["baseline"]["bytes_per_token"] == 0
    assert results["delta_block"]["bytes_per_token"] == (sum(step.values()) - sum(base.values())) / 8
    # every residual add and compiled norm of the baseline is in the routed step too
    assert step[("forward", "torch add")] >= base[("forward", "torch add")]
    assert predicted_ratio(0.0, 1e9, "H100") == 1.0 and predicted_ratio(1e6, 1e9, "H100") < 1.0
