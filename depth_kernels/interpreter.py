"""Triton's interpreter (TRITON_INTERPRET=1, how the kernels run on a CPU and in the tests), made faithful and
quick enough: `interpreting()` says whether it is on; when it is, importing this module patches two of its
methods, each explained below (a rounding the GPU does and the interpreter does not, and a per-call cost that
would make the interpreted kernels twice as slow). Nothing here changes a compiled kernel.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder, InterpreterError, TensorHandle


@triton.jit
def _probe():
    pass


@functools.cache
def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1 when triton was imported): decided
    once, as Triton decides it, though every launcher's configuration asks."""
    return isinstance(_probe, InterpretedFunction)


_interpreted_call = InterpretedFunction.__call__


def _call_helper(self: InterpretedFunction, *args, **kwargs):
    """A call of one of this package's jit helpers inside an interpreted kernel. Triton's interpreter patches
    triton.language anew at every such call (a few ms: about half of the interpreted kernels' time, since the
    helpers are called per source and per row); the kernel's launch has already patched the `tl` these
    helpers use, so theirs run as they are. Triton's own helpers (tl.zeros, ...) use other modules and keep
    the interpreter's call."""
    if not self.fn.__module__.startswith(__package__ + "."):
        return _interpreted_call(self, *args, **kwargs)
    try:
        return self.rewrite()(*args, **kwargs)
    except Exception as e:
        raise InterpreterError(repr(e)) from e


_interpreted_cast = InterpreterBuilder.cast_impl


def _cast_rounded(self: InterpreterBuilder, src: TensorHandle, dst_type: tl.dtype) -> TensorHandle:
    """A cast in an interpreted kernel, fp32 -> bf16 rounded to nearest even, as a GPU's conversion (and torch's)
    rounds it: Triton's interpreter truncates it, which would make every bf16 value an interpreted kernel writes
    differ from the GPU's in half the cases (and a bf16 stream drift toward zero, add by add)."""
    if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
        return _interpreted_cast(self, src, dst_type)
    values = torch.from_numpy(np.array(src.data, dtype=np.float32).reshape(-1))   # a copy: writable, contiguous
    bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)   # bf16 is held as uint16 there
    return TensorHandle(bits.reshape(np.shape(src.data)), dst_type.scalar)


if interpreting():
    InterpretedFunction.__call__ = _call_helper
    InterpreterBuilder.cast_impl = _cast_rounded


