"""Checkpoints: the two formats train.py writes, their checksums, and reading them without trusting them.

A checkpoint is either one `torch.save` file `ckpt_{step:07d}.pt` (one process and DDP; rank 0 writes it) or,
under FSDP, a sharded `torch.distributed.checkpoint` folder `ckpt_{step:07d}/` (every rank writes its shards;
`meta.json` holds the step, loader position, configs and a SHA-256 of every file of the folder). Both hold
model, optimizer, loader, step, model_config, train_config and data (the tokenizer and vocabulary of the
shards), and `load_checkpoint` reads either kind into that dict, so eval.py and finetune.py read both. To turn
a sharded folder into one file (to copy or share it):

    python -m infra.checkpoint consolidate out/run/ckpt_0001000     # -> out/run/ckpt_0001000.full.pt

Safety rules, each checked where the file is read or written:
- Files are read with `torch.load(weights_only=True)`: tensors and plain data only. A file that needs any
  other Python object (which could run code while it is unpickled) is refused, not loaded.
- Every checkpoint carries a checksum, verified on load: a file's covers its whole content (tensor bytes,
  numbers, strings); a folder's meta.json covers itself and the SHA-256 of each shard file, checked before
  torch's reader unpickles the folder's `.metadata`. `newest_intact` skips damaged checkpoints.
- A checkpoint is written under a temporary name, synced to disk and renamed (files.atomic_write), and only
  when every weight and optimizer value is finite.
A checkpoint that fails a check raises CheckpointError (a cli.UserError): one line for the user.

Only public torch.distributed.checkpoint APIs are used: get_state_dict / set_state_dict, dcp.save / dcp.load,
FileSystemReader and its read_metadata.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import warnings
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule

from infra import cli
from infra import distributed
from infra import files
from infra.config import ConfigError

if TYPE_CHECKING:
    from infra.config import TrainConfig
    from model import ModelConfig

_CKPT_NAME = re.compile(r"ckpt_(\d+)(\.pt)?$")
META = "meta.json"


class CheckpointError(cli.UserError, ValueError):
    """A checkpoint (or pretrained folder) that cannot be used: damaged, truncated, changed after it was written,
    not this project's, or holding what this model.py cannot represent."""


def checkpoint_paths(out_dir: str) -> list[str]:
    """The checkpoints in out_dir (`ckpt_{step}.pt` files and sharded `ckpt_{step}/` folders), oldest first.
    Unfinished saves (`*.tmp`) and consolidated copies (`*.full.pt`) are not listed."""
    if not os.path.isdir(out_dir):
        return []
    found = []
    for name in os.listdir(out_dir):
        match = _CKPT_NAME.fullmatch(name)
        path = os.path.join(out_dir, name)
        if match and (os.path.isfile(path) if match.group(2) else os.path.isdir(path)):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


# ------------------------------------------------------------------------------------------------ checksums

def _leaves(obj, prefix: str = ""):
    """(name, value) for every tensor and plain value of a nested dict / list, in a fixed order."""
    if isinstance(obj, dict):
        for key in sorted(obj, key=repr):
            yield from _leaves(obj[key], f"{prefix}/{key!r}")
    elif isinstance(obj, (list, tuple)):
        yield f"{prefix}:{type(obj).__name__}{len(obj)}", None
        for i, value in enumerate(obj):
            yield from _leaves(value, f"{prefix}/{i}")
    else:
        yield prefix, obj


def checksum(state: dict) -> str:
    """SHA-256 over every name, tensor (dtype, shape, bytes) and plain value of `state`, bar its "checksum"."""
    h = hashlib.sha256()
    for name, value in _leaves({k: v for k, v in state.items() if k != "checksum"}):
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous().reshape(-1)
            h.update(f"{name}={t.dtype}{tuple(value.shape)}".encode())
            h.update(t.view(torch.uint8).numpy())
        else:
            h.update(f"{name}={value!r};".encode())
    return h.hexdigest()


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- one file

