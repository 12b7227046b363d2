"""train.py on the embedded corpus: config handling, initial loss, overfitting, exact resume, clear errors,
non-finite steps, Ctrl-C / SIGTERM, the out_dir lock."""
import ast
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infra import checkpoint
from infra import config
from infra import cli
from infra import corpus
from infra import distributed
from infra import files
from infra import runlog
from infra import shards
import train
from infra.config import ConfigError, TrainConfig, load_config
from model import Model, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--d_model=32", "--n_layers=2", "--n_blocks=2", "--n_heads=2", "--n_kv_heads=1", "--head_dim=16", "--d_ff=64",
         "--seq_len=32", "--batch_size=4", "--micro_batch_size=2", "--eval_batches=2", "--log_interval=1",
         "--eval_interval=1000", "--warmup_steps=2", "--lr=3e-3"]


def run(tmp_path, *extra):
    return train.main(["configs/tiny_delta_block.py", *SMALL, f"--out_dir={tmp_path}", *extra])


def test_the_log_line_counts_steps_of_the_run_and_gives_the_time_left(tmp_path, capsys):
    run(tmp_path, "--max_steps=4", "--log_interval=2")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step     2/4", "step     4/4"]
    assert lines[-1].endswith("| ETA 0s") and re.search(r"\| ETA \d+s$", lines[0])
    entries = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert all(e["gpu_busy_s"] is None for e in entries if "tok_per_s" in e)      # measured on a GPU only
    assert [runlog.duration(s) for s in (0.4, 59, 61, 3599, 3600 + 7 * 60 + 31)] == ["0s", "59s", "1m01s", "59m59s",
                                                                                 "1h07m"]
    # the loss-curve command draws the log: training points at the log lines, validation at the end
    from experiments import curves
    drawn = curves.main([str(tmp_path), f"--out={tmp_path / 'plot' / 'c.png'}"])[os.path.normpath(str(tmp_path))]
    tokens = 4 * 32                                                    # batch_size x seq_len of SMALL
    assert drawn["train"] == [(e["step"], e["step"] * tokens, e["loss"]) for e in entries if "tok_per_s" in e]
    assert [p[:2] for p in drawn["val"]] == [(4, 4 * tokens)] and (tmp_path / "plot" / "c.png").stat().st_size > 0


def test_config_file_and_overrides():
    model_cfg, cfg = load_config(["configs/tiny_delta_block.py", "--n_blocks=2", "--lr=1e-3",
                                        "--resume", "--block_source=paper"])
    assert (model_cfg.residual, model_cfg.n_blocks, model_cfg.block_source) == ("delta_block", 2, "paper")
    assert cfg.lr == 1e-3 and cfg.resume is True and cfg.max_steps == 600


@pytest.mark.parametrize("argv,error,message", [
    (["--n_blcks=2"], ConfigError, "unknown config key 'n_blcks' \\(did you mean n_blocks"),
    (["--lr=fast"], ConfigError, "--lr=fast: expected float"),
    (["--n_layers=2.5"], ConfigError, "'n_layers' = 2.5: expected int"),
    (["--residual=deltablock"], ConfigError, "allowed values are baseline"),   # model.py's ValueError, converted
    (["configs/nope.py"], FileNotFoundError, "configs/nope.py"),
])
def test_config_errors(argv, error, message):
    with pytest.raises(error, match=message) as raised:
        load_config(argv)
    assert isinstance(raised.value, cli.UserError)


@pytest.mark.parametrize("text, value", [("0.02", 0.02), ("0", 0.0), ("None", None)])
def test_an_optional_float_takes_a_number_or_none(text, value):
    model_cfg, _ = load_config(["configs/tiny_delta_block.py", f"--query_init_std={text}"])
    assert model_cfg.query_init_std == value and type(model_cfg.query_init_std) is type(value)


def test_an_optional_float_refuses_anything_else(tmp_path):
    with pytest.raises(ConfigError, match="--query_init_std=small: expected float or None"):
        load_config(["configs/tiny_delta_block.py", "--query_init_std=small"])
    path = tmp_path / "cfg.py"
    path.write_text("residual = 'delta'\nquery_init_std = None\n")
    assert load_config([str(path)])[0].query_init_std is None
    path.write_text("residual = 'delta'\nquery_init_std = '0.02'\n")
    with pytest.raises(ConfigError, match="'query_init_std' = '0.02': expected float or None, got str"):
        load_config([str(path)])


