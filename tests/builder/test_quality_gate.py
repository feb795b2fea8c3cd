"""The quality gate really gates: a sound quantization passes, a deliberately damaged one makes
`forge check` exit with code 3 naming the metric and its threshold; quality.json records both."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is the `quant` extra")

import tiny  # noqa: E402
from builder.cli import main  # noqa: E402
from builder.quality.gate import compare  # noqa: E402
from builder.quality.metrics import QualityThresholds  # noqa: E402
from builder.quantize import CalibrationOptions, QuantizeOptions, quantize_engine  # noqa: E402

THRESHOLDS = ["max_perplexity_increase_pct=10", "min_logit_cosine=0.8", "min_top1_agreement=none",
              "windows=4", "seq_len=64", "prompts=2", "greedy_tokens=4"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(sound int4_rtn engine, the same with every weight scale inflated 4x, source checkpoint)."""
    tmp = tmp_path_factory.mktemp("gate")
    good = tiny.build_engine(tmp, "llama_gqa", dtype="bfloat16")
    hf_dir = tmp / "hf-llama_gqa"
    options = QuantizeOptions(weights="int4_rtn", group_size=32,
                              calibration=CalibrationOptions(samples=4, seq_len=32))
    quantize_engine(good, hf_dir, options)
    bad = tmp / "damaged"
    shutil.copytree(good, bad)
    state = load_file(str(bad / "model.safetensors"))
    for key in [k for k in state if k.endswith("weights_scaling_factor")]:
        state[key] = state[key] * 4.0
    save_file(state, str(bad / "model.safetensors"))
    return good, bad, hf_dir


def _check(engine_dir, hf_dir):
    args = ["check", "--engine", str(engine_dir), "--reference", str(hf_dir)]
    for item in THRESHOLDS:
        args += ["--threshold", item]
    return CliRunner().invoke(main, args)


def test_sound_quantization_passes_and_records_quality_json(engines):
    good, _, hf_dir = engines
    result = _check(good, hf_dir)
    assert result.exit_code == 0, result.output
    assert "perplexity_increase_pct" in result.output and "quality gate: passed" in result.output
    quality = json.loads((good / "quality.json").read_text())
    assert quality["passed"] is True and quality["failures"] == []
    assert quality["thresholds"]["max_perplexity_increase_pct"] == 10
    assert quality["dataset"] == "builtin:heldout"


def test_damaged_quantization_fails_with_exit_code_3_naming_the_metric(engines):
    _, bad, hf_dir = engines
    result = _check(bad, hf_dir)
    assert result.exit_code == 3, result.output
    assert "quality gate failed" in result.output
    # A random-weight model's perplexity says little (it is near the vocabulary size either way);
    # the logits' direction is what the damage destroys.
    assert "logit_cosine" in result.output and ">= 0.8" in result.output
    quality = json.loads((bad / "quality.json").read_text())
    assert quality["passed"] is False
    assert any(f.startswith("logit_cosine") for f in quality["failures"])


def test_a_quick_check_measures_a_fraction_says_so_and_a_plain_check_is_full_again(engines):
    good, _, hf_dir = engines
    quick = CliRunner().invoke(main, ["check", "--engine", str(good), "--reference", str(hf_dir),
                                      "--quick", *[a for t in THRESHOLDS for a in ("--threshold", t)]])
    assert quick.exit_code == 0, quick.output
    assert "QUICK GATE (2 of 4 windows, 2 of 2 greedy prompts): not the full gate" in quick.output
    assert "quality gate: passed (QUICK: a fraction of the gate, not the full one)" in quick.output
    report = json.loads((good / "quality.json").read_text())
    assert report["mode"] == "quick" and report["thresholds"]["quick"] is True
    full = _check(good, hf_dir)  # the thresholds of the quick check, but not its quickness
    assert full.exit_code == 0 and "QUICK" not in full.output, full.output
    assert json.loads((good / "quality.json").read_text())["mode"] == "full"


