"""Any model trained here as a Hugging Face folder: the baseline as a plain Qwen3 (infra/hf_qwen3.py), a routed
model (Delta Block, Delta AttnRes, AttnRes, Full AttnRes) with its own modeling code, which transformers runs
with `trust_remote_code=True`:

    folder/config.json                  model_type "delta_attnres", auto_map, and the repository's model_config
    folder/model.safetensors            the parameters, named "model." + model.py's names (sharded when large)
    folder/modeling_delta_attnres.py    the transformers classes (infra/hf_remote/)
    folder/model.py, folder/router.py   the repository's network and reference routing, imported relatively
    folder/generation_config.json       use_cache false: generation recomputes the prefix (no key-value cache)
    + the tokenizer files of `source`, a folder that has them (the Qwen3 fine-tuned from, for instance)

    python finetune.py export CKPT OUT_DIR [--source=FOLDER]

The exported forward is the reference routing path of the same code, so its logits are the repository's.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import asdict

from infra import files
from infra.hf_qwen3 import copy_tokenizer, save_hf_qwen3, write_weights
from model import Model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELING = os.path.join(ROOT, "infra", "hf_remote", "modeling_delta_attnres.py")
# What an exported copy changes in the repository's files: imports relative to the folder, and no kernel path
# (transformers refuses a modeling file that names a package it cannot import, here the fast path's).
REWRITES = {
    "router.py": [],
    "model.py": [("from router import", "from .router import"),
                 ("from depth_kernels.grouped_state import GroupedDepthState",
                  "raise ValueError(\"an exported model routes on the reference path: kernel='reference'\")")],
}
DEFAULT_MAX_POSITIONS = 4096        # when `source` gives no max_position_embeddings (lm-eval reads it)


def exported_source(name: str) -> str:
    """The repository's `name` as the exported folder holds it (REWRITES applied, each exactly once)."""
    with open(os.path.join(ROOT, name)) as f:
        text = f.read()
    for old, new in REWRITES[name]:
        if text.count(old) != 1:
            raise RuntimeError(f"{name}: the export rewrites {old!r}, found {text.count(old)} times: update REWRITES")
        text = text.replace(old, new)
    return text


def save_hf(model: Model, path: str, source: str | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `model` as a Hugging Face folder: a plain Qwen3 for the baseline, else a folder with remote code
    (the module doc). source: a folder whose tokenizer files are copied and whose config.json's token ids and
    max_position_embeddings are kept."""
    if model.cfg.residual == "baseline":
        return save_hf_qwen3(model, path, source, max_shard_bytes)
    kept = files.read_json(os.path.join(source, "config.json")) if source is not None else {}
    state = {"model." + n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters()}
    config = {key: kept[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in kept}
    config.update({"architectures": ["DeltaAttnResForCausalLM"], "model_type": "delta_attnres",
                   "auto_map": {"AutoConfig": "modeling_delta_attnres.DeltaAttnResConfig",
                                "AutoModelForCausalLM": "modeling_delta_attnres.DeltaAttnResForCausalLM"},
                   "model_config": {**asdict(model.cfg), "kernel": "reference"},
                   "max_position_embeddings": kept.get("max_position_embeddings", DEFAULT_MAX_POSITIONS),
                   "tie_word_embeddings": model.cfg.tie_embeddings,
                   "torch_dtype": str(next(iter(state.values())).dtype).removeprefix("torch.")})
    write_weights(state, path, max_shard_bytes)
    copy_tokenizer(source, path)
    files.write_json(os.path.join(path, "config.json"), config)
    generation = os.path.join(path, "generation_config.json")
    files.write_json(generation, {**(files.read_json(generation) if os.path.isfile(generation) else {}),
                                  "use_cache": False})
    shutil.copyfile(MODELING, os.path.join(path, os.path.basename(MODELING)))
    for name in REWRITES:
        with open(os.path.join(path, name), "w") as f:
            f.write(exported_source(name))
