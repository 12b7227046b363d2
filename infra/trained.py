"""A trained model, ready to evaluate or sample: from any checkpoint kind or a Hugging Face Qwen3 folder, with
the tokenizer, data folder and context length of the run that made it (eval.py, sample.py).

A path may be a checkpoint file, a sharded FSDP checkpoint folder (ckpt_*/ with meta.json), an out_dir (its
newest intact checkpoint) or a Hugging Face Qwen3 folder (pretrained weights, read by hf_qwen3.py).
Checkpoints are read through checkpoint.py, so the same safety checks apply, and a checkpoint's model_config is
checked as a config file is (config.checked).
"""
from __future__ import annotations

import os
from dataclasses import asdict

import torch

from infra import checkpoint
from infra import cli
from infra import corpus
from infra import shards
from infra.config import checked
from infra.hf_qwen3 import load_hf_qwen3
from model import Model, ModelConfig
from infra.tokenizer import get_tokenizer

MODEL_KEYS = ("model", "model_config")
HF_CONTEXT = 2048  # a Hugging Face folder records no training length: the paper's Qwen3 sequence length


def resolve_checkpoint(path: str) -> str:
    """A checkpoint file, a sharded checkpoint folder (FSDP), a Hugging Face folder, or the newest intact
    checkpoint of an out_dir."""
    if os.path.isfile(os.path.join(path, "config.json")) or os.path.isfile(os.path.join(path, checkpoint.META)):
        return path
    if os.path.isdir(path):
        if not checkpoint.checkpoint_paths(path):
            raise cli.NotFoundError(f"{path} is a directory without checkpoints (ckpt_*.pt)")
        return checkpoint.newest_intact(path)[0]
    if not os.path.isfile(path):
        raise cli.NotFoundError(f"no checkpoint at {path} (expected a ckpt_*.pt file, an out_dir or a Qwen3 folder)")
    return path


def load_model(path: str, device: torch.device | str = "cpu") -> tuple[Model, dict]:
    """(model in eval mode, the checkpoint dict with "path" added) from any path resolve_checkpoint takes.
    Clear errors for other file formats."""
    path = resolve_checkpoint(path)
    if os.path.isfile(os.path.join(path, "config.json")):  # Hugging Face Qwen3
        model = load_hf_qwen3(path)
        ckpt = {"path": path, "hf_folder": path, "model_config": asdict(model.cfg),
                "train_config": {"seq_len": HF_CONTEXT}}
        return model.to(device).eval(), ckpt
    ckpt = checkpoint.load_checkpoint(path)
    missing = [k for k in MODEL_KEYS if k not in ckpt]
    if missing:
        raise checkpoint.CheckpointError(f"{path}: unknown checkpoint format, missing keys {missing} (found "
                                         f"{sorted(ckpt)[:8]}); train.py writes a dict with keys "
                                         f"{list(MODEL_KEYS)}, 'train_config', 'step'")
    unknown = set(ckpt["model_config"]) - ModelConfig.field_names()
    if unknown:
        raise checkpoint.CheckpointError(f"{path}: model_config has fields this model.py does not know: "
                                         f"{sorted(unknown)}")
    model = Model(checked(ModelConfig, ckpt["model_config"], f"{path}: model_config: "))
    model.load_state_dict(ckpt["model"])
    ckpt["path"] = path
    return model.to(device).eval(), ckpt


def run_data_dir(ckpt: dict) -> str:
    """The data folder the checkpoint was trained on (the embedded corpus is prepared if needed)."""
    name = ckpt.get("train_config", {}).get("data")
    if name is None:
        raise cli.UsageError(f"{ckpt['path']} records no train_config['data']: pass --data")
    return corpus.data_dir(name)


def run_tokenizer(ckpt: dict, model: Model):
    """The tokenizer of the checkpoint's data, or the tokenizer.json that ships with a Qwen3 folder."""
    if "hf_folder" in ckpt:
        path = os.path.join(ckpt["hf_folder"], "tokenizer.json")
        if not os.path.isfile(path):
            raise cli.NotFoundError(f"{path} not found: copy Qwen3's tokenizer.json into {ckpt['hf_folder']}")
        return get_tokenizer("qwen3", path, model.cfg.vocab_size)
    meta = shards.load_meta(run_data_dir(ckpt), model.cfg.vocab_size)
    return get_tokenizer(meta["tokenizer"], meta.get("tokenizer_path"), model.cfg.vocab_size)


def context_length(ckpt: dict) -> int:
    """The sequence length the model was trained with: the window for evaluation and sampling."""
    return int(ckpt.get("train_config", {}).get("seq_len", 1024))

