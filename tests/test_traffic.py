"""The traffic meter (meters/traffic.py) counts what a hand count gives on tiny cases: torch ops read their
arguments and write their outputs (views and allocations move nothing, a broadcast counts once), kernel
launches move the tensors they describe, and the meter's routing bytes are a step's minus the baseline's; the
lower bound (bound.py), the occupancy model (occupancy.py) and the host-time meter (host.py) on cases a hand
count checks."""
import platform

import pytest
import torch

from depth_kernels.depth_route import depth_route
from depth_kernels.grouped_state import GroupedDepthState
from depth_kernels.launch import SourceTable
from depth_kernels.observers import observe_launches, skipped_launches
from meters import host
from meters.bound import lower_bound
from meters.occupancy import Occupancy, occupancy
from meters.traffic import (METHODS, SHAPE_1044M, ByteCounter, compiled_ratio, count_step, dry_step,
                                         measure, predicted_ratio)
from model import Model, ModelConfig


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
        torch.sub(a, b, out=torch.empty(4, 16, device="meta", dtype=torch.bfloat16))   # 2 x 256 B, writes 128 B
    assert counter.bytes == {("forward", "torch add"): 768, ("forward", "torch mul"): 576,
                             ("forward", "torch copy_"): 512, ("forward", "torch sub"): 640}


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


def test_a_receiver_without_sources_of_its_own_moves_its_reads_and_writes_only():
    """Delta Block's receivers read no table (the stream stands in for the table argument, never read): each
    launch moves what it reads and writes, plus 8 bytes per address of the tables it does read."""
    shape = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=1, n_kv_heads=1, head_dim=64, d_ff=128, n_blocks=2)
    counter = count_step(ModelConfig(**shape, residual="delta_block", kernel="triton"), (1, 8))
    size = lambda t: t.numel() * t.element_size()                        # noqa: E731
    for launch, (moved, _) in zip(counter.launches, counter.kernels):
        tables = [t for t, _ in launch.reads if isinstance(t, SourceTable)]
        reads = sum(sum(map(size, t.tensors)) * n if isinstance(t, SourceTable) else size(t) * n
                    for t, n in launch.reads)
        assert moved == reads + sum(map(size, launch.writes)) + 8 * sum(len(t.tensors) for t in tables), launch
    assert any(launch.kernel.fn.__name__ == "_receiver_fwd" and not any(isinstance(t, SourceTable) for t, _ in
               launch.reads) for launch in counter.launches)


def test_routing_bytes_are_the_step_minus_the_baseline():
    shape = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=1, n_kv_heads=1, head_dim=64, d_ff=128,
                 n_blocks=2)
    results = measure(shape, (1, 8), {"baseline": METHODS["baseline"], "delta_block": METHODS["delta_block"]})
    base = count_step(ModelConfig(**shape, residual="baseline", kernel="triton"), (1, 8)).bytes
    step = count_step(ModelConfig(**shape, residual="delta_block", kernel="triton"), (1, 8)).bytes
    assert results["baseline"]["bytes_per_token"] == 0
    assert results["delta_block"]["bytes_per_token"] == (sum(step.values()) - sum(base.values())) / 8
    # every residual add and compiled norm of the baseline is in the routed step too
    assert step[("forward", "torch add")] >= base[("forward", "torch add")]
    assert predicted_ratio(0.0, 1e9, "H100") == 1.0 and predicted_ratio(1e6, 1e9, "H100") < 1.0


def test_the_lower_bound_is_a_hand_count_and_below_what_the_kernels_move():
    """4 layers, 2 blocks of Delta Block: the committed sources are e (fp32) and one block delta (bf16), 3 x their
    bytes; the 8 sublayers but the 2 block starts read the partial: 12 d bytes each (its fp32 base read forward
    and backward, its gradient written and read in bf16, as the kernels hand it over; 16 d in fp32).
    Fine-grained Delta AttnRes: e and 7 outputs, no partial. The floor's hand-offs: 5 rows of 2 d bytes for each
    receiver of 2 or more committed sources: the second block's 4 (Delta Block), every sublayer but the first (7,
    Delta AttnRes), and AttnRes's 4 and its final read."""
    d = 64
    shape = dict(vocab_size=64, d_model=d, n_layers=4, n_heads=1, n_kv_heads=1, head_dim=64, d_ff=128, n_blocks=2)
    block = lower_bound(ModelConfig(**shape, residual="delta_block"))
    bound = 3 * d * 6 + 6 * 12 * d
    assert block == {"sources": 3 * d * (4 + 2), "partial": 6 * 12 * d, "bytes_per_token": bound,
                     "handoffs": 4 * 10 * d, "floor": bound + 4 * 10 * d}
    assert lower_bound(ModelConfig(**shape, residual="delta"))["handoffs"] == 7 * 10 * d
    assert lower_bound(ModelConfig(**shape, residual="attnres"))["handoffs"] == 5 * 10 * d
    fp32 = lower_bound(ModelConfig(**shape, residual="delta_block"), output_dtype=torch.float32)
    assert fp32["partial"] == 6 * 16 * d
    assert lower_bound(ModelConfig(**shape, residual="delta"))["bytes_per_token"] == 3 * d * (4 + 7 * 2)
    assert lower_bound(ModelConfig(**shape, residual="delta_block", block_source="paper"))["partial"] == 0
    measured = measure(shape, (1, 8), {m: METHODS[m] for m in ("baseline", "delta", "delta_block", "attnres")})
    for method in ("delta", "delta_block", "attnres"):
        assert measured[method]["lower_bound"]["floor"] < measured[method]["bytes_per_token"], method


