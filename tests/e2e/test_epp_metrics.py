"""What a Gateway API Inference Extension endpoint picker reads from a real tritonserver.

A LoRA engine that runs 4 sequences at a time serves 12 streams at once, some with an adapter,
sent again as each ends until the test stops them. Every series is found the way the picker
finds it (`EPP_METRIC_SPECS`: a family name and the labels a series must carry; for the LoRA
info gauge, the series with the largest value), with the family's `# TYPE` gauge. Nothing here
asserts a duration: every wait polls a scrape with a bound.
"""
import re
import threading
import urllib.request

import pytest

from builder.client import stream_grpc
from builder.repository.emit import RepositoryOptions, emit_repository
from tests.e2e.test_observability import wait_for
from lora_helpers import ids_inputs as lora_ids_inputs
from tests.triton_helpers import running_tritonserver
from triton_backend.models.metrics import EPP_METRIC_SPECS, LORA_INFO_METRIC

pytestmark = pytest.mark.slow
MAX_BATCH_SIZE = 4
STREAMS = [1, 1, 1, None, None, None, None, None, None, None, None, None]  # lora_task_id each
PROMPT = [5 + i % 50 for i in range(20)]
NEW_TOKENS = 200
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import lora_helpers
    import tiny

    # one adapter, trained a single step: what it does to the tokens does not matter here
    tmp = tmp_path_factory.mktemp("epp")
    hf_dir = tiny.make_checkpoint(tmp / "hf-llama_gqa", "llama_gqa")
    adapter = lora_helpers.train_adapter(hf_dir, tmp / "peft-adapter-a",
                                         *lora_helpers.ADAPTERS["adapter-a"], steps=1)
    engine_dir = lora_helpers.build_lora_engine(tmp, {"adapter-a": adapter},
                                                limits={"max_batch_size": MAX_BATCH_SIZE})
    repo = emit_repository(engine_dir, tmp / "repo", RepositoryOptions(stats_period_ms=20))
    with running_tritonserver(repo, ready_timeout=600) as running:  # a busy machine is slow
        yield running


class Scrape:
    """One /metrics exposition: each family's `# TYPE` and its series as (labels, value)."""

    def __init__(self, server):
        with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        self.types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
        self.series: dict[str, list[tuple[dict, float]]] = {}
        for line in text.splitlines():
            match = SAMPLE.match(line)
            if match:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
                self.series.setdefault(match.group(1), []).append((labels, float(match.group(3))))

    def find(self, spec: str) -> list[tuple[dict, float]]:
        """The series a picker spec `name{label=value,...}` selects, of model tensorrt_llm."""
        name, _, selector = spec.partition("{")
        wanted = dict(pair.split("=") for pair in selector.rstrip("}").split(",") if pair)
        wanted["model"] = "tensorrt_llm"
        return [(labels, value) for labels, value in self.series.get(name, [])
                if wanted.items() <= labels.items()]

    def value(self, field: str) -> float:
        (_, value), = self.find(EPP_METRIC_SPECS[field])
        return value

    def kv(self, block_type: str) -> float:
        return self.value("kvUsageSpec") if block_type == "fraction" else self.find(
            f"nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type={block_type}}}")[0][1]

    def lora_info(self) -> dict:
        """The labels of the LoRA info series the picker reads: the one with the largest value
        (and there is exactly one)."""
        series = self.find(EPP_METRIC_SPECS["loraSpec"])
        assert len(series) == 1, series
        return series[0][0]

    def whole(self) -> bool:
        """Not caught between two sets of one publish (fraction is set right after used and
        before free: a scrape with used + free == max shows the fraction of that used)."""
        return self.kv("used") + self.kv("free") == self.kv("max")


def ids_inputs(task_id):
    return lora_ids_inputs(PROMPT, NEW_TOKENS, task_id)


