"""eval.py: perplexity by hand, on the run's data, a shard folder or a text file, and of a Hugging Face folder.

Checkpoints are written in tmp_path with checkpoint.save_file from tiny models; the data folders are tiny
byte-token shards.
"""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import eval as ev
from infra import shards
from infra.hf_qwen3 import save_hf_qwen3
from model import Model
from tests.helpers import (SUCCESSOR_LOGIT, byte_data, routed_model, save, successor_model, tiny_config,
                           write_data)


def test_data_with_another_vocabulary_is_rejected(tmp_path):
    path = save(routed_model(), tmp_path, byte_data(tmp_path / "data"))
    other = np.arange(100, dtype=np.uint16)
    gpt2 = write_data(tmp_path / "gpt2", other, tokenizer="gpt2", vocab_size=50257)
    with pytest.raises(ValueError, match="'gpt2' but the model was trained on 'byte' tokens"):
        ev.main([path, f"--data={gpt2}"])
    wide = write_data(tmp_path / "wide", other, vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size 300 but the model's vocab_size is 257"):
        ev.main([path, f"--data={wide}"])


# --------------------------------------------------------------------------------------------- perplexity

def test_perplexity_is_exp_of_hand_computed_mean_token_loss(tmp_path):
    seq_len = 16
    directory = byte_data(tmp_path / "data", n=3 * seq_len + 6)   # three full windows and a short one
    model = routed_model()
    path = save(model, tmp_path, directory, seq_len=seq_len)
    result = ev.main([path, "--batch_size=2"])[path]["perplexity"]

    tokens = shards.read_shard(str(directory / "val_000000.bin")).astype(np.int64)
    nll, n_bytes = [], 0
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, seq_len):
            window = tokens[start:start + seq_len + 1].tolist()
            logp = model(torch.tensor([window[:-1]]))[0].log_softmax(-1)
            nll += [-logp[i, window[i + 1]].item() for i in range(len(window) - 1)]
            n_bytes += sum(t < 256 for t in window[1:])
    assert result["tokens"] == len(tokens) - 1 == len(nll)
    assert result["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(sum(nll) / math.log(2) / n_bytes, rel=1e-5)
    saved = json.loads(Path(path[:-len(".pt")] + ".eval.json").read_text())
    assert saved["perplexity"]["ppl"] == result["ppl"]


def test_perplexity_on_a_text_file(tmp_path):
    path = save(successor_model(), tmp_path, byte_data(tmp_path / "data"), seq_len=8)
    text = tmp_path / "alphabet.txt"
    text.write_text("abcdefghijklmnopqrstuvwxyz")
    result = ev.main([path, f"--data={text}"])[path]["perplexity"]
    # Every one of the 25 targets is the successor of its input byte: p = e^10 / (e^10 + 256).
    p = math.exp(SUCCESSOR_LOGIT) / (math.exp(SUCCESSOR_LOGIT) + 256)
    assert result["tokens"] == 25
    assert result["loss"] == pytest.approx(-math.log(p), rel=1e-2)


def test_hugging_face_folder_evaluates_like_its_checkpoint(tmp_path):
    directory = byte_data(tmp_path / "data", n=200)
    torch.manual_seed(0)
    model = Model(tiny_config("baseline")).eval()
    path = save(model, tmp_path, directory, seq_len=16)
    save_hf_qwen3(model, str(tmp_path / "hf"))
    from_ckpt = ev.main([path, f"--data={directory}", "--seq_len=16"])[path]["perplexity"]
    from_hf = ev.main([str(tmp_path / "hf"), f"--data={directory}", "--seq_len=16"])[str(tmp_path / "hf")]
    assert from_hf["perplexity"]["loss"] == pytest.approx(from_ckpt["loss"], rel=1e-6)
    assert (tmp_path / "hf" / "eval.json").exists()
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        ev.main([str(tmp_path / "hf"), "--sample", "a"])
