"""An OpenAI-compatible HTTP endpoint in front of the Triton repository (`forge serve
--openai-port`): FastAPI routes that render chat templates, map OpenAI parameters onto the
ensemble's inputs and stream Triton's responses back as OpenAI objects."""
