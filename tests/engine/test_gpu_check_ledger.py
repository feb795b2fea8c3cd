"""`forge gpu-check`'s ledger: each check in its own budget, its time and counts kept, the report
written after every check; an injected failure (`LLM_FORGE_GPU_CHECK_FAIL`) or an exhausted
budget ends that check alone. And the cold GPU run's estimate from the counts."""
import json
import time

import pytest

from builder.gpu_check import estimate, ledger
from builder.gpu_check.ledger import FAIL_ENV, Ledger, Skipped, count, write_json

NAMES = ["a: build", "a: parity", "a: speed", "b: build", "served"]


def _run_all(tmp_path, monkeypatch, failing: str | None = None):
    if failing is not None:
        monkeypatch.setenv(FAIL_ENV, failing)
    out = tmp_path / "report.json"
    written = []
    book: Ledger

    def write():
        write_json(out, {"ledger": book.to_list()})
        written.append(len(json.loads(out.read_text())["ledger"]))

    book = Ledger(write, lambda line: None)
    results = {}
    for name in NAMES:
        def check(name=name):
            count("reference_runs", 2)
            if name == "b: build":
                count("engine_builds")
            return name.upper()
        results[name] = book.run(name, 60, check)
    return book, results, written, json.loads(out.read_text())


def test_each_check_is_timed_counted_and_written_after(tmp_path, monkeypatch):
    book, results, written, report = _run_all(tmp_path, monkeypatch)
    assert written == [1, 2, 3, 4, 5]  # the report on disk after every check
    assert results == {name: name.upper() for name in NAMES}
    assert [r["status"] for r in report["ledger"]] == ["ok"] * 5
    assert [r["counts"]["reference_runs"] for r in report["ledger"]] == [2] * 5
    assert [r["counts"]["engine_builds"] for r in report["ledger"]] == [0, 0, 0, 1, 0]
    totals = book.totals()
    assert totals["reference_runs"] == 10 and totals["engine_builds"] == 1
    assert totals["seconds"] == pytest.approx(sum(r.seconds for r in book.records))


@pytest.mark.parametrize("failing", NAMES)
def test_an_injected_failure_in_any_check_leaves_a_complete_report(tmp_path, monkeypatch,
                                                                   failing):
    book, results, written, report = _run_all(tmp_path, monkeypatch, failing)
    assert written == [1, 2, 3, 4, 5]
    by_name = {r["name"]: r for r in report["ledger"]}
    assert list(by_name) == NAMES
    assert by_name[failing]["status"] == "failed"
    assert by_name[failing]["error"] == f"InjectedFailure: {FAIL_ENV} names {failing!r}"
    assert by_name[failing]["counts"]["reference_runs"] == 0  # it never started
    assert results[failing] is None
    assert all(r["status"] == "ok" for name, r in by_name.items() if name != failing)


def test_a_check_out_of_budget_says_so_and_the_next_runs(tmp_path):
    book = Ledger(lambda: None, lambda line: None)
    assert book.remaining() is None

    def slow():
        assert 0 < book.remaining() <= 0.2
        while True:  # interrupted by the budget's alarm
            time.sleep(0.01)

    assert book.run("slow", 0.2, slow) is None
    assert book.run("next", 30, lambda: 7) == 7
    slow_record, next_record = book.records
    assert slow_record.status == "timed out"
    assert slow_record.error == "ran out of its 0 s budget"
    assert next_record.status == "ok" and next_record.error is None


def test_a_check_without_its_input_is_skipped_and_failures_keep_their_message():
    book = Ledger(lambda: None, lambda line: None)

    def needs():
        raise Skipped("needs the engine, which an earlier check did not give")

    def broken():
        raise ValueError("limits.max_seq_len (9) is too small")

    book.run("needs", 5, needs)
    book.run("broken", 5, broken)
    assert [(r.status, r.error) for r in book.records] == [
        ("skipped", "needs the engine, which an earlier check did not give"),
        ("failed", "ValueError: limits.max_seq_len (9) is too small")]