def save_file(path: str, state: dict) -> None:
    """One checkpoint file with its checksum, written atomically."""
    state = {**state, "checksum": checksum(state)}
    files.atomic_write(path, lambda tmp: torch.save(state, tmp))


def _load_file(path: str) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, RuntimeError, EOFError, ... for foreign or damaged files
        # weights_only's reason is the first sentence after "WeightsUnpickler error:"; others say it first
        reason = re.search(r"WeightsUnpickler error:\s*([^\n]+?)(\. |\n|$)", str(e))
        reason = reason.group(1).strip() if reason else (str(e).splitlines() or [type(e).__name__])[0].split(". ")[0]
        if reason.startswith("Unsupported global"):
            raise CheckpointError(f"{path} is not a checkpoint this project writes: it holds more than tensors and "
                                  f"plain data ({reason}), and such a file can run code when loaded, so it was not "
                                  "loaded") from None
        raise CheckpointError(f"{path} is not a checkpoint this project writes, or it is damaged: torch.load "
                              f"failed ({reason})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a checkpoint this project writes: it holds a "
                              f"{type(state).__name__}, not a dict")
    if "checksum" not in state:
        raise CheckpointError(f"{path} is not a checkpoint this project writes: it has no checksum")
    if state.pop("checksum") != checksum(state):
        raise CheckpointError(f"{path} is damaged: its content does not match its checksum (changed after it "
                              "was written: a disk, copy or transfer error?)")
    return state


# --------------------------------------------------------------------------------------- sharded folders

def _verified_meta(path: str) -> dict:
    """A sharded folder's meta.json after checking its checksum and every shard file's SHA-256."""
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{path} is not a finished sharded checkpoint (no {META})")
    try:
        meta = files.read_json(meta_path)
    except files.DamagedFileError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(meta, dict) or "checksum" not in meta or "files" not in meta:
        raise CheckpointError(f"{path} is not a sharded checkpoint this project writes: its {META} has no checksum")
    if meta["checksum"] != checksum(meta):
        raise CheckpointError(f"{meta_path} is damaged: its content does not match its checksum")
    for name, digest in meta["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{path} is incomplete: {name} is missing")
        if _file_sha256(file) != digest:
            raise CheckpointError(f"{file} is damaged: its SHA-256 differs from the one in {META}")
    return {k: v for k, v in meta.items() if k not in ("files", "checksum")}


def _hash_folder(ctx: distributed.Context, path: str) -> dict[str, str]:
    """Collective: SHA-256 of every file in the folder, the files dealt out over the ranks; on rank 0."""
    names = sorted(os.listdir(path))
    mine = {name: _file_sha256(os.path.join(path, name)) for name in names[ctx.rank::ctx.world_size]}
    if ctx.world_size == 1:
        return mine
    parts = [None] * ctx.world_size
    dist.all_gather_object(parts, mine)
    return {name: digest for part in parts for name, digest in part.items()}


def save_folder(ctx: distributed.Context, state: dict, path: str, meta: dict) -> None:
    """Collective: a sharded checkpoint folder of every rank's `state` (torch.distributed.checkpoint) with
    meta.json (`meta`, the SHA-256 of every file, and its checksum), written under path.tmp and renamed."""
    tmp = path + ".tmp"
    if ctx.is_main and os.path.exists(tmp):
        shutil.rmtree(tmp)  # left by a crashed save
    distributed.barrier(ctx)
    dcp.save(state, checkpoint_id=tmp)  # syncs every file it writes
    distributed.barrier(ctx)
    digests = _hash_folder(ctx, tmp)
    if ctx.is_main:
        meta = json.loads(json.dumps({**meta, "files": digests}))  # summed as it will be read: tuples as lists
        files.write_json(os.path.join(tmp, META), {**meta, "checksum": checksum(meta)})
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
        files.fsync_path(os.path.dirname(os.path.abspath(path)))