def test_unknown_key_in_config_file(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("d_model = 64\nlearning_rate = 1e-3\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_config([str(path)])


def test_initial_loss_is_log_vocab():
    torch.manual_seed(0)
    model = Model(ModelConfig(residual="delta_block", n_blocks=4))
    loader = shards.ShardLoader(corpus.data_dir(TrainConfig().data), "train", 8, 64)
    x, y = loader.next_batch()
    assert abs(train.loss_fn(model, x, y).item() - math.log(257)) < 0.05


def test_one_batch_overfits():
    torch.manual_seed(0)
    model = Model(ModelConfig(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128,
                              residual="delta_block", n_blocks=2))
    cfg = TrainConfig(weight_decay=0.0)
    opt = torch.optim.AdamW(train.param_groups(model, cfg), lr=3e-3)
    x, y = shards.ShardLoader(corpus.data_dir(cfg.data), "train", 4, 32).next_batch()
    for _ in range(150):
        loss = train.loss_fn(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = run(tmp_path / "a", "--max_steps=6", "--ckpt_interval=3")
    assert [os.path.basename(p) for p in checkpoint.checkpoint_paths(tmp_path / "a")] == \
        ["ckpt_0000003.pt", "ckpt_0000006.pt"]
    os.makedirs(tmp_path / "b")
    shutil.copy(tmp_path / "a" / "ckpt_0000003.pt", tmp_path / "b")  # as if the run died after step 3
    resumed = run(tmp_path / "b", "--max_steps=6", "--ckpt_interval=3", "--resume")
    assert resumed["step"] == 6 and len(resumed["losses"]) == 3
    assert resumed["losses"] == full["losses"][3:]                     # exactly, not approximately
    assert resumed["val_loss"] == full["val_loss"]


def test_jsonl_log_and_checkpoint_contents(tmp_path):
    result = run(tmp_path, "--max_steps=4", "--keep_checkpoints=1")
    records = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4]
    assert {"lr", "grad_norm", "tok_per_s", "mfu", "step_time_s", "peak_mem_gb"} <= set(train_records[0])
    final = records[-1]
    assert final["final"] and final["val_loss"] == result["val_loss"]
    # the first record says where the run trained: runs are compared only within one machine and commit
    where = records[0]["provenance"]
    assert where["isa"] == torch.backends.cpu.get_cpu_capability() and where["threads"] == torch.get_num_threads()
    assert where["commit"] == (runlog.git("rev-parse", "HEAD") or "unknown") and where["torch"] == torch.__version__
    assert re.fullmatch("[0-9a-f]{40}|unknown", where["commit"]) and where["cpu"] and isinstance(where["dirty"], bool)
    assert math.isclose(final["val_ppl"], math.exp(final["val_loss"]))
    ckpt = checkpoint.load_checkpoint(checkpoint.checkpoint_paths(tmp_path)[-1])
    assert ckpt["step"] == 4 and ckpt["model_config"]["residual"] == "delta_block"
    assert ckpt["train_config"]["out_dir"] == str(tmp_path)


def test_resume_of_a_run_with_the_default_query_init(tmp_path):
    """The checkpoint records the config as given (query_init_std=None, never rewritten), so --resume with the
    same command finds the same config."""
    run(tmp_path, "--max_steps=1", "--gate")
    saved = checkpoint.load_checkpoint(checkpoint.checkpoint_paths(tmp_path)[-1])
    assert saved["model_config"]["query_init_std"] is None
    assert run(tmp_path, "--max_steps=2", "--gate", "--resume")["step"] == 2


def test_resume_with_a_different_model_is_an_error(tmp_path):
    run(tmp_path, "--max_steps=1")
    with pytest.raises(ValueError, match="differs from the checkpoint's in \\['n_blocks'\\]"):
        run(tmp_path, "--max_steps=2", "--resume", "--n_blocks=1")


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run(tmp_path, "--resume")


def test_corrupt_shard_is_a_clear_error(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    shards.write_shard(str(folder / "train_000000.bin"), np.arange(1000) % 257, 257, "byte")
    shards.write_shard(str(folder / "val_000000.bin"), np.arange(500) % 257, 257, "byte")
    (folder / "meta.json").write_text(json.dumps({"tokenizer": "byte", "vocab_size": 257}))
    with open(folder / "train_000000.bin", "r+b") as f:
        f.truncate(600)
    with pytest.raises(ValueError, match="train_000000.bin"):
        run(tmp_path / "out", f"--data={folder}", "--max_steps=1")


def test_vocab_mismatch_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="257"):
        run(tmp_path, "--vocab_size=200", "--max_steps=1")


def test_time_budget_stops_early(tmp_path):
    result = run(tmp_path, "--max_steps=100000", "--time_budget_s=2")
    assert result["step"] < 100000 and math.isfinite(result["val_loss"])


def test_the_heap_is_frozen_after_the_first_step_until_the_run_ends(tmp_path, monkeypatch):
    """runlog.freeze_heap: from the second step on the garbage collector no longer scans the model and compiled
    code (gc.freeze), and the run hands them back when it ends, so that a later run in the process can free them."""
    import gc
    frozen_at_steps = []
    step = train._optimizer_step
    monkeypatch.setattr(train, "_optimizer_step", lambda *args: (frozen_at_steps.append(gc.get_freeze_count()),
                                                                 step(*args)))
    assert gc.get_freeze_count() == 0
    run(tmp_path, "--max_steps=3")
    assert frozen_at_steps[0] == 0 and all(n > 1000 for n in frozen_at_steps[1:]) and len(frozen_at_steps) == 3
    assert gc.get_freeze_count() == 0


def test_global_batch_must_divide_over_ranks_and_micro_batches():
    cfg = TrainConfig(batch_size=8, micro_batch_size=2)
    assert [config.batch_split(cfg, world) for world in (1, 2, 4)] == [(2, 4), (2, 2), (2, 1)]
    with pytest.raises(ValueError, match="batch_size=8 is not a multiple of micro_batch_size=2 x world_size=3 = 6"):
        config.batch_split(cfg, 3)


def test_micro_batch_left_out_is_the_batch_over_the_world_size():
    cfg = TrainConfig(batch_size=8)
    assert [config.batch_split(cfg, world) for world in (1, 2, 8)] == [(8, 1), (4, 1), (1, 1)]
    with pytest.raises(ValueError, match="batch_size=8 does not split over 3 processes"):
        config.batch_split(cfg, 3)


def test_fsdp_on_one_process_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="parallel='fsdp' on a single process shards nothing"):
        run(tmp_path, "--parallel=fsdp", "--max_steps=1")


ROUTED = dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64, residual="delta_block",
              n_blocks=2, gate=True, null_source=True, learned_null=True)


