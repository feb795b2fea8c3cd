"""LLM metrics as Triton custom metrics (scraped from the server's /metrics endpoint).

Gauges from the executor's `get_stats()`: NVIDIA's names for what dashboards, gateways and
autoscalers built for TensorRT-LLM already read, and `llm_forge_executor_stats` with every counter
of `get_stats()` under its own name:

- `nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=...}`: `used`, `free`, `max`,
  `tokens_per`, and `fraction` = used / max in [0, 1] (0 while max is 0), as NVIDIA's
  inflight_batcher_llm computes it.
- `nv_trt_llm_request_metrics{request_type=...}`: `scheduled` (running in the batch; NVIDIA's
  numScheduledRequests), `waiting` (accepted and not running: the scheduler's waiting queue and
  the executor's `queued` ones not yet moved into the engine), `active` (running, as before: equal
  to `scheduled` here, where NVIDIA's also counts the batch manager's paused requests) and
  `queued` (the executor's part of `waiting`). NVIDIA's `waiting` is active - scheduled and leaves
  out its executor queue; ours counts every request that waits, as the Gateway API Inference
  Extension's endpoint picker means by it (its queue-depth input, like vLLM's
  `vllm:num_requests_waiting`). `EPP_METRIC_SPECS` are the picker's specs for these servers.

Per-request histograms, observed when a request's final response leaves the model, from the
same timestamps the model returns as outputs (arrival, first token, last token):
time to first token, mean inter-token latency, end-to-end latency, queue time (arrival to
first scheduled, from the engine), prompt and output lengths.
A counter `llm_forge_requests_total{outcome=...}` counts how every request ended (completed,
cancelled, error, rejected: refused as busy by the admission limits, timeout: ended at its
deadline, invalid: refused by the request checks). Names are in `METRIC_NAMES`; the
Grafana dashboard in docs/ reads exactly these.

Engines with LoRA adapters add two gauges:
- `vllm:lora_requests_info` (`LORA_INFO_METRIC`), in vLLM's shape, which the endpoint picker's
  LoRA-affinity scorer reads: labels `max_lora` (the most distinct adapters one step runs),
  `running_lora_adapters` and `waiting_lora_adapters` (comma-separated adapter names with
  requests running / waiting), value = the time of its last update in seconds since the epoch.
  Exactly one series is current: when the adapter sets change, a new series replaces the old
  one (the picker reads the series with the largest value).
- `nv_trt_llm_lora_request_metrics{lora_adapter=NAME, request_type=running|waiting}`: requests
  per adapter;
and the adapter cache's counters among the executor stats (`lora_max_loras`,
`lora_num_resident`, `lora_num_loads`, `lora_num_evictions`, `lora_num_host_adapters`,
`lora_num_host_loads`, `lora_num_host_evictions`, `lora_load_seconds`).
"""
from __future__ import annotations

import time

from triton_backend.engine.numbers import is_number

KV_BLOCK_STATS = {"used": "num_used_blocks", "free": "num_free_blocks", "max": "num_total_blocks",
                  "tokens_per": "tokens_per_block"}
# request_type -> the stats it adds up
REQUEST_STATS = {"active": ("num_active_requests",), "scheduled": ("num_active_requests",),
                 "waiting": ("num_waiting_requests", "num_queued_requests"),
                 "queued": ("num_queued_requests",)}

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
DEADLINE_MARKER = "exceeded its deadline"   # llm_engine.deadline_error
LORA_REQUEST_METRIC = "nv_trt_llm_lora_request_metrics"  # registered by LoRA engines only
LORA_INFO_METRIC = "vllm:lora_requests_info"               # registered by LoRA engines only
LORA_INFO_REFRESH_SECONDS = 1.0  # the info gauge's time is refreshed at most this often
# The Gateway API Inference Extension endpoint picker's metric specs for these servers: the
# fields of an `engineConfigs` entry of its `core-metrics-extractor` plugin (release v1.5.0;
# before v1.4.0 the flags --total-queued-requests-metric, --total-running-requests-metric,
# --kv-cache-usage-percentage-metric, --lora-info-metric). `loraSpec` only for LoRA engines.
EPP_METRIC_SPECS = {
    "queuedRequestsSpec": "nv_trt_llm_request_metrics{request_type=waiting}",
    "runningRequestsSpec": "nv_trt_llm_request_metrics{request_type=scheduled}",
    "kvUsageSpec": "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}",
    "cacheBlockSizeSpec": "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=tokens_per}",
    "cacheNumBlocksSpec": "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max}",
    "loraSpec": LORA_INFO_METRIC,
}
METRIC_NAMES = (tuple(HISTOGRAMS) + ("nv_trt_llm_kv_cache_block_metrics",
                                     "nv_trt_llm_request_metrics", "llm_forge_executor_stats",
                                     "llm_forge_requests_total"))


