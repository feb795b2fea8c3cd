"""`forge bench`, the one benchmark tool: the served level (workloads, clients, the load
generator, statistics, report and plots), the shape matrix against vLLM, the engine level in
process, the feature workloads and the soak; one output format for all (`summary`). The map of
its modules is in docs/bench.md.
"""
