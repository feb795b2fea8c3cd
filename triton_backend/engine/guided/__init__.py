"""Guided decoding: a per-request grammar that masks the tokens a sequence may take next.

`params.py` says what a request asks for (NVIDIA's guide types), `compiler.py` turns it into a
grammar once per distinct guide (LRU cache, bounded in size and time), `state.py` follows one
sequence through its grammar, and `masks.py` applies the masks of a step's rows to the logits.
The grammar library is llguidance (see docs/guided-decoding.md for why).
"""
from triton_backend.engine.guided.params import GUIDE_TYPES, MAX_GUIDE_CHARS, GuidedDecodingParams

__all__ = ["GUIDE_TYPES", "MAX_GUIDE_CHARS", "GuidedDecodingParams"]
