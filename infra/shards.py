"""Token shards: the on-disk format, the data folder's meta.json, and the training batch loader.

A data folder holds `{split}_{k:06d}.bin` shards and a `meta.json` (`python data.py` prepares them, through
corpus.py). A shard is a 256-byte little-endian header followed by the tokens as uint16 or uint32. The header
is 6 int64 (magic, version, dtype code, token count, vocab size, length of the tokenizer name), the
tokenizer's name in UTF-8, then zeros; version 1 shards have no name. Opening a shard checks the header
against the file size and every token id against the vocabulary (one pass over the memory map). `ShardLoader`
reads windows of T+1 tokens at stride T (consecutive windows share one token) from the shards of one split and
deals them out to DDP ranks.

The shards' headers are the one record of a folder's tokenizer and vocabulary: load_meta refuses a meta.json
that names others. Damaged shards, and data that does not fit the run, raise DataError (a cli.UserError).
"""
import glob
import json
import os

import numpy as np
import torch

from infra import cli
from infra import files
from infra.tokenizer import TOKENIZER_VOCAB_SIZES

MAGIC = int.from_bytes(b"DARS", "little")  # a shard file starts with the bytes "DARS"
VERSION = 2
HEADER_INTS = 6
HEADER_BYTES = 256
MAX_NAME_BYTES = HEADER_BYTES - HEADER_INTS * 8
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}  # dtype code = bytes per token


class DataError(cli.UserError, ValueError):
    """Token data that cannot be used: a damaged shard, a folder whose parts disagree, or data that does not fit
    the model or the run (its vocabulary, its length, a resumed run's position)."""


# ----------------------------------------------------------------------------------------------------------
# Shards

def write_shard(path: str, tokens: np.ndarray, vocab_size: int, tokenizer: str) -> None:
    """Write 1-D `tokens` of `tokenizer` (its name) with a header; uint16 when the vocabulary fits, else uint32.
    Atomic (files.atomic_write): a crash never leaves a shard that reads as valid but short."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"{path}: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    name = tokenizer.encode("utf-8")
    if not 0 < len(name) <= MAX_NAME_BYTES:
        raise ValueError(f"{path}: tokenizer name {tokenizer!r} must have 1..{MAX_NAME_BYTES} bytes in UTF-8")
    dtype = DTYPES[2] if vocab_size <= 2**16 else DTYPES[4]
    header = np.array([MAGIC, VERSION, dtype.itemsize, tokens.size, vocab_size, len(name)], dtype="<i8")

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(header.tobytes() + name.ljust(MAX_NAME_BYTES, b"\0"))
            tokens.astype(dtype, copy=False).tofile(f)
    files.atomic_write(path, write)


def read_header(path: str) -> dict:
    """A shard's header, checked against the file's size: dtype, n_tokens, vocab_size, tokenizer (None for
    version 1)."""
    if not os.path.exists(path):
        raise cli.NotFoundError(f"token shard {path} does not exist")
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise DataError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header (corrupt?)")
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    magic, version, code, n_tokens, vocab_size, name_bytes = (int(v) for v in np.frombuffer(raw, "<i8", HEADER_INTS))
    if magic != MAGIC:
        raise DataError(f"{path}: not a token shard (magic {magic:#x}, expected {MAGIC:#x})")
    if version not in (1, VERSION):
        raise DataError(f"{path}: unknown shard version {version} (this code reads versions 1 and {VERSION})")
    if code not in DTYPES:
        raise DataError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
    if vocab_size < 1 or not 0 <= (name_bytes if version > 1 else 0) <= MAX_NAME_BYTES:
        raise DataError(f"{path}: corrupt header (vocab size {vocab_size}, tokenizer name of {name_bytes} bytes)")
    expected = HEADER_BYTES + n_tokens * code
    if size != expected:
        raise DataError(f"{path}: header says {n_tokens} tokens ({expected} bytes) but the file has {size} "
                        f"bytes (truncated or corrupt)")
    name = raw[HEADER_INTS * 8:HEADER_INTS * 8 + name_bytes].decode("utf-8", "replace") if version > 1 else None
    return {"dtype": DTYPES[code], "n_tokens": n_tokens, "vocab_size": vocab_size, "tokenizer": name}


def read_shard(path: str) -> np.ndarray:
    """The tokens of a validated shard as a read-only memmap. Every id is checked against the shard's
    vocabulary here, so a damaged shard fails when it is opened, not at some later step."""
    h = read_header(path)
    if h["n_tokens"] == 0:  # mmap cannot map zero bytes
        return np.zeros(0, dtype=h["dtype"])
    tokens = np.memmap(path, dtype=h["dtype"], mode="r", offset=HEADER_BYTES, shape=(h["n_tokens"],))
    if h["vocab_size"] <= np.iinfo(h["dtype"]).max and int(tokens.max()) >= h["vocab_size"]:
        at = int(np.argmax(tokens >= h["vocab_size"]))
        raise DataError(f"{path}: token id {int(tokens[at])} at position {at} is outside the shard's vocabulary "
                        f"[0, {h['vocab_size']}) (a damaged shard, or one written by other code)")
    return tokens


def shard_info(path: str) -> dict:
    """The vocabulary a shard's ids index: {"tokenizer": name (None for version 1), "vocab_size": ...}."""
    h = read_header(path)
    return {"tokenizer": h["tokenizer"], "vocab_size": h["vocab_size"]}


