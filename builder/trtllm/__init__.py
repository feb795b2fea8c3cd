"""The trtllm target: TensorRT-LLM checkpoint per rank, `trtllm-build`, LoRA."""
