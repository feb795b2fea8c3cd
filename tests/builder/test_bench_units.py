"""`forge bench` without a server: workloads, timing definitions, statistics, the load generator
(with an in-process fake client), comparisons, the report, plots and the command line."""
from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner

import tiny
from builder.bench.engine_level import paired_ratios
from builder.bench.loadgen import LevelPlan, run_level
from builder.bench.records import RequestRecord
from builder.bench.report import refresh, write_results
from builder.bench.summary import document, finish, markdown
from builder.bench.runner import BenchSettings, compare_levels
from builder.bench.stats import percentiles, summarize
from builder.bench.workloads import WorkItem, build_workload
from builder.cli.bench import bench_command


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny.make_tokenizer(tmp_path_factory.mktemp("tok"))


# -- workloads -------------------------------------------------------------------------------
def test_builtin_workloads_are_seeded_and_prefix_stable(tokenizer):
    a = build_workload("chat", 6, seed=3, scale=0.1, tokenizer=tokenizer)
    b = build_workload("chat", 9, seed=3, scale=0.1, tokenizer=tokenizer)
    c = build_workload("chat", 6, seed=4, scale=0.1, tokenizer=tokenizer)
    assert a.items == b.items[:6]
    assert a.items != c.items


def test_chat_lengths_are_fitted_with_the_tokenizer(tokenizer):
    wl = build_workload("chat", 20, scale=0.25, tokenizer=tokenizer)
    for item in wl.items:
        assert item.stream
        assert len(tokenizer.encode(item.prompt, add_special_tokens=False)) == item.num_input_tokens
        assert 16 - 2 <= item.num_input_tokens <= 256
        assert 4 <= item.max_tokens <= 64
    assert len({i.num_input_tokens for i in wl.items}) > 5  # mixed lengths


def test_voicebot_shares_one_system_prompt_and_query_rewrite_is_short(tokenizer):
    vb = build_workload("voicebot", 4, scale=0.05, tokenizer=tokenizer)
    prefixes = {i.prompt.split("\nCaller:")[0] for i in vb.items}
    assert len(prefixes) == 1
    system_tokens = len(tokenizer.encode(prefixes.pop(), add_special_tokens=False))
    assert abs(system_tokens - 95) <= 2
    assert all(i.stream and 8 <= i.max_tokens <= 11 for i in vb.items)
    qr = build_workload("query-rewrite", 10, tokenizer=tokenizer)
    for item in qr.items:
        assert not item.stream
        assert 8 <= item.num_input_tokens <= 20 and 10 <= item.max_tokens <= 20


