"""train.py under `torchrun --nproc_per_node=2` (gloo on CPU): DDP equals one process, FSDP2 equals DDP (also with
the whole model in bf16), exact resume from a sharded checkpoint (also on another world size), disjoint rank
windows, a time budget that stops every rank at the same step; and the command line under torchrun: the derived
micro-batch, SIGTERM saving on every rank, one error line, a hung rank that ends the job.

One torchrun launch runs every two-rank training (each launch costs seconds of start-up); this file is also
that launch's worker (`__main__` below). The single-process references run in the pytest process.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # the kernel path's runs: before triton decorates the kernels

import torch._dynamo  # noqa: E402  (it imports triton)

from infra import checkpoint  # noqa: E402
from infra import cli  # noqa: E402
from infra import corpus  # noqa: E402
from infra import distributed  # noqa: E402
from infra import shards  # noqa: E402
import train  # noqa: E402
from infra.config import TrainConfig  # noqa: E402
from model import Model, ModelConfig  # noqa: E402

SMALL = dict(d_model=32, n_layers=3, n_blocks=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
MAX_STEPS, SAVE_AT = 5, 2
# Global batch 8: one process reads micro-batches of 8; two ranks read micro-batches of 2 with 2-step
# gradient accumulation, so the no-sync path and the final reduction are both exercised.
TRAIN = dict(seq_len=32, batch_size=8, micro_batch_size=2, max_steps=MAX_STEPS, eval_batches=2, log_interval=1,
             eval_interval=1000, warmup_steps=2, lr=3e-3, device="cpu")


def configs(residual: str, out_dir: str, kernel: str = "auto", model: dict | None = None,
            **overrides) -> tuple[ModelConfig, TrainConfig]:
    return (ModelConfig(residual=residual, kernel=kernel, **SMALL, **(model or {})),
            TrainConfig(out_dir=str(out_dir), **{**TRAIN, **overrides}))


GRAPHS: list[int] = []   # one entry per graph dynamo hands to the "graph_counter" backend


def graph_counter(gm, example_inputs):
    """torch.compile's aot_eager, counting the graphs it is given (the worker and the pytest process both
    register it, by importing this file)."""
    GRAPHS.append(len(gm.graph.nodes))
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


torch._dynamo.register_backend(graph_counter)
# the kernel path's runs read 8-token sequences for 3 steps (the interpreter's time grows with the tokens: at 32
# tokens and 5 steps, FSDP2 through the kernels took 2 minutes)
SHORT = dict(seq_len=8, max_steps=3)
# gate and learned null under the GPU's precision rule, emulated on CPU: bf16 autocast, FSDP2's bf16 matrices
PRECISE = dict(kernel="triton", model=dict(gate=True, null_source=True, learned_null=True), precision="bf16", **SHORT)
COMPILED = dict(kernel="triton", compile=True, compile_backend="graph_counter", batch_size=4, **SHORT)
# the whole forward as one compiled region, on the reference routing path, which traces whole
WHOLE = dict(COMPILED, kernel="reference", compile_regions="model")


def precision_dtypes(parallel: str, ctx: distributed.Context, precision: str = "bf16") -> dict[str, list[str]]:
    """The dtypes one forward under `precision` computes in, wrapped as train.py wraps it: the residual stream
    (the final norm's input), the sources, the router parameters, the sublayer outputs."""
    torch.manual_seed(0)
    model = Model(ModelConfig(residual="delta_block", kernel="triton", **SMALL, **PRECISE["model"]))
    seen: dict[str, set] = {"stream": set(), "sources": set(), "routers": set(), "outputs": set()}

    def observe(l, sources, router):
        seen["sources"].update(str(s.dtype) for s in sources[:-1])   # the last is the null source
        seen["routers"].update(str(p.dtype) for p in router.tensors())
    model.routing_observer = observe
    model.norm.register_forward_pre_hook(lambda m, args: seen["stream"].add(str(args[0].dtype)))
    for layer in model.layers:
        for m in (layer.self_attn, layer.mlp):
            m.register_forward_hook(lambda m, args, out: seen["outputs"].add(str(out.dtype)))
    wrapped = distributed.parallelize(model, parallel, ctx, precision=precision)
    with distributed.autocast(ctx.device, precision):
        wrapped(torch.randint(0, model.cfg.vocab_size, (2, 8)))
    return {k: sorted(v) for k, v in seen.items()}


class WindowSpy:
    """Records the window ids of every training-loader batch, in reading order (shuffled loaders only)."""

    def __init__(self, monkeypatch_setattr):
        self.ids: list[int] = []
        original = shards.ShardLoader.next_batch

        def next_batch(loader):
            batch = original(loader)
            if loader.shuffle:
                self.ids.extend(loader.last_ids.tolist())
            return batch
        monkeypatch_setattr(shards.ShardLoader, "next_batch", next_batch)


# --------------------------------------------------------------------------------------- the worker

def worker(out_dir: str) -> None:
    """Runs on each of 2 ranks; rank 0 writes results.json."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict = {}

    def run(name: str, residual: str, **overrides) -> None:
        result = train.train(*configs(residual, os.path.join(out_dir, name), **overrides))
        results[name] = {"losses": result["losses"], "val_loss": result["val_loss"], "step": result["step"]}

    spy = WindowSpy(lambda obj, attr, value: setattr(obj, attr, value))
    run("ddp_baseline", "baseline")
    windows = [None, None]
    dist.all_gather_object(windows, spy.ids)
    results["windows"] = windows
    run("ddp_delta_block", "delta_block")
    run("fsdp_delta_block", "delta_block", parallel="fsdp", activation_checkpointing=True, ckpt_interval=SAVE_AT,
        keep_checkpoints=5)
    # Resume the FSDP run from its step-SAVE_AT checkpoint, as if it had died just after saving it.
    resumed = os.path.join(out_dir, "fsdp_resumed")
    if rank == 0:
        os.makedirs(resumed)
        shutil.copytree(os.path.join(out_dir, "fsdp_delta_block", f"ckpt_{SAVE_AT:07d}"),
                        os.path.join(resumed, f"ckpt_{SAVE_AT:07d}"))
    dist.barrier()
    run("fsdp_resumed", "delta_block", parallel="fsdp", resume=True)
    # The kernel path reads the pre-norm weights directly (no module call): they must not sit in a layer's
    # FSDP group, or they would still be shards when read.
    run("ddp_delta_block_short", "delta_block", **SHORT)
    run("fsdp_delta_block_kernel", "delta_block", parallel="fsdp", kernel="triton", **SHORT)
    run("ddp_delta", "delta")
    run("fsdp_delta", "delta", parallel="fsdp")
    # a fused AdamW: the NaN guard on the device, the figures read every second step
    for parallel in ("ddp", "fsdp"):
        run(f"{parallel}_fused", "delta_block", parallel=parallel, adamw="fused", log_interval=2)
    # one precision rule: DDP with autocast and FSDP2 with bf16 matrices compute in the same dtypes
    run("ddp_bf16", "delta_block", **PRECISE)
    run("fsdp_bf16", "delta_block", parallel="fsdp", **PRECISE)
    ctx = distributed.Context(rank, 2, torch.device("cpu"), owns_group=False)
    results["dtypes"] = {parallel: precision_dtypes(parallel, ctx) for parallel in ("ddp", "fsdp")}
    # the authors' recipe, the whole model in bf16: DDP all-reduces bf16 gradients, FSDP2 shards bf16 parameters
    run("ddp_bf16_params", "delta_block", precision="bf16-params")
    run("fsdp_bf16_params", "delta_block", parallel="fsdp", precision="bf16-params")
    results["dtypes_bf16_params"] = {parallel: precision_dtypes(parallel, ctx, "bf16-params")
                                     for parallel in ("ddp", "fsdp")}
    # compiled sublayers under DDP with one bucket per parameter: dynamo must not cut the graphs at buckets
    ddp = distributed.DistributedDataParallel

    class OneBucketPerParameter(ddp):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, bucket_cap_mb=1e-4)
    distributed.DistributedDataParallel = OneBucketPerParameter
    for parallel in ("ddp", "fsdp"):
        torch._dynamo.reset()                # each run compiles its own graphs, none reused from the last
        GRAPHS.clear()
        run(f"{parallel}_compiled", "delta_block", parallel=parallel, **COMPILED)
        results[f"{parallel}_compiled"]["graphs"] = list(GRAPHS)
    distributed.DistributedDataParallel = ddp
    for parallel in ("ddp", "fsdp"):         # the whole forward as one region, cut by DDP at its buckets
        torch._dynamo.reset()
        GRAPHS.clear()
        run(f"{parallel}_whole", "delta_block", parallel=parallel, **WHOLE)
        results[f"{parallel}_whole"]["graphs"] = list(GRAPHS)

    # Rank 1's clock runs 10 s per reading: only it reaches the 30 s budget, yet both ranks must stop together
    # (a rank that went on alone would wait forever in the next collective).
    if rank == 1:
        fake = iter(range(0, 10 ** 6, 10))
        train.time = type("FastClock", (), {"time": staticmethod(lambda: float(next(fake)))})
    run("budget", "baseline", max_steps=50, time_budget_s=30.0)
    run("budget_fused", "baseline", max_steps=50, time_budget_s=30.0, adamw="fused", log_interval=4)
    for name in ("budget", "budget_fused"):
        steps = [None, None]
        dist.all_gather_object(steps, results[name]["step"])
        results[f"{name}_steps"] = steps
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    distributed.end_worker()


def hang_rank_1() -> None:
    """train.py's command line (the arguments after --hang-rank-1), with rank 1 stuck in its first forward
    for longer than dist_timeout_s=5."""
    if os.environ["RANK"] == "1":
        loss_fn = train.loss_fn

        def stuck(model, x, y):
            time.sleep(10)
            return loss_fn(model, x, y)
        train.loss_fn = stuck
    sys.argv = ["train.py", *sys.argv[2:]]
    cli.run(train.main)


if __name__ == "__main__":
    hang_rank_1() if sys.argv[1] == "--hang-rank-1" else worker(sys.argv[1])


# ---------------------------------------------------------------------------------------- the tests

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[dict, str]:
    out = str(tmp_path_factory.mktemp("torchrun"))
    corpus.data_dir(TrainConfig().data)  # prepare the corpus once, before two processes look for it
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.abspath(__file__), out]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, \
        f"torchrun failed after {time.time() - t0:.0f}s:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f), out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """Single-process runs with the same global batch (micro-batch 8, no accumulation), and their windows."""
    out = tmp_path_factory.mktemp("single")
    results = {}
    with pytest.MonkeyPatch.context() as mp:
        for residual in ("baseline", "delta_block"):
            spy = WindowSpy(mp.setattr)
            results[residual] = train.train(*configs(residual, out / residual, micro_batch_size=8))
            results[residual]["windows"] = spy.ids
    results["bf16_params"] = train.train(*configs("delta_block", out / "bf16_params", micro_batch_size=8,
                                                  precision="bf16-params"))
    results["fused"] = train.train(*configs("delta_block", out / "fused", micro_batch_size=8, adamw="fused"))
    return results


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """One process, the kernel path with compiled sublayers (counting their graphs) and eagerly, with the
    2-rank runs' micro-batch (so the graphs' shapes are theirs)."""
    out = tmp_path_factory.mktemp("compiled")
    torch._dynamo.reset()
    GRAPHS.clear()
    results = {"compiled": train.train(*configs("delta_block", out / "compiled", **COMPILED))}
    results["compiled"]["graphs"] = list(GRAPHS)
    eager = {**COMPILED, "compile": False}
    results["eager"] = train.train(*configs("delta_block", out / "eager", **eager))
    torch._dynamo.reset()
    GRAPHS.clear()
    results["whole"] = train.train(*configs("delta_block", out / "whole", **WHOLE))
    results["whole"]["graphs"] = list(GRAPHS)
    results["whole_eager"] = train.train(*configs("delta_block", out / "whole_eager", **{**WHOLE, "compile": False}))
    torch._dynamo.reset()
    return results


@pytest.mark.parametrize("residual", ["baseline", "delta_block"])
def test_ddp_matches_one_process(two_ranks, single, residual):
    results, _ = two_ranks
    ddp = results[f"ddp_{residual}"]
    assert len(ddp["losses"]) == MAX_STEPS
    assert ddp["losses"] == pytest.approx(single[residual]["losses"], abs=1e-5, rel=0)
    assert ddp["val_loss"] == pytest.approx(single[residual]["val_loss"], abs=1e-5, rel=0)
    assert ddp["losses"][-1] < ddp["losses"][0] - 0.05  # it trains: the comparison is not between constants


@pytest.mark.parametrize("run, reference", [("fsdp_delta", "ddp_delta"), ("fsdp_delta_block", "ddp_delta_block"),
                                            ("fsdp_delta_block_kernel", "ddp_delta_block_short")])
def test_fsdp_matches_ddp(two_ranks, run, reference):
    results, _ = two_ranks
    assert results[run]["losses"] == pytest.approx(results[reference]["losses"], abs=1e-4, rel=0)


def test_a_fused_adamw_trains_alike_in_one_process_ddp_and_fsdp(two_ranks, single):
    """adamw="fused" (the CUDA default; its NaN guard decided on the device, the loop reading every second step)
    trains under DDP and FSDP2 as in one process, and as torch's per-tensor AdamW up to its rounding."""
    results, _ = two_ranks
    ddp, fsdp = results["ddp_fused"]["losses"], results["fsdp_fused"]["losses"]
    assert len(ddp) == MAX_STEPS and ddp == pytest.approx(single["fused"]["losses"], abs=1e-5, rel=0)
    assert fsdp == pytest.approx(ddp, abs=1e-4, rel=0)
    assert ddp == pytest.approx(results["ddp_delta_block"]["losses"], abs=1e-4, rel=0)
    assert ddp[-1] < ddp[0] - 0.05


