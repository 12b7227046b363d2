"""The parallel plumbing of train.py: the process group from torchrun's environment, DDP or FSDP2 wrapping
with activation checkpointing and per-sublayer compilation, gradient-sync control, and checkpoints.

A checkpoint is either one `torch.save` file `ckpt_{step:07d}.pt` (single process and DDP; rank 0 writes
it) or, for FSDP, a sharded `torch.distributed.checkpoint` directory `ckpt_{step:07d}/` (every rank writes
its shards; `meta.json` holds the step, loader position and configs). Both are written under a temporary
name and renamed, so a crash mid-save leaves the previous checkpoint intact. `load_checkpoint` reads either
kind into the same dict (keys model, optimizer, loader, step, model_config, train_config), so eval.py and
finetune.py read both; to turn a sharded directory into one file (to copy or share it):

    python distributed.py consolidate out/run/ckpt_0001000            # -> out/run/ckpt_0001000.full.pt
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from model import Model

PARALLEL = ("ddp", "fsdp")
_CKPT_NAME = re.compile(r"ckpt_(\d+)(\.pt)?$")


# ------------------------------------------------------------------------------------------ processes

@dataclass(frozen=True)
class Context:
    """Where this process sits: rank among world_size processes and the device it computes on."""
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool        # this process group was created by setup() and is destroyed by teardown()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device: str = "auto") -> Context:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK; NCCL on CUDA, gloo on CPU),
    or run as one process. An already initialised group (e.g. a test harness's) is used as it is."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r}: allowed values are auto, cpu, cuda")
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but CUDA is not available")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 and not dist.is_initialized():
        return Context(0, 1, torch.device("cuda" if use_cuda else "cpu"), owns_group=False)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    return Context(dist.get_rank(), dist.get_world_size(), dev, owns_group=owns)


def teardown(ctx: Context) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: Context) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In place over all ranks (a no-op on one process); op is "sum" or "max"."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


# ------------------------------------------------------------------------------------------- wrapping

def checkpoint_activations(model: Model) -> None:
    """Recompute each attention and MLP module in backward instead of storing its activations. The unit is
    the sublayer, not the layer, because the routed (and pre-normed) input is computed between sublayers.
    The forward is replaced in place, so parameter names and checkpoint keys do not change."""
    for layer in model.layers:
        for m in (layer.self_attn, layer.mlp):
            m.forward = functools.partial(checkpoint, m.forward, use_reentrant=False)


def compile_sublayers(model: Model, backend: str | Callable = "inductor") -> None:
    """torch.compile the forward of every attention, MLP and norm module.

    Modules of one class share their compiled graph across layers, so the graph count does not grow with
    depth: a 36-layer model compiles at most 3 forward and 3 backward graphs (RMSNorm, Attention, MLP; the
    kernel path applies the pre-norms itself and calls only the final norm). Depth routing runs between the
    compiled sublayers (its fast path is a kernel), so its number of sources, which changes from sublayer to
    sublayer, never reaches a compiled graph. Forwards are replaced in place: parameter names, FSDP hooks and checkpoint
    keys stay as they are.
    """
    modules = [model.norm] + [m for layer in model.layers
                              for m in (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm,
                                        layer.mlp)]
    for m in modules:
        m.forward = torch.compile(m.forward, backend=backend)


def shard(model: Model, ctx: Context) -> None:
    """FSDP2: one parameter group per transformer layer, then the root (embedding, routers, every norm).

    A layer's forward is two sublayer calls with routing in between, so its group is the list [attention,
    MLP]: FSDP all-gathers it before the attention call and frees it after the MLP call. The pre-norms stay
    with the root (2 L d numbers): the routing reads their weights directly when it fuses the read with the
    norm (kernels/lean.py), outside any module call that could trigger an all-gather. On CUDA parameters
    compute in bf16 and gradients are reduced in fp32; the sharded fp32 copies are what AdamW updates.
    """
    mesh = dist.device_mesh.init_device_mesh(ctx.device.type, (ctx.world_size,))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if ctx.device.type == "cuda" else MixedPrecisionPolicy())
    for layer in model.layers:
        fully_shard([layer.self_attn, layer.mlp], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def parallelize(model: Model, parallel: str, ctx: Context, *, activation_checkpointing: bool = False,
                compile: bool = False) -> nn.Module:
    """Apply compilation, activation checkpointing (around the compiled forwards), then DDP or FSDP2.
    Returns the module to call; its parameter names (and, except under FSDP, objects) are `model`'s."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel={parallel!r}: allowed values are {', '.join(PARALLEL)}")
    if compile:
        compile_sublayers(model)
    if activation_checkpointing:
        checkpoint_activations(model)
    if parallel == "fsdp":
        shard(model, ctx)
        return model
    if ctx.world_size > 1:
        return DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def gradient_sync(model: nn.Module, enabled: bool) -> ContextManager:
    """Around a micro-step's forward and backward: with enabled=False, gradients only accumulate locally
    (DDP no_sync, FSDP2 set_requires_gradient_sync(False)); the final micro-step reduces them once."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    elif isinstance(model, DistributedDataParallel) and not enabled:
        return model.no_sync()
    return nullcontext()


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm before clipping (a plain tensor, also when FSDP's gradients are shards)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# ---------------------------------------------------------------------------------------- checkpoints

def checkpoint_paths(out_dir: str) -> list[str]:
    """The checkpoints in out_dir (`ckpt_{step}.pt` files and sharded `ckpt_{step}/` directories), oldest
    first. Unfinished saves (`*.tmp`) and consolidated copies (`*.full.pt`) are not listed."""
    if not os.path.isdir(out_dir):
        return []
    found = []
    for name in os.listdir(out_dir):
        match = _CKPT_NAME.fullmatch(name)
        path = os.path.join(out_dir, name)
        if match and (os.path.isfile(path) if match.group(2) else os.path.isdir(path)):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def save_checkpoint(path: str, state: dict) -> None:
    """Write to a temporary file, then rename: a crash mid-write never corrupts the previous checkpoint."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """A checkpoint file, or a sharded directory consolidated in memory (no process group needed)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "meta.json")):
            raise FileNotFoundError(f"{path} is not a finished sharded checkpoint (no meta.json)")
        # As format_utils.dcp_to_torch_save does: the empty planner fills `state` with every stored tensor.
        state: dict = {}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _load_state_dict(state, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(),
                             no_dist=True)
        return {**state, **read_meta(path)}
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    return torch.load(path, map_location=map_location, weights_only=False)