def test_jsonl_workload_and_its_errors(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "hello there", "max_tokens": 5}\n\n'
                    '{"prompt": "again", "max_tokens": 2, "stream": false}\n')
    wl = build_workload(str(path), 1)
    assert [(i.prompt, i.max_tokens, i.stream) for i in wl.items] == [
        ("hello there", 5, True), ("again", 2, False)]
    assert all(not i.stream for i in build_workload(str(path), 1, stream=False).items)
    path.write_text('{"prompt": "x", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match=":1: max_tokens"):
        build_workload(str(path), 1)
    with pytest.raises(ValueError, match="workload must be one of"):
        build_workload("no-such-workload", 1)


# -- records and stats -----------------------------------------------------------------------
def _record(index=0, chunks=(0.5, 0.7, 0.9), end=1.0, server_tokens=None, stream=True, **kw):
    r = RequestRecord(index=index, max_tokens=3, stream=stream, **kw)
    for t in chunks:
        r.add_chunk(t, "x")
    r.note_server_tokens(server_tokens)
    r.end = end
    r.count_output_tokens(None)
    return r


def test_paired_ratios_divide_within_each_repeat():
    # Each repeat divides its own two figures, whatever the host did between repeats.
    runs = {"engine": [{"cN": {"tok_s": 200.0}}, {"cN": {"tok_s": 120.0}},
                       {"cN": {"tok_s": 100.0}}],
            "triton": [{"cN": {"tok_s": 180.0}}, {"cN": {"tok_s": 108.0}},
                       {"cN": {"tok_s": 95.0}}]}
    ratios = paired_ratios(runs, "triton", "engine", "cN.tok_s")
    assert ratios == pytest.approx([0.9, 0.9, 0.95])
    with pytest.raises(ValueError, match="triton has 1 repeats, engine 3"):
        paired_ratios({"engine": runs["engine"], "triton": runs["triton"][:1]}, "triton",
                      "engine", "cN.tok_s")


def test_ttft_itl_e2e_definitions():
    r = _record(chunks=(0.5, 0.7, 0.9), end=1.0)
    assert r.ttft == 0.5 and r.e2e == 1.0
    assert r.itl == pytest.approx(0.2)
    # Two chunks carrying 5 tokens: ITL spreads the gap over the tokens after the first.
    r = _record(chunks=(0.5, 0.9), end=1.0, server_tokens=5)
    assert r.output_tokens == 5 and r.output_tokens_source == "server"
    assert r.itl == pytest.approx(0.1)
    assert _record(stream=False, chunks=(0.8,), end=0.8).itl is None
    r.add_chunk(1.5, "")  # empty responses are not tokens
    assert len(r.chunk_times) == 2
    failed = _record()
    failed.error = "boom"
    assert failed.ttft is None and failed.e2e is None and not failed.ok


def test_percentiles_and_summary():
    p = percentiles([1, 2, 3, 4, None], (50, 99))
    assert p["p50"] == 2.5 and p["p99"] == pytest.approx(3.97) and p["mean"] == 2.5
    assert percentiles([], (50,)) == {"p50": None, "mean": None}
    records = [_record(i, server_tokens=3) for i in range(3)]
    records[2].error = "bad"
    cancelled = _record(3)
    cancelled.cancelled, cancelled.error = True, "timeout"
    s = summarize(records + [cancelled], wall_s=2.0, concurrency=2)
    assert (s["requests"], s["completed"], s["errors"], s["cancelled"]) == (4, 2, 1, 1)
    assert s["output_tokens"] == 6 and s["output_tokens_per_s"] == 3.0
    assert s["requests_per_s"] == 1.0 and s["ttft_s"]["p50"] == 0.5


# -- load generator --------------------------------------------------------------------------
class FakeClient:
    """Answers instantly-ish; records how many requests were in flight at once."""

    in_flight = 0
    peak = 0
    lock = threading.Lock()

    def send(self, item, index, level_start):
        with FakeClient.lock:
            FakeClient.in_flight += 1
            FakeClient.peak = max(FakeClient.peak, FakeClient.in_flight)
        sent = time.perf_counter()
        time.sleep(0.01)
        with FakeClient.lock:
            FakeClient.in_flight -= 1
        return _record(index, chunks=(0.005,), end=time.perf_counter() - sent,
                       start=sent - level_start)

    def close(self):
        pass


def test_closed_loop_respects_concurrency_and_count():
    FakeClient.peak = 0
    items = [WorkItem(f"p{i}", 3, True) for i in range(4)]
    run = run_level([FakeClient() for _ in range(3)], items, LevelPlan(3, num_requests=10))
    assert [r.index for r in run.records] == list(range(10))
    assert FakeClient.peak == 3
    assert run.wall_s >= max(r.start for r in run.records)


def test_poisson_rate_never_starts_early_and_duration_stops():
    import random

    plan = LevelPlan(2, num_requests=6, rate=50.0, seed=1)
    run = run_level([FakeClient(), FakeClient()], [WorkItem("p", 3, True)], plan)
    rng, arrival = random.Random("arrivals:1"), 0.0
    for record in run.records:
        arrival += rng.expovariate(50.0)
        assert record.start >= arrival - 1e-6
    run = run_level([FakeClient()], [WorkItem("p", 3, True)], LevelPlan(1, duration_s=0.1))
    assert 1 <= len(run.records) < 1000


def test_plan_and_settings_validation():
    with pytest.raises(ValueError, match="exactly one"):
        LevelPlan(1)
    with pytest.raises(ValueError, match="concurrency"):
        LevelPlan(0, num_requests=1)
    settings = BenchSettings((1, 4), requests="2x")
    assert [settings.num_requests(c) for c in (1, 4)] == [2, 8]
    assert BenchSettings((1,), requests="5").plan(4).num_requests == 5
    assert BenchSettings((1,), duration_s=3.0).plan(2).duration_s == 3.0


# -- comparison, report, plots, CLI ----------------------------------------------------------
def _result():
    def level(c, tps, ttft):
        records = [_record(i, server_tokens=3) for i in range(2)]
        s = summarize(records, 1.0, c)
        s.update(output_tokens_per_s=tps)
        s["ttft_s"]["p99"] = ttft
        return s

    a = [level(1, 100.0, 0.05), level(4, 300.0, 0.08)]
    b = [level(1, 50.0, 0.10), level(4, 60.0, 0.40)]
    return document("forge bench", {"concurrencies": [1, 4], "fixed_output": True}, [],
                    workload={"name": "chat", "seed": 0, "scale": 1.0, "input_tokens": None,
                              "max_tokens": None, "stream": True},
                    targets=[{"label": "ours", "url": "h:1", "model": "ensemble",
                              "protocol": "grpc", "fixed_output_honoured": True, "levels": a},
                             {"label": "naive", "url": "h:2", "model": "ensemble",
                              "protocol": "grpc", "fixed_output_honoured": True, "levels": b}],
                    comparison=compare_levels(a, b))


def test_comparison_ratios_report_and_plots(tmp_path):
    from rich.console import Console

    result = _result()
    rows = result["comparison"]
    assert rows[0]["output_tokens_per_s_ratio"] == 2.0 and rows[1]["output_tokens_per_s_ratio"] == 5.0
    assert rows[1]["ttft_p99_ratio"] == pytest.approx(0.2)
    console = Console(record=True, width=240)
    finish(refresh(result), tmp_path, console)
    text = console.export_text()
    assert "ours vs naive" in text and "5.00x" in text and "workload chat" in text
    summary = (tmp_path / "summary.md").read_text()
    assert summary == markdown(json.loads((tmp_path / "results.json").read_text()))
    assert "| 4 | 300.0 | 60.0 | 5.00x | " in summary
    assert " / 80 | " in summary and " / 400 | " in summary
    one = {k: v for k, v in result.items() if k != "comparison"}  # a run with one server
    assert markdown(refresh({**one, "targets": one["targets"][:1]})).count(
        "| concurrency | ok/err/canc |") == 1
    path = write_results(result, tmp_path)
    doc = json.loads(path.read_text())
    assert doc["comparison"][0]["concurrency"] == 1
    assert [t["title"][:13] for t in doc["tables"]] == ["ours: ensembl", "naive: ensemb", "ours vs naive"]
    from builder.bench.plots import write_plots

    for png in write_plots(result, tmp_path):
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_report_says_when_input_tokens_were_not_counted():
    """Without a tokenizer the prompts' lengths are unknown: the report says so and how to count
    them, never `input tokens None`; counted ranges read as ranges."""
    from builder.bench.report import workload_line

    result = _result()
    line = workload_line(result)
    assert "None" not in line.split("requests per level")[0]
    assert "input tokens not counted (no tokenizer: --engine DIR or --tokenizer DIR" in line
    assert "input tokens not counted" in markdown(refresh(result))
    result["workload"].update(input_tokens={"min": 12, "max": 40, "mean": 20.5},
                              max_tokens={"min": 16, "max": 16, "mean": 16.0})
    assert "input tokens 12-40 (mean 20.5); max_tokens 16;" in workload_line(result)


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "1,x"], "--concurrency"),
    (["--concurrency", "0"], "--concurrency"),
    (["--requests", "3", "--duration", "2"], "not both"),
    (["--workload", "nope"], "workload must be one of"),
    (["--compare", "a:1", "b:2", "--baseline", "c:3"], "not both"),
    (["--compare", "a:1", "b:2", "--labels", "x"], "--labels"),
    (["--compare", "a:1", "b:2", "--metrics-url", "a:3"], "--metrics-url needs 2"),
])
def test_cli_bad_input_exits_2(args, message):
    result = CliRunner().invoke(bench_command, args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_cli_baseline_naive_needs_an_engine():
    result = CliRunner().invoke(bench_command, ["--baseline", "naive"])
    assert result.exit_code == 2 and "--engine" in result.output


def test_rewrite_workload_copies_its_input(tokenizer):
    from builder.bench import corpus

    wl = build_workload("rewrite", 8, scale=0.5, tokenizer=tokenizer)
    assert wl.items == build_workload("rewrite", 8, scale=0.5, tokenizer=tokenizer).items
    asks = [item.prompt.split("\n")[0] for item in wl.items]
    assert asks[0].startswith("Rewrite") and asks[1] == "Article:" and asks[2].startswith("Summarise")
    code = wl.items[3].prompt
    assert any(source in code for source, _ in corpus.CODE_SNIPPETS) and "_value`" in code
    for item in wl.items:
        assert item.stream and item.max_tokens == 48
        assert len(tokenizer.encode(item.prompt, add_special_tokens=False)) == item.num_input_tokens


def test_server_counters_over_a_level():
    from builder.bench.report import server_counters
    from builder.bench.server_stats import level_delta, metrics_url
    from builder.client.metrics_reader import parse

    page = """# HELP llm_forge_executor_stats counters
llm_forge_executor_stats{model="tensorrt_llm",stat="prefix_cache_queried_tokens",version="1"} %d
llm_forge_executor_stats{model="tensorrt_llm",stat="prefix_cache_hit_tokens",version="1"} %d
llm_forge_executor_stats{model="tensorrt_llm",stat="spec_num_draft_tokens",version="1"} %d
llm_forge_executor_stats{model="tensorrt_llm",stat="spec_num_accepted_tokens",version="1"} %d
llm_forge_executor_stats{model="tensorrt_llm",stat="spec_num_verify_steps",version="1"} %d
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm"} 3
"""
    before = parse(page % (1000, 0, 40, 10, 10)).totals()
    after = parse(page % (3000, 1900, 140, 70, 35)).totals()
    assert before["prefix_cache_queried_tokens"] == 1000 and "used" not in before
    delta = level_delta(before, after)
    assert delta["prefix_cache_hit_rate"] == pytest.approx(0.95)
    assert delta["spec_acceptance_rate"] == pytest.approx(0.6)
    assert delta["spec_mean_accepted_length"] == pytest.approx((60 + 25) / 25)
    assert server_counters({"server": delta}) == "95% / 60% / 3.40"
    assert server_counters({}) == "- / - / -"
    assert metrics_url("localhost:8002") == "http://localhost:8002/metrics"
    assert metrics_url("http://h:1/metrics") == "http://h:1/metrics"


# -- prompts per level -----------------------------------------------------------------------
def test_each_level_and_the_warmup_draw_prompts_of_their_own(tokenizer, tmp_path):
    wl = build_workload("chat", 6, seed=1, scale=0.1, tokenizer=tokenizer)
    first, later, warmup = wl.items_for(None), wl.items_for("level1"), wl.items_for("warmup")
    assert first == wl.items
    assert later == wl.items_for("level1")  # seeded: the same on both servers and on reruns
    prompts = [{i.prompt for i in items} for items in (first, later, warmup)]
    assert not prompts[0] & prompts[1] and not prompts[0] & prompts[2]
    assert not prompts[1] & prompts[2]
    assert wl.describe()["prompts_per_level"] == "distinct"
    # voicebot's shared system prompt is what it measures: it stays shared across levels.
    vb = build_workload("voicebot", 2, scale=0.05, tokenizer=tokenizer)
    systems = {i.prompt.split("\nCaller:")[0] for r in (None, "level1") for i in vb.items_for(r)}
    assert len(systems) == 1
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "hi", "max_tokens": 2}\n')
    own = build_workload(str(path), 1)
    assert own.items_for("level1") == own.items
    assert own.describe()["prompts_per_level"] == "the same at every level"


