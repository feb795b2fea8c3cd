"""`make bench`: our engine vs the naive baseline on the demo model, one command.

Builds what is missing (the spec's torch engine and a `naive` engine of the same checkpoint, each
with its Triton repository), serves both on free loopback ports, runs `forge bench --compare` on
them (same requests, alternating), writes the report into --out, and stops both servers.
Engines already built are reused; --rebuild forces a fresh build.
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def _log(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def ensure_engines(spec_path: Path, rebuild: bool) -> tuple[Path, Path, Path, Path]:
    """(engine, repository, naive engine, naive repository), building the missing ones."""
    from builder.checkpoint import resolve_checkpoint
    from builder.engine_builder import build_engine
    from builder.naive import build_naive_engine
    from builder.repository import RepositoryOptions, emit_repository
    from builder.spec import load_spec

    spec = load_spec(spec_path)
    naive = dataclasses.replace(spec, name=f"{spec.name}-naive", target="naive", output=None)
    engine, naive_engine = ROOT / spec.output_dir, ROOT / naive.output_dir
    repo, naive_repo = ROOT / "model_repository" / spec.name, ROOT / "model_repository" / naive.name
    if rebuild or not (engine / "config.json").is_file():
        _log(f"building {_rel(engine)} from {spec_path.name}")
        build_engine(dataclasses.replace(spec, output=str(engine)), repository_dir=repo)
    if rebuild or not (naive_engine / "config.json").is_file():
        _log(f"building the naive baseline {_rel(naive_engine)}")
        build_naive_engine(naive, resolve_checkpoint(spec.checkpoint, _log), naive_engine, _log)
    for eng, rep, s in ((engine, repo, spec), (naive_engine, naive_repo, naive)):
        if rebuild or not (rep / "ensemble" / "config.pbtxt").is_file():
            _log(f"emitting {_rel(rep)}")
            emit_repository(eng, rep, RepositoryOptions(**s.repository))
    return engine, repo, naive_engine, naive_repo


def forge_command() -> list[str]:
    forge = Path(sys.executable).parent / "forge"
    if forge.is_file():
        return [str(forge)]
    return [sys.executable, "-c", "from builder.cli import main; main()"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "examples" / "smollm2-135m.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "latest")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--scale", default="0.25", help="token-length scale of the workload")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", default="2x", help="per level: N or Kx (K x concurrency)")
    parser.add_argument("--warmup", default="2")
    parser.add_argument("--rebuild", action="store_true")
    args = parser.parse_args()

    from builder.serve import start_tritonserver

    started = time.perf_counter()
    engine, repo, naive_engine, naive_repo = ensure_engines(args.spec.resolve(), args.rebuild)
    servers = []
    try:
        for name, repository in (("llm-forge", repo), ("naive", naive_repo)):
            _log(f"serving {name}: {_rel(repository)}")
            servers.append(start_tritonserver(repository, ready_timeout=300))
            _log(f"{name} ready on grpc {servers[-1].grpc_url}")
        if args.out.exists():
            shutil.rmtree(args.out)
        command = forge_command() + [
            "bench", "--compare", servers[0].grpc_url, servers[1].grpc_url,
            "--labels", "llm-forge,naive", "--workload", args.workload, "--scale", args.scale,
            "--concurrency", args.concurrency, "--requests", args.requests,
            "--warmup", args.warmup, "--tokenizer", str(engine), "--out", str(args.out)]
        _log("running: forge " + " ".join(command[command.index("bench"):]))
        code = subprocess.call(command, cwd=ROOT)
    finally:
        for server in servers:
            server.stop()
    _log(f"finished in {time.perf_counter() - started:.0f}s; report in {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
