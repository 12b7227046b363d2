"""shards.py: the shard format and its failure modes, meta.json and vocabulary checks, and the batch loader."""
import json
import os

import numpy as np
import pytest
import torch

from infra import shards


# ---------------------------------------------------------------------------------------------- shards

@pytest.mark.parametrize("vocab_size, dtype", [(257, np.uint16), (65536, np.uint16), (151936, np.uint32)])
def test_shard_round_trip(tmp_path, vocab_size, dtype):
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=1001)
    tokens[:2] = [0, vocab_size - 1]  # both ends of the range, above 65535 for Qwen3's vocabulary
    path = str(tmp_path / "s.bin")
    shards.write_shard(path, tokens, vocab_size, "qwen3")
    out = shards.read_shard(path)
    assert out.dtype == dtype and not out.flags.writeable
    np.testing.assert_array_equal(out, tokens)
    assert shards.shard_info(path) == {"tokenizer": "qwen3", "vocab_size": vocab_size}
    assert os.path.getsize(path) == 256 + tokens.size * np.dtype(dtype).itemsize
    assert os.listdir(tmp_path) == ["s.bin"]  # no temporary file left


def test_empty_shard(tmp_path):
    path = str(tmp_path / "s.bin")
    shards.write_shard(path, np.zeros(0, dtype=np.int64), 257, "byte")
    assert shards.read_shard(path).size == 0


@pytest.mark.parametrize("bad", [[0, 257], [-1, 3]])
def test_shard_rejects_out_of_range_tokens(tmp_path, bad):
    path = str(tmp_path / "s.bin")
    with pytest.raises(ValueError, match="257"):
        shards.write_shard(path, np.array(bad), 257, "byte")
    assert not os.path.exists(path)


def _good_shard(tmp_path) -> str:
    path = str(tmp_path / "s.bin")
    shards.write_shard(path, np.arange(100), 257, "byte")
    return path


def test_missing_shard(tmp_path):
    path = str(tmp_path / "nope.bin")
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        shards.read_shard(path)


def test_truncated_shard(tmp_path):
    path = _good_shard(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 2)
    with pytest.raises(ValueError, match=r"s\.bin.*truncated"):
        shards.read_shard(path)
    with open(path, "r+b") as f:
        f.truncate(100)  # not even a whole header
    with pytest.raises(ValueError, match=r"s\.bin.*header"):
        shards.read_shard(path)


@pytest.mark.parametrize("slot, value, message", [(0, 0x12345678, "magic"), (1, 7, "version"),
                                                  (2, 3, "dtype")])
def test_corrupt_header(tmp_path, slot, value, message):
    path = _good_shard(tmp_path)
    with open(path, "r+b") as f:
        f.seek(8 * slot)
        f.write(np.array([value], dtype="<i8").tobytes())
    with pytest.raises(ValueError, match=rf"s\.bin.*{message}"):
        shards.read_shard(path)


def test_out_of_range_token_id_fails_when_the_shard_is_opened(tmp_path):
    path = _good_shard(tmp_path)  # ids 0..99 of a 257-token vocabulary, uint16
    with open(path, "r+b") as f:
        f.seek(256 + 2 * 50)
        f.write(np.array([999], dtype="<u2").tobytes())
    with pytest.raises(ValueError, match=r"s\.bin: token id 999 at position 50 is outside the shard's vocabulary "
                                         r"\[0, 257\)"):
        shards.read_shard(path)


def test_shards_of_another_vocabulary_in_one_split_are_an_error(tmp_path):
    shards.write_shard(str(tmp_path / "train_000000.bin"), np.arange(100), 257, "byte")
    shards.write_shard(str(tmp_path / "train_000001.bin"), np.arange(100), 300, "other")
    with pytest.raises(ValueError, match="different vocabularies"):
        shards.ShardLoader(str(tmp_path), "train", batch_size=2, seq_len=8)
    os.remove(tmp_path / "train_000001.bin")
    loader = shards.ShardLoader(str(tmp_path), "train", batch_size=2, seq_len=8)
    assert loader.info == {"tokenizer": "byte", "vocab_size": 257}


