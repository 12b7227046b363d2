"""One intra-op thread per test process: the tests' tensors are tiny, and the two-rank torchrun tests
would otherwise oversubscribe a 2-core machine (one test measured 136 s with default threads vs 2 s)."""
import torch

torch.set_num_threads(1)