def read_meta(path: str) -> dict:
    """Everything but the tensors: step, loader, model_config, train_config (cheap for sharded checkpoints)."""
    if os.path.isdir(path):
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    return {k: v for k, v in load_checkpoint(path).items() if k not in ("model", "optimizer")}


def consolidate(directory: str, out_path: str | None = None) -> str:
    """Write a sharded checkpoint directory as one `torch.save` file; returns its path."""
    out_path = out_path or directory.rstrip("/") + ".full.pt"
    save_checkpoint(out_path, load_checkpoint(directory))
    return out_path


def remove(path: str) -> None:
    """Delete a checkpoint of either kind."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def save(ctx: Context, model: nn.Module, optimizer: torch.optim.Optimizer, path: str, meta: dict) -> None:
    """Collective: every rank calls it. FSDP models write a sharded directory `path`, others `path + ".pt"`."""
    if isinstance(model, FSDPModule):
        tmp = path + ".tmp"
        if ctx.is_main and os.path.exists(tmp):
            shutil.rmtree(tmp)  # left by a crashed save
        barrier(ctx)
        dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=tmp)
        if ctx.is_main:
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f)
            if os.path.exists(path):
                shutil.rmtree(path)
            os.replace(tmp, path)
    else:
        raw = unwrap(model)
        state = {"model": get_model_state_dict(raw), "optimizer": get_optimizer_state_dict(raw, optimizer)}
        if ctx.is_main:
            save_checkpoint(path + ".pt", {**state, **meta})
    barrier(ctx)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Fill model and optimizer from either checkpoint kind, whatever the current world size: a sharded
    directory is resharded by torch.distributed.checkpoint; a single file is loaded whole on every rank."""
    raw = unwrap(model)
    if isinstance(raw, FSDPModule) and os.path.isdir(path):
        state = {"model": get_model_state_dict(raw), "optimizer": get_optimizer_state_dict(raw, optimizer)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(raw, state["model"])
        set_optimizer_state_dict(raw, optimizer, state["optimizer"])
        return
    full = load_checkpoint(path)
    options = StateDictOptions(full_state_dict=isinstance(raw, FSDPModule))
    set_model_state_dict(raw, full["model"], options=options)
    set_optimizer_state_dict(raw, optimizer, full["optimizer"], options=options)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] != "consolidate":
        sys.exit("usage: python distributed.py consolidate CKPT_DIR [OUT.pt]")
    print(consolidate(*sys.argv[2:]))