def _load_folder(path: str) -> dict:
    """A sharded folder consolidated in memory (no process group needed)."""
    meta = _verified_meta(path)
    reader = dcp.FileSystemReader(path)
    state = _empty_state(reader.read_metadata())
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {**state, **meta}


def _empty_state(metadata: Metadata) -> dict:
    """The nested state a folder holds, with empty tensors (and None for other values) for dcp.load to fill.

    dcp.load fills a state whose keys it is given; the folder's metadata lists them: each stored value by its
    flattened key, with planner_data holding the path of keys (str) and list indices (int) it came from."""
    tree: dict = {}
    for key, item in metadata.state_dict_metadata.items():
        *parents, leaf = (metadata.planner_data or {}).get(key, (key,))
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        is_tensor = isinstance(item, TensorStorageMetadata)
        node[leaf] = torch.empty(item.size, dtype=item.properties.dtype) if is_tensor else None
    return _as_lists(tree)


def _as_lists(node: Any) -> Any:
    """`node` with every dict whose keys are the list indices 0..n-1 turned back into that list."""
    if not isinstance(node, dict):
        return node
    node = {key: _as_lists(value) for key, value in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node


# ------------------------------------------------------------------------------------------- either kind

def load_checkpoint(path: str) -> dict:
    """A verified checkpoint of either kind, on the CPU: keys model, optimizer, loader, step, model_config,
    train_config (and data, for checkpoints that record it)."""
    if os.path.isdir(path):
        return _load_folder(path)
    if not os.path.isfile(path):
        raise cli.NotFoundError(f"no checkpoint at {path}")
    return _load_file(path)


def read_meta(path: str) -> dict:
    """Everything but the tensors: step, loader, model_config, train_config, data (cheap for folders)."""
    if os.path.isdir(path):
        return _verified_meta(path)
    return {k: v for k, v in load_checkpoint(path).items() if k not in ("model", "optimizer")}


def newest_intact(out_dir: str, set_aside: bool = False) -> tuple[str, dict]:
    """The newest checkpoint in out_dir that verifies, and its read_meta; each unusable newer one is reported
    on stderr and skipped. set_aside (for a run that resumes): once an intact one is found, rename the
    unusable newer ones to NAME.unusable, so that they are neither resumed from again nor counted among the
    kept checkpoints; nothing is deleted."""
    paths = checkpoint_paths(out_dir)
    if not paths:
        raise cli.NotFoundError(f"no checkpoint (ckpt_*.pt or ckpt_*/) in {out_dir}")
    unusable = []
    for path in reversed(paths):
        try:
            meta = read_meta(path)
        except CheckpointError as e:
            unusable.append((path, str(e)))
            print(f"skipping an unusable checkpoint: {e}", file=sys.stderr, flush=True)
            continue
        for bad, _ in unusable if set_aside else ():
            os.replace(bad, bad + ".unusable")
            print(f"renamed {bad} to {bad}.unusable", file=sys.stderr, flush=True)
        return path, meta
    raise CheckpointError(f"no intact checkpoint in {out_dir}: " + "; ".join(reason for _, reason in unusable))


def _all_finite(ctx: distributed.Context, state: dict) -> bool:
    """Collective: whether every floating-point value of every rank's part of `state` is finite."""
    bad = False
    for _, value in _leaves(state):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            local = value.to_local() if hasattr(value, "to_local") else value  # an FSDP shard
            bad = bad or not bool(torch.isfinite(local).all())
    return distributed.all_reduce(torch.tensor(float(bad), device=ctx.device), "max").item() == 0


def save(ctx: distributed.Context, model: nn.Module, optimizer: torch.optim.Optimizer, path: str,
         meta: dict) -> str:
    """Collective: every rank calls it. FSDP models write a sharded folder `path`, others the file
    `path + ".pt"` (from rank 0); returns the path written. A non-finite weight or optimizer value raises
    FloatingPointError on every rank and nothing is written."""
    raw = distributed.unwrap(model)
    model_state, optimizer_state = get_state_dict(raw, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    sharded = isinstance(raw, FSDPModule)
    target = path if sharded else path + ".pt"
    if not _all_finite(ctx, state):
        raise FloatingPointError(f"the weights or optimizer state hold NaN or inf: {target} was not written")
    if sharded:
        save_folder(ctx, state, path, meta)
    elif ctx.is_main:
        save_file(target, {**state, **meta})
    distributed.barrier(ctx)
    return target


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Fill model and optimizer from either kind, whatever the current world size: a sharded folder is
    resharded by torch.distributed.checkpoint; a file is loaded whole on every rank. A folder is read as it
    is: verify it first (newest_intact or read_meta)."""
    raw = distributed.unwrap(model)
    if isinstance(raw, FSDPModule) and os.path.isdir(path):
        _refuse_router_modules(path, dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        model_state, optimizer_state = get_state_dict(raw, optimizer)  # this rank's shards, to be filled
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(raw, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return
    full = load_checkpoint(path)
    _refuse_router_modules(path, full["model"])
    set_state_dict(raw, optimizer, model_state_dict=full["model"], optim_state_dict=full["optimizer"],
                   options=StateDictOptions(full_state_dict=isinstance(raw, FSDPModule)))


def _refuse_router_modules(path: str, keys) -> None:
    """A checkpoint from when each router was a module of its own (`routers.0.query`, ...; now one stacked
    parameter per kind, router.Routers): its model weights load (Model.load_state_dict stacks them), its optimizer
    state, kept per tensor, cannot be resumed."""
    if any(re.match(r"(model\.)?routers\.\d+\.", key) for key in keys):
        raise CheckpointError(f"{path}: written when each router was a module of its own (routers.0.query, ...): "
                              "its weights load (infra/trained.py: eval.py, sample.py, finetune.py export) but its "
                              "optimizer state cannot resume")


def consolidate(directory: str, out_path: str | None = None) -> str:
    """Write a sharded checkpoint folder as one checkpoint file; returns its path."""
    out_path = out_path or directory.rstrip("/") + ".full.pt"
    save_file(out_path, load_checkpoint(directory))
    return out_path


def remove(path: str) -> None:
    """Delete a checkpoint of either kind."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def resume_point(model_cfg: ModelConfig, cfg: TrainConfig,
                 ctx: distributed.Context) -> tuple[str | None, dict | None]:
    """With --resume: the newest intact checkpoint's path and metadata; else (None, None), refusing an out_dir
    that holds another run's checkpoints."""
    if not cfg.resume:
        existing = checkpoint_paths(cfg.out_dir)
        if existing:
            raise cli.InUseError(f"{cfg.out_dir} already holds checkpoints of another run "
                                 f"({os.path.basename(existing[-1])}): pass --resume to continue it, or "
                                 "choose another --out_dir")
        return None, None
    path, meta = distributed.on_main(ctx, lambda: newest_intact(cfg.out_dir, set_aside=True))
    saved, current = meta["model_config"], asdict(model_cfg)
    if saved != current:
        diff = {k for k in saved.keys() | current.keys() if saved.get(k, "(none)") != current.get(k, "(none)")}
        raise ConfigError(f"--resume: the model config differs from the checkpoint's in {sorted(diff)}")
    return path, meta


def main(argv: list[str]) -> str:
    if len(argv) not in (2, 3) or argv[0] != "consolidate":
        raise cli.UsageError("usage: python -m infra.checkpoint consolidate CKPT_DIR [OUT.pt]")
    if not os.path.isdir(argv[1]):
        raise cli.NotFoundError(f"{argv[1]} is not a sharded checkpoint folder (ckpt_*/ with {META})")
    path = consolidate(*argv[1:])
    print(path)
    return path


if __name__ == "__main__":
    cli.run(main)
