"""The parallel plumbing of train.py: the device and precision rule (also eval's, sample's and finetune's), the
process group from torchrun's environment, running a step on rank 0 for every rank, stop requests from
SIGINT/SIGTERM, DDP or FSDP2 wrapping with activation checkpointing and per-sublayer compilation, and
gradient-sync control. Checkpoints are checkpoint.py's.

The precision rule, one for a single process, DDP and FSDP2 (`precision="auto"`: "bf16" on CUDA, "fp32" on the
CPU; any of the three can be asked for on any device):

    bf16    the matrix multiplies (attention and MLP projections, the LM head) run in bf16 under autocast;
            everything else computes in fp32: the embedding e, so the residual stream h~ sums in fp32; the
            RMSNorm weights (pre-norms, the final norm, and but under FSDP2 the q/k norms); every router
            parameter (query, norm weight, gate, null source), so routing logits, weights and the read-out r
            are fp32. The sources are e (fp32) and the sublayer outputs v_l, bf16 as the matmuls return them.
            Parameters and AdamW's states are fp32; FSDP2 gathers the layers in bf16 (half the traffic; the
            values autocast casts the matrices to, while the layers' q/k-norm weights become bf16 copies:
            `shard`) and reduces gradients in fp32.
    fp32    everything in fp32, no autocast.
    bf16-params  the authors' recipe: the whole model cast to bf16 (`model.to(torch.bfloat16)` in `parallelize`),
            no autocast. Parameters, gradients, AdamW's states, the embedding and so the residual stream, every
            source, norm weight and router parameter are bf16; RMSNorm and the depth softmax still compute in
            fp32 inside and return bf16 (router.py), and the loss is fp32 (train.loss_fn). DDP all-reduces bf16
            gradients; FSDP2 gathers the bf16 shards as they are and reduces gradients in fp32. It saves half the
            bytes of parameters, gradients and AdamW's states (8 per parameter, not 16). It costs precision: the
            stream rounds to 8 significant bits at every residual add, and a change smaller than half the
            spacing of bf16 numbers at a weight (2^-9 to 2^-8 of its size) is rounded away. So a norm weight at 1
            ignores AdamW steps (about lr in size) below 0.002 downwards and 0.004 upwards (at lr 3e-3 it can
            only fall), and AdamW's decoupled decay, a multiply by 1 - lr * weight_decay apart from the step
            (torch's foreach and single-tensor AdamW), does nothing while lr * weight_decay < 2^-9.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import os
import signal
import sys
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from infra import adamw
from infra import cli
from model import Model

PARALLEL = ("ddp", "fsdp")
PRECISIONS = ("auto", "bf16", "fp32", "bf16-params")
COMPILE_REGIONS = ("sublayers", "model")     # what torch.compile takes as one region: compile_sublayers, compile_model
COMPILE_MODES = ("default", "reduce-overhead")   # torch.compile's mode: "reduce-overhead" replays CUDA graphs
T = TypeVar("T")


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


def pick_device(name: str = "auto") -> torch.device:
    """The one device rule: "auto" is CUDA when it is available, else the CPU; any other name (cpu, cuda,
    cuda:1) is taken as given. CUDA without an index is this process's GPU: LOCAL_RANK's under torchrun."""
    try:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    except RuntimeError:  # what torch raises for a string that names no device
        raise cli.UsageError(f"device={name!r}: allowed values are auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise cli.UsageError(f"device={name!r} but CUDA is not available here: use device=cpu or auto")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def compute_dtype(device: torch.device, precision: str = "auto") -> torch.dtype:
    """The dtype of the matrix multiplies under the precision rule (the module's docstring)."""
    if precision not in PRECISIONS:
        raise cli.UsageError(f"precision={precision!r}: allowed values are {', '.join(PRECISIONS)}")
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if precision in ("bf16", "bf16-params") else torch.float32


def autocast(device: torch.device, precision: str = "auto") -> ContextManager:
    """The precision rule for forward passes (the module's docstring): bf16 autocast, or none (fp32, and
    bf16-params, whose model is bf16 already)."""
    dtype = compute_dtype(device, precision)
    use = dtype != torch.float32 and precision != "bf16-params"
    return torch.autocast(device.type, dtype=dtype) if use else nullcontext()


def setup(device: str = "auto", timeout_s: float = 600.0) -> Context:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK; NCCL on CUDA, gloo on CPU),
    or run as one process. An already initialised group (e.g. a test harness's) is used as it is.

    timeout_s: how long a collective waits for the other ranks before it fails, so that a rank that hung or
    died ends the job instead of blocking the others indefinitely."""
    if device not in ("auto", "cpu", "cuda"):
        raise cli.UsageError(f"device={device!r}: allowed values are auto, cpu, cuda")
    dev = pick_device(device)
    use_cuda = dev.type == "cuda"
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not dist.is_initialized():
        return Context(0, 1, dev, owns_group=False)
    if use_cuda:
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return Context(dist.get_rank(), dist.get_world_size(), dev, owns_group=owns)


def teardown(ctx: Context) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def end_worker() -> None:
    """The end of a worker process that a harness started under torchrun (a test's, the rehearsal's), once its
    results are written: every rank leaves the group together, then the process exits without the interpreter's
    teardown. There, gloo's worker threads may still hold work whose destruction needs the interpreter, and a rank
    then aborts (SIGABRT, "terminate called without an active exception") after all its work has passed."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def barrier(ctx: Context) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In place over all ranks (a no-op on one process); op is "sum" or "max"."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


class RankTimeoutError(cli.RankFailureError, TimeoutError):
    """Under torchrun: a collective waited more than dist_timeout_s for a rank that hung or died."""


class RankLostError(cli.RankFailureError, ConnectionError):
    """Under torchrun: another rank ended while this one waited for it."""


@contextlib.contextmanager
def rank_failures(ctx: Context, timeout_s: float) -> Iterator[None]:
    """Around a run: what a collective raises when another rank never comes (RankTimeoutError) or has ended
    (RankLostError), as one line for the user. torch gives these failures no type of their own: its message is
    the only way to tell them apart."""
    try:
        yield
    except RuntimeError as e:
        reason = str(e).splitlines()[0]
        if ctx.world_size > 1 and "timed out" in reason.lower():
            raise RankTimeoutError(f"rank {ctx.rank} waited more than dist_timeout_s={timeout_s:g}s for the other "
                                   f"ranks: one of them hung or died ({reason})") from e
        if ctx.world_size > 1 and "closed by peer" in reason.lower():
            raise RankLostError(f"rank {ctx.rank} lost another rank, which has ended ({reason})") from e
        raise


def on_main(ctx: Context, fn: Callable[[], T]) -> T:
    """Collective: fn() runs on rank 0 only and every rank gets its (picklable) result. If it raises, rank 0
    raises that error and the other ranks raise one that quotes it (a cli.UserError if rank 0's is one, so
    that no rank prints a traceback for the user's mistake), so no rank is left waiting for rank 0 in a later
    collective."""
    if ctx.world_size == 1:
        return fn()
    box: list = [None]
    error = None
    if ctx.is_main:
        try:
            box = [("ok", fn(), False)]
        except Exception as e:
            error, box = e, [("error", f"{type(e).__name__}: {e}", isinstance(e, cli.UserError))]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    status, value, user_error = box[0]
    if status == "error":
        raise (cli.UserError if user_error else RuntimeError)(f"rank 0 failed: {value}")
    return value


class StopRequest:
    """SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption; torchrun forwards it to every rank) become a
    request to stop at the end of the current step, which train.py turns into a checkpoint on every rank at
    the same step. A second SIGINT quits at once without saving; a second SIGTERM changes nothing. Outside the
    main thread signals cannot be caught, and nothing changes.
    """

    def __init__(self, announce: bool):
        self.announce = announce
        self.signal: int | None = None   # the first signal received
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signal is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signal = signum
        if self.announce:  # os.write: print is not safe inside a signal handler
            os.write(sys.stderr.fileno(), f"{signal.Signals(signum).name}: saving a checkpoint at the end of this "
                                          f"step, then stopping (Ctrl-C again quits without saving)\n".encode())


# ------------------------------------------------------------------------------------------- wrapping

def checkpoint_activations(model: Model) -> None:
    """Recompute each attention and MLP module in backward instead of storing its activations. The unit is
    the sublayer, not the layer, because the routed (and pre-normed) input is computed between sublayers.
    The forward is replaced in place, so parameter names and checkpoint keys do not change."""
    for layer in model.layers:
        for m in (layer.self_attn, layer.mlp):
            m.forward = functools.partial(checkpoint, m.forward, use_reentrant=False)


def compile_sublayers(model: Model, backend: str | Callable = "inductor", mode: str = "default") -> None:
    """torch.compile the forward of every attention, MLP and norm module.

    Modules of one class share their compiled graph across layers, so the graph count does not grow with
    depth: a 36-layer model compiles at most 3 forward and 3 backward graphs (RMSNorm, Attention, MLP; the
    kernel path applies the pre-norms itself and calls only the final norm). Depth routing runs between the
    compiled sublayers (its fast path is a kernel), so its number of sources, which changes from sublayer to
    sublayer, never reaches a compiled graph; the kernel path's reads are also kept out of a graph traced
    around the whole model (depth_kernels/grouped_state.py), which then breaks at each read. Forwards are replaced in
    place: parameter names, FSDP hooks and checkpoint keys stay as they are.
    """
    modules = [model.norm] + [m for layer in model.layers
                              for m in (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm,
                                        layer.mlp)]
    for m in modules:
        m.forward = _compile(m.forward, backend, mode)


def compile_model(model: Model, backend: str | Callable = "inductor", mode: str = "default") -> None:
    """torch.compile the model's whole forward as one region: one call from the host per step forward and one
    backward, where compile_sublayers makes 4 L + 1 calls each way with the routing run eagerly between them.

    The reference routing path (kernel="torch", and every method on the CPU) traces whole: the number of sources
    of each read is fixed by its place in the unrolled layer loop, so one graph holds the model at any depth (it
    grows with depth, and so does its compile time). The kernel path's reads stay out of traced graphs
    (depth_kernels/grouped_state.py), so there the region breaks at each read. The forward is replaced in place:
    parameter names and checkpoint keys stay as they are.
    """
    model.forward = _compile(model.forward, backend, mode)


# Checks the generated code would otherwise make at every call: each input's sizes and strides (dynamo's guards
# have checked them before the call), each extern kernel's output layout (fixed by the operator) and alignment
# (a misaligned input is copied by the runtime first). At 36 layers they were 8.4 of the baseline's 80.8 M
# instructions of host work a step (meters.host, whole forward compiled).
UNCHECKED = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


def _compile(fn: Callable, backend: str | Callable, mode: str) -> Callable:
    """torch.compile with `mode`'s settings and without the generated code's redundant checks (UNCHECKED); only
    inductor takes either."""
    if backend != "inductor":
        return torch.compile(fn, backend=backend)
    from torch._inductor import list_mode_options      # imported with the compiler, not with this module
    return torch.compile(fn, backend=backend, options={**list_mode_options(mode), **UNCHECKED})


def shard(model: Model, ctx: Context, precision: str = "auto") -> None:
    """FSDP2: one parameter group per transformer layer, then the root (embedding, routers, pre-norms and the
    final norm).

    A layer's forward is two sublayer calls with routing in between, so its group is the list [attention,
    MLP]: FSDP all-gathers it before the attention call and frees it after the MLP call, and its hooks run
    around the sublayers' (compiled) forwards, never inside them. The pre-norms stay with the root (2 L d
    numbers): the routing reads their weights directly when it fuses the read with the norm
    (depth_kernels/grouped_state.py), outside any module call that could trigger an all-gather. The root keeps its
    parameters in fp32 and the layers are gathered in the compute dtype, as the precision rule says (the
    module's docstring): the one difference from DDP's autocast is that a layer's q/k-norm weights, which sit
    in its attention, compute as bf16 copies there. Gradients are reduced in fp32; the sharded fp32 copies are
    what AdamW updates. Inputs are not cast: autocast casts them at each matmul, as under DDP.
    """
    mesh = dist.device_mesh.init_device_mesh(ctx.device.type, (ctx.world_size,))
    layers = MixedPrecisionPolicy(param_dtype=compute_dtype(ctx.device, precision), reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    for layer in model.layers:
        fully_shard([layer.self_attn, layer.mlp], mesh=mesh, mp_policy=layers)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))


