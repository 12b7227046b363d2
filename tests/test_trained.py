"""trained.py: a model from a checkpoint file, a sharded folder or an out_dir, with clear errors for anything else.

Checkpoints are written in tmp_path with checkpoint.save_file from tiny models; the data folders are tiny
byte-token shards.
"""
import json
from dataclasses import asdict

import pytest
import torch

from infra import checkpoint
from infra import cli
from infra import distributed
from infra import trained
from infra.config import ConfigError, TrainConfig
from tests.helpers import byte_data, routed_model, save


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        trained.load_model(str(tmp_path / "missing.pt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without checkpoints"):
        trained.load_model(str(tmp_path / "empty"))
    (tmp_path / "text.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="not a checkpoint this project writes"):
        trained.load_model(str(tmp_path / "text.pt"))
    torch.save({"model": {}, "model_config": {}}, tmp_path / "unchecked.pt")
    with pytest.raises(checkpoint.CheckpointError, match="unchecked.pt is not a checkpoint this project writes: it "
                                                         "has no checksum"):
        trained.load_model(str(tmp_path / "unchecked.pt"))
    checkpoint.save_file(str(tmp_path / "other.pt"), {"state_dict": {}})
    with pytest.raises(ValueError, match=r"unknown checkpoint format, missing keys \['model', 'model_config'\]"):
        trained.load_model(str(tmp_path / "other.pt"))


def test_a_model_config_that_model_py_refuses_is_a_user_error(tmp_path):
    path = save(routed_model(), tmp_path, byte_data(tmp_path / "data"))
    ckpt = checkpoint.load_checkpoint(path)
    checkpoint.save_file(path, {**ckpt, "model_config": {**ckpt["model_config"], "n_blocks": 5}})
    with pytest.raises(ConfigError, match=rf"^{path}: model_config: n_blocks=5: allowed values are 1..n_layers=2"):
        trained.load_model(path)


def test_out_dir_resolves_to_newest_checkpoint(tmp_path):
    directory = byte_data(tmp_path / "data")
    save(routed_model(seed=1), tmp_path, directory, step=5)
    newest = routed_model(seed=2)
    save(newest, tmp_path, directory, step=20)
    model, ckpt = trained.load_model(str(tmp_path))
    assert ckpt["path"].endswith("ckpt_0000020.pt")
    assert torch.equal(model.routers[0].query, newest.routers[0].query)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_checkpoint_directory_loads(tmp_path):
    """An FSDP run's sharded checkpoint (torch.distributed.checkpoint folder + meta.json) evaluates directly."""
    directory = byte_data(tmp_path / "data")
    model = routed_model(seed=3)
    sharded = tmp_path / "run" / "ckpt_0000007"
    meta = {"model_config": asdict(model.cfg), "step": 7,
            "train_config": asdict(TrainConfig(data=str(directory), seq_len=16))}
    ctx = distributed.Context(0, 1, torch.device("cpu"), owns_group=False)
    checkpoint.save_folder(ctx, {"model": model.state_dict(), "optimizer": {"param_groups": [{"lr": 0.1}]}},
                           str(sharded), meta)
    assert checkpoint.load_checkpoint(str(sharded))["optimizer"] == {"param_groups": [{"lr": 0.1}]}
    for path in (sharded, tmp_path / "run"):  # the folder itself, or its out_dir
        loaded, ckpt = trained.load_model(str(path))
        assert ckpt["path"] == str(sharded)
        idx = torch.randint(0, 257, (1, 9))
        assert torch.equal(loaded(idx), model(idx))


def test_a_sharded_folder_without_checksums_is_refused(tmp_path):
    unsigned = tmp_path / "ckpt_0000001"
    unsigned.mkdir()
    (unsigned / "meta.json").write_text(json.dumps({"model_config": asdict(routed_model().cfg), "step": 1}))
    with pytest.raises(cli.UserError, match="ckpt_0000001 is not a sharded checkpoint this project writes: its "
                                            "meta.json has no checksum"):
        trained.load_model(str(unsigned))
