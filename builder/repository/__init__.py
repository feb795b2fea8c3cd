"""The emitted Triton repository: `emit` writes it from the templates (`template`), with the
options a spec may tune (`options`), where its model runs (`device`), which engine it serves
(`target`) and, for a trtllm engine, NVIDIA's models (`trtllm`)."""