def test_check_uses_the_users_data(engines, tmp_path):
    good, _, hf_dir = engines
    data = tmp_path / "mine.jsonl"
    data.write_text("\n".join(json.dumps({"text": tiny.CORPUS}) for _ in range(2)))
    result = CliRunner().invoke(main, ["check", "--engine", str(good), "--reference", str(hf_dir),
                                       "--data", str(data), "--threshold", "windows=2",
                                       "--threshold", "seq_len=32"])
    assert result.exit_code == 0, result.output
    assert json.loads((good / "quality.json").read_text())["dataset"] == str(data)


class _Fixed:
    """A model that returns given logits and a given greedy continuation."""

    def __init__(self, logits: torch.Tensor, greedy: list[int]) -> None:
        self._logits, self._greedy = logits, greedy

    def logits(self, ids):
        return self._logits[:len(ids)]

    def greedy(self, ids, n):
        return self._greedy[:n]


def test_metrics_on_known_logits():
    torch.manual_seed(0)
    ref = torch.randn(8, 16)
    windows = torch.randint(0, 16, (1, 8))
    same = compare(_Fixed(ref, [1, 2, 3, 4]), _Fixed(ref.clone(), [1, 2, 3, 4]), windows,
                   QualityThresholds(prompts=1, greedy_tokens=4), lambda m: None)
    assert same["perplexity_increase_pct"] == pytest.approx(0.0, abs=1e-9)
    assert same["top1_agreement"] == 1.0 and same["logit_cosine"] == pytest.approx(1.0)
    assert same["greedy_agreement"] == 1.0
    diverged = compare(_Fixed(ref, [1, 2, 3, 4]), _Fixed(-ref, [1, 2, 9, 4]), windows,
                       QualityThresholds(prompts=1, greedy_tokens=4), lambda m: None)
    assert diverged["top1_agreement"] == 0.0 and diverged["logit_cosine"] == pytest.approx(-1.0)
    assert diverged["greedy_agreement"] == 0.5  # departs at the third of four tokens


def test_unknown_quality_key_is_named():
    with pytest.raises(ValueError, match=r"quantization\.quality\.max_ppl: unknown key"):
        QualityThresholds.from_spec({"max_ppl": 3})


def test_a_rejected_build_keeps_its_report_where_the_message_says(tmp_path):
    """The gate rejects a build (exit 3): the previous engine stays as it was and the report
    lands in <output>.rejected/quality.json, whose path the error names; the report's first
    line is the verdict, and the gate said up front how long it would take. With
    --keep-rejected the whole rejected engine is kept there, and forge check takes it."""
    checkpoint = tiny.make_checkpoint(tmp_path / "hf", "llama_gqa")
    output = tmp_path / "engine"
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"name: gated\ncheckpoint: {checkpoint}\ndtype: bfloat16\noutput: {output}\n"
        "limits: {max_batch_size: 4, max_num_tokens: 64, max_input_len: 64, max_seq_len: 128}\n"
        "quantization:\n  weights: int4_rtn\n  group_size: 32\n"
        "  calibration: {samples: 2, seq_len: 32}\n"
        "  quality: {max_perplexity_increase_pct: null, min_top1_agreement: null,\n"
        "            min_logit_cosine: 1.01, windows: 2, seq_len: 32, prompts: 1,\n"
        "            greedy_tokens: 2}\n")  # a cosine above 1 no quantization can reach
    result = CliRunner().invoke(main, ["engine", "--spec", str(spec), "--no-repository"])
    assert result.exit_code == 3, result.output
    report = output.with_name("engine.rejected") / "quality.json"
    assert f"(report: {report}; " in result.output
    quality = json.loads(report.read_text())
    assert quality["passed"] is False and quality["failures"][0].startswith("logit_cosine")
    assert not output.exists()  # nothing was installed in its place
    assert "--keep-rejected keeps the whole engine to check or try" in result.output
    said = " ".join(result.output.split())  # the console wraps long lines
    assert "quality gate (full): 2 held-out windows, 1 greedy prompts, " in said
    assert "questions, each through the reference and the engine; no earlier full gate" in said
    verdict = "quality gate: FAILED: logit_cosine = "
    assert verdict in said and said.index(verdict) < said.index("perplexity_increase_pct")

    kept = CliRunner().invoke(main, ["engine", "--spec", str(spec), "--no-repository",
                                     "--keep-rejected"])
    assert kept.exit_code == 3, kept.output
    assert "the last full one of this model here took " in " ".join(kept.output.split())
    rejected = output.with_name("engine.rejected")
    assert f"rejected engine kept: {rejected}; `forge check --engine {rejected}`" in kept.output
    assert {"config.json", "model.safetensors", "quality.json"} <= {p.name for p in
                                                                    rejected.iterdir()}
    assert not output.exists()
    tried = CliRunner().invoke(main, ["generate", "--engine", str(rejected), "--prompt-ids",
                                      "5,6,7", "--max-tokens", "2", "--json"])
    assert tried.exit_code == 0 and len(json.loads(tried.output)["output_ids"]) <= 2, tried.output
    check = CliRunner().invoke(main, ["check", "--engine", str(rejected), "--reference",
                                      str(checkpoint), "--threshold", "min_logit_cosine=0.5"])
    assert check.exit_code == 0, check.output
    assert check.output.lstrip().startswith("quality gate: passed") or \
        "\nquality gate: passed\n" in check.output


