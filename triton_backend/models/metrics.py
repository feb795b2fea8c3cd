"""LLM metrics as Triton custom metrics (scraped from the server's /metrics endpoint).

Gauges from the executor's `get_stats()`: NVIDIA's names for what dashboards built for
TensorRT-LLM already read (`nv_trt_llm_kv_cache_block_metrics`, `nv_trt_llm_request_metrics`),
and `llm_forge_executor_stats` with every counter of `get_stats()` under its own name.

Per-request histograms, observed when a request's final response leaves the model, from the
same timestamps the model returns as outputs (arrival, first token, last token):
time to first token, mean inter-token latency, end-to-end latency, queue time (arrival to
first scheduled, from the engine), prompt and output lengths.
A counter `llm_forge_requests_total{outcome=...}` counts how every request ended (completed,
cancelled, error, rejected: refused as busy by the admission limits, timeout: ended at its
deadline, invalid: refused by the request checks). Names are in `METRIC_NAMES`; the
Grafana dashboard in docs/ reads exactly these.

Engines with LoRA adapters add `nv_trt_llm_lora_request_metrics{lora_adapter=NAME,
request_type=running|waiting}` (requests per adapter, for gateways that route by adapter, as
vLLM's `vllm:lora_requests_info`), and the adapter cache's counters among the executor stats
(`lora_num_resident`, `lora_num_loads`, `lora_num_evictions`, `lora_num_host_adapters`,
`lora_num_host_loads`, `lora_num_host_evictions`, `lora_load_seconds`).
"""
from __future__ import annotations

from triton_backend.engine.numbers import is_number

KV_BLOCK_STATS = {"used": "num_used_blocks", "free": "num_free_blocks", "max": "num_total_blocks",
                  "tokens_per": "tokens_per_block"}
REQUEST_STATS = {"active": "num_active_requests", "waiting": "num_waiting_requests",
                 "queued": "num_queued_requests"}

