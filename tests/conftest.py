"""One intra-op thread per test process: the tests' tensors are tiny, and the two-rank torchrun tests
would otherwise oversubscribe a 2-core machine (one test measured 136 s with default threads vs 2 s).
Without CUDA the Triton kernels run in Triton's interpreter, which must be chosen before triton is first
imported (importing torch._dynamo imports it), so here, before any test module."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

torch.set_num_threads(1)