def test_one_precision_rule_for_ddp_and_fsdp(two_ranks):
    """precision="bf16" (the CUDA default, here on CPU): under DDP (autocast) and FSDP2 (bf16 matrices) alike
    the stream, the embedding source and every router parameter are fp32 and the sublayer outputs bf16, so
    both train alike: the same bf16 values enter the same matmuls, only the gradient sums' order differs."""
    results, _ = two_ranks
    fp32, bf16 = "torch.float32", "torch.bfloat16"
    expected = {"stream": [fp32], "sources": [bf16, fp32], "routers": [fp32], "outputs": [bf16]}
    assert results["dtypes"] == {"ddp": expected, "fsdp": expected}
    ddp, fsdp = results["ddp_bf16"]["losses"], results["fsdp_bf16"]["losses"]
    # the order's differences, rounded to bf16 in the weights at every step, grow: 0, 3.1e-5 and 1.5e-4 over the
    # 3 steps (losses near 5.5); 3e-4 leaves twice that
    assert fsdp == pytest.approx(ddp, abs=3e-4, rel=0)
    assert ddp[-1] < ddp[0] - 0.05


def test_bf16_params_under_ddp_and_fsdp(two_ranks, single):
    """precision="bf16-params": under DDP and FSDP2 the stream, the sources, every router parameter and the
    sublayer outputs are bf16, and both train as one process does, up to bf16 rounding (the gradients of two
    micro-batches are summed in bf16 under accumulation, once without)."""
    results, _ = two_ranks
    bf16 = ["torch.bfloat16"]
    expected = {"stream": bf16, "sources": bf16, "routers": bf16, "outputs": bf16}
    assert results["dtypes_bf16_params"] == {"ddp": expected, "fsdp": expected}
    ddp, fsdp = results["ddp_bf16_params"]["losses"], results["fsdp_bf16_params"]["losses"]
    assert ddp == pytest.approx(single["bf16_params"]["losses"], abs=2e-2, rel=0)
    assert fsdp == pytest.approx(ddp, abs=2e-2, rel=0)
    assert ddp[-1] < ddp[0] - 0.05


