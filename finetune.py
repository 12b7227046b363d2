"""Fine-tune a pretrained Hugging Face Qwen3 into depth routing (the paper's Sec. 3.5), safely.

    python finetune.py configs/finetune_qwen3_0.6b_delta_block.py --init_from=checkpoints/Qwen3-0.6B
    python finetune.py configs/finetune_qwen3_0.6b_baseline.py --init_from=checkpoints/Qwen3-0.6B
    python finetune.py export out/ft_qwen3_0.6b_baseline/ckpt_0020000.pt out/qwen3_0.6b_ft_hf \\
        --source=checkpoints/Qwen3-0.6B          # a fine-tuned baseline back to a Hugging Face folder

`load_hf_qwen3` reads a Qwen3 folder (config.json, model.safetensors or a sharded index) into model.py's
Model, tensor by tensor, and adds routers at their initialisation. The fine-tuning run reuses train.py's
loop with separate optimizer groups: routers at router_lr_scale x the backbone's lr and no weight decay.
Before the first step it measures how far the converted model is from the pretrained one (the same
weights with routing switched off) on the first validation batch. With gate=True the difference is exactly
0. The paper's zero query without a gate is not an identity (PAPER.md section 5) and the log says so: with
boundary block sources the read is c * h~ and only RMSNorm's eps changes the logits (a small difference);
with the paper's Fig. 3 sources the difference is large.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
import torch.nn as nn

import checkpoint
import cli
import data
import files
import train
from config import NON_NEGATIVE, TrainConfig, check_ranges, load_config
from model import Model, ModelConfig
from router import make_policy


@dataclass
class FinetuneConfig:
    init_from: str = ""              # a Hugging Face Qwen3 folder: config.json, *.safetensors, tokenizer.json
    router_lr_scale: float = 100.0   # router lr = backbone lr (TrainConfig.lr) x this; the paper: 5e-3 / 5e-5
    freeze_backbone: bool = False    # train only the routers
    text: str = "fineweb"            # "fineweb" (FineWeb-Edu, streamed) or a .txt / .jsonl file or a folder of them
    text_max_tokens: int = 0         # training tokens to prepare into TrainConfig.data; 0: the whole text
    text_val_docs: int = 1000        # the first documents form the validation split

    def __post_init__(self):
        check_ranges(self, {"router_lr_scale": NON_NEGATIVE,
                            "text": (lambda v: v.strip() != "", "'fineweb', or a .txt / .jsonl file or folder"),
                            "text_max_tokens": (lambda v: v >= 0, "0 (the whole text) or integers >= 1"),
                            "text_val_docs": (lambda v: v >= 1, "integers >= 1")})


# ModelConfig fields that come from config.json; the others (routing) are the user's to choose.
ARCH_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
             "d_ff": "intermediate_size", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
             "tie_embeddings": "tie_word_embeddings"}
ROUTING_KEYS = ("residual", "n_blocks", "block_source", "include_partial", "null_source", "gate")
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
            raise ValueError(f"unsupported RoPE settings {source!r}: expected one dict of default RoPE parameters")
        kind = source.get("rope_type", source.get("type", "default"))
        if kind != "default":
            raise ValueError(f"unsupported RoPE scaling {kind!r}: model.py implements only default RoPE "
                             "(no yarn / linear / dynamic scaling)")
        if "rope_theta" in source:
            thetas.append(float(source["rope_theta"]))
    if "rope_theta" in hf:
        thetas.append(float(hf["rope_theta"]))
    if not thetas:
        raise ValueError("config.json gives no rope_theta (neither at the top level nor in rope_parameters)")
    if len(set(thetas)) > 1:
        raise ValueError(f"config.json gives conflicting RoPE bases {sorted(set(thetas))} "
                         "(rope_theta vs rope_parameters.rope_theta)")
    return thetas[0]


def _check_supported(hf: dict) -> None:
    """Fail on anything model.py would silently compute differently."""
    kind = hf.get("model_type")
    if kind == "qwen3_moe" or hf.get("num_experts") or hf.get("num_local_experts"):
        raise ValueError(f"unsupported config: mixture of experts (model_type={kind!r}); model.py has dense MLPs only")
    if kind != "qwen3":
        raise ValueError(f"unsupported config: model_type={kind!r}, expected 'qwen3'")
    if hf.get("attention_bias"):
        raise ValueError("unsupported config: attention_bias=true; model.py's projections have no bias")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported config: hidden_act={hf['hidden_act']!r}; model.py's MLP is SwiGLU (silu)")
    n_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:  # transformers' rule when layer_types is absent
        sliding = hf.get("use_sliding_window") and hf.get("sliding_window") is not None
        start = hf.get("max_window_layers", n_layers)
        layer_types = ["sliding_attention" if sliding and i >= start else "full_attention" for i in range(n_layers)]
    windowed = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if windowed:
        raise ValueError(f"unsupported config: sliding-window attention in layers {windowed}; "
                         "model.py attends over the full causal context")


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """Map a Qwen3 config.json (as a dict) onto ModelConfig; `overrides` set routing fields. An architecture
    field in `overrides` must agree with config.json (the weights fix it)."""
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in hf:
            raise ValueError(f"config.json lacks {key!r}")
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
            raise ValueError(f"{key}={value!r} conflicts with the checkpoint's config.json "
                             f"{ARCH_KEYS[key]}={arch[key]!r}; the architecture is read from the checkpoint")
    return ModelConfig(**{**arch, **overrides})


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
    raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json "
                            "(only safetensors checkpoints are read)")


def load_hf_qwen3(path: str, *, dtype: torch.dtype = torch.float32, **overrides) -> Model:
    """A Hugging Face Qwen3 folder -> Model with the pretrained weights (in `dtype`) and fresh routers.

    overrides: ModelConfig routing fields, e.g. residual="delta_block", n_blocks=28, null_source=True, gate=True.
    The model is built on the meta device and each tensor is read from safetensors, shape-checked and assigned
    in turn, so memory holds one copy of the weights.
    """
    from safetensors import safe_open
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} not found: init_from must be a Hugging Face Qwen3 folder")
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
                    raise ValueError(f"{file}: unexpected tensor {key!r} (not part of a Qwen3 with this config.json)")
                name = expected[key]
                want = tuple(model.get_parameter(name).shape)
                got = tuple(f.get_slice(key).get_shape())
                if got != want:
                    raise ValueError(f"{file}: tensor {key!r} has shape {got} but config.json implies {want}")
                module_name, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(module_name), leaf, nn.Parameter(f.get_tensor(key).to(dtype)))
                loaded.add(key)
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:3]}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.routers.to_empty(device="cpu")
    for router in model.routers:
        router.reset_parameters()
    model.routers.to(dtype)
    return model


def save_hf_qwen3(model: Model, path: str, source: str | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write a baseline Model as a Hugging Face Qwen3 folder that transformers loads.

    source: a Qwen3 folder whose config.json (token ids, max positions) is kept and whose tokenizer files are
    copied. Routed models are refused: transformers' Qwen3 has no routers and a different forward pass.
    """
    from safetensors.torch import save_file
    cfg = model.cfg
    if cfg.residual != "baseline":
        raise ValueError(f"cannot save residual={cfg.residual!r} as a Hugging Face Qwen3: its routers and routed "
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
    files.write_json(os.path.join(path, "config.json"), hf)
    for name in TOKENIZER_FILES if source is not None else ():
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(path, name))


