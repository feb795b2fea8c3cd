"""`forge bench`'s engine-level and feature subcommands on a tiny engine: each writes the one
results.json / summary.md format with the columns the docs quote, and refuses bad input naming
the option (exit 2)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import tiny
from builder.bench.summary import Table, ratio_cell
from builder.cli.bench import bench_command


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return str(tiny.build_engine(tmp_path_factory.mktemp("tiny"), speculative={
        "mode": "ngram", "num_draft_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}))


def bench(tmp_path, *args: str) -> dict:
    out = tmp_path / args[0]
    result = CliRunner().invoke(bench_command, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["tool"] == f"forge bench {args[0]}" and doc["host"]["vcpus"] >= 1
    assert (out / "summary.md").read_text().count("|---|") == len(doc["tables"])
    return doc


def test_one_table_format():
    table = Table(["case", "tok/s"], title="t")
    table.add("a", 1.5)
    assert table.markdown() == "t\n\n| case | tok/s |\n|---|---:|\n| a | 1.5 |\n"
    assert ratio_cell([2.0, 3.0, 4.0], [1.0, 2.0, 2.0]) == "1.50x (2.00, 1.50, 2.00)"


def test_steps_times_engines_in_turns_quiet_and_busy(engine, tmp_path):
    doc = bench(tmp_path, "steps", "--engine", f"a={engine}", "--engine", f"b={engine}",
                "--concurrency", "1,2", "--prompt-len", "8", "--steps", "2", "--repeats", "2",
                "--neighbour", "quiet,busy", "--threads", "1")
    (table,) = doc["tables"]
    assert table["columns"] == ["engine", "KV cache", "concurrency", "step ms", "busy step ms",
                                "tok/s", "vs a (repeats)", "busy / quiet step"]
    assert [row[:3] for row in table["rows"]] == [["a", "float32", "1"], ["b", "float32", "1"],
                                                  ["a", "float32", "2"], ["b", "float32", "2"]]
    assert all(len(v["quiet"]) == 2 for v in doc["runs_step_s"].values())


def test_profile_decode_prefill_and_shape(engine, tmp_path):
    doc = bench(tmp_path, "profile", "--engine", engine, "--concurrency", "2", "--steps", "1")
    assert doc["tables"][0]["columns"] == ["op", "calls/run", "self ms/run", "share"]
    assert doc["step_ms"] > 0
    doc = bench(tmp_path, "profile", "--engine", engine, "--prefill", "64", "--repeats", "1")
    assert doc["share_of_peak"] > 0 and "GFLOP/s" in doc["notes"][1]
    doc = bench(tmp_path, "profile", "--engine", engine, "--shape", "16/4@2x4",
                "--target-itl-ms", "auto")
    assert doc["tables"][0]["rows"][0][:2] == ["16/4 c=2 x4", "auto"]
    assert doc["figures"]["output_tok_s"] > 0


def test_spec_and_chunked_prefill(engine, tmp_path):
    doc = bench(tmp_path, "spec", "--engine", engine, "--prompts", "2", "--scale", "0.1",
                "--max-tokens", "8",
                "--repeats", "1")
    assert doc["tables"][0]["columns"][-1] == "speculation / none (repeats)"
    doc = bench(tmp_path, "chunked-prefill", "--engine", engine, "--max-num-tokens", "16",
                "--target-itl-ms", "0,auto", "--streams", "2", "--steady-steps", "2",
                "--repeats", "1")
    assert [row[:2] for row in doc["tables"][0]["rows"]] == [["16 / 0", "64"],
                                                            ["16 / auto", "64"]]


@pytest.mark.parametrize("args, message", [
    (["steps", "--engine", "nope"], "--engine 'nope': expected NAME=DIR"),
    (["steps", "--neighbour", "loud"], "--neighbour must be quiet, busy or quiet,busy"),
    (["steps", "--concurrency", "1,x"], "--concurrency must be comma-separated integers"),
    (["profile", "--engine", ".", "--prefill", "8", "--shape", "8/2@1"], "not both"),
    (["soak"], "give --engine DIR or --repository DIR"),
    (["matrix", "--vllm-venv", "/nonexistent"], "no vllm in /nonexistent"),
])
def test_bad_input_exits_2_naming_the_option(args, message):
    result = CliRunner().invoke(bench_command, args)
    assert result.exit_code == 2 and message in result.output, result.output
