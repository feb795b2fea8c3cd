"""Which engine an emitted repository serves, and whether a build may write one.

A build writes a repository where it was asked to (`--repository`, or `model_repository/<name>`
by default) only when that directory is new or already serves this build's engine: a variant built
elsewhere under the same spec name (say an INT4 build with `--output ../variants/int4`) must not
repoint the repository that `make serve` serves. `--force` overrides, and says so.
"""
from __future__ import annotations

import os
from pathlib import Path


def repository_parameters(repository_dir: Path, model: str) -> dict[str, str]:
    """The string parameters of `<repository>/<model>/config.pbtxt`."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    path = Path(repository_dir) / model / "config.pbtxt"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (is {repository_dir} an emitted repository?)")
    parsed = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    return {key: value.string_value for key, value in parsed.parameters.items()}


def served_engine(repository_dir: Path) -> Path | None:
    """The engine directory the repository's `tensorrt_llm` model serves (resolved the way the
    models resolve it: relative to the repository), or None when there is no repository there."""
    repository_dir = Path(repository_dir)
    if not (repository_dir / "tensorrt_llm" / "config.pbtxt").is_file():
        return None
    engine = repository_parameters(repository_dir, "tensorrt_llm").get("engine_dir")
    if not engine:
        return None
    return Path(os.path.normpath(repository_dir.resolve() / engine))


def serves_another_engine(repository_dir: Path, engine_dir: Path) -> Path | None:
    """The other engine `repository_dir` serves, or None (new, or serving `engine_dir`)."""
    served = served_engine(repository_dir)
    if served is None or served == Path(engine_dir).resolve():
        return None
    return served


def check_repository_target(repository_dir: Path, engine_dir: Path, force: bool) -> None:
    """Refuse (ValueError: exit 2) to rewrite a repository that serves another engine."""
    other = serves_another_engine(repository_dir, engine_dir)
    if other is not None and not force:
        raise ValueError(
            f"repository {repository_dir} serves the engine {other}, not {engine_dir}: it is "
            f"not rewritten without --force (give this engine its own --repository DIR, or "
            f"--no-repository)")
