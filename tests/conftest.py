"""One intra-op thread per test process: the tests' tensors are tiny, and the two-rank torchrun tests
would otherwise oversubscribe a 2-core machine (one test measured 136 s with default threads vs 2 s).
Without CUDA the Triton kernels run in Triton's interpreter, which must be chosen before triton is first
imported (importing torch._dynamo imports it), so here, before any test module.

The slowest files run first (pytest.ini keeps this order: --no-loadscope-reorder), so that the two workers
finish together: on a fresh machine (no Triton cache) the sm_90 compile of tests/test_gpu_ready.py is some 12
minutes of one core, which it spreads over every core, and started last it ran alone at the end."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

torch.set_num_threads(1)


SLOWEST_FIRST = ("test_gpu_ready.py", "test_kernels.py", "test_distributed.py", "test_rehearsal.py")
# What `pytest -m "not slow"` (the quick subset, README) leaves out, and why: the rest runs in a few minutes on 2 cores
SLOW = {"test_gpu_ready.py": "the offline sm_90 compile of every kernel",
        "test_kernels.py": "the kernels in Triton's interpreter",
        "test_distributed.py": "two-rank torchrun jobs",
        "test_rehearsal.py": "training through the interpreted kernels",
        "test_whole_run.py": "whole models stepped through the interpreted kernels",
        "test_every_module_imports_alone_in_a_fresh_interpreter": "a fresh interpreter per module"}


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FIRST)))   # stable: files stay whole
    for item in items:
        if item.path.name in SLOW or item.originalname in SLOW:
            item.add_marker("slow")
