"""gpu-check's two parity rules: float32 exact; bf16 close (where our greedy token first parts
from transformers', transformers' own logits for the two are within the tolerance; the prefill's
top-1 agrees where its top two are further apart than that)."""
import pytest
import torch

from builder.gpu_check.parity import BF16_TOLERANCE, compare_prefill, greedy_parity

VOCAB = 8


def _logits(rows: list[dict[int, float]]) -> torch.Tensor:
    out = torch.zeros(len(rows), VOCAB)
    for i, row in enumerate(rows):
        for token, value in row.items():
            out[i, token] = value
    return out


def test_identical_ids_are_exact_and_close():
    logits = [_logits([{1: 5.0}, {2: 5.0}])]
    result = greedy_parity([[1, 2]], [[1, 2]], logits)
    assert result["exact"] and result["close"] and result["partings"] == []
    assert (result["matched_tokens"], result["total_tokens"]) == (2, 2)


def test_parting_at_a_near_tie_is_close_not_exact():
    near = BF16_TOLERANCE / 2
    logits = [_logits([{1: 5.0}, {2: 5.0, 3: 5.0 - near}, {4: 1.0}])]
    result = greedy_parity([[1, 2, 4]], [[1, 3, 6]], logits)  # after parting: not compared
    assert not result["exact"] and result["close"]
    assert result["partings"] == [(0, 1, near)]


def test_parting_where_the_reference_was_sure_is_not_close():
    logits = [_logits([{1: 5.0}]), _logits([{2: 5.0, 3: 5.0 - 2 * BF16_TOLERANCE}])]
    result = greedy_parity([[1], [2]], [[1], [3]], logits)
    assert not result["close"]
    assert result["partings"] == [(1, 0, 2 * BF16_TOLERANCE)]
    assert not greedy_parity([[1, 2]], [[1]], [_logits([{1: 5.0}, {2: 5.0}])])["close"]


def test_the_prefill_rule_counts_only_clear_positions():
    theirs = _logits([{1: 3.0}, {2: 3.0, 5: 3.0 - BF16_TOLERANCE / 3}, {4: 2.0}])
    ours = _logits([{1: 3.0}, {5: 3.1}, {4: 2.0}])  # swaps the near tie only
    result = compare_prefill(ours, theirs)
    assert result["clear_positions"] == 2 and result["top1_agreement_clear"] == 1.0
    assert result["top1_agreement"] == pytest.approx(2 / 3)
    assert result["max_abs_diff"] == pytest.approx(3.0)  # token 2: 3.0 against 0
    wrong = _logits([{1: 3.0}, {2: 3.0}, {6: 2.5}])
    assert compare_prefill(wrong, theirs)["top1_agreement_clear"] == 0.5


def test_a_bf16_run_is_held_to_the_close_rule(tmp_path, monkeypatch):
    """gpu-check's bf16 branch (a GPU's) on the CPU: a tiny bf16 engine against transformers in
    bf16, through the shape's own checks; where the greedy ids part, it is at a near tie."""
    import tiny

    from builder.gpu_check import models, shape_checks
    from builder.gpu_check.parity import BF16_TOLERANCE
    from builder.gpu_check.run import Report, Settings

    monkeypatch.setenv("LLM_FORGE_KERNELS", "gpu")
    engine_dir = tiny.build_engine(tmp_path, "llama_gqa", dtype="bfloat16")
    settings = Settings.for_device("cpu", tmp_path / "work")
    run = shape_checks.ShapeRun(models.Shape("tiny-bf16", 64, 128, 2, 4, 2, 384, 0.02),
                                "bfloat16", measure_speed=False)
    run.checkpoint, run.engine_dir = engine_dir.parent / "hf-llama_gqa", engine_dir
    report = Report(settings)
    shape_checks.reference(run, settings)
    shape_checks.load(run, settings)
    shape_checks.parity_eager(run, report)
    shape_checks.capture(run)
    shape_checks.parity_graphs(run, report)
    checks = {c["name"]: c for c in report.checks}
    assert set(checks) == {
        "tiny-bf16 prefill top-1 = transformers where the top two are > 0.25 apart",
        "tiny-bf16 greedy ids close to transformers (eager)",
        "tiny-bf16 greedy ids close to transformers (graphs)",
        "tiny-bf16 prefix-cache hit in the parity batch (eager)",
        "tiny-bf16 prefix-cache hit in the parity batch (graphs)"}
    assert all(c["passed"] and c["applied"] for c in checks.values()), checks
    for mode in ("eager", "graphs"):
        partings = run.result["parity"][mode]["partings"]
        assert all(abs(gap) <= BF16_TOLERANCE for _, _, gap in partings), partings
    assert run.result["prefill_logits"]["clear_positions"] > 0
