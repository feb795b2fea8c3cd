"""The serving side of llm-forge: the engine runtime and the Triton Python-backend models."""