@pytest.mark.parametrize("on", ["matrices", "all"])
def test_weight_decay_on_matrices_or_on_every_parameter(on):
    """"matrices": the backbone's 2-D parameters only (the embedding too), never a norm or router (whose stacked
    rows are 2-D too); "all" (the authors' code): every one. One AdamW step on zero gradients moves exactly the
    decayed parameters that are not 0."""
    torch.manual_seed(0)
    model = Model(ModelConfig(**ROUTED))
    groups = train.param_groups(model, TrainConfig(weight_decay=0.1, weight_decay_on=on))
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for g in groups for p in g["params"]) == sorted(names.values())  # each once
    decayed = {names[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    matrices = {n for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("routers.")}
    assert "embed_tokens.weight" in matrices and model.routers.query.dim() == 2
    assert decayed == (matrices if on == "matrices" else set(names.values()))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {n for n in decayed if before[n].abs().max() > 0}      # gates and null sources start at 0


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_bf16_params_computes_in_bf16_throughout(kernel):
    """precision="bf16-params": parallelize casts the whole model; the stream, every source, router parameter,
    sublayer output, the logits and every gradient are bf16."""
    torch.manual_seed(0)
    model = Model(ModelConfig(**ROUTED, kernel=kernel))
    seen = set()
    model.routing_observer = lambda l, sources, router: seen.update(
        {t.dtype for t in sources} | {p.dtype for p in router.tensors()})
    model.norm.register_forward_pre_hook(lambda m, args: seen.add(args[0].dtype))
    for layer in model.layers:
        for m in (layer.self_attn, layer.mlp):
            m.register_forward_hook(lambda m, args, out: seen.add(out.dtype))
    ctx = distributed.Context(0, 1, torch.device("cpu"), owns_group=False)
    wrapped = distributed.parallelize(model, "ddp", ctx, precision="bf16-params")
    x = torch.randint(0, model.cfg.vocab_size, (2, 8))
    with distributed.autocast(ctx.device, "bf16-params"):
        logits = wrapped(x)
    train.loss_fn(wrapped, x, x).backward()
    assert seen == {logits.dtype} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.grad.isfinite().all() for p in model.parameters())


def test_compiled_regions_and_modes_are_checked_before_anything_is_compiled():
    """An unknown region or mode names the allowed ones; CUDA graphs under FSDP2 (whose gathers move the
    parameters every step) are refused with the alternative."""
    ctx = distributed.Context(0, 1, torch.device("cpu"), owns_group=False)
    model = Model(ModelConfig(**ROUTED))
    with pytest.raises(cli.UsageError, match="compile_regions='layer': allowed values are sublayers, model"):
        distributed.parallelize(model, "ddp", ctx, compile=True, compile_regions="layer")
    with pytest.raises(cli.UsageError, match="FSDP2 gathers them into new memory every step: use parallel='ddp'"):
        distributed.parallelize(model, "fsdp", ctx, compile=True, compile_mode="reduce-overhead")
    with pytest.raises(ConfigError, match="compile_mode='max': allowed values are default, reduce-overhead"):
        TrainConfig(compile_mode="max")
    assert not hasattr(model.forward, "_torchdynamo_orig_callable")      # nothing compiled on the way


def test_bf16_params_trains_and_saves_bf16_weights(tmp_path):
    result = run(tmp_path, "--max_steps=4", "--precision=bf16-params")
    assert all(math.isfinite(v) for v in result["losses"]) and result["losses"][-1] < result["losses"][0]
    weights = checkpoint.load_checkpoint(checkpoint.checkpoint_paths(tmp_path)[-1])["model"]
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_wandb_not_installed_is_a_clear_error(tmp_path):
    try:
        import wandb  # noqa: F401
        pytest.skip("wandb is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="wandb=True but wandb is not installed"):
        run(tmp_path, "--wandb", "--max_steps=1")


class NaNGradient(torch.autograd.Function):
    """The identity, with a NaN gradient: a finite loss whose gradient norm is NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def poison(monkeypatch, steps: set[int], how) -> None:
    """Apply `how` to the loss of the training steps in `steps` (1-based; SMALL has 2 micro-batches per step)."""
    calls = []
    loss_fn = train.loss_fn

    def poisoned(model, x, y):
        calls.append(1)
        loss = loss_fn(model, x, y)
        return how(loss) if (len(calls) + 1) // 2 in steps else loss
    monkeypatch.setattr(train, "loss_fn", poisoned)


def all_finite(path) -> bool:
    state = checkpoint.load_checkpoint(path)
    tensors = list(state["model"].values()) + [t for s in state["optimizer"]["state"].values() for t in s.values()]
    return all(torch.isfinite(t).all() for t in tensors)


def test_nan_gradient_with_finite_loss_is_skipped_and_never_saved(tmp_path, monkeypatch):
    poison(monkeypatch, set(range(3, 100)), NaNGradient.apply)
    with pytest.raises(FloatingPointError, match=r"3 steps in a row, up to step 5, had a non-finite loss or gradient "
                                                 r"norm .* The newest finite checkpoint is .*ckpt_0000002\.pt"):
        run(tmp_path, "--max_steps=10", "--ckpt_interval=1", "--keep_checkpoints=5")
    paths = checkpoint.checkpoint_paths(tmp_path)
    assert [os.path.basename(p) for p in paths] == ["ckpt_0000001.pt", "ckpt_0000002.pt"]
    assert all(all_finite(p) for p in paths)
    skipped = [json.loads(line) for line in open(tmp_path / "log.jsonl") if '"skipped"' in line]
    assert [r["step"] for r in skipped] == [3, 4, 5] and math.isnan(skipped[0]["grad_norm"])


def test_a_lone_non_finite_step_is_skipped_and_counted(tmp_path, monkeypatch):
    poison(monkeypatch, {3}, lambda loss: loss * float("nan"))
    result = run(tmp_path, "--max_steps=5")
    assert result["step"] == 5 and result["skipped_steps"] == 1 and math.isnan(result["losses"][2])
    assert all(math.isfinite(loss) for i, loss in enumerate(result["losses"]) if i != 2)
    assert all_finite(checkpoint.checkpoint_paths(tmp_path)[-1])
    steps = [json.loads(line) for line in open(tmp_path / "log.jsonl") if '"tok_per_s"' in line]
    assert [r["skipped_steps"] for r in steps] == [0, 0, 1, 1, 1]


def test_the_guard_on_the_device_reads_only_where_it_logs_and_skips_the_same(tmp_path, monkeypatch):
    """A fused AdamW skips a non-finite step on the device (found_inf): the loop reads the device only at steps
    that log, save or end; the skipped step is counted there, and the weights, AdamW's moments and its step
    counts are those of a run that reads at every step."""
    reads = []
    read = train._read_figures
    monkeypatch.setattr(train, "_read_figures", lambda run, *a: reads.append(run.step) or read(run, *a))
    poison(monkeypatch, {3}, lambda loss: loss * float("nan"))
    result = run(tmp_path / "every", "--max_steps=6", "--adamw=fused")
    poison(monkeypatch, {3}, lambda loss: loss * float("nan"))
    reads.clear()
    deferred = run(tmp_path / "deferred", "--max_steps=6", "--adamw=fused", "--log_interval=4")
    assert reads == [4, 6] and deferred["skipped_steps"] == result["skipped_steps"] == 1
    assert math.isnan(deferred["losses"][2]) and deferred["losses"][3:] == result["losses"][3:]
    a, b = (checkpoint.load_checkpoint(checkpoint.checkpoint_paths(tmp_path / d)[-1]) for d in ("every", "deferred"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert {int(s["step"]) for s in b["optimizer"]["state"].values()} == {5}     # 6 steps, one skipped


def test_the_guard_on_the_device_stops_at_the_read_after_max_bad_steps(tmp_path, monkeypatch):
    poison(monkeypatch, set(range(3, 100)), NaNGradient.apply)
    with pytest.raises(FloatingPointError, match=r"3 steps in a row, up to step 5, had a non-finite loss"):
        run(tmp_path, "--max_steps=10", "--adamw=fused", "--log_interval=8")
    skipped = [json.loads(line)["step"] for line in open(tmp_path / "log.jsonl") if '"skipped"' in line]
    assert skipped == [3, 4, 5]


@pytest.mark.parametrize("arg, allowed", [
    ("batch_size=0", "integers >= 1"), ("d_model=0", "integers >= 1"), ("n_heads=0", "integers >= 1"),
    ("max_steps=-1", "integers >= 0"), ("ckpt_interval=-1", r"0 \(off\) or integers >= 1"),
    ("n_kv_heads=0", "integers >= 1"), ("seq_len=0", "integers >= 1"), ("eval_interval=0", "integers >= 1"),
    ("log_interval=0", "integers >= 1"), ("head_dim=15", "even integers >= 2"), ("n_blocks=0", "1..n_layers=8"),
    ("micro_batch_size=-2", r"0 \(batch_size / world size\) or integers >= 1"),
    ("lr=-0.1", "finite numbers > 0"), ("lr=1e999", "finite numbers > 0"), ("beta2=1.0", r"numbers in \[0, 1\)"),
    ("grad_clip=-1.0", "finite numbers >= 0"), ("keep_checkpoints=0", "integers >= 1"),
    ("device=tpu", "auto, cpu, cuda"), ("min_lr_ratio=2.0", "numbers in"), ("eval_batches=0", "integers >= 1"),
    ("ckpt_minutes=-1.0", "finite numbers >= 0"), ("norm_eps=-1.0", "finite numbers >= 0"),
    ("max_bad_steps=0", "integers >= 1"), ("adamw=adam", "auto, fused, loop"),
    ("dist_timeout_s=0.0", "finite numbers > 0"), ("out_dir=", "non-empty"),
    ("weight_decay_on=norms", "matrices, all"), ("precision=bf16_params", "auto, bf16, fp32, bf16-params"),
    ("out_init=zero", "scaled, plain"),
])
def test_nonsense_config_values_name_key_value_and_allowed_values(arg, allowed):
    key, value = arg.split("=")
    strings = ("device", "out_dir", "weight_decay_on", "precision", "out_init", "adamw")
    shown = repr(value if key in strings else ast.literal_eval(value))  # as the config holds it
    with pytest.raises(ValueError, match=f"^{key}={re.escape(shown)}: allowed values are {allowed}"):
        load_config(["configs/tiny_delta_block.py", f"--{arg}"])


@pytest.mark.parametrize("script", ["train.py", "finetune.py"])
def test_help_lists_every_key_and_no_arguments_print_the_usage(script):
    """--help (or -h) prints the usage and every key with its default, exit 0; no arguments print the usage and
    exit 2 instead of starting a run of the defaults."""
    helped = subprocess.run([sys.executable, script, "configs/tiny_delta_block.py", "-h"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith(f"usage: python {script} CONFIG.py [--key=value ...]")
    assert "max_steps=1000" in helped.stdout and "residual='baseline'" in helped.stdout
    assert ("init_from=''" in helped.stdout) == (script == "finetune.py")
    bare = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and bare.stdout == "" and f"`python {script} --help` lists the keys" in bare.stderr


@pytest.mark.parametrize("script", ["eval.py", "sample.py", "data.py"])
def test_the_argparse_commands_print_usage_for_help_and_for_no_arguments(script):
    helped = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith("usage:")
    bare = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and "usage:" in bare.stderr and "required" in bare.stderr


def test_overrides_take_key_value_with_or_without_the_equals_sign():
    spaced = load_config(["configs/tiny_delta_block.py", "--max_steps", "5", "--resume", "--compile", "false",
                          "--lr", "1e-3", "--out_dir", "out/x"])
    equals = load_config(["configs/tiny_delta_block.py", "--max_steps=5", "--resume", "--compile=false",
                          "--lr=1e-3", "--out_dir=out/x"])
    assert spaced == equals and spaced[1].max_steps == 5 and spaced[1].resume and not spaced[1].compile
    with pytest.raises(ConfigError, match="^--max_steps needs a value: write --max_steps=VALUE$"):
        load_config(["configs/tiny_delta_block.py", "--max_steps"])
    with pytest.raises(ConfigError, match="^unexpected argument 'later': write overrides as --key=value"):
        load_config(["configs/tiny_delta_block.py", "--resume", "later"])


def test_a_user_error_is_one_line_and_a_bug_keeps_its_traceback():
    proc = subprocess.run([sys.executable, "train.py", "configs/tiny_delta_block.py", "--eval_interval=0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == "train.py: error: eval_interval=0: allowed values are integers >= 1\n"
    # a plain exception is a bug, even one raised by a `raise` statement of this repository
    code = "from infra import cli\ndef main(argv):\n    raise ValueError('an internal check failed')\ncli.run(main)\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.endswith("ValueError: an internal check failed\n") and "error:" not in proc.stderr


def test_a_rank_failure_ends_the_process_even_while_a_thread_holds_up_pythons_exit():
    """What gloo's worker thread does after a timed-out collective, here a thread that never ends: a normal exit
    would wait for it forever."""
    code = ("import threading\nfrom infra import cli\ndef main(argv):\n"
            "    threading.Thread(target=threading.Event().wait).start()\n"
            "    raise cli.RankFailureError('rank 0 waited more than dist_timeout_s=5s')\ncli.run(main)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (1, "-c: error: rank 0 waited more than dist_timeout_s=5s\n")


def cli_run(monkeypatch, capsys, main, rank: str = "0") -> tuple[int, str]:
    """(exit status, stderr) of cli.run(main) as the command `prog.py`, on torchrun's rank `rank`."""
    monkeypatch.setattr(sys, "argv", ["prog.py"])
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exited:
        cli.run(main)
    return exited.value.code, capsys.readouterr().err


def test_a_user_error_raised_in_a_helper_reads_as_one_raised_in_main(monkeypatch, capsys):
    """The type decides, not where the error is raised: moving a `raise UserError` into a helper changes nothing."""
    def check_widgets(n: int) -> None:
        if n > 2:
            raise cli.UserError(f"n_widgets={n}: allowed values are 1, 2")

    def main_raises(argv):
        raise cli.UserError("n_widgets=3: allowed values are 1, 2")

    def main_calls_a_helper(argv):
        check_widgets(3)

    expected = (1, "prog.py: error: n_widgets=3: allowed values are 1, 2\n")
    assert cli_run(monkeypatch, capsys, main_raises) == cli_run(monkeypatch, capsys, main_calls_a_helper) == expected
    assert cli_run(monkeypatch, capsys, main_calls_a_helper, rank="1") == (1, "")  # rank 0 speaks for all
    with pytest.raises(ZeroDivisionError):                                        # a bug goes on, to its traceback
        cli_run(monkeypatch, capsys, lambda argv: 1 / 0)


def test_model_py_value_errors_reach_the_user_as_one_line(monkeypatch, capsys):
    """model.py is library code and raises ValueError; the config boundary turns it into a user error."""
    monkeypatch.setattr(train, "train", lambda *args: pytest.fail("the config was accepted"))
    status, err = cli_run(monkeypatch, capsys, lambda argv: train.main(["configs/tiny_delta_block.py",
                                                                        "--residual=deltablock"]))
    assert status == 1 and err.startswith("prog.py: error: residual='deltablock': allowed values are baseline")
    assert err.count("\n") == 1


def test_sigterm_during_training_leaves_a_resumable_checkpoint(tmp_path):
    out, constant_lr = tmp_path / "run", ["--warmup_steps=0", "--min_lr_ratio=1.0"]  # max_steps changes no step
    proc = subprocess.Popen([sys.executable, "train.py", "configs/tiny_delta_block.py", *SMALL, *constant_lr,
                             f"--out_dir={out}", "--max_steps=100000"], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while not (out / "log.jsonl").exists() or '"loss"' not in (out / "log.jsonl").read_text():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    [path] = checkpoint.checkpoint_paths(out)
    step = checkpoint.read_meta(path)["step"]
    assert f"stopped by SIGTERM: saved {path}" in stdout
    resumed = run(out, *constant_lr, "--resume", f"--max_steps={step + 2}")
    full = run(tmp_path / "full", *constant_lr, f"--max_steps={step + 2}")
    assert resumed["step"] == step + 2 and resumed["losses"] == full["losses"][step:]


def test_checkpoints_every_ckpt_minutes(tmp_path, monkeypatch):
    clock = iter(range(0, 10 ** 6, 100))  # every reading of the clock is 100 s after the previous one
    monkeypatch.setattr(train, "time", SimpleNamespace(time=lambda: float(next(clock))))
    run(tmp_path, "--max_steps=3", "--ckpt_minutes=1", "--keep_checkpoints=5")
    assert [os.path.basename(p) for p in checkpoint.checkpoint_paths(tmp_path)] == \
        ["ckpt_0000001.pt", "ckpt_0000002.pt", "ckpt_0000003.pt"]


def test_out_dir_is_locked_by_the_run_that_owns_it(tmp_path):
    with files.locked(str(tmp_path / "run.lock"), wait=False, holder_of="a test"):
        with pytest.raises(FileExistsError, match=rf"out_dir {tmp_path} is in use by process {os.getpid()}"):
            run(tmp_path, "--max_steps=1")
    assert run(tmp_path, "--max_steps=1")["step"] == 1  # the lock goes with the process that held it


def test_resume_on_another_tokenizers_data_is_an_error(tmp_path):
    folder = tmp_path / "shards"

    def write(tokenizer):
        folder.mkdir(exist_ok=True)
        for split, n in (("train", 2000), ("val", 500)):
            shards.write_shard(str(folder / f"{split}_000000.bin"), np.arange(n) % 257, 257, tokenizer)
        (folder / "meta.json").write_text(json.dumps({"tokenizer": tokenizer, "vocab_size": 257}))
    write("byte")
    run(tmp_path / "out", f"--data={folder}", "--max_steps=1")
    write("another-bpe")  # the same vocabulary size, other tokens
    with pytest.raises(ValueError, match="--resume: the checkpoint was trained on .*'byte'.* holds .*'another-bpe'"):
        run(tmp_path / "out", f"--data={folder}", "--max_steps=2", "--resume")


def test_flops_per_token_counts_every_matmul_weight():
    cfg = ModelConfig(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, residual="delta")
    matrices = [p for n, p in Model(cfg).named_parameters() if p.dim() == 2 and not n.startswith("routers.")]
    weights = sum(p.numel() for p in matrices)  # the tied embedding is the head; routers' rows multiply no matrix
    assert runlog.flops_per_token(cfg, 128) == 6 * weights + 12 * 3 * 4 * 16 * 128


def test_a_fresh_run_refuses_another_runs_checkpoints(tmp_path):
    run(tmp_path, "--max_steps=2")
    with pytest.raises(FileExistsError, match="ckpt_0000002.pt.*--resume"):
        run(tmp_path, "--max_steps=2")


def test_resuming_a_finished_run_writes_nothing_new(tmp_path):
    run(tmp_path, "--max_steps=2")
    before = os.path.getmtime(checkpoint.checkpoint_paths(tmp_path)[-1])
    result = run(tmp_path, "--max_steps=2", "--resume")
    assert result["step"] == 2 and result["losses"] == []
    assert os.path.getmtime(checkpoint.checkpoint_paths(tmp_path)[-1]) == before


@pytest.mark.parametrize("vocab_size, command", [
    (151936, "(vocab_size=151936 is the qwen3 tokenizer's): `python data.py fineweb --tokenizer=qwen3 --out={d}`"),
    (50257, "(vocab_size=50257 is the gpt2 tokenizer's): `python data.py fineweb --tokenizer=gpt2 --out={d}`"),
    (257, "(vocab_size=257 is the byte-level corpus's): `python data.py shakespeare --out={d}`"),
    (32000, "with a tokenizer of at most vocab_size=32000 tokens, the model's (built in: byte: 257, gpt2: 50257, "
            "qwen3: 151936): `python data.py fineweb --tokenizer=PATH/tokenizer.json --out={d}`"),
])
def test_an_unprepared_data_folder_names_the_command_for_the_model_vocabulary(tmp_path, vocab_size, command):
    missing = tmp_path / "fineweb_edu"
    with pytest.raises(FileNotFoundError) as raised:
        run(tmp_path / "out", f"--data={missing}", f"--vocab_size={vocab_size}", "--max_steps=1")
    assert str(raised.value) == f"{missing}/meta.json not found: prepare {missing} first " + command.format(d=missing)
    assert isinstance(raised.value, cli.UserError)


def test_a_new_user_of_a_qwen3_config_is_told_to_prepare_qwen3_tokens(tmp_path):
    """`python train.py configs/1044m_delta_block.py` on a fresh machine: the hint fits the config's vocabulary."""
    missing = tmp_path / "fineweb_edu_qwen3"
    command = f"`python data.py fineweb --tokenizer=qwen3 --out={missing}`"
    with pytest.raises(FileNotFoundError, match=re.escape(command)):
        train.main(["configs/1044m_delta_block.py", f"--data={missing}", f"--out_dir={tmp_path / 'out'}",
                    "--device=cpu"])


def test_a_meta_json_that_disagrees_with_its_shards_is_an_error(tmp_path):
    """The shards' headers are the folder's one record of its tokenizer: a meta.json naming another one stops a
    fresh run and a resumed one."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for split, n in (("train", 2000), ("val", 500)):
        shards.write_shard(str(folder / f"{split}_000000.bin"), np.arange(n) % 257, 257, "byte")
    (folder / "meta.json").write_text(json.dumps({"tokenizer": "byte", "vocab_size": 257}))
    run(tmp_path / "out", f"--data={folder}", "--max_steps=1")
    (folder / "meta.json").write_text(json.dumps({"tokenizer": "gpt2", "vocab_size": 50257}))
    message = (r"meta.json names tokenizer 'gpt2' with vocab_size 50257 but train_000000.bin holds tokens of "
               r"'byte' with vocab_size 257")
    for out, resume in ((tmp_path / "fresh", []), (tmp_path / "out", ["--resume", "--max_steps=2"])):
        with pytest.raises(shards.DataError, match=message):
            run(out, f"--data={folder}", "--max_steps=1", *resume)
