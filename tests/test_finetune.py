"""finetune.py: Hugging Face Qwen3 <-> model.py, the gated identity, router learning rates, the CLI.

Checkpoints are tiny random Qwen3ForCausalLM models written by transformers into temporary folders, with a
tokenizer trained on generated text; nothing is downloaded.
"""
import json
import os
import random
import shutil

import pytest
import torch

import checkpoint
import finetune
from config import TrainConfig, load_config
from finetune import FinetuneConfig, load_hf_qwen3, model_config_from_hf, save_hf_qwen3
from model import Model, ModelConfig

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
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
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
    """The paper's fine-tuning init (zero query + null source, no gate) changes the logits (PAPER.md section 5).
    Boundary sources sum to the stream, so the read is c * h~ and only RMSNorm's eps breaks scale invariance:
    a small change. The paper's Fig. 3 sources do not decompose the stream: a large change."""
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
    from safetensors.torch import load_file, save_file
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


# ----------------------------------------------------------------------------------------------- fine-tuning

def run_args(folder, corpus, tmp_path, *extra):
    return [f"--init_from={folder}", f"--text={corpus}", "--text_val_docs=10", f"--data={tmp_path / 'data'}",
            f"--out_dir={tmp_path / 'out'}", "--max_steps=1", "--warmup_steps=0", "--batch_size=4",
            "--micro_batch_size=4", "--seq_len=32", "--eval_batches=2", "--lr=1e-4", "--device=cpu", *extra]


def read_log(tmp_path):
    with open(tmp_path / "out" / "log.jsonl") as f:
        return [json.loads(line) for line in f]


def step_changes(folder, tmp_path, **overrides):
    """{parameter name: |after one step - before|} from the run's checkpoint and a fresh conversion."""
    before = load_hf_qwen3(str(folder), **overrides).state_dict()
    after = checkpoint.load_checkpoint(str(tmp_path / "out" / "ckpt_0000001.pt"))["model"]
    return {k: (after[k] - before[k]).abs() for k in before}


def test_one_step_moves_routers_at_router_lr_and_backbone_at_lr(ckpts, corpus, tmp_path, capsys):
    """Adam's first update is lr * g / (|g| + eps) ~ lr per element (plus lr * wd * p on matrices)."""
    folder, _ = ckpts["untied_sharded"]
    routed = dict(residual="delta_block", n_blocks=2, null_source=True)
    finetune.main(run_args(folder, corpus, tmp_path, *(f"--{k}={v}" for k, v in routed.items())))
    step0 = read_log(tmp_path)[0]
    assert step0["step"] == 0 and not step0["init_is_identity"] and step0["init_max_abs_logit_diff"] > 0
    assert step0["val_loss_converted"] != step0["val_loss_pretrained"]
    assert "the init is NOT an identity" in capsys.readouterr().out
    changes = step_changes(folder, tmp_path, **routed)
    queries = [v for k, v in changes.items() if k.endswith(".query")]
    assert torch.allclose(torch.stack(queries).max(), torch.tensor(1e-2), rtol=1e-3)  # 1e-4 x 100
    for k, v in changes.items():
        if not k.startswith("routers."):  # every backbone tensor gets gradient somewhere
            assert v.max().item() == pytest.approx(1e-4, rel=0.1), k


def test_gated_init_logs_identity_and_freeze_backbone(ckpts, corpus, tmp_path, capsys):
    folder, _ = ckpts["tied"]
    routed = dict(residual="delta", null_source=True, gate=True)
    finetune.main(run_args(folder, corpus, tmp_path, "--freeze_backbone=true",
                           *(f"--{k}={v}" for k, v in routed.items())))
    step0 = read_log(tmp_path)[0]
    assert step0["init_max_abs_logit_diff"] == 0.0 and step0["init_is_identity"]
    assert step0["val_loss_converted"] == step0["val_loss_pretrained"]
    assert "the init is an exact identity" in capsys.readouterr().out
    # the pretrained side of the check is the baseline conversion of the same checkpoint
    cfg = TrainConfig(data=str(tmp_path / "data"), batch_size=4, micro_batch_size=4, seq_len=32, eval_batches=2)
    base = finetune.step0_check(load_hf_qwen3(str(folder)), cfg, torch.device("cpu"))
    assert base["val_loss_converted"] == step0["val_loss_pretrained"]
    changes = step_changes(folder, tmp_path, **routed)
    assert all(v.max() == 0 for k, v in changes.items() if not k.startswith("routers."))
    # The gate's gradient is tiny here: sources that sum to the stream make the read c * h~, along which the
    # pre-norm is scale invariant, so Adam's lr * g / (|g| + eps) is a sizeable part of the router lr, not all.
    gates = torch.stack([v for k, v in changes.items() if k.endswith(".gate")])
    assert 1e-3 < gates.max().item() <= 1e-2 * (1 + 1e-6)