# ------------------------------------------------------------------------------------------------------ data

def read_texts(source: str) -> Iterator[str]:
    """Documents from a .txt file (the whole file is one document), a .jsonl file (one {"text": ...} per
    line), or a folder of both (sorted by name)."""
    if os.path.isdir(source):
        paths = sorted(glob.glob(os.path.join(source, "*.txt")) + glob.glob(os.path.join(source, "*.jsonl")))
        if not paths:
            raise FileNotFoundError(f"text folder {source} has no .txt or .jsonl files")
    elif os.path.isfile(source):
        if not source.endswith((".txt", ".jsonl")):
            raise ValueError(f"text={source!r}: expected a .txt or .jsonl file, a folder of them, or 'fineweb'")
        paths = [source]
    else:
        raise FileNotFoundError(f"text={source!r}: no such file or folder (or use text='fineweb')")
    for path in paths:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".txt"):
                yield f.read()
                continue
            for n, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                        raise ValueError(f"{path}:{n}: expected a JSON object with a string field 'text'")
                    yield row["text"]


def prepare_text(ft: FinetuneConfig, out_dir: str, rank: int = 0) -> dict:
    """Tokenise ft.text with the checkpoint's tokenizer.json into token shards in out_dir (once).

    A stamp file records the tokenizer's hash and the text settings; shards made otherwise are an error, not
    silently reused. Under torchrun, rank 0 prepares and the other ranks wait for the stamp (so out_dir must
    be on a file system all ranks see).
    """
    tokenizer = os.path.join(ft.init_from, "tokenizer.json")
    if not os.path.isfile(tokenizer):
        raise FileNotFoundError(f"{tokenizer} not found: the text is tokenised with the checkpoint's own tokenizer")
    with open(tokenizer, "rb") as f:
        stamp = {"tokenizer_sha256": hashlib.sha256(f.read()).hexdigest(), "text": ft.text,
                 "max_tokens": ft.text_max_tokens, "val_docs": ft.text_val_docs}
    stamp_path, meta_path = os.path.join(out_dir, "finetune_text.json"), os.path.join(out_dir, "meta.json")
    if rank != 0:  # the stamp is written last, so shards and meta.json are complete once it exists
        while not (os.path.isfile(stamp_path) and os.path.isfile(meta_path)):
            time.sleep(5)
    if os.path.isfile(meta_path):
        found = files.read_json(stamp_path) if os.path.isfile(stamp_path) else "unknown settings"
        if found != stamp:
            raise ValueError(f"data={out_dir} holds shards prepared from {found}, not {stamp}: "
                             "choose another data= folder or delete it")
        return data.load_meta(out_dir)
    if os.path.isfile(stamp_path):  # left by an interrupted preparation; must not release the other ranks
        os.remove(stamp_path)
    texts = None if ft.text == "fineweb" else read_texts(ft.text)
    meta = data.prepare_fineweb(out_dir, tokenizer=tokenizer, tokenizer_path=tokenizer, texts=texts,
                                max_tokens=ft.text_max_tokens or None, val_docs=ft.text_val_docs)
    if meta["train_tokens"] == 0 or meta["val_tokens"] == 0:
        raise ValueError(f"text={ft.text!r} gave {meta['n_val_docs']} validation and {meta['n_train_docs']} training "
                         f"documents (text_val_docs={ft.text_val_docs}): both splits need text")
    files.write_json(stamp_path, stamp)
    return meta