def test_occupancy_counts_a_launch_by_hand_and_the_prediction_uses_it():
    """Phase 1's forward at d = 1280 on 16-bit sources runs persistent programs (two per SM on a GPU), each a
    token row at a time in chunks that cover the row exactly (1280 columns, none masked), with its pipeline's
    STAGES source rows in flight; a kernel short of what Little's law asks for is a problem; the compiled step
    ratio takes each launch at the time its timer gives: slower kernels, a lower ratio, and every launch asked
    once."""
    shape = dict(SHAPE_1044M, n_layers=2, n_blocks=2)
    counter = ByteCounter()
    dry_step(ModelConfig(**shape, residual="delta_block", kernel="triton"), (4, 1024), counter)
    launch = next(l for l in counter.launches if l.kernel.fn.__name__ == "_group_fwd"
                  and l.reads[0][0].tensors[-1].element_size() == 2)
    o = occupancy(launch)
    programs = min(2, -(-launch.grid // 132))          # 264 programs on a GPU, 3 under the interpreter
    assert (launch.args["BLOCK_D"], launch.args.get("BLOCK_T", 0)) == (1280, 0)
    assert (o.programs_per_sm, o.rows_in_flight, o.masked) == (programs, 1, 0.0)
    assert o.bytes_in_flight == programs * launch.args["STAGES"] * 1280 * 2
    assert Occupancy("k", 1280, 1, 1, 4096, 0.0).problems() and not Occupancy("k", 1280, 1, 1, 16384, 0.0).problems()
    asked = []
    methods = {m: METHODS[m] for m in ("baseline", "delta_block")}
    fast = measure(dict(shape, n_layers=4), (1, 64), methods, timer=lambda l, moved: asked.append(l) or moved / 4e12)
    slow = measure(dict(shape, n_layers=4), (1, 64), methods, timer=lambda l, moved: moved / 1e12)
    counted = count_step(ModelConfig(**dict(shape, n_layers=4), residual="delta_block", kernel="triton"), (1, 64))
    assert len(asked) == len(counted.launches) > 0
    assert fast["delta_block"]["kernel_seconds_per_token"] == pytest.approx(
        sum(moved for moved, _ in counted.kernels) / 4e12 / 64)
    assert compiled_ratio(slow["delta_block"], 1e9) < compiled_ratio(fast["delta_block"], 1e9) < 1.0
    assert "kernel_seconds_per_token" not in measure(dict(shape, n_layers=4), (1, 64), methods)["delta_block"]


def test_the_host_meter_counts_launches_and_routing_time():
    shape = dict(host.SHAPE, n_layers=4, n_blocks=2)
    base = host.step_time("baseline", repeats=2, shape=shape)
    routed = host.step_time("delta_block", repeats=2, shape=shape)
    assert base["launches"] == 0 and routed["launches"] > 2 * 2 * 4      # forward and backward of 8 receivers
    assert routed["seconds"] > 0 and base["seconds"] > 0
    paired = host.measure(("baseline", "delta_block"), repeats=2, shape=shape)
    assert paired["baseline"]["routing_seconds"] == 0 and paired["delta_block"]["launches"] == routed["launches"]
    if platform.libc_ver()[0] == "glibc":                                # the meter's allocator keeps freed memory
        assert host.keep_freed_memory()


def test_the_whole_step_meter_takes_train_pys_step_per_compiled_region():
    """meters.host --step: the optimizer step as train.py takes it, for each compiled region: the kernel path's
    launches are skipped (eager, sublayers), the whole forward compiled on the reference path launches none of
    them, and the step really trains (the optimizer moves the weights); once compiled, the region's own kernels
    are skipped too, counted, and put back after the step."""
    from torch._inductor.codecache import PyCodeCache
    shape = dict(host.STEP_SHAPE, n_layers=2, n_blocks=2)
    stepper = host.TrainStep("delta_block", "model", shape)
    assert stepper.optimizer.defaults["fused"] and stepper.run.guard_on_device      # as on a GPU
    before = [p.detach().clone() for p in stepper.model.parameters()]
    assert stepper.step() > 0 and stepper.launches == 0                             # compiles: its kernels run
    assert any(not torch.equal(a, p) for a, p in zip(before, stepper.model.parameters()))
    def kernels():
        return [getattr(m, name) for m in PyCodeCache.modules for name in host.kernel_names(m.__file__)]
    real = kernels()
    fused_adamw = torch._fused_adamw_
    assert real and stepper.step() > 0 and stepper.launches == 0 and stepper.compiled_kernels > 2  # fwd, bwd
    assert kernels() == real
    # AdamW's and clipping's multi-tensor operations are skipped and counted from the second step, then put back:
    # a fused step per parameter group, its count's add and (the guard's) subtraction, the norms, the clip's multiply
    assert stepper.multi_tensor_ops == 2 * 3 + 2 and torch._fused_adamw_ is fused_adamw
    results = host.measure_steps(("baseline", "delta_block"), repeats=1, shape=shape, backend="aot_eager")
    assert set(results) == {f"{m}/{r}" for m in ("baseline", "delta_block") for r in host.REGIONS}
    assert results["delta_block/eager"]["launches"] == results["delta_block/sublayers"]["launches"] > 0
    assert results["baseline/eager"]["launches"] == 0 and all(r["seconds"] > 0 for r in results.values())
    apart = host.measure_regions(repeats=1, regions=("eager",), shape=shape)    # a process per region
    assert set(apart) == {f"{m}/eager" for m in host.METHODS} and apart["delta_block/eager"]["launches"] == \
        results["delta_block/eager"]["launches"] and apart["baseline/eager"]["compiled_kernels"] == 2 * 3 + 2  # AdamW's


def test_skipped_launches_are_listed_and_never_described():
    """The host meter's skip: every launch in the block is listed by name and skipped (its output is never
    written), and no observer is asked (so nothing builds the launch's description)."""
    sources = [torch.randn(1, 4, 16) for _ in range(3)]
    query, norm_weight = torch.zeros(16), torch.ones(16)
    described = []
    with observe_launches(lambda launch: described.append(launch) and False), skipped_launches() as names:
        out = depth_route(sources, query, norm_weight)
    assert names == ["_route_fwd"] and not described
    assert not torch.allclose(out, torch.stack(sources).mean(0))          # skipped: r is never computed
    assert torch.allclose(depth_route(sources, query, norm_weight), torch.stack(sources).mean(0), atol=1e-6)


@pytest.mark.parametrize("residual", ["delta", "full_attnres"])
def test_fine_grained_receivers_make_the_streams_add_and_its_gradient_in_their_kernels(residual, monkeypatch):
    """4 layers (8 sublayers, receivers in groups), autocast (fp32 stream, bf16 outputs): each receiver but a
    group's first makes the stream's add h~_{l+1} = h~_l + v_l for its newest source v_l in its forward kernel, and
    joins the stream's gradient in its backward kernel. Per such receiver, d bytes a token, against the same model
    where autograd makes the add:
    - forward: torch's add (read 4 + 2, write 4) is gone; the kernel reads v_l (2) and writes h~_{l+1} (4), and
      reads h~_l where it read h~_{l+1} (an additive read; a replacement read reads h~_l only for the add: 4);
    - backward: the add's cast of the stream's gradient to v_l's bf16 (read 4, write 2) and autograd's sum of it
      with v_l's accumulator (2 + 2, 2) are gone, and so is its sum of the read's and the stream's dL/dh~_{l+1}
      (4 + 4, 4: additive reads only); the kernel reads the stream's part (4), [reads back the dh it stored (4),]
      and adds dL/dh~_{l+1} into v_l's accumulator (2 + 2)."""
    d = 64
    shape = dict(vocab_size=64, d_model=d, n_layers=4, n_heads=1, n_kv_heads=1, head_dim=64, d_ff=128)
    cfg = ModelConfig(**shape, residual=residual, kernel="triton")
    state = Model(cfg).depth_state(torch.zeros(1, 8, d))
    reads = len(state.plan) - int(state.policy.final_read)    # the final read commits nothing
    adders = len(state.adders)                                # every receiver but each group's first
    assert sorted(state.adders) == [r for r in range(1, reads) if state.plan[r] == state.plan[r - 1]]
    assert adders >= 4, state.plan
    step = count_step(cfg, (1, 8)).bytes
    init = GroupedDepthState.__init__

    def without_adders(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.adders = set()
    monkeypatch.setattr(GroupedDepthState, "__init__", without_adders)
    plain = count_step(cfg, (1, 8)).bytes
    additive = residual == "delta"
    per_adder = {("forward", "torch add"): -10, ("forward", "kernel _receiver_fwd"): 2 + 4 + 4 * (not additive),
                 ("backward", "torch _to_copy"): -6, ("backward", "torch add"): -6 - 12 * additive,
                 ("backward", "kernel _receiver_bwd"): 4 + 4 * additive + 4}
    changed = {key: (step.get(key, 0) - plain.get(key, 0)) // (d * adders * 8) for key in set(step) | set(plain)
               if step.get(key, 0) != plain.get(key, 0)}
    assert changed == per_adder
