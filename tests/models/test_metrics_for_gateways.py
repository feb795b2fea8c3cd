"""The gauges a Gateway API Inference Extension endpoint picker reads, with a fake pb_utils whose
families, like Triton's Python backend, keep a series until the family object dies."""
import pytest

from triton_backend.models.metrics import (
    EPP_METRIC_SPECS, LORA_INFO_METRIC, LORA_INFO_REFRESH_SECONDS, ExecutorMetrics,
    kv_cache_gauges, lora_info_labels, request_gauges)

LABELS = {"model": "tensorrt_llm", "version": "1"}


class Family:
    """A metric family object; its series live while it does (`live` is the server's view)."""
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    live: dict = {}  # (name, labels) -> Series, as a scrape would list them

    def __init__(self, name, description, kind):
        self.name, self.kind, self.series = name, kind, []

    def Metric(self, labels, buckets=None):
        series = Series()
        key = (self.name, tuple(sorted(labels.items())))
        Family.live[key] = series
        self.series.append(key)
        return series

    def __del__(self):
        for key in self.series:
            Family.live.pop(key, None)


class Series:
    def __init__(self):
        self.value, self.sets = None, 0

    def set(self, value):
        self.value, self.sets = value, self.sets + 1

    def observe(self, value):
        pass

    def increment(self, value):
        pass


class FakePbUtils:
    MetricFamily = Family


@pytest.fixture(autouse=True)
def fresh_server():
    Family.live = {}


def gauge(name, **labels):
    return Family.live[(name, tuple(sorted(dict(LABELS, **labels).items())))].value


def lora_series() -> dict:
    return {dict(labels)["running_lora_adapters"] + "|" + dict(labels)["waiting_lora_adapters"]:
            (dict(labels), series.value)
            for (name, labels), series in Family.live.items() if name == LORA_INFO_METRIC}


def test_fraction_is_used_over_max_within_0_and_1():
    stats = {"num_used_blocks": 3, "num_free_blocks": 5, "num_total_blocks": 8,
             "tokens_per_block": 16}
    gauges = kv_cache_gauges(stats)
    assert gauges == {"used": 3.0, "free": 5.0, "max": 8.0, "tokens_per": 16.0, "fraction": 0.375}
    assert list(gauges)[:3] == ["used", "fraction", "free"]  # the order they are set in
    assert kv_cache_gauges(dict(stats, num_used_blocks=0, num_total_blocks=0))["fraction"] == 0.0
    assert kv_cache_gauges(dict(stats, num_used_blocks=8))["fraction"] == 1.0
    assert "fraction" not in kv_cache_gauges({"num_free_blocks": 5})


def test_waiting_counts_every_request_accepted_and_not_running():
    stats = {"num_active_requests": 4, "num_waiting_requests": 6, "num_queued_requests": 2}
    assert request_gauges(stats) == {"active": 4.0, "scheduled": 4.0, "waiting": 8.0,
                                     "queued": 2.0}
    # an executor that reports running requests only (the naive baseline)
    assert request_gauges({"num_active_requests": 1}) == {"active": 1.0, "scheduled": 1.0}


def test_publish_sets_the_pickers_names_and_moves_them():
    metrics = ExecutorMetrics(FakePbUtils, "tensorrt_llm", "1")
    metrics.publish({"num_used_blocks": 0, "num_free_blocks": 64, "num_total_blocks": 64,
                     "tokens_per_block": 16, "num_active_requests": 0,
                     "num_waiting_requests": 0, "num_queued_requests": 0})
    kv, requests = "nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_request_metrics"
    assert gauge(kv, kv_cache_block_type="fraction") == 0.0
    assert gauge(requests, request_type="scheduled") == gauge(requests,
                                                              request_type="waiting") == 0.0
    metrics.publish({"num_used_blocks": 16, "num_free_blocks": 48, "num_total_blocks": 64,
                     "tokens_per_block": 16, "num_active_requests": 4,
                     "num_waiting_requests": 5, "num_queued_requests": 1})
    assert gauge(kv, kv_cache_block_type="fraction") == 0.25
    assert gauge(requests, request_type="scheduled") == 4.0
    assert gauge(requests, request_type="waiting") == 6.0
    assert gauge(requests, request_type="queued") == 1.0
    assert LORA_INFO_METRIC not in {name for name, _ in Family.live}  # LoRA engines only


def test_the_specs_name_what_publish_sets():
    metrics = ExecutorMetrics(FakePbUtils, "tensorrt_llm", "1")
    metrics.publish({"num_used_blocks": 1, "num_free_blocks": 1, "num_total_blocks": 2,
                     "tokens_per_block": 16, "num_active_requests": 1,
                     "num_waiting_requests": 0, "num_queued_requests": 0,
                     "lora_max_loras": 8, "lora_running": {}, "lora_waiting": {}})
    for field, spec in EPP_METRIC_SPECS.items():
        name, _, selector = spec.partition("{")
        wanted = dict(pair.split("=") for pair in selector.rstrip("}").split(",") if pair)
        assert any(n == name and wanted.items() <= dict(labels).items()
                   for n, labels in Family.live), field


def test_lora_info_keeps_exactly_one_current_series():
    clock = [1000.0]
    metrics = ExecutorMetrics(FakePbUtils, "tensorrt_llm", "1")
    metrics._lora_info._clock = lambda: clock[0]
    base = {"lora_max_loras": 2, "lora_running": {}, "lora_waiting": {}}
    metrics.publish(base)
    assert lora_series() == {"|": ({**LABELS, "max_lora": "2", "running_lora_adapters": "",
                                    "waiting_lora_adapters": ""}, 1000.0)}
    clock[0] = 1000.5
    metrics.publish(dict(base, lora_running={"b": 1, "a": 2}, lora_waiting={"c": 1},
                         num_steps=1))
    assert lora_series() == {"a,b|c": ({**LABELS, "max_lora": "2", "running_lora_adapters": "a,b",
                                        "waiting_lora_adapters": "c"}, 1000.5)}
    # the same adapters: the value is refreshed, at most once per LORA_INFO_REFRESH_SECONDS
    info = next(s for (n, _), s in Family.live.items() if n == LORA_INFO_METRIC)
    clock[0] += LORA_INFO_REFRESH_SECONDS / 2
    metrics.publish(dict(base, lora_running={"a": 1, "b": 1}, lora_waiting={"c": 3}))
    assert info.sets == 1
    clock[0] += LORA_INFO_REFRESH_SECONDS
    metrics.publish(dict(base, lora_running={"a": 1, "b": 1}, lora_waiting={"c": 3}))
    assert info.sets == 2 and lora_series()["a,b|c"][1] == clock[0]
    clock[0] += 0.1  # the requests end: back to no adapters, one series again
    metrics.publish(base)
    assert list(lora_series()) == ["|"] and lora_series()["|"][1] == clock[0]


def test_lora_info_labels_from_engine_stats():
    assert lora_info_labels({"lora_max_loras": 8, "lora_running": {"x": 1},
                             "lora_waiting": {"z": 2, "y": 1}}) == {
        "max_lora": "8", "running_lora_adapters": "x", "waiting_lora_adapters": "y,z"}
