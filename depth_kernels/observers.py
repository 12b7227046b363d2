"""Watching the routing kernels' launches, for the meters (meters/): every launch goes through launch.launch,
which first hands a description of it (kernel, arguments, what it reads and writes, built only when someone
observes) to the observers here. meters/traffic.py counts bytes with it, meters/aot.py compiles exactly the
specialisations the model launches, meters/bench.py times the host path without launching, and
`skipped_launches` skips launches unobserved (meters/host.py, meters/peak.py). Nothing here runs while no one
observes: the model's path pays one test of two empty lists per launch.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import triton
from torch import Tensor

# io() -> (reads, writes): what a launch reads, each a Tensor or a launch.SourceTable (every source in it) with
# how many times, and the tensors it writes
IO = Callable[[], tuple[list[tuple[object, int]], list[Tensor]]]


@dataclass
class Launch:
    """One kernel launch as observers see it: the kernel, its grid and keyword arguments (launch options
    included), and what it reads and writes in full: tensors, or a SourceTable (every source in it), each
    read the given number of times."""
    kernel: triton.JITFunction
    grid: int
    args: dict
    reads: list[tuple[object, int]]          # (a Tensor or a launch.SourceTable, times read)
    writes: list[Tensor]


_observers: list[Callable[[Launch], bool]] = []
_skipping: list[list[str]] = []      # the open skipped_launches blocks' lists of kernel names


@contextmanager
def observe_launches(observer: Callable[[Launch], bool]) -> Iterator[None]:
    """Call observer(launch) before every launch in the block; the launch is skipped if it returns True
    (so launches can be counted on meta tensors, or timed without a GPU)."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


@contextmanager
def skipped_launches() -> Iterator[list[str]]:
    """Skip every launch in the block, listing the kernels' names, without describing them to observers: the
    host work of a GPU run less its launches (meters/host.py measures it so)."""
    names: list[str] = []
    _skipping.append(names)
    try:
        yield names
    finally:
        _skipping.remove(names)


def intercepted(kernel: triton.JITFunction, grid: int, args: dict, io: IO) -> bool:
    """Whether this launch is taken away from the device: by an open skipped_launches block (which lists its
    kernel's name), or by an observer that returns True. io() -> (reads, writes) is asked only while an observer
    watches."""
    if _skipping:
        _skipping[-1].append(kernel.fn.__name__)
        return True
    if _observers:
        seen = Launch(kernel, grid, args, *io())
        return any([observer(seen) for observer in _observers])   # a list: every observer sees it
    return False