def kv_cache_gauges(stats: dict) -> dict[str, float]:
    """`nv_trt_llm_kv_cache_block_metrics` by kv_cache_block_type, from what `stats` has, in
    the order they are set: `fraction` right after `used` and before `free`, so a scrape that
    sees the `free` of a publish (used + free == max) sees its `fraction` too."""
    values = {label: float(stats[key]) for label, key in KV_BLOCK_STATS.items() if key in stats}
    gauges = {"used": values.pop("used")} if "used" in values else {}
    if "used" in gauges and "max" in values:
        used, total = gauges["used"], values["max"]
        gauges["fraction"] = min(1.0, max(0.0, used / total)) if total > 0 else 0.0
    return dict(gauges, **values)


def request_gauges(stats: dict) -> dict[str, float]:
    """`nv_trt_llm_request_metrics` by request_type, each the sum of the stats it adds up (a
    type none of whose stats `stats` has is left out)."""
    return {label: float(sum(stats[key] for key in keys if key in stats))
            for label, keys in REQUEST_STATS.items() if any(key in stats for key in keys)}


def lora_info_labels(stats: dict) -> dict[str, str]:
    """The LORA_INFO_METRIC labels: adapter names sorted, so one state is one label set."""
    return {"max_lora": str(int(stats.get("lora_max_loras", 0))),
            "running_lora_adapters": ",".join(sorted(stats.get("lora_running") or {})),
            "waiting_lora_adapters": ",".join(sorted(stats.get("lora_waiting") or {}))}


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
        self._lora_info = LoraInfoGauge(family, self._labels)
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
        for label, number in kv_cache_gauges(stats).items():
            self._set("kv", "kv_cache_block_type", label, number)
        for label, number in request_gauges(stats).items():
            self._set("requests", "request_type", label, number)
        for key, value in stats.items():
            if is_number(value):
                self._set("stats", "stat", key, value)
        if "lora_running" in stats:
            self._publish_lora(stats)
            self._lora_info.publish(stats)

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


class LoraInfoGauge:
    """LORA_INFO_METRIC with exactly one current series.

    Its labels carry the state, so a change of adapters is a new series. Triton's Python backend
    keeps a series until its family object dies, so each label set gets a family object of its
    own (the same family on the server): the new series is set before the old object is dropped,
    so no scrape finds none. The value is refreshed at most every LORA_INFO_REFRESH_SECONDS
    while stats are published (each set is a round trip to the server).
    """

    def __init__(self, family, labels: dict[str, str], clock=time.time):
        self._family_type, self._base_labels, self._clock = family, labels, clock
        self._family = self._metric = None
        self._labels: dict[str, str] | None = None
        self._set_at = 0.0

    def publish(self, stats: dict) -> None:
        labels, now = lora_info_labels(stats), self._clock()
        if labels != self._labels:
            kind = self._family_type
            family = kind(name=LORA_INFO_METRIC, kind=kind.GAUGE,
                          description="LoRA adapters with requests running and waiting "
                                      "(value: last update, seconds since the epoch)")
            metric = family.Metric(labels=dict(self._base_labels, **labels))
            metric.set(now)
            self._family, self._metric, self._labels = family, metric, labels  # old one goes
        elif now - self._set_at >= LORA_INFO_REFRESH_SECONDS:
            self._metric.set(now)
        else:
            return
        self._set_at = now
