"""`forge gpu-check`: the engine proven on a GPU in one command (parity with transformers, speed
against transformers and the memory roofline, FP8 against bf16, served through Triton), or the
same checks on small shapes on a CPU. `run.py` orchestrates; `models.py` makes the checkpoints
and engines; `parity.py`, `speed.py` and `served.py` measure; `table.py` prints."""
