"""checkpoint.py and files.py: hostile files are never unpickled, damage is detected and skipped, non-finite
weights are never written, writes are synced before the rename, and JSON errors name their file."""
import json
import os
from dataclasses import asdict

import pytest
import torch

from infra import checkpoint
from infra import cli
from infra import distributed
from infra import files
import finetune
import sample
from infra import shards
import train
from infra import trained
from infra.hf_qwen3 import load_hf_qwen3
from model import Model, ModelConfig

SMALL = ["--d_model=32", "--n_layers=2", "--n_blocks=2", "--n_heads=2", "--n_kv_heads=1", "--head_dim=16", "--d_ff=64",
         "--seq_len=32", "--batch_size=4", "--eval_batches=2", "--log_interval=1", "--eval_interval=1000"]


def run(out_dir, *extra) -> dict:
    return train.main(["configs/tiny_delta_block.py", *SMALL, f"--out_dir={out_dir}", *extra])


class Payload:
    """Unpickling this object calls exec, which writes the file `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('the payload ran')",)


def test_a_malicious_pickle_never_runs(tmp_path):
    marker = tmp_path / "payload_ran"
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    path = str(out_dir / "ckpt_0000001.pt")
    torch.save({"model": Payload(str(marker)), "model_config": {}, "step": 1}, path)
    with pytest.raises(checkpoint.CheckpointError, match=r"holds more than tensors and plain data \(Unsupported "
                                                         r"global: GLOBAL exec was not an allowed global by "
                                                         r"default\), and such a file can run code"):
        checkpoint.load_checkpoint(path)
    for load in (lambda: trained.load_model(path), lambda: trained.load_model(str(out_dir)),
                 lambda: sample.main([path]), lambda: finetune.main(["export", path, str(tmp_path / "hf")]),
                 lambda: run(out_dir, "--resume", "--max_steps=2")):
        with pytest.raises(checkpoint.CheckpointError):
            load()
    assert not marker.exists()


def flip_inside_a_tensor(path: str, tensor: torch.Tensor) -> None:
    """Flip one byte in the middle of `tensor`'s stored bytes in the file."""
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    at = raw.find(tensor.numpy().tobytes()[:64])
    assert at > 0
    raw[at + 32] ^= 0x10
    with open(path, "wb") as f:
        f.write(raw)


def test_a_flipped_byte_is_detected_and_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, capsys):
    out_dir = tmp_path / "run"
    run(out_dir, "--max_steps=2", "--ckpt_interval=1")
    older, newest = checkpoint.checkpoint_paths(out_dir)
    flip_inside_a_tensor(newest, checkpoint.load_checkpoint(newest)["model"]["embed_tokens.weight"])
    with pytest.raises(checkpoint.CheckpointError, match="ckpt_0000002.pt is damaged: its content does not match"):
        checkpoint.load_checkpoint(newest)
    assert checkpoint.newest_intact(str(out_dir))[0] == older
    resumed = run(out_dir, "--resume", "--max_steps=3")
    assert resumed["step"] == 3 and len(resumed["losses"]) == 2  # steps 2 and 3, from the step-1 checkpoint
    assert "skipping an unusable checkpoint: " in capsys.readouterr().err
    # the damaged one is set aside, not deleted, and no longer counts among the kept checkpoints
    assert sorted(os.listdir(out_dir)) == ["ckpt_0000001.pt", "ckpt_0000002.pt.unusable", "ckpt_0000003.pt",
                                           "log.jsonl", "run.lock"]


def test_non_finite_weights_are_never_written(tmp_path):
    model = Model(ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64))
    optimizer = torch.optim.AdamW(model.parameters())
    with torch.no_grad():
        model.norm.weight[3] = float("inf")
    ctx = distributed.Context(0, 1, torch.device("cpu"), owns_group=False)
    with pytest.raises(FloatingPointError, match="NaN or inf: .*ckpt_0000001.pt was not written"):
        checkpoint.save(ctx, model, optimizer, str(tmp_path / "ckpt_0000001"), {"step": 1})
    assert os.listdir(tmp_path) == []


