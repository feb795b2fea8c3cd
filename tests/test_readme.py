"""The README's promises to a newcomer, checked without running anything heavy: short, an
OpenAI request early, the test command CI runs, every `make` target, `forge` command and flag,
link and marked block it shows exists, and its servers (and the docs pages' ones) never start
over a running one. scripts/check_readme.py runs the commands; its own behaviour is tested here
on small pages."""
from __future__ import annotations

import os
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


CHECKED_DOCS = ("docs/deploy.md", "docs/quantization.md", "docs/guided-decoding.md")


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


def test_make_serve_moves_every_port_it_is_told():
    """The README offers `make serve` other ports so it can run beside the first server."""
    import subprocess

    ports = {"HTTP_PORT": 8100, "GRPC_PORT": 8101, "METRICS_PORT": 8102, "HEALTH_PORT": 8103}
    done = subprocess.run(["make", "-n", "serve", *(f"{k}={v}" for k, v in ports.items())],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    command = " ".join(done.stdout.replace("\\\n", " ").split())
    assert ("serve --repository model_repository/smollm2-135m --http-port 8100 --grpc-port 8101 "
            "--metrics-port 8102 --health-port 8103") in command, done.stdout + done.stderr
    for name in ports:
        assert f"`{name}=`" in README


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
    assert all(b.kind in ("run", "server", "python", "stop") for b in blocks)


def test_output_pieces_between_ellipses_are_matched():
    check_readme = _check_readme_module()
    shown = ['{"id":"chatcmpl-...","object":"chat.completion",...,"choices":[',
             ' "content":"Paris."}']
    assert check_readme.missing_output(shown, '{"id":"chatcmpl-1","object":"chat.completion",'
                                              '"x":1,"choices":[{"content":"Paris."}]}') == []
    assert check_readme.missing_output(shown, '{"content":"Lyon."}') != []
    assert check_readme.without_comment("make serve    # until Ctrl-C") == "make serve"


def test_read_in_order_no_server_starts_over_a_running_one():
    """Each page's servers take the default ports: the page says to stop one (a `stop` marker)
    before the next starts, as a reader in one terminal would have to."""
    check_readme = _check_readme_module()
    overlapping_servers = sys.modules[check_readme.parse.__module__].overlapping_servers
    for name in ("README.md", *CHECKED_DOCS):
        blocks = check_readme.parse((ROOT / name).read_text(), name)
        assert blocks, f"{name} marks no commands"
        assert overlapping_servers(blocks) == [], name
    clash = check_readme.parse(
        '<!-- readme-check: server ready="up" -->\n```\n$ a\n```\n'
        '<!-- readme-check: server ready="up" -->\n```\n$ b\n```\n')
    assert len(overlapping_servers(clash)) == 1


SERVER = ("exec {python} -c \"import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: "
          "sys.exit(0)); print('up', flush=True); time.sleep(60)\"")


def _run_page(page: str, tmp_path, with_=()):
    check_readme = _check_readme_module()
    runner = check_readme.Runner(tmp_path, dict(os.environ), sys.executable, set(with_))
    return runner.run_page(check_readme.parse(page.replace("{python}", sys.executable)))


def test_a_server_started_over_a_running_one_fails_and_stop_ends_it(tmp_path):
    server = f'<!-- readme-check: server ready="up" timeout=60 -->\n```console\n$ {SERVER}\n```\n'
    clashing = _run_page(server + server, tmp_path)
    assert [r.ok for r in clashing].count(False) == 1
    assert "still runs; the page must say to stop it first" in next(r.status for r in clashing
                                                                    if not r.ok)
    stopped = _run_page(server + "<!-- readme-check: stop -->\n" + server, tmp_path)
    assert all(r.ok for r in stopped), [r.status for r in stopped]
    assert [r.command for r in stopped].count("Ctrl-C to the server") == 2


def test_sessions_promises_exit_codes_and_needs(tmp_path):
    """`session`: one shell for the block's lines; a python block's `# -> TEXT` is checked;
    `exit=N` expects that code; `needs=WORD` skips a block unless the check runs --with WORD."""
    lines = "```console\n$ X=41\n$ echo $((X + 1))\n42\n```\n"
    one_shell = _run_page("<!-- readme-check: run session -->\n" + lines, tmp_path)
    assert [r.status for r in one_shell] == ["ok"]
    apart = _run_page("<!-- readme-check: run -->\n" + lines, tmp_path)
    assert apart[1].status.startswith("output differs: no '42'")
    promise = "<!-- readme-check: python -->\n```python\nprint('yes')  # -> {}\n```\n"
    assert _run_page(promise.format("yes"), tmp_path)[0].status == "ok"
    assert _run_page(promise.format("no"), tmp_path)[0].status.startswith("output differs")
    refused = "<!-- readme-check: run exit=3 -->\n```console\n$ {}\n```\n"
    assert _run_page(refused.format("exit 3"), tmp_path)[0].status == "ok"
    assert _run_page(refused.format("true"), tmp_path)[0].status.startswith(
        "FAILED (expected exit 3)")
    cluster = "<!-- readme-check: run needs=cluster -->\n```console\n$ false\n```\n"
    skipped = _run_page(cluster, tmp_path)
    assert skipped[0].ok and skipped[0].status.startswith("skipped (needs cluster")
    assert not _run_page(cluster, tmp_path, with_=["cluster"])[0].ok


def test_the_venv_stamp_is_the_one_setup_sh_writes():
    """--venv accepts a venv only when setup.sh would leave it as it is: the stamp must be
    computed as setup.sh computes it (its line, run by bash with its own defaults)."""
    import subprocess

    check_readme = _check_readme_module()
    script = (ROOT / "scripts" / "setup.sh").read_text()
    lines = [line for line in script.splitlines()
             if re.match(r"(TORCH_PIN|EXTRAS|WANT)=", line)]
    assert len(lines) == 3, lines
    done = subprocess.run(["bash", "-c", "\n".join(lines) + '\necho "$WANT"'], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]})
    assert done.stdout.strip() == check_readme.setup_stamp(ROOT)
