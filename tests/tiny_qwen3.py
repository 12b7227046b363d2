"""Tiny Hugging Face Qwen3 checkpoints for the tests of hf_qwen3.py and finetune.py: random Qwen3ForCausalLM
models written by transformers into temporary folders, with a tokenizer trained on generated text; nothing is
downloaded. Importing this module skips the importing tests where transformers is not installed.
"""
import json
import random
import shutil

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

transformers = pytest.importorskip("transformers")

HF_TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24, rope_theta=10000.0, rms_norm_eps=1e-6)  # head_dim != 64/4
WORDS = ("the a river stone light quiet over under runs falls slowly bright cold old green hill "
         "and of to in is was wind rain sea field").split()
# The released Qwen3-0.6B config.json (the fields that matter), to check the paper configs against it.
QWEN3_0P6B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
              "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
              "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
              "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of generated documents (.jsonl and .txt) and a small BPE tokenizer.json trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 80))) + "." for _ in range(60)]
    with open(root / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[:50])
    for i, d in enumerate(docs[50:]):
        (root / f"b{i}.txt").write_text(d)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=120, special_tokens=["<|endoftext|>", "[UNK]"]))
    tok.save(str(root / "tokenizer.json"))
    return root


def write_checkpoint(folder, corpus, tie: bool, max_shard_size=None, seed=0, **config):
    """A random Qwen3ForCausalLM saved by transformers, with norms and weights perturbed so that every tensor
    matters and logits are O(1)."""
    torch.manual_seed(seed)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**HF_TINY, **config}, tie_word_embeddings=tie,
                                                                initializer_range=0.1)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    hf.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    shutil.copy(corpus / "tokenizer.json", folder / "tokenizer.json")
    return hf


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, corpus):
    """{"tied": (folder, hf_model), "untied_sharded": (folder, hf_model)}"""
    out = {}
    for name, tie, shard in (("tied", True, None), ("untied_sharded", False, "40KB")):
        folder = tmp_path_factory.mktemp(name)
        out[name] = folder, write_checkpoint(folder, corpus, tie, shard)
    return out


def tokens(B=2, T=13, seed=0):
    return torch.randint(0, HF_TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))
