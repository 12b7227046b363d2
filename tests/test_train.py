"""train.py on the embedded corpus: config handling, initial loss, overfitting, exact resume, clear errors."""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

import data
import train
from model import Model, ModelConfig

SMALL = ["--d_model=32", "--n_layers=2", "--n_blocks=2", "--n_heads=2", "--n_kv_heads=1", "--head_dim=16", "--d_ff=64",
         "--seq_len=32", "--batch_size=4", "--micro_batch_size=2", "--eval_batches=2", "--log_interval=1",
         "--eval_interval=1000", "--warmup_steps=2", "--lr=3e-3"]


def run(tmp_path, *extra):
    return train.main(["configs/tiny_delta_block.py", *SMALL, f"--out_dir={tmp_path}", *extra])


def test_config_file_and_overrides():
    model_cfg, cfg = train.load_config(["configs/tiny_delta_block.py", "--n_blocks=2", "--lr=1e-3",
                                        "--resume", "--block_source=paper"])
    assert (model_cfg.residual, model_cfg.n_blocks, model_cfg.block_source) == ("delta_block", 2, "paper")
    assert cfg.lr == 1e-3 and cfg.resume is True and cfg.max_steps == 600


@pytest.mark.parametrize("argv,error,message", [
    (["--n_blcks=2"], KeyError, "unknown config key 'n_blcks' \\(did you mean n_blocks"),
    (["--lr=fast"], ValueError, "--lr=fast: expected float"),
    (["--n_layers=2.5"], TypeError, "'n_layers' = 2.5: expected int"),
    (["--residual=deltablock"], ValueError, "allowed values are baseline"),
    (["configs/nope.py"], FileNotFoundError, "configs/nope.py"),
])
def test_config_errors(argv, error, message):
    with pytest.raises(error, match=message):
        train.load_config(argv)


def test_unknown_key_in_config_file(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("d_model = 64\nlearning_rate = 1e-3\n")
    with pytest.raises(KeyError, match="learning_rate"):
        train.load_config([str(path)])


def test_initial_loss_is_log_vocab():
    torch.manual_seed(0)
    model = Model(ModelConfig(residual="delta_block", n_blocks=4))
    loader = data.ShardLoader(train.data_dir(train.TrainConfig()), "train", 8, 64)
    x, y = loader.next_batch()
    assert abs(train.loss_fn(model, x, y).item() - math.log(257)) < 0.05


def test_one_batch_overfits():
    torch.manual_seed(0)
    model = Model(ModelConfig(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128,
                              residual="delta_block", n_blocks=2))
    cfg = train.TrainConfig(weight_decay=0.0)
    opt = torch.optim.AdamW(train.param_groups(model, cfg), lr=3e-3)
    x, y = data.ShardLoader(train.data_dir(cfg), "train", 4, 32).next_batch()
    for _ in range(150):
        loss = train.loss_fn(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = run(tmp_path / "a", "--max_steps=6", "--ckpt_interval=3")
    assert [os.path.basename(p) for p in train.checkpoint_paths(tmp_path / "a")] == \
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
    assert math.isclose(final["val_ppl"], math.exp(final["val_loss"]))
    ckpt = train.load_checkpoint(train.checkpoint_paths(tmp_path)[-1])
    assert ckpt["step"] == 4 and ckpt["model_config"]["residual"] == "delta_block"
    assert ckpt["train_config"]["out_dir"] == str(tmp_path)


def test_resume_with_a_different_model_is_an_error(tmp_path):
    run(tmp_path, "--max_steps=1")
    with pytest.raises(ValueError, match="differs from the checkpoint's in \\['n_blocks'\\]"):
        run(tmp_path, "--max_steps=2", "--resume", "--n_blocks=1")


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run(tmp_path, "--resume")


def test_corrupt_shard_is_a_clear_error(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    data.write_shard(str(shards / "train_000000.bin"), np.arange(1000) % 257, 257)
    data.write_shard(str(shards / "val_000000.bin"), np.arange(500) % 257, 257)
    (shards / "meta.json").write_text(json.dumps({"tokenizer": "byte", "vocab_size": 257}))
    with open(shards / "train_000000.bin", "r+b") as f:
        f.truncate(600)
    with pytest.raises(ValueError, match="train_000000.bin"):
        run(tmp_path / "out", f"--data={shards}", "--max_steps=1")


def test_vocab_mismatch_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="257"):
        run(tmp_path, "--vocab_size=200", "--max_steps=1")


def test_time_budget_stops_early(tmp_path):
    result = run(tmp_path, "--max_steps=100000", "--time_budget_s=2")
    assert result["step"] < 100000 and math.isfinite(result["val_loss"])


def test_global_batch_must_divide_over_ranks_and_micro_batches():
    cfg = train.TrainConfig(batch_size=8, micro_batch_size=2)
    assert [train.check_config(cfg, world) for world in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(ValueError, match="batch_size=8 is not a multiple of micro_batch_size=2 x world_size=3 = 6"):
        train.check_config(cfg, 3)
    with pytest.raises(ValueError, match="parallel='zero': allowed values are ddp, fsdp"):
        train.check_config(train.TrainConfig(parallel="zero"), 1)


def test_fsdp_on_one_process_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="parallel='fsdp' on a single process shards nothing"):
        run(tmp_path, "--parallel=fsdp", "--max_steps=1")


def test_wandb_not_installed_is_a_clear_error(tmp_path):
    try:
        import wandb  # noqa: F401
        pytest.skip("wandb is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="wandb=True but wandb is not installed"):
        run(tmp_path, "--wandb", "--max_steps=1")


def test_nan_loss_stops_keeps_the_last_good_checkpoint_and_names_the_step(tmp_path, monkeypatch):
    calls = []
    loss_fn = train.loss_fn

    def poisoned(model, x, y):  # two micro-batches per step: calls 5 and 6 are step 3
        calls.append(1)
        loss = loss_fn(model, x, y)
        return loss * float("nan") if len(calls) >= 5 else loss
    monkeypatch.setattr(train, "loss_fn", poisoned)
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 3; .*ckpt_0000002\.pt"):
        run(tmp_path, "--max_steps=5", "--ckpt_interval=2")
    assert [os.path.basename(p) for p in train.checkpoint_paths(tmp_path)] == ["ckpt_0000002.pt"]
    assert train.load_checkpoint(train.checkpoint_paths(tmp_path)[-1])["step"] == 2


def test_flops_per_token_counts_every_matmul_weight():
    cfg = ModelConfig(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, residual="delta")
    weights = sum(p.numel() for p in Model(cfg).parameters() if p.dim() == 2)  # the tied embedding is the head
    assert train.flops_per_token(cfg, 128) == 6 * weights + 12 * 3 * 4 * 16 * 128


def test_a_fresh_run_refuses_another_runs_checkpoints(tmp_path):
    run(tmp_path, "--max_steps=2")
    with pytest.raises(FileExistsError, match="ckpt_0000002.pt.*--resume"):
        run(tmp_path, "--max_steps=2")


def test_resuming_a_finished_run_writes_nothing_new(tmp_path):
    run(tmp_path, "--max_steps=2")
    before = os.path.getmtime(train.checkpoint_paths(tmp_path)[-1])
    result = run(tmp_path, "--max_steps=2", "--resume")
    assert result["step"] == 2 and result["losses"] == []
    assert os.path.getmtime(train.checkpoint_paths(tmp_path)[-1]) == before
