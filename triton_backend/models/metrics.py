"""Executor counters as Triton custom metrics (scraped from the server's /metrics endpoint).

Two families: NVIDIA's names for what dashboards built for TensorRT-LLM already read
(`nv_trt_llm_kv_cache_block_metrics`, `nv_trt_llm_request_metrics`), and
`llm_forge_executor_stats` with every counter of `Executor.get_stats()` under its own name.
"""
from __future__ import annotations

KV_BLOCK_STATS = {"used": "num_used_blocks", "free": "num_free_blocks", "max": "num_total_blocks"}
REQUEST_STATS = {"active": "num_active_requests", "waiting": "num_waiting_requests"}


class ExecutorMetrics:
    """Publishes `get_stats()` dicts; `pb_utils` is passed in so this module needs no Triton."""

    def __init__(self, pb_utils, model_name: str, model_version: str):
        gauge = pb_utils.MetricFamily.GAUGE
        self._labels = {"model": model_name, "version": model_version}
        self._families = {
            "kv": pb_utils.MetricFamily(name="nv_trt_llm_kv_cache_block_metrics",
                                        description="KV cache blocks", kind=gauge),
            "requests": pb_utils.MetricFamily(name="nv_trt_llm_request_metrics",
                                              description="Executor requests", kind=gauge),
            "stats": pb_utils.MetricFamily(name="llm_forge_executor_stats",
                                           description="llm-forge executor counters (get_stats)",
                                           kind=gauge),
        }
        self._metrics: dict[tuple[str, str], object] = {}

    def _metric(self, family: str, label_key: str, label: str):
        key = (family, label)
        if key not in self._metrics:
            labels = dict(self._labels, **{label_key: label})
            self._metrics[key] = self._families[family].Metric(labels=labels)
        return self._metrics[key]

    def publish(self, stats: dict) -> None:
        for label, key in KV_BLOCK_STATS.items():
            if key in stats:
                self._metric("kv", "kv_cache_block_type", label).set(float(stats[key]))
        for label, key in REQUEST_STATS.items():
            if key in stats:
                self._metric("requests", "request_type", label).set(float(stats[key]))
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._metric("stats", "stat", key).set(float(value))