def test_compiled_sublayers_stay_whole_under_ddp_and_fsdp(two_ranks, compiled):
    """With a gradient bucket per parameter, DDP compiles the same graphs as one process (none is cut at a
    bucket), and so does FSDP2 (its hooks run around the compiled forwards); the compiled kernel path trains
    as the eager one."""
    results, _ = two_ranks
    assert results["ddp_compiled"]["graphs"] == results["fsdp_compiled"]["graphs"] == compiled["compiled"]["graphs"]
    assert compiled["compiled"]["losses"] == pytest.approx(compiled["eager"]["losses"], abs=1e-6, rel=0)
    for parallel in ("ddp", "fsdp"):
        assert results[f"{parallel}_compiled"]["losses"] == pytest.approx(compiled["compiled"]["losses"], abs=1e-5,
                                                                          rel=0)


def test_the_whole_forward_compiles_as_one_region_and_trains_as_eager(two_ranks, compiled):
    """compile_regions="model": one process traces the routed model whole, one graph for training's forward
    (and one for evaluation's, under no_grad), and trains as the eager reference; DDP (which may cut the graph
    at its buckets) and FSDP2 train as one process does."""
    results, _ = two_ranks
    whole = compiled["whole"]
    assert len(whole["graphs"]) == 2 and min(whole["graphs"]) > 100       # not a graph per sublayer
    assert whole["losses"] == pytest.approx(compiled["whole_eager"]["losses"], abs=1e-6, rel=0)
    assert whole["losses"][-1] < whole["losses"][0]
    for parallel in ("ddp", "fsdp"):
        assert results[f"{parallel}_whole"]["losses"] == pytest.approx(whole["losses"], abs=1e-5, rel=0), parallel


