"""Meters and build checks of the kernels, apart from the fast path: saved bytes (memory), peak memory
(peak), bytes moved and the speed they predict (traffic), the sm_90 build check (aot), GPU benchmarks
(bench)."""
