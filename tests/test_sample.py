"""sample.py and the KV cache of model.py's Attention: cached logits equal the full forward, cached and
uncached generation agree, and sampling from the command line."""
import pytest
import torch

import eval as ev
import sample
from infra import generation
from model import Attention, KVCache, Model
from tests.helpers import byte_data, routed_model, save, successor_model, tiny_config
from infra.tokenizer import ByteTokenizer


@pytest.mark.parametrize("residual", ["delta_block", "attnres", "baseline"])
def test_kv_cache_logits_equal_the_full_forward(residual):
    model = routed_model(residual) if residual != "baseline" else Model(tiny_config("baseline")).eval()
    idx = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        full = model(idx)
        cache = [KVCache() for _ in model.layers]
        steps = [model(idx[:, :6], cache)]
        steps += [model(idx[:, t:t + 1], cache) for t in range(6, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert [c.length for c in cache] == [11] * len(model.layers)
    assert all(isinstance(layer.self_attn, Attention) for layer in model.layers)   # no module is swapped


def test_cached_and_uncached_greedy_generation_agree():
    model = routed_model("delta_block")
    idx = torch.randint(0, 256, (1, 5))

    def run(use_cache: bool, context: int) -> torch.Tensor:
        tokens = generation.generate(model, idx, 12, temperature=0, context=context, use_cache=use_cache)
        return torch.cat(list(tokens), 1)

    assert torch.equal(run(True, 32), run(False, 32))
    assert run(True, 8).shape == (1, 12)        # past the window: rebuilt from its newer half


def test_sampling_from_the_command_line(tmp_path):
    path = save(successor_model(), tmp_path, byte_data(tmp_path / "data"), seq_len=16)
    report = ev.main([path, "--sample", "ab", "--max_new_tokens=5", "--temperature=0"])
    assert report[path]["sample"] == "abcdefg"
    tok = ByteTokenizer()
    top1 = generation.sample_text(successor_model(), tok, "k", 4, temperature=2.0, top_k=1, seed=3)
    assert top1 == "klmno"                      # top_k=1 is greedy at any temperature
    with pytest.raises(ValueError, match="temperature >= 0"):
        generation.sample_text(successor_model(), tok, "k", 4, temperature=-1.0)
