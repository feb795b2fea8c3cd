"""`forge bench --baseline naive` end to end: a tiny engine served by a real tritonserver, its
naive baseline built and served by the bench itself, the chat workload on both, the report."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import tiny
from builder.cli.bench import bench_command
from triton_helpers import running_tritonserver

pytestmark = pytest.mark.slow


def test_bench_against_the_naive_baseline(tmp_path):
    engine = tiny.build_engine(tmp_path, "llama_gqa", repository=True)
    out = tmp_path / "report"
    with running_tritonserver(tmp_path / "model_repository") as server:
        result = CliRunner().invoke(bench_command, [
            "--url", server.grpc_url, "--engine", str(engine), "--baseline", "naive",
            "--workload", "chat", "--scale", "0.05", "--concurrency", "1,3",
            "--requests", "3", "--warmup", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "engine vs naive" in result.output
    assert (engine.parent / f"{engine.name}-naive" / "hf" / "config.json").is_file()
    doc = json.loads((out / "results.json").read_text())
    assert [t["label"] for t in doc["targets"]] == ["engine", "naive"]
    for target in doc["targets"]:
        assert target["fixed_output_honoured"]
        assert [lv["concurrency"] for lv in target["levels"]] == [1, 3]
        for level in target["levels"]:
            assert (level["completed"], level["errors"], level["cancelled"]) == (3, 0, 0)
            for request in level["requests_detail"]:
                # fixed output length: every request generated exactly max_tokens tokens
                assert request["output_tokens"] == request["max_tokens"]
                assert request["output_tokens_source"] == "server"
                assert request["ttft_s"] <= request["e2e_s"]
    # Same requests on both servers.
    a, b = (t["levels"][0]["requests_detail"] for t in doc["targets"])
    assert [r["num_input_tokens"] for r in a] == [r["num_input_tokens"] for r in b]
    assert [row["concurrency"] for row in doc["comparison"]] == [1, 3]
    assert "| 3 |" in (out / "summary.md").read_text()
    for name in ("throughput_vs_concurrency", "ttft_p99_vs_throughput", "itl_vs_concurrency"):
        assert (out / f"{name}.png").stat().st_size > 10_000
