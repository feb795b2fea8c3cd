"""The quality gate: `gate` compares a quantized engine with its source on held-out text (`sides`:
the two models), `task_check` asks both the same questions, `report` says the verdict."""
