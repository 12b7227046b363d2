"""Checkpoints: the two formats train.py writes, their checksums, and reading them without trusting them.

A checkpoint is either one `torch.save` file `ckpt_{step:07d}.pt` (one process and DDP; rank 0 writes it) or,
under FSDP, a sharded `torch.distributed.checkpoint` folder `ckpt_{step:07d}/` (every rank writes its shards;
`meta.json` holds the step, loader position, configs and a SHA-256 of every file of the folder). Both hold
model, optimizer, loader, step, model_config, train_config and data (the tokenizer and vocabulary of the
shards), and `load_checkpoint` reads either kind into that dict, so eval.py and finetune.py read both. To turn
a sharded folder into one file (to copy or share it):

    python checkpoint.py consolidate out/run/ckpt_0001000            # -> out/run/ckpt_0001000.full.pt

Safety rules, each checked where the file is read or written:
- Files are read with `torch.load(weights_only=True)`: tensors and plain data only. A file that needs any
  other Python object (which could run code while it is unpickled) is refused, not loaded.
- Every checkpoint carries a checksum, verified on load: a file's covers its whole content (tensor bytes,
  numbers, strings); a folder's meta.json covers itself and the SHA-256 of each shard file, checked before
  torch's reader unpickles the folder's `.metadata`. `newest_intact` skips damaged checkpoints.
- A checkpoint is written under a temporary name, synced to disk and renamed (files.atomic_write), and only
  when every weight and optimizer value is finite.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.fsdp import FSDPModule

from infra import cli
from infra import distributed
from infra import files

_CKPT_NAME = re.compile(r"ckpt_(\d+)(\.pt)?$")
META = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: damaged, truncated, changed after it was written, or not this project's."""


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


def _unverified(path: str) -> None:
    warnings.warn(f"{path} has no checksum (written before checkpoints had one): loading it unverified",
                  stacklevel=3)


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
        _unverified(path)
    elif state["checksum"] != checksum(state):
        raise CheckpointError(f"{path} is damaged: its content does not match its checksum (changed after it "
                              "was written: a disk, copy or transfer error?)")
    state.pop("checksum", None)
    return state


# --------------------------------------------------------------------------------------- sharded folders

def _verified_meta(path: str) -> dict:
    """A sharded folder's meta.json after checking its checksum and every shard file's SHA-256."""
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{path} is not a finished sharded checkpoint (no {META})")
    meta = files.read_json(meta_path)
    if "checksum" not in meta:
        _unverified(path)
        return meta
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


def _save_folder(ctx: distributed.Context, state: dict, path: str, meta: dict) -> None:
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
    state: dict = {}
    # As format_utils.dcp_to_torch_save does: the empty planner fills `state` with every stored tensor.
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _load_state_dict(state, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    return {**state, **meta}


# ------------------------------------------------------------------------------------------- either kind

def load_checkpoint(path: str) -> dict:
    """A verified checkpoint of either kind, on the CPU: keys model, optimizer, loader, step, model_config,
    train_config (and data, for checkpoints that record it)."""
    if os.path.isdir(path):
        return _load_folder(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
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
        raise FileNotFoundError(f"no checkpoint (ckpt_*.pt or ckpt_*/) in {out_dir}")
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
    state = {"model": get_model_state_dict(raw), "optimizer": get_optimizer_state_dict(raw, optimizer)}
    sharded = isinstance(raw, FSDPModule)
    target = path if sharded else path + ".pt"
    if not _all_finite(ctx, state):
        raise FloatingPointError(f"the weights or optimizer state hold NaN or inf: {target} was not written")
    if sharded:
        _save_folder(ctx, state, path, meta)
    elif ctx.is_main:
        save_file(target, {**state, **meta})
    distributed.barrier(ctx)
    return target


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, path: str, loaded: dict | None = None) -> None:
    """Fill model and optimizer from either kind, whatever the current world size: a sharded folder is
    resharded by torch.distributed.checkpoint; a file (or its `loaded` content) is loaded whole on every rank.
    A folder is read as it is: verify it first (newest_intact or read_meta)."""
    raw = distributed.unwrap(model)
    if isinstance(raw, FSDPModule) and os.path.isdir(path):
        state = {"model": get_model_state_dict(raw), "optimizer": get_optimizer_state_dict(raw, optimizer)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(raw, state["model"])
        set_optimizer_state_dict(raw, optimizer, state["optimizer"])
        return
    full = loaded if loaded is not None and "model" in loaded else load_checkpoint(path)
    options = StateDictOptions(full_state_dict=isinstance(raw, FSDPModule))
    set_model_state_dict(raw, full["model"], options=options)
    set_optimizer_state_dict(raw, optimizer, full["optimizer"], options=options)


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


def main(argv: list[str]) -> str:
    if len(argv) not in (2, 3) or argv[0] != "consolidate":
        raise ValueError("usage: python checkpoint.py consolidate CKPT_DIR [OUT.pt]")
    path = consolidate(*argv[1:])
    print(path)
    return path


if __name__ == "__main__":
    cli.run(main)