def test_a_save_is_synced_before_its_rename_and_a_failed_one_leaves_the_old_file(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt_0000001.pt")
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda src, dst: events.append(("rename", str(dst))) or replace(src, dst))
    checkpoint.save_file(path, {"model": {"w": torch.ones(3)}, "step": 1})
    (_, synced), rename, dir_synced = events
    assert synced.startswith(path) and synced.endswith(".tmp")
    assert rename == ("rename", path) and dir_synced == ("fsync", str(tmp_path))

    def crash(tmp):
        with open(tmp, "w") as f:
            f.write("half a checkpoint")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        files.atomic_write(path, crash)
    assert os.listdir(tmp_path) == ["ckpt_0000001.pt"] and checkpoint.load_checkpoint(path)["step"] == 1


def test_json_errors_name_the_file(tmp_path):
    (tmp_path / "meta.json").write_text('{"tokenizer": "byte", ')
    with pytest.raises(ValueError, match=rf"{tmp_path}/meta.json is not valid JSON"):
        shards.load_meta(str(tmp_path))
    sharded = tmp_path / "ckpt_0000003"
    sharded.mkdir()
    (sharded / "meta.json").write_text("not json")
    with pytest.raises(ValueError, match=rf"{sharded}/meta.json is not valid JSON"):
        trained.load_model(str(sharded))
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match=rf"{tmp_path}/config.json is not valid JSON"):
        load_hf_qwen3(str(tmp_path))


def test_a_file_round_trips_with_its_checksum(tmp_path):
    model = Model(ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64))
    state = {"model": model.state_dict(), "model_config": asdict(model.cfg), "step": 7, "betas": (0.9, 0.95)}
    path = str(tmp_path / "ckpt_0000007.pt")
    checkpoint.save_file(path, state)
    assert torch.load(path, weights_only=True)["checksum"] == checkpoint.checksum(state)
    loaded = checkpoint.load_checkpoint(path)
    assert set(loaded) == set(state) and loaded["betas"] == (0.9, 0.95)
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    assert checkpoint.checksum({**state, "step": 8}) != checkpoint.checksum(state)
    assert json.dumps(loaded["model_config"]) == json.dumps(state["model_config"])


def test_a_file_without_a_checksum_is_refused_and_skipped(tmp_path, capsys):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    checkpoint.save_file(str(out_dir / "ckpt_0000001.pt"), {"model": {"w": torch.ones(2)}, "step": 1})
    torch.save({"model": {"w": torch.ones(2)}, "step": 2}, out_dir / "ckpt_0000002.pt")  # not written by save_file
    with pytest.raises(checkpoint.CheckpointError, match="ckpt_0000002.pt is not a checkpoint this project writes: "
                                                         "it has no checksum"):
        checkpoint.load_checkpoint(str(out_dir / "ckpt_0000002.pt"))
    assert checkpoint.newest_intact(str(out_dir))[0] == str(out_dir / "ckpt_0000001.pt")
    assert "skipping an unusable checkpoint" in capsys.readouterr().err


def test_a_checkpoint_with_a_module_per_router_loads_its_weights_and_refuses_to_resume(tmp_path):
    """Checkpoints from when each router was a module of its own (routers.0.query, ...): their rows are stacked
    into the routers' parameters on load; resuming their per-tensor optimizer state is refused by name."""
    out_dir = tmp_path / "out"
    run(out_dir, "--max_steps=1")
    path = checkpoint.checkpoint_paths(str(out_dir))[-1]
    state = checkpoint.load_checkpoint(path)
    stacked = {k: v for k, v in state["model"].items() if k.startswith("routers.")}
    assert stacked and all(v.dim() == 2 for v in stacked.values())
    for key, value in stacked.items():
        del state["model"][key]
        kind = key.removeprefix("routers.")
        state["model"].update({f"routers.{i}.{kind}": row.clone() for i, row in enumerate(value)})
    checkpoint.save_file(path, state)
    model, _ = trained.load_model(path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in stacked.items())
    with pytest.raises(checkpoint.CheckpointError, match=r"written when each router was a module of its own "
                                                         r"\(routers.0.query, ...\): its weights load"):
        run(out_dir, "--max_steps=2", "--resume")


def test_the_consolidate_command_names_its_usage(tmp_path):
    with pytest.raises(cli.UsageError, match=r"^usage: python -m infra.checkpoint consolidate CKPT_DIR \[OUT.pt\]$"):
        checkpoint.main(["merge", str(tmp_path)])
    with pytest.raises(cli.NotFoundError, match="is not a sharded checkpoint folder"):
        checkpoint.main(["consolidate", str(tmp_path / "ckpt_0000001")])