def test_count_names_only_what_the_ledger_keeps():
    with pytest.raises(ValueError, match="'compiles' is not one of triton_compiles"):
        count("compiles")
    before = ledger.COUNTS["graph_captures"]
    count("graph_captures", 4)
    assert ledger.COUNTS["graph_captures"] == before + 4


def test_the_cold_gpu_estimate_adds_up_its_terms(tmp_path):
    from builder.gpu_check.run import Settings

    settings = Settings.for_device("cpu", tmp_path)
    here = estimate.plan_counts(settings)
    assert here == {"engine_builds": 3, "engine_loads": 3, "graph_captures": 3 * 2,
                    "kernel_variants": 15 + 12, "reference_runs": 2 * (4 + 1 + 2 * 2)}
    plan = estimate.cold_gpu_run(settings, here)
    assert plan["this_run"]["counts_match"]
    assert not estimate.cold_gpu_run(settings, {**here, "engine_loads": 9})["this_run"][
        "counts_match"]
    assert plan["seconds"] == pytest.approx(sum(plan["terms"].values()), abs=0.5)
    assert plan["fits_5_minutes"] == (plan["seconds"] <= 300)
    gpu = plan["gpu_plan"]
    # The two bf16 shapes, the small one again in float32 (the exact rule), the FP8 engine.
    assert gpu["engine_builds"] == gpu["engine_loads"] == 4
    assert gpu["capture_sizes"] == [1, 4, 16, 64] and gpu["graph_captures"] == 4 * 4
    # Per GPU shape (head size 64, 16 tokens a block, 2,048 keys, 132 SMs): four fused ops, the
    # paged kernel at 1, 2, 4 and 8 splits and at chunk tiles 2, 4, 8 and 16, three merges (the
    # same for both bf16 shapes: one head size); the float32 run's own; and the FP8 input
    # quantization (one block of 1,024).
    assert gpu["kernel_variants"] == (4 + 4 + 4 + 3) + (4 + 4 + 4) + 15 + 1
    assert gpu["reference_runs"] == 2 * (4 + 1 + 2 * 3) + (4 + 1)
    assert plan["terms"]["triton compiles"] == pytest.approx(
        estimate.UNIT_S["triton_compile"] * gpu["kernel_variants"], abs=0.05)
    settings.fp8 = False
    without_fp8 = estimate.cold_gpu_run(settings, here)
    assert without_fp8["gpu_plan"]["engine_builds"] == 3
    assert without_fp8["seconds"] < plan["seconds"]


def test_once_the_runs_budget_is_spent_the_rest_are_not_run_saying_so():
    written = []
    book = Ledger(lambda: written.append(len(book.records)), lambda line: None, total_s=0.3)

    def slow():
        while True:
            time.sleep(0.01)

    assert book.run("first", 60, slow) is None  # its 60 s cut to what the run had left
    assert book.run("second", 60, lambda: 1) is None
    first, second = book.records
    assert first.status == "timed out" and first.budget_s <= 0.3
    assert second.status == "not run" and second.error == "the run's 0 s budget is spent"
    assert written == [1, 2]


def test_a_gpu_run_adds_a_float32_run_of_the_smaller_shape_for_the_exact_rule(tmp_path):
    from builder.gpu_check.run import Settings, shape_runs

    gpu = shape_runs(Settings.for_device("cuda", tmp_path))
    assert [(r.name, r.dtype, r.exact, r.measure_speed) for r in gpu] == [
        ("smollm2-135m-shape", "bfloat16", False, True),
        ("llama-1.07b-shape", "bfloat16", False, True),
        ("smollm2-135m-shape-fp32", "float32", True, False)]
    cpu = shape_runs(Settings.for_device("cpu", tmp_path))
    assert [(r.name, r.dtype, r.exact) for r in cpu] == [
        ("smollm2-shape-tiny", "float32", True), ("llama-shape-tiny", "float32", True)]