def test_run_bench_sends_each_level_its_own_prompts(monkeypatch, tokenizer):
    from builder.bench import runner

    sent: list[tuple[int, str]] = []

    class Inputs:
        def accepts(self, name):
            return True

    class Recorder(FakeClient):
        def send(self, item, index, level_start):
            sent.append((index, item.prompt))
            return super().send(item, index, level_start)

    monkeypatch.setattr(runner, "fetch_model_inputs", lambda *a: Inputs())
    monkeypatch.setattr(runner, "make_client", lambda *a: Recorder())
    wl = build_workload("chat", 4, scale=0.1, tokenizer=tokenizer)
    settings = BenchSettings((1, 2), requests="4", warmup=1)
    runner.run_bench([runner.Target("a", "h:1"), runner.Target("b", "h:2")], wl, settings)
    warmup = {p for i, p in sent if i < 0}
    levels = [{p for i, p in sent[n:n + 8] if i >= 0} for n in (2, 10)]  # after both warm-ups
    assert len(warmup) == 1 and all(len(level) == 4 for level in levels)  # both targets alike
    assert not levels[0] & levels[1] and not warmup & (levels[0] | levels[1])


FAKE_VLLM = '''
print("vLLM says hello on stdout")  # must not reach the answer pipe


class EngineArgs:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class SamplingParams:
    def __init__(self, max_tokens, min_tokens, **kwargs):
        assert min_tokens == max_tokens
        self.max_tokens = max_tokens
'''
FAKE_ENGINE = '''
from types import SimpleNamespace


class LLMEngine:
    """One token a step for every request, cumulative outputs, like vLLM's default."""

    @classmethod
    def from_engine_args(cls, args):
        assert args.kwargs["enable_prefix_caching"] is False
        return cls()

    def __init__(self):
        self.requests = {}

    def add_request(self, rid, prompt, params):
        self.requests[rid] = [prompt["prompt_token_ids"], params.max_tokens, []]

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        outputs = []
        for rid, (ids, n, out) in list(self.requests.items()):
            out.append(len(ids))
            outputs.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(
                token_ids=list(out))]))
            if len(out) == n:
                del self.requests[rid]
        return outputs
'''


