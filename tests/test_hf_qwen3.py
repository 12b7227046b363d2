"""hf_qwen3.py: Hugging Face Qwen3 <-> model.py: logits equal transformers', the gated identity, config.json
mapping and its refusals, shape errors that name the tensor, and the round trip through transformers."""
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from infra.hf_qwen3 import load_hf_qwen3, model_config_from_hf, save_hf_qwen3
from tests.tiny_qwen3 import QWEN3_0P6B, ckpts, corpus, tokens  # noqa: F401 (ckpts, corpus: fixtures)

transformers = pytest.importorskip("transformers")


# ----------------------------------------------------------------------------------------------- loading

@pytest.mark.parametrize("name", ["tied", "untied_sharded"])
def test_logits_match_transformers(ckpts, name):
    folder, hf = ckpts[name]
    assert (name == "untied_sharded") == os.path.isfile(folder / "model.safetensors.index.json")
    model = load_hf_qwen3(str(folder)).eval()
    assert model.cfg.head_dim == 24 and model.cfg.n_kv_heads == 2 and model.cfg.tie_embeddings == (name == "tied")
    assert (model.lm_head.weight is model.embed_tokens.weight) == (name == "tied")
    idx = tokens()
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    assert theirs.abs().max() > 1.0  # logits large enough for 1e-5 to be a strict comparison
    assert (ours - theirs).abs().max().item() < 1e-5


@pytest.mark.parametrize("residual", ["delta", "delta_block"])
def test_gate_gives_exactly_the_pretrained_logits(ckpts, residual):
    folder, _ = ckpts["untied_sharded"]
    base = load_hf_qwen3(str(folder)).eval()
    routed = load_hf_qwen3(str(folder), residual=residual, n_blocks=4, null_source=True, gate=True).eval()
    assert len(routed.routers) == 8
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(routed(idx), base(idx))


@pytest.mark.parametrize("block_source, low, high", [("boundary", 1e-7, 1e-3), ("paper", 1e-2, float("inf"))])
def test_zero_query_null_source_is_not_an_identity(ckpts, block_source, low, high):
    """The paper's fine-tuning init (zero query + null source, no gate) changes the logits (docs/method.md,
    section 'Initialisation and identity'). Boundary sources sum to the stream, so the read is c * h~ and only
    RMSNorm's eps breaks scale invariance: a small change. The paper's Fig. 3 sources do not decompose the
    stream: a large change."""
    folder, _ = ckpts["tied"]
    base = load_hf_qwen3(str(folder)).eval()
    routed = load_hf_qwen3(str(folder), residual="delta_block", n_blocks=4, null_source=True,
                           block_source=block_source).eval()
    idx = tokens()
    with torch.no_grad():
        assert low < (routed(idx) - base(idx)).abs().max().item() < high


def test_config_mapping_old_and_new_rope_fields():
    old = model_config_from_hf(QWEN3_0P6B)
    assert (old.d_model, old.n_layers, old.n_heads, old.n_kv_heads, old.head_dim, old.d_ff, old.vocab_size) == \
        (1024, 28, 16, 8, 128, 3072, 151936)
    assert old.rope_theta == 1e6 and old.tie_embeddings and old.norm_eps == 1e-6
    new = {k: v for k, v in QWEN3_0P6B.items() if k not in ("rope_theta", "rope_scaling", "head_dim")}
    new["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    cfg = model_config_from_hf(new)
    assert cfg.rope_theta == 5e5 and cfg.head_dim == 1024 // 16  # head_dim absent: hidden / heads
    with pytest.raises(ValueError, match="conflicting RoPE bases"):
        model_config_from_hf({**new, "rope_theta": 1e6})


@pytest.mark.parametrize("patch, message", [
    ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}, r"sliding-window .* \[20, "),
    ({"layer_types": ["sliding_attention"] * 28}, "sliding-window"),
    ({"model_type": "qwen3_moe", "num_experts": 128}, "mixture of experts"),
    ({"num_experts": 8}, "mixture of experts"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}}, "'linear'"),
    ({"model_type": "llama"}, "model_type='llama'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_configs_are_clear_errors(patch, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf({**QWEN3_0P6B, **patch})


def test_sliding_window_flag_without_windowed_layers_is_fine():
    assert model_config_from_hf({**QWEN3_0P6B, "use_sliding_window": True, "sliding_window": 4096}).n_layers == 28


def test_architecture_override_must_agree_with_checkpoint():
    assert model_config_from_hf(QWEN3_0P6B, n_layers=28, residual="delta_block", n_blocks=28).n_blocks == 28
    with pytest.raises(ValueError, match="d_model=512 conflicts .* hidden_size=1024"):
        model_config_from_hf(QWEN3_0P6B, d_model=512)
    with pytest.raises(KeyError, match="n_block"):
        model_config_from_hf(QWEN3_0P6B, n_block=3)


def test_shape_mismatch_names_the_tensor(ckpts, tmp_path):
    folder, _ = ckpts["tied"]
    shutil.copytree(folder, tmp_path / "bad")
    state = load_file(folder / "model.safetensors")
    state["model.layers.2.self_attn.k_proj.weight"] = state["model.layers.2.self_attn.k_proj.weight"][:-1]
    save_file(state, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.self_attn\.k_proj\.weight' has shape \(47, 64\) "
                                         r"but config.json implies \(48, 64\)"):
        load_hf_qwen3(str(tmp_path / "bad"))
    del state["model.layers.2.self_attn.k_proj.weight"]
    save_file(state, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 tensor\(s\) missing .*model\.layers\.2\.self_attn\.k_proj\.weight"):
        load_hf_qwen3(str(tmp_path / "bad"))


# ----------------------------------------------------------------------------------------------- saving

@pytest.mark.parametrize("name", ["tied", "untied_sharded"])
def test_round_trip_through_transformers(ckpts, tmp_path, name):
    folder, hf = ckpts[name]
    out = tmp_path / "saved"
    save_hf_qwen3(load_hf_qwen3(str(folder)), str(out), source=str(folder), max_shard_bytes=60_000)
    assert os.path.isfile(out / "model.safetensors.index.json") and os.path.isfile(out / "tokenizer.json")
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert again.config.tie_word_embeddings == (name == "tied")
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(again(idx).logits, hf(idx).logits)


def test_saving_a_routed_model_is_an_error(ckpts, tmp_path):
    folder, _ = ckpts["tied"]
    routed = load_hf_qwen3(str(folder), residual="delta_block", n_blocks=2, gate=True)
    with pytest.raises(ValueError, match="residual='delta_block'"):
        save_hf_qwen3(routed, str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")
