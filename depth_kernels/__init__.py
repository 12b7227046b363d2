"""Fast paths for depth routing, verified against router.py's reference: what every launch shares (launch.py),
Eq. 1 as one kernel pair (depth_route.py), the model's grouped read in two phases (group_read.py,
receiver_read.py) run by the model's grouped depth state (grouped_state.py). The meters and build checks live
apart, in meters/.

Nothing here is imported by model.py until the kernel path is chosen: Triton decides at import time whether
to interpret (TRITON_INTERPRET=1, how the CPU tests run the kernels)."""
