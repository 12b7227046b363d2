"""trained.py: a model from a checkpoint file, a sharded folder or an out_dir, with clear errors for anything else.

Checkpoints are written in tmp_path with checkpoint.save_file from tiny models; the data folders are tiny
byte-token shards.
"""
import json
from dataclasses import asdict

import pytest
import torch

from infra import trained
from infra.config import TrainConfig
from tests.helpers import byte_data, routed_model, save


@pytest.mark.filterwarnings("ignore:.*has no checksum")
def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        trained.load_model(str(tmp_path / "missing.pt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without checkpoints"):
        trained.load_model(str(tmp_path / "empty"))
    (tmp_path / "text.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="not a checkpoint this project writes"):
        trained.load_model(str(tmp_path / "text.pt"))
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"unknown checkpoint format, missing keys \['model', 'model_config'\]"):
        trained.load_model(str(tmp_path / "other.pt"))


def test_out_dir_resolves_to_newest_checkpoint(tmp_path):
    directory = byte_data(tmp_path / "data")
    save(routed_model(seed=1), tmp_path, directory, step=5)
    newest = routed_model(seed=2)
    save(newest, tmp_path, directory, step=20)
    model, ckpt = trained.load_model(str(tmp_path))
    assert ckpt["path"].endswith("ckpt_0000020.pt")
    assert torch.equal(model.routers[0].query, newest.routers[0].query)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:.*has no checksum")
def test_sharded_checkpoint_directory_loads(tmp_path):
    """An FSDP run's sharded checkpoint (torch.distributed.checkpoint folder + meta.json) evaluates directly."""
    import torch.distributed.checkpoint as dcp
    directory = byte_data(tmp_path / "data")
    model = routed_model(seed=3)
    sharded = tmp_path / "run" / "ckpt_0000007"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(sharded), no_dist=True)
    meta = {"model_config": asdict(model.cfg), "step": 7,
            "train_config": asdict(TrainConfig(data=str(directory), seq_len=16))}
    (sharded / "meta.json").write_text(json.dumps(meta))
    for path in (sharded, tmp_path / "run"):  # the folder itself, or its out_dir
        loaded, ckpt = trained.load_model(str(path))
        assert ckpt["path"] == str(sharded)
        idx = torch.randint(0, 257, (1, 9))
        assert torch.equal(loaded(idx), model(idx))
