"""The trtllm target: TensorRT-LLM checkpoint per rank, `trtllm-build` (`build`) and LoRA
(`lora`), assembled by `engine`."""
