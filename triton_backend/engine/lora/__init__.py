"""Multi-LoRA serving: adapters in the runtime layout (`layout.py`, `nvidia.py`), the adapter
cache (`cache.py`) and the per-step batched application (`batch.py`)."""