def check_compile_backend(backend: str) -> None:
    import torch._dynamo  # only when compiling: importing dynamo costs a second
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise cli.UsageError(f"compile_backend={backend!r}: allowed values are {', '.join(sorted(known))}")


def parallelize(model: Model, parallel: str, ctx: Context, *, activation_checkpointing: bool = False,
                compile: bool = False, compile_backend: str = "inductor", compile_regions: str = "sublayers",
                compile_mode: str = "default", precision: str = "auto") -> nn.Module:
    """Cast to bf16 for precision="bf16-params", apply activation checkpointing and compilation (the sublayers,
    or the whole forward with the checkpointed sublayers inside it), then DDP or FSDP2. Returns the module to
    call; its parameter names (and, except under FSDP, objects: `.to` casts each parameter's data in place) are
    `model`'s."""
    if parallel not in PARALLEL:
        raise cli.UsageError(f"parallel={parallel!r}: allowed values are {', '.join(PARALLEL)}")
    if compile_regions not in COMPILE_REGIONS:
        raise cli.UsageError(f"compile_regions={compile_regions!r}: allowed values are {', '.join(COMPILE_REGIONS)}")
    if compile and compile_mode == "reduce-overhead" and parallel == "fsdp":
        raise cli.UsageError("compile_mode='reduce-overhead' replays CUDA graphs, which need the parameters at fixed "
                             "addresses; FSDP2 gathers them into new memory every step: use parallel='ddp'")
    if precision == "bf16-params":
        model.to(torch.bfloat16)
    if compile and compile_regions == "sublayers":
        check_compile_backend(compile_backend)
        # Under DDP dynamo would cut every compiled graph at DDP's gradient-bucket boundaries (optimize_ddp),
        # so that a bucket's all-reduce can start inside the graph's backward: an MLP's fp32 matrices fill
        # more than one bucket. Each graph here is one sublayer, whose backward already ends where the next
        # bucket can start, so the graphs stay whole: one per sublayer kind, as in one process.
        torch._dynamo.config.optimize_ddp = False
        compile_sublayers(model, compile_backend, compile_mode)
    if activation_checkpointing:          # around the compiled sublayers; inside a compiled model
        checkpoint_activations(model)
    if compile and compile_regions == "model":
        check_compile_backend(compile_backend)
        torch._dynamo.config.optimize_ddp = True   # the one graph is cut at the buckets, so all-reduces overlap
        compile_model(model, compile_backend, compile_mode)
    if parallel == "fsdp":
        shard(model, ctx, precision)
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


def rebind(groups: list[dict], names: dict[int, str], model: nn.Module) -> list[dict]:
    """Optimizer groups over `model`'s current parameters: FSDP replaces parameter objects by sharded ones,
    so groups are carried by parameter name."""
    params = dict(model.named_parameters())
    out = []
    for group in groups:
        if any(id(p) not in names for p in group["params"]):
            raise ValueError("an optimizer group holds a tensor that is not a parameter of the model")
        out.append({**group, "params": [params[names[id(p)]] for p in group["params"]]})
    return out


def clip_grad_norm(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """The global norm of the gradients of what `optimizer` updates, before clipping them (a plain tensor, also
    when FSDP's gradients are shards). foreach on every device: a few multi-tensor operations, not some per
    parameter (on a CPU the same numbers). The optimizer's lists, not model.parameters(): walking the modules for
    it cost 2-3 ms of host time a step at 36 layers (meters.host); infra.adamw.AdamW's lists, kept between steps,
    where it is that optimizer."""
    if isinstance(optimizer, adamw.AdamW):
        norm = optimizer.clip_grad_norm(max_norm or float("inf"))
    else:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm or float("inf"), foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
