"""The README's promises to a newcomer, checked without running anything heavy: short, an
OpenAI request early, the test command CI runs, and every `make` target, `forge` command and
flag, link and marked block it shows exists. scripts/check_readme.py runs the commands."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from builder.cli import main as forge_cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
LINES = README.splitlines()
# The Kubernetes paragraph points at `forge deploy` and docs/deploy.md, which land together:
# they are checked once the page is in the tree.
LANDING_WITH_DEPLOY_DOC = {"deploy"} if not (ROOT / "docs" / "deploy.md").is_file() else set()


def _check_readme_module():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_readme
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return check_readme


def test_short_with_an_openai_request_in_the_first_100_lines():
    assert len(LINES) <= 300
    first = next(i for i, line in enumerate(LINES, 1) if "/v1/chat/completions" in line
                 and line.lstrip().startswith("$ curl"))
    assert first <= 100
    serving = [i for i, line in enumerate(LINES, 1) if line.startswith("## Serving")]
    assert "OpenAI" in LINES[serving[0] - 1] and "Triton" in LINES[serving[1] - 1]


def test_the_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1].strip()
    assert ci == "make test"
    assert re.search(r"^\$ make test\s", README, re.M)
    assert re.search(r"^\$ make engine\s", README, re.M)


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w.-]*):", (ROOT / "Makefile").read_text(), re.M))


def test_every_make_target_it_names_exists():
    named = set(re.findall(r"`?\bmake ([a-z][\w-]*)", README))
    assert named and named <= _make_targets(), named - _make_targets()


def _forge_mentions() -> list[str]:
    """`forge SUBCOMMAND ...` as written in code: fenced commands and inline code spans."""
    spans = re.findall(r"`([^`\n]*\bforge [a-z][^`\n]*)`", README)
    fenced = [line for line in LINES if re.search(r"(^|\s|/)forge [a-z]", line)
              and line.lstrip().startswith("$")]
    return spans + fenced


def test_every_forge_command_and_flag_it_names_exists():
    commands = forge_cli.commands
    seen = 0
    for text in _forge_mentions():
        for match in re.finditer(r"\bforge ([a-z]+)((?:\s+[^|`]*)?)", text):
            name, rest = match.group(1), match.group(2)
            if name in LANDING_WITH_DEPLOY_DOC:
                continue
            assert name in commands, f"forge {name} (in: {text})"
            options = {opt for param in commands[name].params if isinstance(param, click.Option)
                       for opt in param.opts + param.secondary_opts}
            options |= {"-h", "--help"}
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest):
                if "/" in flag:
                    continue
                assert flag in options, f"forge {name} has no {flag} (in: {text})"
            seen += 1
    assert seen >= 10


def test_every_relative_link_resolves():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if target.startswith("http") or ("deploy" in LANDING_WITH_DEPLOY_DOC
                                         and target == "docs/deploy.md"):
            continue
        assert (ROOT / target).exists(), target


def test_marked_blocks_parse_and_cover_both_servers():
    check_readme = _check_readme_module()
    blocks = check_readme.parse(README)
    servers = [b for b in blocks if b.kind == "server"]
    assert [b.options.get("ready") for b in servers] == ["OpenAI API ready", "tritonserver ready"]
    commands = [c.text for b in blocks for c in b.commands]
    assert any(c.startswith("make engine") for c in commands)
    assert any(c.startswith("make lora-demo") for c in commands)
    assert all(b.kind in ("run", "server", "python") for b in blocks)


def test_output_pieces_between_ellipses_are_matched():
    check_readme = _check_readme_module()
    shown = ['{"id":"chatcmpl-...","object":"chat.completion",...,"choices":[',
             ' "content":"Paris."}']
    assert check_readme.missing_output(shown, '{"id":"chatcmpl-1","object":"chat.completion",'
                                              '"x":1,"choices":[{"content":"Paris."}]}') == []
    assert check_readme.missing_output(shown, '{"content":"Lyon."}') != []
    assert check_readme.without_comment("make serve    # until Ctrl-C") == "make serve"