class Load:
    """One thread per stream, each sending its request again as it ends, until `stop()`
    (which cancels the requests in flight)."""

    def __init__(self, server, task_ids):
        self.halt, self.errors = threading.Event(), []
        self.threads = [threading.Thread(target=self._run, args=(server, task_id), daemon=True)
                        for task_id in task_ids]
        for thread in self.threads:
            thread.start()

    def _run(self, server, task_id):
        while not self.halt.is_set():
            try:
                for _ in stream_grpc(server.grpc_url, "tensorrt_llm", ids_inputs(task_id)):
                    if self.halt.is_set():
                        break  # closing the stream cancels the request
            except RuntimeError as exc:
                self.errors.append(str(exc))
                return

    def stop(self):
        self.halt.set()
        for thread in self.threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in self.threads)


def idle(server):
    scrape = Scrape(server)
    quiet = (scrape.value("queuedRequestsSpec") == 0 and scrape.value("runningRequestsSpec") == 0
             and scrape.kv("used") == 0 and scrape.lora_info()["running_lora_adapters"] == ""
             and scrape.lora_info()["waiting_lora_adapters"] == "")
    return scrape if quiet else None


def test_the_pickers_names_are_gauges_with_one_current_lora_series(server):
    scrape = wait_for(lambda: idle(server), timeout=60)
    assert scrape, "the server never settled idle"
    for field, spec in EPP_METRIC_SPECS.items():
        name = spec.partition("{")[0]
        assert scrape.types.get(name) == "gauge", (field, name, scrape.types.get(name))
        assert len(scrape.find(spec)) == 1, (field, spec)
    assert EPP_METRIC_SPECS["loraSpec"] == LORA_INFO_METRIC == "vllm:lora_requests_info"
    assert scrape.lora_info() == {"model": "tensorrt_llm", "version": "1", "max_lora": "8",
                                  "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert scrape.kv("fraction") == 0 and scrape.kv("max") > 0
    assert scrape.value("cacheBlockSizeSpec") == 8  # tokens per block, as the engine was built


def test_waiting_scheduled_and_fraction_follow_the_load(server):
    assert wait_for(lambda: idle(server), timeout=60), "the server never settled idle"
    load = Load(server, STREAMS)
    seen: list[Scrape] = []

    def loaded():
        scrape = Scrape(server)
        seen.append(scrape)
        full = (scrape.value("runningRequestsSpec") == MAX_BATCH_SIZE
                and scrape.value("queuedRequestsSpec") > 0 and scrape.whole())
        return scrape if full else None

    def adapter_running():
        running = Scrape(server).lora_info()["running_lora_adapters"].split(",")
        return "adapter-a" in running

    try:
        full = wait_for(loaded, timeout=120)
        lora = wait_for(adapter_running, timeout=120)
    finally:
        load.stop()
    assert full, [(s.value("runningRequestsSpec"), s.value("queuedRequestsSpec")) for s in seen]
    assert lora, "adapter-a never listed as running while its requests were in flight"
    assert load.errors == []
    # all 12 are accepted: the 4 in the batch are scheduled, the other 8 wait
    assert 0 < full.value("queuedRequestsSpec") <= len(STREAMS) - MAX_BATCH_SIZE
    assert 0 < full.kv("used") <= full.kv("max")
    whole = [s for s in seen if s.whole()]
    assert whole
    for scrape in whole:  # fraction is used / max in the same scrape, within [0, 1]
        assert scrape.kv("fraction") == pytest.approx(scrape.kv("used") / scrape.kv("max"),
                                                      rel=1e-9)
        assert 0 <= scrape.kv("fraction") <= 1
        assert scrape.value("runningRequestsSpec") <= MAX_BATCH_SIZE
    # the load gone, everything returns to 0 and the LoRA info lists no adapter
    after = wait_for(lambda: idle(server), timeout=120)
    assert after, "waiting/scheduled/used did not return to 0"
    assert after.kv("fraction") == 0
