"""Fast paths for depth routing, verified against router.py's reference: Triton kernels (depth_route.py), the
model's memory-lean fused read (lean.py), saved-memory accounting (memory.py) and a GPU benchmark (bench.py).

Nothing here is imported by model.py until the kernel path is chosen: Triton decides at import time whether
to interpret (TRITON_INTERPRET=1, how the CPU tests run the kernels)."""
