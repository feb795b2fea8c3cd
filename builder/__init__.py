"""The build side of llm-forge: spec -> checkpoint -> (quantize) -> engine -> repository -> checks."""
__version__ = "0.1.0"
