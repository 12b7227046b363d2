"""Fast paths for depth routing, verified against router.py's reference: what every launch shares (launch.py),
Eq. 1 as one kernel pair (depth_route.py), the model's grouped read in two phases (grouped.py, receiver.py) run
by a memory-lean depth state (lean.py), and the meters and checks: saved memory (memory.py), bytes moved
(traffic.py), the sm_90 build (aot.py) and the GPU benchmark (bench.py).

Nothing here is imported by model.py until the kernel path is chosen: Triton decides at import time whether
to interpret (TRITON_INTERPRET=1, how the CPU tests run the kernels)."""