def test_rank_windows_are_disjoint_and_make_the_global_batch(two_ranks, single):
    results, _ = two_ranks
    rank0, rank1 = results["windows"]
    per_step = TRAIN["batch_size"] // 2  # each rank's share of one step
    for s in range(MAX_STEPS):
        mine0, mine1 = rank0[s * per_step:(s + 1) * per_step], rank1[s * per_step:(s + 1) * per_step]
        assert len(set(mine0)) == len(mine0) == per_step and set(mine0).isdisjoint(mine1)
        step_ids = single["baseline"]["windows"][s * 2 * per_step:(s + 1) * 2 * per_step]
        assert sorted(mine0 + mine1) == sorted(step_ids)


def test_fsdp_resume_reproduces_the_uninterrupted_run(two_ranks):
    results, out = two_ranks
    full, resumed = results["fsdp_delta_block"], results["fsdp_resumed"]
    assert resumed["step"] == MAX_STEPS and len(resumed["losses"]) == MAX_STEPS - SAVE_AT
    assert resumed["losses"] == pytest.approx(full["losses"][SAVE_AT:], abs=1e-6, rel=0)
    names = [os.path.basename(p) for p in checkpoint.checkpoint_paths(os.path.join(out, "fsdp_delta_block"))]
    assert names == [f"ckpt_{SAVE_AT:07d}", f"ckpt_{2 * SAVE_AT:07d}", f"ckpt_{MAX_STEPS:07d}"]


