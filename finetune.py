"""Fine-tune a pretrained Hugging Face Qwen3 into depth routing (the paper's Sec. 3.5), safely.

    python finetune.py configs/finetune_qwen3_0p6b_delta_block.py --init_from=checkpoints/Qwen3-0.6B
    python finetune.py configs/finetune_qwen3_0p6b_attnres.py --init_from=checkpoints/Qwen3-0.6B
    python finetune.py configs/finetune_qwen3_0p6b_baseline.py --init_from=checkpoints/Qwen3-0.6B
    python finetune.py export out/ft_qwen3_0p6b_baseline/ckpt_0020000.pt out/qwen3_0p6b_ft_hf \\
        --source=checkpoints/Qwen3-0.6B          # a fine-tuned baseline back to a Hugging Face folder

The pretrained folder is read by infra/hf_qwen3.py, which adds routers at their initialisation; `export` writes a
fine-tuned baseline back through it. The text is tokenised once with the checkpoint's own tokenizer;
`val_text="wikitext2"` validates on WikiText-2 (raw) instead: its test split, the one the authors' fine-tuning
script loads for its perplexity (`"wikitext2:validation"` takes the validation split). The fine-tuning run
reuses train.py's loop with separate optimizer groups: routers at router_lr_scale x the backbone's lr and no
weight decay. Before the first step it measures how far the converted model is from the pretrained one (the
same weights with routing switched off) on the first validation batch. With gate=True the difference is
exactly 0. The paper's zero query without a gate is not an identity (docs/method.md, section 'Initialisation
and identity') and the log says so: with boundary block sources the read is c * h~ and only RMSNorm's eps
changes the logits (a small difference); with the paper's Fig. 3 sources the difference is large.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np
import torch

from infra import cli
from infra import corpus
from infra import distributed
from infra import files
from infra import shards
import train
from infra import trained
from infra.config import NON_NEGATIVE, ConfigError, TrainConfig, batch_split, check_ranges, command_line
from infra.hf_export import save_hf
from infra.hf_qwen3 import load_hf_qwen3
from infra.tokenizer import get_tokenizer
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
    val_text: str = ""               # "": that split; "wikitext2" (= "wikitext2:test"): WikiText-2 (raw)'s test
                                     # split, as the authors' script; "wikitext2:validation"; or a local .txt /
                                     # .jsonl / .parquet file, loaded through `datasets` the same way

    def __post_init__(self):
        check_ranges(self, {"router_lr_scale": NON_NEGATIVE,
                            "text": (lambda v: v.strip() != "", "'fineweb', or a .txt / .jsonl file or folder"),
                            "val_text": (lambda v: v == "" or v in WIKITEXT2_SPLITS or v.endswith(VAL_FILES),
                                         "'' (text's first documents), 'wikitext2' (its test split, the "
                                         "authors'), 'wikitext2:test', 'wikitext2:validation', or a .txt / "
                                         ".jsonl / .parquet file"),
                            "text_max_tokens": (lambda v: v >= 0, "0 (the whole text) or integers >= 1"),
                            "text_val_docs": (lambda v: v >= 1, "integers >= 1")})


# ModelConfig fields a fine-tuning config chooses; the architecture comes from the checkpoint's config.json.
ROUTING_KEYS = ("residual", "n_blocks", "block_source", "include_partial", "null_source", "gate")
# val_text files by ending -> the `datasets` builder that reads them (each row's "text" field)
VAL_FILES = (".txt", ".jsonl", ".parquet")
VAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}
WIKITEXT2 = ("wikitext", "wikitext-2-raw-v1")   # Hugging Face dataset and config
# val_text -> WikiText-2's split. The authors' fine-tuning script loads split="test", so plain "wikitext2" does.
WIKITEXT2_SPLITS = {"wikitext2": "test", "wikitext2:test": "test", "wikitext2:validation": "validation"}


def val_text_name(val_text: str) -> str:
    """val_text as the stamp and meta.json record it: WikiText-2 with its split named ("wikitext2" ->
    "wikitext2:test"), so shards of one split are never reused for the other."""
    return f"wikitext2:{WIKITEXT2_SPLITS[val_text]}" if val_text in WIKITEXT2_SPLITS else val_text


# ------------------------------------------------------------------------------------------------------ data

def read_texts(source: str) -> Iterator[str]:
    """Documents from a .txt file (the whole file is one document), a .jsonl file (one {"text": ...} per
    line), or a folder of both (sorted by name)."""
    if os.path.isdir(source):
        paths = sorted(glob.glob(os.path.join(source, "*.txt")) + glob.glob(os.path.join(source, "*.jsonl")))
        if not paths:
            raise cli.NotFoundError(f"text folder {source} has no .txt or .jsonl files")
    elif os.path.isfile(source):
        if not source.endswith((".txt", ".jsonl")):
            raise ConfigError(f"text={source!r}: expected a .txt or .jsonl file, a folder of them, or 'fineweb'")
        paths = [source]
    else:
        raise cli.NotFoundError(f"text={source!r}: no such file or folder (or use text='fineweb')")
    for path in paths:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".txt"):
                yield f.read()
                continue
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        row = None
                    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                        raise shards.DataError(f"{path}:{n}: expected a JSON object with a string field 'text'")
                    yield row["text"]


def prepare_text(ft: FinetuneConfig, out_dir: str, rank: int = 0) -> dict:
    """Tokenise ft.text with the checkpoint's tokenizer.json into token shards in out_dir (once).

    A stamp file records the tokenizer's hash and the text settings; shards made otherwise are an error, not
    silently reused. Under torchrun, rank 0 prepares and the other ranks wait for the stamp (so out_dir must
    be on a file system all ranks see).
    """
    tokenizer = os.path.join(ft.init_from, "tokenizer.json")
    if not os.path.isfile(tokenizer):
        raise cli.NotFoundError(f"{tokenizer} not found: the text is tokenised with the checkpoint's own "
                                "tokenizer")
    with open(tokenizer, "rb") as f:
        stamp = {"tokenizer_sha256": hashlib.sha256(f.read()).hexdigest(), "text": ft.text,
                 "max_tokens": ft.text_max_tokens, "val_docs": ft.text_val_docs}
    if ft.val_text:  # only then: folders prepared without val_text keep their stamp
        stamp["val_text"] = val_text_name(ft.val_text)
    stamp_path, meta_path = os.path.join(out_dir, "finetune_text.json"), os.path.join(out_dir, "meta.json")
    if rank != 0:  # the stamp is written last, so shards and meta.json are complete once it exists
        while not (os.path.isfile(stamp_path) and os.path.isfile(meta_path)):
            time.sleep(5)
    if os.path.isfile(meta_path):
        found = files.read_json(stamp_path) if os.path.isfile(stamp_path) else "unknown settings"
        if found != stamp:
            raise shards.DataError(f"data={out_dir} holds shards prepared from {found}, not {stamp}: "
                                   "choose another data= folder or delete it")
        return shards.load_meta(out_dir)
    if os.path.isfile(stamp_path):  # left by an interrupted preparation; must not release the other ranks
        os.remove(stamp_path)
    texts = None if ft.text == "fineweb" else read_texts(ft.text)
    meta = corpus.prepare_fineweb(out_dir, tokenizer=tokenizer, tokenizer_path=tokenizer, texts=texts,
                                max_tokens=ft.text_max_tokens or None, val_docs=ft.text_val_docs)
    if meta["train_tokens"] == 0 or meta["val_tokens"] == 0:
        raise shards.DataError(f"text={ft.text!r} gave {meta['n_val_docs']} validation and {meta['n_train_docs']} "
                               f"training documents (text_val_docs={ft.text_val_docs}): both splits need text")
    if ft.val_text:
        meta = replace_val_split(ft.val_text, out_dir, tokenizer, meta)
    files.write_json(stamp_path, stamp)
    return meta


def load_val_text(source: str, cache_dir: str) -> str:
    """The text of val_text through `datasets`: a split of WikiText-2 raw from the hub (WIKITEXT2_SPLITS), or a
    local file (one row per line of a .txt, per object of a .jsonl, per row of a .parquet), rows joined by blank
    lines as Hugging Face's perplexity guide joins WikiText's."""
    try:
        import datasets
    except ImportError:
        raise cli.MissingPackageError(f"val_text={source!r} needs `datasets`: pip install datasets") from None
    if source in WIKITEXT2_SPLITS:
        split = WIKITEXT2_SPLITS[source]
        args, kwargs, what = WIKITEXT2, {"split": split}, f"{'/'.join(WIKITEXT2)} ({split})"
    else:
        if not os.path.isfile(source):
            raise cli.NotFoundError(f"val_text={source!r}: no such file")
        builder = VAL_BUILDERS[os.path.splitext(source)[1]]
        args, kwargs, what = (builder,), {"data_files": source, "split": "train"}, source
    try:  # offline, a dataset the hub does not have, a damaged file: OSError (ConnectionError included), ValueError
        rows = datasets.load_dataset(*args, cache_dir=cache_dir, **kwargs)
        texts = rows["text"]
    except (OSError, ValueError, KeyError) as e:
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise shards.DataError(f"val_text={source!r}: could not load {what}: {type(e).__name__}: {reason}") from None
    return "\n\n".join(texts)


def replace_val_split(source: str, out_dir: str, tokenizer: str, meta: dict) -> dict:
    """Validate on val_text: its tokens become the val split (one shard), and the held-out documents of `text`
    stay beside it as text_val_*.bin (eval.py --split=text_val). Returns the updated meta.json."""
    text = load_val_text(source, os.path.join(out_dir, "datasets_cache"))
    tok = get_tokenizer(tokenizer, tokenizer)           # as prepare_fineweb names it: the file's identity
    ids = np.asarray(tok.encode(text) + [tok.eot], dtype=np.int64)
    if len(ids) < 2:
        raise shards.DataError(f"val_text={source!r} has no text to validate on")
    for path in glob.glob(os.path.join(out_dir, "text_val_*.bin")):
        os.remove(path)
    for path in sorted(glob.glob(os.path.join(out_dir, "val_*.bin"))):
        os.replace(path, os.path.join(out_dir, "text_" + os.path.basename(path)))
    shards.write_shard(os.path.join(out_dir, "val_000000.bin"), ids, tok.vocab_size, tok.name)
    meta = {**meta, "val_text": val_text_name(source), "val_tokens": len(ids), "text_val_tokens": meta["val_tokens"],
            "n_shards": {**meta["n_shards"], "val": 1, "text_val": meta["n_shards"]["val"]}}
    files.write_json(os.path.join(out_dir, "meta.json"), meta)
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
        raise ConfigError("nothing to train: freeze_backbone=True and residual='baseline' has no routers")
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
    model.to(device).eval()
    # the same windows train.py validates on: the first eval_batches x batch_size, in order
    micro, grad_accum = batch_split(cfg, world_size)
    loader = shards.ShardLoader(cfg.data, "val", micro, cfg.seq_len, shuffle=False, step_batch=cfg.batch_size)
    n_batches = cfg.eval_batches * grad_accum * world_size
    x = loader.next_batch()[0].to(device)                                      # (B, T)
    with distributed.autocast(device):
        converted = model(x)                                                   # (B, T, V)
        with routing_off(model):
            pretrained = model(x)                                              # (B, T, V)
    # one row at a time: an fp32 copy of a whole (B, T, 151936) batch would be tens of GB
    diff = max((converted[i].float() - pretrained[i].float()).abs().max().item() for i in range(x.shape[0]))
    del converted, pretrained
    val_converted = train.evaluate(model, loader, n_batches, device)
    with routing_off(model):
        val_pretrained = train.evaluate(model, loader, n_batches, device)
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
    model_cfg, cfg, ft = command_line(argv, "finetune.py", classes=(ModelConfig, TrainConfig, FinetuneConfig))
    if not ft.init_from:
        raise ConfigError("--init_from=PATH is required: a Hugging Face Qwen3 folder (config.json, safetensors, "
                          "tokenizer.json)")
    if cfg.data == "shakespeare":
        raise ConfigError("data='shakespeare' is byte-level; set data= to a folder for shards of `text` tokenised "
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
        device = distributed.pick_device(cfg.device)  # the device train() will use on this rank
        entry = step0_check(model, cfg, device, int(os.environ.get("WORLD_SIZE", "1")))
        print(describe_step0(entry, model.cfg.residual))
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")
    return train.train(model.cfg, cfg, model=model, groups=groups)


def export(argv: list[str]) -> dict:
    """python finetune.py export CKPT OUT_DIR [--source=HF_FOLDER]: a training checkpoint as a Hugging Face folder
    (infra/hf_export.py): the baseline as a plain Qwen3, a routed model with its modeling code (trust_remote_code)."""
    parser = argparse.ArgumentParser(prog="finetune.py export", description=export.__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--source", default=None, help="a folder whose tokenizer files go with the model (the Qwen3 "
                        "fine-tuned from)")
    args = parser.parse_args(argv)
    model, ckpt = trained.load_model(args.checkpoint)
    save_hf(model, args.out_dir, source=args.source)
    print(f"wrote {args.out_dir}")
    return {"out_dir": args.out_dir, "step": ckpt.get("step")}


if __name__ == "__main__":
    cli.run(lambda argv: train.exit_status(main(argv)))