SECONDS_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TOKEN_BUCKETS = [1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

# name -> (description, buckets)
HISTOGRAMS = {
    "nv_llm_time_to_first_token_seconds": ("Time from arrival to the first generated token",
                                           SECONDS_BUCKETS),
    "nv_llm_inter_token_latency_seconds": ("Mean time between generated tokens of a request",
                                           SECONDS_BUCKETS),
    "nv_llm_e2e_request_latency_seconds": ("Time from arrival to the final response",
                                           SECONDS_BUCKETS),
    "llm_forge_request_queue_time_seconds": ("Time from arrival to first being scheduled",
                                             SECONDS_BUCKETS),
    "nv_llm_input_token_len": ("Prompt length in tokens", TOKEN_BUCKETS),
    "nv_llm_output_token_len": ("Generated tokens per request", TOKEN_BUCKETS),
}
OUTCOMES = ("completed", "cancelled", "error", "rejected", "timeout", "invalid")
BUSY_MARKER = "server busy"                 # admission.ServerBusy's messages start with it
DEADLINE_MARKER = "exceeded its deadline"   # llm_engine.deadline_error
LORA_REQUEST_METRIC = "nv_trt_llm_lora_request_metrics"  # registered by LoRA engines only
LORA_INFO_METRIC = "vllm:lora_requests_info"  # vLLM's name: the gateway's endpoint picker reads it
METRIC_NAMES = (tuple(HISTOGRAMS) + ("nv_trt_llm_kv_cache_block_metrics",
                                     "nv_trt_llm_request_metrics", "llm_forge_executor_stats",
                                     "llm_forge_requests_total"))


def outcome_of(error: str | None, finish_reason: str | None) -> str:
    """How a request ended, from its final response."""
    if error is not None:
        if "busy" in error.lower():
            return "rejected"
        return "timeout" if DEADLINE_MARKER in error else "error"
    return "cancelled" if finish_reason == "cancelled" else "completed"


class ExecutorMetrics:
    """Publishes `get_stats()` dicts and per-request observations; `pb_utils` is passed in so
    this module needs no Triton (tests hand in a fake)."""

    def __init__(self, pb_utils, model_name: str, model_version: str):
        family = pb_utils.MetricFamily
        self._labels = {"model": model_name, "version": model_version}
        self._families = {
            "kv": family(name="nv_trt_llm_kv_cache_block_metrics",
                         description="KV cache blocks", kind=family.GAUGE),
            "requests": family(name="nv_trt_llm_request_metrics",
                               description="Executor requests", kind=family.GAUGE),
            "stats": family(name="llm_forge_executor_stats",
                            description="llm-forge executor counters (get_stats)",
                            kind=family.GAUGE),
        }
        self._metrics: dict[tuple[str, str], object] = {}
        self._values: dict[tuple[str, str], float] = {}  # what each gauge was last set to
        self._family = family
        self._lora_metrics: dict[tuple[str, str], object] = {}
        # A family is unregistered when its Python object dies: every one is kept here.
        for name, (description, _) in HISTOGRAMS.items():
            self._families[name] = family(name=name, description=description,
                                          kind=family.HISTOGRAM)
        self._families["outcomes"] = family(name="llm_forge_requests_total",
                                            description="Requests by how they ended",
                                            kind=family.COUNTER)
        self._histograms = {
            name: self._families[name].Metric(labels=self._labels,
                                              buckets=list(map(float, buckets)))
            for name, (_, buckets) in HISTOGRAMS.items()}
        self._outcomes = {o: self._families["outcomes"].Metric(
            labels=dict(self._labels, outcome=o)) for o in OUTCOMES}

    def _metric(self, family: str, label_key: str, label: str):
        key = (family, label)
        if key not in self._metrics:
            labels = dict(self._labels, **{label_key: label})
            self._metrics[key] = self._families[family].Metric(labels=labels)
        return self._metrics[key]

    def publish(self, stats: dict) -> None:
        for label, key in KV_BLOCK_STATS.items():
            if key in stats:
                self._set("kv", "kv_cache_block_type", label, stats[key])
        for label, key in REQUEST_STATS.items():
            if key in stats:
                self._set("requests", "request_type", label, stats[key])
        for key, value in stats.items():
            if is_number(value):
                self._set("stats", "stat", key, value)
        if "lora_running" in stats:
            self._publish_lora(stats)

    def _set(self, family: str, label_key: str, label: str, value) -> None:
        """Set one gauge, only when its value changed: each set is a round trip from the Python
        stub to the server, and most counters hold still between two publishes."""
        key, value = (family, label), float(value)
        if self._values.get(key) != value:
            self._metric(family, label_key, label).set(value)
            self._values[key] = value

    def _publish_lora(self, stats: dict) -> None:
        """Requests per adapter and state; an adapter seen once stays listed (at 0)."""
        if "lora" not in self._families:
            self._families["lora"] = self._family(
                name=LORA_REQUEST_METRIC, description="Requests per LoRA adapter",
                kind=self._family.GAUGE)
        for state in ("running", "waiting"):
            counts = stats.get(f"lora_{state}") or {}
            seen = {name for name, s in self._lora_metrics if s == state}
            for name in set(counts) | seen:
                key = (name, state)
                if key not in self._lora_metrics:
                    self._lora_metrics[key] = self._families["lora"].Metric(
                        labels=dict(self._labels, lora_adapter=name, request_type=state))
                self._lora_metrics[key].set(float(counts.get(name, 0)))

    def count(self, outcome: str) -> None:
        self._outcomes[outcome].increment(1.0)

    def observe_request(self, *, arrival_ns: int, first_token_ns: int, last_token_ns: int,
                        final_ns: int, num_input_tokens: int, num_output_tokens: int,
                        outcome: str, queue_ns: int | None = None) -> None:
        """One finished request: latency histograms (only what it has: no first token, no
        TTFT), lengths and its outcome."""
        self.count(outcome)
        if outcome in ("rejected", "invalid"):  # never ran: no latency to observe
            return
        hist = self._histograms
        hist["nv_llm_input_token_len"].observe(float(num_input_tokens))
        hist["nv_llm_output_token_len"].observe(float(num_output_tokens))
        hist["nv_llm_e2e_request_latency_seconds"].observe(max(0, final_ns - arrival_ns) / 1e9)
        if queue_ns is not None:
            hist["llm_forge_request_queue_time_seconds"].observe(queue_ns / 1e9)
        if first_token_ns:
            hist["nv_llm_time_to_first_token_seconds"].observe(
                max(0, first_token_ns - arrival_ns) / 1e9)
            if num_output_tokens > 1 and last_token_ns > first_token_ns:  # streamed
                hist["nv_llm_inter_token_latency_seconds"].observe(
                    max(0, last_token_ns - first_token_ns) / 1e9 / (num_output_tokens - 1))
