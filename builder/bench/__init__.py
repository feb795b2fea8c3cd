"""`forge bench`: workloads, the load generator, statistics, the report and plots, comparisons.

Modules, in the order data flows: `workloads` (seeded requests, token counts fitted with the
engine's tokenizer; prompts from the offline `corpus`) -> `clients` (gRPC stream / HTTP generate,
one request at a time, timestamps on arrival) -> `loadgen` (one concurrency level, closed loop
or Poisson-capped) -> `records` (one request's timings; TTFT/ITL/E2E definitions) -> `stats`
(percentiles per level) -> `runner` (all levels, one or two servers alternating) -> `report`
(results.json, tables) and `plots` (PNG).
"""