def test_check_vocab():
    meta = {"tokenizer": "gpt2", "vocab_size": 50257}
    shards.check_vocab(meta, 50257)
    shards.check_vocab(meta, 50304)  # padded embedding
    with pytest.raises(ValueError, match=r"gpt2.*50257.*32000|gpt2.*32000.*50257"):
        shards.check_vocab(meta, 32000)


def test_load_meta_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python data.py shakespeare"):
        shards.load_meta(str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match=r"`python data.py fineweb --tokenizer=qwen3 --out=.*nothing`$"):
        shards.load_meta(str(tmp_path / "nothing"), model_vocab_size=151936)


@pytest.mark.parametrize("vocab_size, command", [
    (257, "python data.py shakespeare --out=d"), (50257, "python data.py fineweb --tokenizer=gpt2 --out=d"),
    (151936, "python data.py fineweb --tokenizer=qwen3 --out=d"),
    (50304, "python data.py fineweb --tokenizer=PATH/tokenizer.json --out=d"),
])
def test_how_to_prepare_fits_the_model_vocabulary(vocab_size, command):
    hint = shards.how_to_prepare("d", vocab_size)
    assert hint.endswith(f"`{command}`") and str(vocab_size) in hint


def test_meta_json_must_agree_with_the_shards(tmp_path):
    shards.write_shard(str(tmp_path / "train_000000.bin"), np.arange(100), 257, "byte")
    shards.write_shard(str(tmp_path / "val_000000.bin"), np.arange(100), 257, "byte")
    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": "byte", "vocab_size": 257}))
    assert shards.load_meta(str(tmp_path)) == {"tokenizer": "byte", "vocab_size": 257}
    for meta in ({"tokenizer": "qwen3", "vocab_size": 257}, {"tokenizer": "byte", "vocab_size": 300}):
        (tmp_path / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(shards.DataError, match=rf"meta.json names tokenizer '{meta['tokenizer']}' with "
                                                   rf"vocab_size {meta['vocab_size']} but train_000000.bin holds "
                                                   r"tokens of 'byte' with vocab_size 257"):
            shards.load_meta(str(tmp_path))


# ---------------------------------------------------------------------------------------------- loader

T = 8


@pytest.fixture
def two_shards(tmp_path) -> str:
    # Tokens number their own position, with a jump between shards, so a batch row tells which window it
    # is (x[0] // T) and a window that crossed the shard boundary would break y == x + 1.
    shards.write_shard(str(tmp_path / "train_000000.bin"), np.arange(0, 8 * T + 1), 65536, "byte")  # 8 windows
    shards.write_shard(str(tmp_path / "train_000001.bin"), np.arange(1000, 1000 + 4 * T + 5), 65536,
                       "byte")  # 4 windows
    shards.write_shard(str(tmp_path / "val_000000.bin"), np.arange(2 * T + 1), 65536, "byte")  # 2 windows
    return str(tmp_path)


def _batches(loader: shards.ShardLoader, n: int) -> list[torch.Tensor]:
    return [loader.next_batch() for _ in range(n)]


def test_loader_shift_and_windows(two_shards):
    loader = shards.ShardLoader(two_shards, "train", batch_size=3, seq_len=T, shuffle=False)
    assert loader.n_windows == 12
    starts = []
    for x, y in _batches(loader, 4):
        assert x.shape == y.shape == (3, T) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)
        starts += x[:, 0].tolist()
    assert starts == [0, 8, 16, 24, 32, 40, 48, 56, 1000, 1008, 1016, 1024]


def test_loader_deterministic_shuffle(two_shards):
    def starts(seed):
        loader = shards.ShardLoader(two_shards, "train", batch_size=4, seq_len=T, seed=seed)
        return [x[:, 0].tolist() for x, _ in _batches(loader, 3)]
    assert starts(0) == starts(0)
    assert starts(0) != starts(1)
    assert sorted(sum(starts(0), [])) == sorted(list(range(0, 64, 8)) + list(range(1000, 1032, 8)))


