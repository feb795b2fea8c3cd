"""The quality gate: a quantized engine against its source, on held-out text and chat questions."""