def load_meta(data_dir: str, model_vocab_size: int | None = None) -> dict:
    """The data folder's meta.json (tokenizer, vocab_size, what was prepared), checked against its shards'
    headers. A folder without one fails with the command that prepares it for a model of model_vocab_size."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        hint = how_to_prepare(data_dir, model_vocab_size)
        raise cli.NotFoundError(f"{path} not found: prepare {data_dir} first {hint}")
    meta = files.read_json(path)
    for shard in sorted(glob.glob(os.path.join(data_dir, "*_[0-9]*.bin"))):
        info = shard_info(shard)  # version 1 shards record no tokenizer, only the vocabulary
        if info["vocab_size"] != meta.get("vocab_size") or info["tokenizer"] not in (None, meta.get("tokenizer")):
            raise DataError(f"{data_dir}: meta.json names tokenizer {meta.get('tokenizer')!r} with vocab_size "
                            f"{meta.get('vocab_size')} but {os.path.basename(shard)} holds tokens of "
                            f"{info['tokenizer']!r} with vocab_size {info['vocab_size']}: the folder mixes two "
                            "preparations: prepare it again")
    return meta


def how_to_prepare(data_dir: str, vocab_size: int | None) -> str:
    """How to prepare data_dir for a model of vocab_size (None: not known), as the rest of a sentence."""
    builtin = ", ".join(f"{name}: {size}" for name, size in TOKENIZER_VOCAB_SIZES.items())
    name = next((name for name, size in TOKENIZER_VOCAB_SIZES.items() if size == vocab_size), None)
    if vocab_size is None:
        return (f"e.g. `python data.py shakespeare --out={data_dir}` (byte-level, vocab_size 257) or "
                f"`python data.py fineweb --tokenizer=qwen3 --out={data_dir}` (vocab_size 151936)")
    if name == "byte":
        return f"(vocab_size={vocab_size} is the byte-level corpus's): `python data.py shakespeare --out={data_dir}`"
    if name is not None:
        return (f"(vocab_size={vocab_size} is the {name} tokenizer's): "
                f"`python data.py fineweb --tokenizer={name} --out={data_dir}`")
    return (f"with a tokenizer of at most vocab_size={vocab_size} tokens, the model's (built in: {builtin}): "
            f"`python data.py fineweb --tokenizer=PATH/tokenizer.json --out={data_dir}`")


def check_vocab(meta: dict, model_vocab_size: int) -> None:
    """Tokens must index inside the embedding; a larger (padded) model vocabulary is fine. meta: a data
    folder's meta.json or a loader's `info` (tokenizer and vocab_size)."""
    if meta["vocab_size"] > model_vocab_size:
        raise DataError(f"data tokenizer {meta['tokenizer']!r} has vocab_size {meta['vocab_size']} but the model's "
                        f"vocab_size is {model_vocab_size}: token ids would index past the embedding")


# ----------------------------------------------------------------------------------------------------------
# Batches

def windows(tokens: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Windows of up to seq_len + 1 tokens, consecutive ones sharing one token: each token but the first is a
    target exactly once. ShardLoader reads the same windows, bar the last, which may be shorter."""
    return [tokens[s:s + seq_len + 1] for s in range(0, len(tokens) - 1, seq_len)]


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
            raise cli.NotFoundError(f"no token shards match {pattern}")
        self.shards = [read_shard(p) for p in paths]
        infos = {json.dumps(shard_info(p)) for p in paths}
        if len(infos) > 1:
            raise DataError(f"the {split} shards in {data_dir} come from different vocabularies: {sorted(infos)}")
        self.info = json.loads(infos.pop())  # {"tokenizer", "vocab_size"} of the shards
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.seed, self.shuffle, self.step_batch = seed, shuffle, step_batch
        windows = np.array([max(0, (len(s) - 1) // seq_len) for s in self.shards])
        self.first_window = np.concatenate([[0], np.cumsum(windows)])  # window id where each shard begins
        self.n_windows = int(self.first_window[-1])
        if self.n_windows < step_batch:
            steps = f" x {step_batch // global_batch} micro-batches" if step_batch > global_batch else ""
            raise DataError(f"split {split!r} in {data_dir} has {self.n_windows} windows of {seq_len + 1} tokens, "
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
                raise DataError(f"loader state has {key}={state[key]} but this loader has {key}={mine}")
        global_batch = self.B * self.world_size
        if state["position"] % global_batch:
            raise DataError(f"loader state is at window {state['position']} of its epoch, inside a batch of "
                            f"{self.B} x {self.world_size} ranks: resume at a step boundary")
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["position"] // global_batch
        self._order_epoch = None
