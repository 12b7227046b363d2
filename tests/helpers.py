"""What several test files build: tiny models with known behaviour, tiny byte-token data folders, checkpoints of
them, and a tiny tokenizer.json. Everything is made in the test's tmp_path; nothing is downloaded.

The "successor" model predicts the next byte with a known probability, so losses, task accuracies and
generations can be worked out by hand.
"""
import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from infra import checkpoint
from infra import shards
from infra.config import TrainConfig
from model import Model, ModelConfig

SUCCESSOR_LOGIT = 10.0


def tiny_config(residual: str = "delta_block", **kw) -> ModelConfig:
    return ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
                       residual=residual, n_blocks=2, **kw)


def routed_model(residual: str = "delta_block", seed: int = 0, **kw) -> Model:
    """A tiny model with random router queries and norm weights, so routing is far from uniform."""
    torch.manual_seed(seed)
    model = Model(tiny_config(residual, **kw))
    with torch.no_grad():
        for router in model.routers:
            router.query.normal_(std=2.0)
            router.norm_weight.uniform_(0.5, 1.5)
    return model.eval()


def successor_model() -> Model:
    """Logit SUCCESSOR_LOGIT for byte b + 1 after byte b, 0 for every other token, whatever came before.

    Sublayers write nothing (zero o_proj / down_proj), so the final norm sees the one-hot embedding of the
    current token scaled to rms 1, i.e. sqrt(d) at that token's coordinate; lm_head maps it to the logits.
    """
    d = 260
    model = Model(ModelConfig(vocab_size=257, d_model=d, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8, d_ff=8,
                              tie_embeddings=False))
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.embed_tokens.weight.zero_()
        model.embed_tokens.weight[:, :257] = torch.eye(257)
        model.lm_head.weight.zero_()
        model.lm_head.weight[1:, :256] = SUCCESSOR_LOGIT / math.sqrt(d) * torch.eye(256)
    return model.eval()


def write_data(directory: Path, val: np.ndarray, tokenizer: str = "byte", vocab_size: int = 257) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for split, tokens in (("train", val[::-1].copy()), ("val", val)):
        shards.write_shard(str(directory / f"{split}_000000.bin"), tokens, vocab_size, tokenizer)
    (directory / "meta.json").write_text(json.dumps({"tokenizer": tokenizer, "vocab_size": vocab_size}))
    return directory


def byte_data(directory: Path, n: int = 500, seed: int = 0) -> Path:
    """Random bytes with an end-of-text every 50 tokens."""
    tokens = np.random.default_rng(seed).integers(0, 256, size=n).astype(np.uint16)
    tokens[49::50] = 256
    return write_data(directory, tokens)


def save(model: Model, out_dir: Path, data_dir: Path, seq_len: int = 16, step: int = 1) -> str:
    """A checkpoint file of `model`, as train.py writes one, trained on `data_dir` with `seq_len`."""
    path = str(out_dir / f"ckpt_{step:07d}.pt")
    checkpoint.save_file(path, {"model": model.state_dict(), "model_config": asdict(model.cfg),
                                 "train_config": asdict(TrainConfig(data=str(data_dir), seq_len=seq_len)),
                                 "optimizer": {}, "loader": {}, "step": step})
    return path


def tiny_tokenizer_json(tmp_path: Path) -> str:
    """A byte-level BPE tokenizer.json of 300 tokens with <|endoftext|>, trained on three lines of Hamlet."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["to be or not to be", "that is the question", "whether 'tis nobler"], trainer)
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    return path