def test_baseline_finetune_exports_to_transformers(ckpts, corpus, tmp_path):
    folder, _ = ckpts["untied_sharded"]
    finetune.main(run_args(folder, corpus, tmp_path))
    out = tmp_path / "hf"
    finetune.main(["export", str(tmp_path / "out" / "ckpt_0000001.pt"), str(out), f"--source={folder}"])
    ckpt = checkpoint.load_checkpoint(str(tmp_path / "out" / "ckpt_0000001.pt"))
    ours = Model(ModelConfig(**ckpt["model_config"]))
    ours.load_state_dict(ckpt["model"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    idx = tokens()
    with torch.no_grad():
        assert (ours.eval()(idx) - hf(idx).logits).abs().max().item() < 1e-5


def test_prepared_text_is_not_reused_with_other_settings(ckpts, corpus, tmp_path):
    folder, _ = ckpts["tied"]
    ft = FinetuneConfig(init_from=str(folder), text=str(corpus), text_val_docs=10)
    meta = finetune.prepare_text(ft, str(tmp_path / "d"))
    assert meta["n_val_docs"] == 10 and meta["n_train_docs"] == 50 and meta["tokenizer_path"].endswith("tokenizer.json")
    assert finetune.prepare_text(ft, str(tmp_path / "d")) == meta
    assert finetune.prepare_text(ft, str(tmp_path / "d"), rank=1) == meta  # other ranks: reuse, never prepare
    ft.text_val_docs = 5
    with pytest.raises(ValueError, match="holds shards prepared from"):
        finetune.prepare_text(ft, str(tmp_path / "d"))
    ft.text_val_docs = 60
    with pytest.raises(ValueError, match="both splits need text"):
        finetune.prepare_text(ft, str(tmp_path / "e"))


def test_read_texts(tmp_path):
    (tmp_path / "a.txt").write_text("one whole document\n\nstill the same one")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second"}) + "\n\n" + json.dumps({"text": "third"}) + "\n")
    assert list(finetune.read_texts(str(tmp_path))) == ["one whole document\n\nstill the same one", "second", "third"]
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"c\.jsonl:2: expected a JSON object with a string field 'text'"):
        list(finetune.read_texts(str(tmp_path / "c.jsonl")))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="expected a .txt or .jsonl file"):
        list(finetune.read_texts(str(tmp_path / "x.csv")))


def test_cli_errors(ckpts, corpus, tmp_path):
    folder, _ = ckpts["tied"]
    with pytest.raises(KeyError, match="router_lr_scale"):
        finetune.main(run_args(folder, corpus, tmp_path, "--router_lr=1.0"))
    with pytest.raises(ValueError, match="--init_from=PATH is required"):
        finetune.main([f"--data={tmp_path}"])
    with pytest.raises(ValueError, match="nothing to train"):
        finetune.main(run_args(folder, corpus, tmp_path, "--freeze_backbone=true"))


@pytest.mark.parametrize("name", ["delta_block", "baseline"])
def test_paper_configs_fit_the_released_qwen3_0p6b(name):
    model_cfg, cfg, ft = load_config([f"configs/finetune_qwen3_0.6b_{name}.py"],
                                     classes=(ModelConfig, TrainConfig, FinetuneConfig))
    assert (cfg.max_steps, cfg.batch_size, cfg.warmup_steps, cfg.lr) == (20_000, 32, 500, 5e-5)
    converted = model_config_from_hf(QWEN3_0P6B, **finetune.routing_overrides(model_cfg))
    assert converted.residual == name
    if name == "delta_block":
        assert converted.null_source and cfg.lr * ft.router_lr_scale == pytest.approx(5e-3)


@pytest.mark.parametrize("arg, allowed", [("router_lr_scale=-1.0", "finite numbers >= 0"),
                                          ("text_val_docs=0", "integers >= 1"),
                                          ("text_max_tokens=-5", r"0 \(the whole text\) or integers >= 1"),
                                          ("text=", "'fineweb', or a .txt / .jsonl file or folder")])
def test_nonsense_finetune_values_name_key_value_and_allowed_values(arg, allowed):
    key, value = arg.split("=")
    with pytest.raises(ValueError, match=rf"^{key}={value or repr('')}: allowed values are {allowed}"):
        load_config([f"--{arg}"], classes=(ModelConfig, TrainConfig, FinetuneConfig))
