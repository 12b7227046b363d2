"""Hugging Face Qwen3 in and out: a Qwen3 folder (config.json, safetensors) as model.py's Model, and back.

`load_hf_qwen3` reads a Qwen3 folder (config.json, model.safetensors or a sharded index) into Model, tensor by
tensor, and adds routers at their initialisation; `save_hf_qwen3` writes a baseline Model as a folder that
transformers loads. Parameter names map one to one (model.py's are Qwen3's without the "model." prefix).
Anything model.py would compute differently (mixture of experts, sliding windows, RoPE scaling, biases) is
refused when config.json is read, not silently converted.
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from infra import cli
from infra import files
from infra.checkpoint import CheckpointError
from infra.config import ConfigError, checked
from model import Model, ModelConfig

# ModelConfig fields that come from config.json; the others (routing) are the user's to choose.
ARCH_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
             "d_ff": "intermediate_size", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
             "tie_embeddings": "tie_word_embeddings"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "added_tokens.json",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja")
QWEN3_MAX_POSITIONS = 40960  # the released Qwen3 configs' max_position_embeddings, when no source config is given


# ----------------------------------------------------------------------------------------------- config.json

def _rope_theta(hf: dict) -> float:
    """RoPE base from the old `rope_theta` (+ `rope_scaling`) or the newer `rope_parameters`; only default RoPE."""
    params, scaling = hf.get("rope_parameters"), hf.get("rope_scaling")
    thetas = []
    for source in (params, scaling):
        if source is None:
            continue
        if not isinstance(source, dict) or any(isinstance(v, dict) for v in source.values()):
            raise CheckpointError(f"unsupported RoPE settings {source!r}: expected one dict of default RoPE parameters")
        kind = source.get("rope_type", source.get("type", "default"))
        if kind != "default":
            raise CheckpointError(f"unsupported RoPE scaling {kind!r}: model.py implements only default RoPE "
                                  "(no yarn / linear / dynamic scaling)")
        if "rope_theta" in source:
            thetas.append(float(source["rope_theta"]))
    if "rope_theta" in hf:
        thetas.append(float(hf["rope_theta"]))
    if not thetas:
        raise CheckpointError("config.json gives no rope_theta (neither at the top level nor in rope_parameters)")
    if len(set(thetas)) > 1:
        raise CheckpointError(f"config.json gives conflicting RoPE bases {sorted(set(thetas))} "
                              "(rope_theta vs rope_parameters.rope_theta)")
    return thetas[0]


def _check_kind(hf: dict) -> None:
    """A Qwen3 and nothing else (a routed model exported from here says how it loads)."""
    kind = hf.get("model_type")
    if kind == "qwen3_moe" or hf.get("num_experts") or hf.get("num_local_experts"):
        raise CheckpointError(f"unsupported config: mixture of experts (model_type={kind!r}); model.py has dense "
                              "MLPs only")
    if kind == "delta_attnres":
        raise CheckpointError("unsupported config: model_type='delta_attnres', expected 'qwen3': a routed model "
                              "exported from here; transformers loads it with trust_remote_code=True")
    if kind != "qwen3":
        raise CheckpointError(f"unsupported config: model_type={kind!r}, expected 'qwen3'")


def _check_supported(hf: dict) -> None:
    """Fail on anything model.py would silently compute differently."""
    if hf.get("attention_bias"):
        raise CheckpointError("unsupported config: attention_bias=true; model.py's projections have no bias")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"unsupported config: hidden_act={hf['hidden_act']!r}; model.py's MLP is SwiGLU (silu)")
    n_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:  # transformers' rule when layer_types is absent
        sliding = hf.get("use_sliding_window") and hf.get("sliding_window") is not None
        start = hf.get("max_window_layers", n_layers)
        layer_types = ["sliding_attention" if sliding and i >= start else "full_attention" for i in range(n_layers)]
    windowed = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if windowed:
        raise CheckpointError(f"unsupported config: sliding-window attention in layers {windowed}; "
                              "model.py attends over the full causal context")


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """Map a Qwen3 config.json (as a dict) onto ModelConfig; `overrides` set routing fields. An architecture
    field in `overrides` must agree with config.json (the weights fix it)."""
    _check_kind(hf)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in hf:
            raise CheckpointError(f"config.json lacks {key!r}")
    _check_supported(hf)
    n_heads = hf["num_attention_heads"]
    arch = {"vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"], "n_layers": hf["num_hidden_layers"],
            "n_heads": n_heads, "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // n_heads, "d_ff": hf["intermediate_size"],
            "rope_theta": _rope_theta(hf), "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}
    unknown = set(overrides) - ModelConfig.field_names()
    if unknown:
        raise KeyError(f"unknown ModelConfig field(s) {sorted(unknown)}")
    for key, value in overrides.items():
        if key in arch and value != arch[key]:
            raise ConfigError(f"{key}={value!r} conflicts with the checkpoint's config.json "
                              f"{ARCH_KEYS[key]}={arch[key]!r}; the architecture is read from the checkpoint")
    return checked(ModelConfig, {**arch, **overrides})


# ---------------------------------------------------------------------------------------------------- weights

def _hf_name(name: str) -> str:
    """model.py parameter name -> Hugging Face Qwen3ForCausalLM state-dict key."""
    return name if name.startswith("lm_head.") else "model." + name


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        return [os.path.join(path, name) for name in sorted(set(files.read_json(index)["weight_map"].values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise cli.NotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json "
                            "(only safetensors checkpoints are read)")


def load_hf_qwen3(path: str, *, dtype: torch.dtype = torch.float32, **overrides) -> Model:
    """A Hugging Face Qwen3 folder -> Model with the pretrained weights (in `dtype`) and fresh routers.

    overrides: ModelConfig routing fields, e.g. residual="delta_block", n_blocks=28, null_source=True, gate=True.
    The model is built on the meta device and each tensor is read from safetensors, shape-checked and assigned
    in turn, so memory holds one copy of the weights.
    """
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise cli.NotFoundError(f"{config_path} not found: init_from must be a Hugging Face Qwen3 folder")
    cfg = model_config_from_hf(files.read_json(config_path), **overrides)
    with torch.device("meta"):
        model = Model(cfg)
    # named_parameters lists a tied lm_head once, as embed_tokens.weight: a tied checkpoint may omit it.
    expected = {_hf_name(n): n for n, p in model.named_parameters() if not n.startswith("routers.")}
    ignored = ("lm_head.weight",) if cfg.tie_embeddings else ()
    loaded: set[str] = set()
    for file in _weight_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq") or key in ignored:
                    continue  # recomputed from rope_theta / the tied embedding
                if key not in expected:
                    raise CheckpointError(f"{file}: unexpected tensor {key!r} (not part of a Qwen3 with this "
                                          "config.json)")
                name = expected[key]
                want = tuple(model.get_parameter(name).shape)
                got = tuple(f.get_slice(key).get_shape())
                if got != want:
                    raise CheckpointError(f"{file}: tensor {key!r} has shape {got} but config.json implies {want}")
                module_name, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(module_name), leaf, nn.Parameter(f.get_tensor(key).to(dtype)))
                loaded.add(key)
    missing = sorted(set(expected) - loaded)
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:3]}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.routers.to_empty(device="cpu")
    model.routers.reset_parameters()
    model.routers.to(dtype)
    return model


def save_hf_qwen3(model: Model, path: str, source: str | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write a baseline Model as a Hugging Face Qwen3 folder that transformers loads.

    source: a Qwen3 folder whose config.json (token ids, max positions) is kept and whose tokenizer files are
    copied. Routed models are refused: transformers' Qwen3 has no routers and a different forward pass.
    """
    cfg = model.cfg
    if cfg.residual != "baseline":
        raise cli.UsageError(f"cannot save residual={cfg.residual!r} as a Hugging Face Qwen3: its routers and routed "
                             "forward pass do not exist there; only residual='baseline' models can be saved this way")
    hf = files.read_json(os.path.join(source, "config.json")) if source is not None else {}
    for key in ("rope_parameters", "rope_scaling", "layer_types", "dtype", "torch_dtype"):
        hf.pop(key, None)
    state = {_hf_name(n): p.detach().to("cpu").contiguous() for n, p in model.named_parameters()}
    hf.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
               "attention_bias": False, "use_sliding_window": False, "rope_scaling": None,
               "torch_dtype": str(next(iter(state.values())).dtype).removeprefix("torch."),
               **{hf_key: getattr(cfg, key) for key, hf_key in ARCH_KEYS.items()}})
    hf.setdefault("max_position_embeddings", QWEN3_MAX_POSITIONS)
    write_weights(state, path, max_shard_bytes)
    files.write_json(os.path.join(path, "config.json"), hf)
    copy_tokenizer(source, path)


def copy_tokenizer(source: str | None, path: str) -> None:
    """The tokenizer files (and generation_config.json) of the folder `source`, if given, into `path`."""
    for name in TOKENIZER_FILES if source is not None else ():
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(path, name))


def write_weights(state: dict[str, torch.Tensor], path: str, max_shard_bytes: int = 5 * 2**30) -> None:
    """state as model.safetensors, or as shards of at most max_shard_bytes (one tensor may exceed it) with
    transformers' index, model.safetensors.index.json."""
    os.makedirs(path, exist_ok=True)
    shards: list[dict] = [{}]
    shard_bytes = total = 0
    for key, tensor in state.items():  # greedy: start a new shard when the current one would overflow
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][key] = tensor
        shard_bytes += size
        total += size
    weight_map = {}
    for i, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        files.atomic_write(os.path.join(path, name), lambda tmp: save_file(shard, tmp, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        files.write_json(os.path.join(path, "model.safetensors.index.json"),
                         {"metadata": {"total_size": total}, "weight_map": weight_map})