def test_sharded_checkpoint_resumes_on_one_process(two_ranks, tmp_path):
    results, out = two_ranks
    os.makedirs(tmp_path / "run")
    name = f"ckpt_{SAVE_AT:07d}"
    shutil.copytree(os.path.join(out, "fsdp_delta_block", name), tmp_path / "run" / name)
    resumed = train.train(*configs("delta_block", tmp_path / "run", micro_batch_size=4, resume=True))
    assert resumed["losses"] == pytest.approx(results["fsdp_delta_block"]["losses"][SAVE_AT:], abs=1e-5, rel=0)


def test_consolidated_checkpoint_has_the_single_file_format(two_ranks, single, tmp_path):
    _, out = two_ranks
    sharded = os.path.join(out, "fsdp_delta_block", f"ckpt_{MAX_STEPS:07d}")
    path = checkpoint.consolidate(sharded, str(tmp_path / "full.pt"))
    full = checkpoint.load_checkpoint(path)
    ddp_file = checkpoint.load_checkpoint(os.path.join(out, "ddp_delta_block", f"ckpt_{MAX_STEPS:07d}.pt"))
    assert set(full) == set(ddp_file) == {"model", "optimizer", "loader", "step", "model_config", "train_config",
                                          "data"}
    assert full["step"] == MAX_STEPS and full["loader"] == ddp_file["loader"]
    assert set(full["optimizer"]["state"]) == set(ddp_file["optimizer"]["state"])
    for name, tensor in ddp_file["model"].items():
        assert full["model"][name].shape == tensor.shape, name
        torch.testing.assert_close(full["model"][name], tensor, atol=1e-3, rtol=0)  # same run up to fp32 sums