def test_loader_epoch_rollover(two_shards):
    loader = shards.ShardLoader(two_shards, "train", batch_size=5, seq_len=T)  # 2 batches per epoch, 2 left over
    epoch0 = torch.cat([x for x, _ in _batches(loader, 2)])
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 0
    assert len(set(epoch0[:, 0].tolist())) == 10
    epoch1 = torch.cat([x for x, _ in _batches(loader, 2)])
    assert not torch.equal(epoch0, epoch1)  # a fresh permutation
    loader.reset()
    assert torch.equal(torch.cat([x for x, _ in _batches(loader, 2)]), epoch0)


def test_loader_resume(two_shards):
    loader = shards.ShardLoader(two_shards, "train", batch_size=3, seq_len=T, seed=7)
    _batches(loader, 5)  # into the second epoch
    state = json.loads(json.dumps(loader.state_dict()))  # a checkpoint stores it as plain data
    expected = _batches(loader, 5)
    resumed = shards.ShardLoader(two_shards, "train", batch_size=3, seq_len=T, seed=0)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, _batches(resumed, 5)):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    with pytest.raises(ValueError, match="step_batch"):
        shards.ShardLoader(two_shards, "train", batch_size=2, seq_len=T).load_state_dict(state)


def test_loader_step_batch_ends_epochs_on_whole_steps(two_shards):
    # 12 windows hold one step of 8: the epoch ends after its 2 micro-batches of 4, not after 3.
    loader = shards.ShardLoader(two_shards, "train", batch_size=4, seq_len=T, step_batch=8)
    assert loader.batches_per_epoch == 2
    _batches(loader, 2)
    assert loader.state_dict()["epoch"] == 1
    with pytest.raises(ValueError, match="step_batch=6 is not a multiple of batch_size x world_size = 4 x 1"):
        shards.ShardLoader(two_shards, "train", batch_size=4, seq_len=T, step_batch=6)


def test_loader_resumes_under_another_world_size(two_shards):
    # Saved by one process reading steps of 4 as micro-batches of 2; resumed by 2 ranks with micro-batch 1.
    single = shards.ShardLoader(two_shards, "train", batch_size=2, seq_len=T, seed=5, step_batch=4)
    _batches(single, 4)
    state = single.state_dict()
    expected = torch.cat([x for x, _ in _batches(single, 6)])
    ranks = [shards.ShardLoader(two_shards, "train", batch_size=1, seq_len=T, seed=5, rank=r, world_size=2,
                              step_batch=4) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    rows = torch.cat([torch.cat([r.next_batch()[0] for r in ranks]) for _ in range(6)])
    assert torch.equal(rows, expected)
    odd = shards.ShardLoader(two_shards, "train", batch_size=2, seq_len=T, step_batch=4)
    odd.next_batch()
    with pytest.raises(ValueError, match="resume at a step boundary"):
        shards.ShardLoader(two_shards, "train", batch_size=4, seq_len=T, step_batch=4).load_state_dict(odd.state_dict())


def test_loader_ranks_split_the_global_batch(two_shards):
    single = shards.ShardLoader(two_shards, "train", batch_size=4, seq_len=T, seed=3)
    ranks = [shards.ShardLoader(two_shards, "train", batch_size=2, seq_len=T, seed=3, rank=r, world_size=2)
             for r in range(2)]
    seen = []
    for _ in range(4):  # crosses an epoch: 12 windows hold 3 global batches of 4
        x, y = single.next_batch()
        (x0, y0), (x1, y1) = (r.next_batch() for r in ranks)
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        seen.append(set(x0[:, 0].tolist()) | set(x1[:, 0].tolist()))
        assert set(x0[:, 0].tolist()).isdisjoint(x1[:, 0].tolist())
        assert set(ranks[0].last_ids.tolist()).isdisjoint(ranks[1].last_ids.tolist())
    assert len(set.union(*seen[:3])) == 12  # within an epoch no window is read twice, by any rank


def test_loader_errors(two_shards):
    with pytest.raises(ValueError, match="2 windows"):
        shards.ShardLoader(two_shards, "val", batch_size=2, seq_len=T, world_size=2)
    with pytest.raises(ValueError, match="rank 2"):
        shards.ShardLoader(two_shards, "train", batch_size=1, seq_len=T, rank=2, world_size=2)
    with pytest.raises(FileNotFoundError, match=r"test_\*\.bin"):
        shards.ShardLoader(two_shards, "test", batch_size=1, seq_len=T)