def test_check_with_too_little_text_names_the_minimum(engines, tmp_path):
    good, _, hf_dir = engines
    data = tmp_path / "short.jsonl"
    data.write_text(json.dumps({"text": "A few words only."}) + "\n")
    result = CliRunner().invoke(main, ["check", "--engine", str(good), "--reference", str(hf_dir),
                                       "--data", str(data), "--threshold", "seq_len=32"])
    assert result.exit_code == 2, result.output
    assert ("fewer than one window of 32 tokens (quantization.quality.seq_len; forge check "
            "--threshold seq_len=N lowers it)") in result.output
    assert "error: evaluation text has" in result.output


def test_the_gate_says_up_front_how_long_it_took_here_last_time(tmp_path, monkeypatch):
    """The estimate up front is the last measured time of this model's gate on this machine
    (a count extrapolates badly: the phases stretch unevenly with load)."""
    from builder.quality import report as quality_report

    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path / "cache"))
    reference = tmp_path / "hf"
    reference.mkdir()
    first = quality_report.plan_line(reference, False, 8, 8, 46)
    assert first.startswith("quality gate (full): 8 held-out windows, 8 greedy prompts, 46 "
                            "questions, each through the reference and the engine; no earlier")
    quality_report.record_gate_time(tmp_path / "gone", False, 1.0)  # dropped at the next write
    quality_report.record_gate_time(reference, False, 205.0)
    quality_report.record_gate_time(reference, True, 55.0)
    assert quality_report.plan_line(reference, False, 8, 8, 46).endswith(
        "the last full one of this model here took 3m25s (the quick one 55s: --quick-gate)")
    assert quality_report.plan_line(reference, True, 2, 2, 12).endswith(
        "the last quick one of this model here took 55s")
    kept = (tmp_path / "cache" / "gate_times.json").read_text()
    assert str(reference) in kept and "gone" not in kept


def test_a_gate_turned_off_builds_and_says_so(tmp_path):
    """`quantization.quality.enabled: false`: the quantized engine is built and installed without
    the gate (not even the cheaper check a gate-free build runs), and the build says so."""
    checkpoint = tiny.make_checkpoint(tmp_path / "hf", "llama_gqa")
    output = tmp_path / "engine"
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"name: ungated\ncheckpoint: {checkpoint}\ndtype: bfloat16\noutput: {output}\n"
        "limits: {max_batch_size: 4, max_num_tokens: 64, max_input_len: 64, max_seq_len: 128}\n"
        "quantization:\n  weights: int4_rtn\n  group_size: 32\n"
        "  calibration: {samples: 2, seq_len: 32}\n"
        "  quality: {enabled: false, min_logit_cosine: 1.01}\n")  # a gate would refuse it
    result = CliRunner().invoke(main, ["engine", "--spec", str(spec), "--no-repository"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "quality gate: off (quantization.quality.enabled: false)" in said
    assert "prefill logits vs transformers" not in said
    assert (output / "config.json").is_file() and not (output / "quality.json").exists()