def test_time_budget_stops_every_rank_at_the_same_step(two_ranks):
    """Also with the guard on the device, where the flags are read every fourth step: at such a step."""
    results, _ = two_ranks
    step0, step1 = results["budget_steps"]
    assert step0 == step1 < 50
    step0, step1 = results["budget_fused_steps"]
    assert step0 == step1 < 50 and step0 % 4 == 0


def test_compiled_sublayers_share_graphs_across_layers():
    """Fine-grained routing has the most sources (up to 2L+1 = 25 here). 12 layers are more module instances
    than dynamo's recompile limit (8), yet nothing recompiles: 3 forward + 3 backward graphs, equal to eager."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters
    from functorch.compile import make_boxed_func

    graphs = {"forward": 0, "backward": 0}

    def counting(kind):
        def compiler(gm, _):
            graphs[kind] += 1
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    counters.clear()
    cfg = ModelConfig(residual="delta", d_model=32, n_layers=12, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
    torch.manual_seed(0)
    eager, compiled = Model(cfg), Model(cfg)
    compiled.load_state_dict(eager.state_dict())
    distributed.compile_sublayers(compiled, backend=aot_autograd(fw_compiler=counting("forward"),
                                                                 bw_compiler=counting("backward")))
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    for model in (eager, compiled):
        model(x).square().mean().backward()
    assert graphs == {"forward": 3, "backward": 3}  # RMSNorm, Attention, MLP
    assert not counters["recompiles"]
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)
    torch._dynamo.reset()


def test_the_whole_forward_compiled_by_inductor_gives_eager_gradients():
    """compile_regions="model" with the generated code users get (inductor's, not a tracing backend, which the
    training runs above use): the loss and every parameter's gradient equal eager's, for gated reads with learned
    null sources (2 layers: inductor compiles them in some 30 s on a 2-core CPU); the generated code skips the
    checks distributed.UNCHECKED turns off."""
    from torch._inductor.codecache import PyCodeCache
    torch._dynamo.reset()
    loaded = set(map(id, PyCodeCache.modules))
    cfg = ModelConfig(residual="delta", d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                      gate=True, null_source=True, learned_null=True, kernel="reference")
    torch.manual_seed(0)
    eager, compiled = Model(cfg), Model(cfg)
    with torch.no_grad():                   # gates and null sources off zero, so that every gradient is alive
        for p in eager.routers.parameters():
            p.add_(0.5 * torch.randn_like(p))
    compiled.load_state_dict(eager.state_dict())
    distributed.compile_model(compiled, backend="inductor")
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    losses = [model(x).square().mean() for model in (eager, compiled)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert p.grad.abs().max() > 0, name                               # a gradient that can differ
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)
    generated = [open(m.__file__).read() for m in PyCodeCache.modules if id(m) not in loaded]
    assert any("extern_kernels.mm(" in code for code in generated)          # the forward's and backward's code
    assert not any("assert_size_stride(" in code or "assert_alignment(" in code for code in generated)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend, mode, options", [
    ("inductor", "default", distributed.UNCHECKED),
    ("inductor", "reduce-overhead", {"triton.cudagraphs": True, **distributed.UNCHECKED}),
    ("aot_eager", "reduce-overhead", None)])          # a tracing backend takes neither mode nor options
def test_compiled_regions_get_the_mode_and_the_unchecked_settings(monkeypatch, backend, mode, options):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    model = Model(ModelConfig(residual="delta", d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
                              d_ff=32))
    distributed.compile_model(model, backend, mode)
    distributed.compile_sublayers(model, backend, mode)
    assert calls and all(c == {"backend": backend, **({"options": options} if options else {})} for c in calls)


# ------------------------------------------------------------------------- torchrun train.py, as users run it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI_SMALL = ["--d_model=32", "--n_layers=2", "--n_blocks=2", "--n_heads=2", "--n_kv_heads=1", "--head_dim=16",
             "--d_ff=64", "--seq_len=32", "--eval_batches=1", "--log_interval=1", "--device=cpu"]


def torchrun(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_ranks_derive_the_micro_batch_and_save_together_on_sigterm(tmp_path):
    """configs/tiny_* leave micro_batch_size out, so 2 ranks read 8 each of the batch of 16. SIGTERM to torchrun
    reaches both ranks, which stop at the same step and save one checkpoint, resumable on one process."""
    out = tmp_path / "run"
    proc = torchrun("train.py", "configs/tiny_delta_block.py", *CLI_SMALL, f"--out_dir={out}", "--max_steps=100000")
    while not (out / "log.jsonl").exists() or '"loss"' not in (out / "log.jsonl").read_text():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert "2 x cpu (ddp), micro-batch 8, grad accumulation 1" in stdout
    [path] = checkpoint.checkpoint_paths(out)
    assert f"stopped by SIGTERM: saved {path}" in stdout, stderr
    step = checkpoint.read_meta(path)["step"]
    resumed = train.main(["configs/tiny_delta_block.py", *CLI_SMALL, f"--out_dir={out}", "--resume",
                          f"--max_steps={step + 1}"])
    assert resumed["step"] == step + 1 and len(resumed["losses"]) == 1


@pytest.mark.parametrize("args, message", [
    (["--batch_size=0"], "batch_size=0: allowed values are integers >= 1"),          # found by every rank
    (["--resume", "--out_dir={tmp}"], "no checkpoint (ckpt_*.pt or ckpt_*/) in {tmp}"),  # by rank 0 (on_main)
])
def test_a_user_error_is_printed_once_under_torchrun(tmp_path, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    _, stderr = torchrun("train.py", "configs/tiny_delta_block.py", *CLI_SMALL, *args).communicate(timeout=300)
    assert stderr.count(f"train.py: error: {message.format(tmp=tmp_path)}\n") == 1, stderr
    assert "[rank" not in stderr and "rank 0 failed" not in stderr  # no worker printed a traceback


def test_a_hung_rank_ends_the_job_with_a_message(tmp_path):
    proc = torchrun(os.path.abspath(__file__), "--hang-rank-1", "configs/tiny_delta_block.py", *CLI_SMALL,
                    f"--out_dir={tmp_path}", "--dist_timeout_s=5")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "train.py: error: rank 0 waited more than dist_timeout_s=5s for the other ranks: one of them hung or " \
           "died" in stderr


def test_a_damaged_file_of_a_sharded_checkpoint_is_detected(two_ranks, tmp_path):
    _, out = two_ranks
    folder = tmp_path / f"ckpt_{SAVE_AT:07d}"
    shutil.copytree(os.path.join(out, "fsdp_delta_block", folder.name), folder)
    assert checkpoint.load_checkpoint(str(folder))["step"] == SAVE_AT
    shard = sorted(folder.glob("*.distcp"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    shard.write_bytes(raw)
    with pytest.raises(checkpoint.CheckpointError, match=f"{shard} is damaged"):
        checkpoint.load_checkpoint(str(folder))
