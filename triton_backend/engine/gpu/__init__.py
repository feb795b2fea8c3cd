"""The engine's GPU backend, beside the CPU kernels (`cpu/`) behind the same ops interface:
paged attention reading the cache in place (a Triton kernel), decode steps captured as CUDA
graphs, sampling on the device. Chosen once at load by `backend.select_ops` on a CUDA device."""
