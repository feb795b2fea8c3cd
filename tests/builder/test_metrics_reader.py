"""The one /metrics reader: executor counters by model, other families ignored."""
from builder.client.metrics_reader import EngineStats, parse, scrape

# The shape of a real tritonserver scrape (HELP/TYPE lines, NVIDIA's families beside ours).
PAGE = """# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="tensorrt_llm",version="1"} 12
# HELP llm_forge_executor_stats llm-forge executor counters (get_stats)
# TYPE llm_forge_executor_stats gauge
llm_forge_executor_stats{model="tensorrt_llm",stat="num_threads",version="1"} 2
llm_forge_executor_stats{model="tensorrt_llm",stat="model_active_requests",version="1"} 3
llm_forge_executor_stats{model="tensorrt_llm",stat="prefix_cache_hit_rate",version="1"} 0.25
llm_forge_executor_stats{model="other",stat="model_active_requests",version="1"} 1e+00
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 3
"""


def test_counters_by_model_and_summed():
    stats = parse(PAGE)
    assert stats.of("tensorrt_llm") == {"num_threads": 2.0, "model_active_requests": 3.0,
                                        "prefix_cache_hit_rate": 0.25}
    assert stats.of("missing") == {}
    assert stats.totals()["model_active_requests"] == 4.0
    assert "used" not in stats.totals()


def test_a_server_without_our_counters_gives_empty_stats(tmp_path):
    page = tmp_path / "metrics"
    page.write_text(PAGE.replace("llm_forge_executor_stats", "something_else"))
    assert scrape(page.as_uri()) == EngineStats()
    page.write_text(PAGE)
    assert scrape(page.as_uri()) == parse(PAGE)
