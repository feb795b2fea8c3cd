"""The CPU backend's room: the C++ kernels (`kernels.py` builds and loads `csrc/`), the packed GEMM
layouts and plans (`linear.py`), the one-call decode forward (`forward.py`), and the backend the
runner calls (`ops.CppOps`)."""