# ------------------------------------------------------------------------------------------------- training

def finetune_param_groups(model: Model, cfg: TrainConfig, ft: FinetuneConfig) -> list[dict]:
    """Backbone: weight decay on matrices, lr = cfg.lr (or frozen). Routers: lr x router_lr_scale, no decay."""
    backbone = [p for n, p in model.named_parameters() if not n.startswith("routers.")]
    routers = list(model.routers.parameters())
    groups = []
    if ft.freeze_backbone:
        for p in backbone:
            p.requires_grad_(False)
    else:
        groups += [{"params": [p for p in backbone if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                   {"params": [p for p in backbone if p.dim() < 2], "weight_decay": 0.0}]
    if routers:
        groups.append({"params": routers, "weight_decay": 0.0, "lr_scale": ft.router_lr_scale})
    if not groups:
        raise ValueError("nothing to train: freeze_backbone=True and residual='baseline' has no routers")
    return groups


@contextmanager
def routing_off(model: Model):
    """The model as the pretrained network: a baseline policy never reads the routers, and the backbone
    weights are the pretrained ones until the first optimizer step."""
    policy = model.policy
    model.policy = make_policy("baseline", model.cfg.n_layers)
    try:
        yield model
    finally:
        model.policy = policy


@torch.no_grad()
def step0_check(model: Model, cfg: TrainConfig, device: torch.device, world_size: int = 1) -> dict:
    """Max |logit difference| between the converted and the pretrained model on the first validation batch,
    and both validation losses (over the windows train.py validates on), before any training. Runs on one
    process, in the micro-batches each of world_size ranks will use."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    model.to(device).eval()
    # the same windows train.py validates on: the first eval_batches x batch_size, in order
    micro, grad_accum = train.batch_split(cfg, world_size)
    loader = data.ShardLoader(cfg.data, "val", micro, cfg.seq_len, shuffle=False, step_batch=cfg.batch_size)
    n_batches = cfg.eval_batches * grad_accum * world_size
    x = loader.next_batch()[0].to(device)                                      # (B, T)
    with autocast:
        converted = model(x)                                                   # (B, T, V)
        with routing_off(model):
            pretrained = model(x)                                              # (B, T, V)
    # one row at a time: an fp32 copy of a whole (B, T, 151936) batch would be tens of GB
    diff = max((converted[i].float() - pretrained[i].float()).abs().max().item() for i in range(x.shape[0]))
    del converted, pretrained
    val_converted = train.evaluate(model, loader, n_batches, autocast, device)
    with routing_off(model):
        val_pretrained = train.evaluate(model, loader, n_batches, autocast, device)
    return {"step": 0, "init_max_abs_logit_diff": diff, "init_is_identity": diff == 0.0,
            "val_loss_pretrained": val_pretrained, "val_loss_converted": val_converted}


def describe_step0(entry: dict, residual: str) -> str:
    verdict = ("the init is an exact identity" if entry["init_is_identity"] else
               f"the init is NOT an identity: residual={residual!r} changes the pretrained model's logits")
    return (f"step 0 | max |logit diff| vs pretrained {entry['init_max_abs_logit_diff']:.3e} ({verdict}) | "
            f"val loss pretrained {entry['val_loss_pretrained']:.5f} converted {entry['val_loss_converted']:.5f}")


def routing_overrides(model_cfg: ModelConfig) -> dict:
    """The ModelConfig fields a fine-tuning config chose: routing fields always, an architecture field only
    where it differs from the default (load_hf_qwen3 then checks it against the checkpoint)."""
    defaults = asdict(ModelConfig())
    return {k: v for k, v in asdict(model_cfg).items() if k in ROUTING_KEYS or v != defaults[k]}


def main(argv: list[str]) -> dict:
    if argv[:1] == ["export"]:
        return export(argv[1:])
    model_cfg, cfg, ft = load_config(argv, classes=(ModelConfig, TrainConfig, FinetuneConfig))
    if not ft.init_from:
        raise ValueError("--init_from=PATH is required: a Hugging Face Qwen3 folder (config.json, safetensors, "
                         "tokenizer.json)")
    if cfg.data == "shakespeare":
        raise ValueError("data='shakespeare' is byte-level; set data= to a folder for shards of `text` tokenised "
                         "with the checkpoint's tokenizer")
    rank = int(os.environ.get("RANK", "0"))
    model = load_hf_qwen3(ft.init_from, **routing_overrides(model_cfg))
    prepare_text(ft, cfg.data, rank)
    groups = finetune_param_groups(model, cfg, ft)
    if rank == 0:
        print(f"fine-tuning {ft.init_from}: " + ", ".join(
            f"{sum(p.numel() for p in g['params']):,} params at lr {cfg.lr * g.get('lr_scale', 1.0):.2e} "
            f"(weight decay {g['weight_decay']})" for g in groups))
    if rank == 0 and not cfg.resume:
        use_cuda = torch.cuda.is_available() if cfg.device == "auto" else cfg.device == "cuda"
        # the GPU train() will use on this rank (distributed.setup's rule)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
        entry = step0_check(model, cfg, device, int(os.environ.get("WORLD_SIZE", "1")))
        print(describe_step0(entry, model.cfg.residual))
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")
    return train.train(model.cfg, cfg, model=model, groups=groups)


def export(argv: list[str]) -> dict:
    """python finetune.py export CKPT.pt OUT_DIR [--source=HF_FOLDER]: a baseline training checkpoint -> HF."""
    parser = argparse.ArgumentParser(prog="finetune.py export", description=export.__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--source", default=None, help="the Qwen3 folder fine-tuned from (config, tokenizer)")
    args = parser.parse_args(argv)
    ckpt = checkpoint.load_checkpoint(args.checkpoint)
    model = Model(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    save_hf_qwen3(model, args.out_dir, source=args.source)
    print(f"wrote {args.out_dir}")
    return {"out_dir": args.out_dir, "step": ckpt["step"]}


if __name__ == "__main__":
    cli.run(lambda argv: train.exit_status(main(argv)))
