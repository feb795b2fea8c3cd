"""Serving what the builder made: `serve.py` (`forge serve`: tritonserver on a repository, health,
shutdown), `supervisor.py` (restarting a server that stops answering) and `openai/` (the
OpenAI-compatible endpoint in front of Triton)."""
