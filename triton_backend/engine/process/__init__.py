"""The engine in a process of its own: `executor.py` (`ProcessExecutor`, the executor a Triton
model talks to), `handle.py` (starting the process and waiting for it to be ready) and `main.py`
(the process itself: `python -m triton_backend.engine.process.main`)."""