def test_the_vllm_side_drives_vllms_engine_in_its_venv_over_a_pipe(tmp_path, monkeypatch):
    import os
    import sys

    from builder.bench.engine_bench import ratio_notes
    from builder.bench.engine_level import EngineProtocol
    from builder.bench.vllm_engine_side import VllmEngineSide

    package = tmp_path / "site" / "vllm"
    (package / "v1" / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    (package / "v1" / "__init__.py").write_text("")
    (package / "v1" / "engine" / "__init__.py").write_text("")
    (package / "v1" / "engine" / "llm_engine.py").write_text(FAKE_ENGINE)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / "venv" / "bin" / "python")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))

    side = VllmEngineSide(tmp_path / "venv", "checkpoint", EngineProtocol(3, 4, 5))
    try:
        one = side.run_one([5, 6, 7, 8], "", max_tokens=1)
        assert one.decode_tok_s == 0.0 and one.ttft_s > 0
        every = side.run_all([[1] * 4, [2] * 4, [3] * 4], ["", "", ""])
        assert 0 < every.prefill_s < every.total_s
        assert every.tok_s == pytest.approx(15 / every.total_s)
    finally:
        side.close()
    assert side.child.returncode == 0
    with pytest.raises(FileNotFoundError, match="--vllm-venv: no .*bin/python"):
        VllmEngineSide(tmp_path / "nowhere", "checkpoint", EngineProtocol())

    # Ours over vLLM's: above 1 where ours is ahead.
    def timings(prefill, tok_s, ttft, decode):
        return {"c1": {"ttft_s": ttft, "decode_tok_s": decode},
                "cN": {"prefill_s": prefill, "tok_s": tok_s}}

    runs = {"engine": [timings(3.0, 180.0, 0.4, 120.0)] * 2,
            "vllm": [timings(6.0, 90.0, 0.8, 60.0), timings(4.5, 90.0, 0.8, 60.0)]}
    medians = {name: {f"{lv}.{key}": sum(r[lv][key] for r in rs) / len(rs)
                      for lv in ("c1", "cN") for key in rs[0][lv]} for name, rs in runs.items()}
    (line,) = ratio_notes(medians, runs)
    assert line.startswith("engine vs vllm: prefill of all 1.75x as fast (repeat by repeat: "
                           "2.00, 1.50), tok/s c=N 2.00x, decode c=1 2.00x, TTFT c=1 2.00x")


def test_vllm_computes_on_every_allowed_core_unless_the_environment_binds_it(monkeypatch):
    import os

    from builder.bench.servers import vllm_env

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 0, 1})
    env = vllm_env(4)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,3"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    env = vllm_env(2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env
