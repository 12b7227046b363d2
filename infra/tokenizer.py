"""Tokenizers: text to token ids and back. Every one has .name, .vocab_size, .eot, .encode(str),
.encode_batch(list[str]) and .decode(ids); `get_tokenizer` builds one by name.

The name is what token shards record (shards.py), so it identifies the vocabulary: "byte", "gpt2", "qwen3", or
for any other tokenizer.json the file's name with the first 16 hex digits of its SHA-256.
"""
from __future__ import annotations

import hashlib
import os

from infra import cli

QWEN3_REPO = "Qwen/Qwen3-0.6B"
QWEN3_VOCAB_SIZE = 151936  # Qwen3's embedding rows; its tokenizer defines fewer ids
BYTE_VOCAB_SIZE = 257      # 256 bytes + end of text
GPT2_VOCAB_SIZE = 50257
# The built-in tokenizers' vocabulary sizes, as their shards record them (shards.how_to_prepare reads it).
TOKENIZER_VOCAB_SIZES = {"byte": BYTE_VOCAB_SIZE, "gpt2": GPT2_VOCAB_SIZE, "qwen3": QWEN3_VOCAB_SIZE}
TOKENIZER_NAMES = tuple(TOKENIZER_VOCAB_SIZES)


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus one end-of-text token: no vocabulary file, so the default corpus is offline."""
    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
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
            raise cli.UsageError(f"tokenizer {name!r} has no <|endoftext|> token to mark document ends")
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
    """A tokenizer by name: "byte", "gpt2", "qwen3" (from `path` if given, else the hub), or a tokenizer.json
    (`path`, or the name itself; its name is then file_identity(path) unless another name is given)."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        with cli.downloading("the gpt2 encoding (tiktoken fetches it once, then keeps it in its cache)",
                             "run once with a network, or choose --tokenizer=byte"):
            return TiktokenTokenizer("gpt2")
    from tokenizers import Tokenizer
    file = path or (name if name.endswith(".json") else None)
    if file is not None and not os.path.isfile(file):
        raise cli.NotFoundError(f"tokenizer file {file} not found")
    if name == "qwen3":
        with cli.downloading(f"the qwen3 tokenizer ({QWEN3_REPO})", "give its tokenizer.json as --tokenizer_path"):
            tok = Tokenizer.from_file(path) if path else Tokenizer.from_pretrained(QWEN3_REPO)
        return HFTokenizer(tok, "qwen3", max(QWEN3_VOCAB_SIZE, model_vocab_size or 0))
    if file is not None:
        return HFTokenizer(Tokenizer.from_file(file), file_identity(file) if name == file else name, model_vocab_size)
    raise cli.UsageError(f"unknown tokenizer {name!r}: use one of {TOKENIZER_NAMES} or a path to a tokenizer.json")


def file_identity(path: str) -> str:
    """The name of a tokenizer known only by its file: the file name and the start of its SHA-256 (two
    copies of one tokenizer get the same name, two different tokenizers different ones, wherever they lie)."""
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return f"{os.path.basename(path)}:{digest[:16]}"


