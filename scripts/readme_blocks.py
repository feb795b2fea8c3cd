"""The marked blocks of a Markdown page, as scripts/check_readme.py runs them.

A fenced block runs when an HTML comment right above it says how (the comment does not render):

    <!-- readme-check: run [timeout=S] [output=ignore] [skip="CMD"] [needs=WORD] [session]
                           [exit=N] -->
    <!-- readme-check: server ready="TEXT" [timeout=S] [needs=WORD] -->
    <!-- readme-check: python [timeout=S] [needs=WORD] -->
    <!-- readme-check: stop -->       no fence: where the page tells the reader to stop its server

`run`: each `$ ` line in order, its output checked against the lines shown after it (each piece
between `...` must appear; `output=ignore` where the block shows a sample). `session` runs the
block's lines in one shell, as the reader types them into one terminal (variables carry from one
line to the next). `exit=N`: the exit code each command (or the session) must end with, 0 unless
said (3: a build the quality gate refuses). `server`: started in the background until TEXT
appears; it stays up for the blocks after it until a `stop` (Ctrl-C). `python`: the block as a
script; a line ending in `# -> TEXT` promises that TEXT appears in what the script printed.
`skip="CMD"` leaves out the commands that start with CMD, `needs=WORD` the whole block (a
cluster, a registry), unless the check is told `--with CMD` / `--with WORD`.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

MARKER = re.compile(r"<!--\s*readme-check:\s*(\w+)(.*?)-->")
OPTION = re.compile(r'(\w+)(?:=("([^"]*)"|\S+))?')
KINDS = ("run", "server", "python", "stop")
DEFAULT_TIMEOUT = 600.0


@dataclass
class Command:
    text: str
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    line: int                    # of the marker, 1-based
    kind: str                    # run | server | python | stop
    options: dict[str, str]
    language: str
    body: str
    commands: list[Command]
    page: str = "README.md"

    @property
    def timeout(self) -> float:
        return float(self.options.get("timeout", DEFAULT_TIMEOUT))

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"


def parse(page: str, name: str = "README.md") -> list[Block]:
    """The marked blocks of `page` (its file name: `name`), in order."""
    lines = page.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        match = MARKER.search(line)
        if not match:
            continue
        kind = match.group(1)
        if kind not in KINDS:
            raise ValueError(f"{name} line {i + 1}: unknown readme-check kind {kind!r}")
        options = {m.group(1): (m.group(3) if m.group(3) is not None else m.group(2) or "")
                   for m in OPTION.finditer(match.group(2))}
        if kind == "stop":
            blocks.append(Block(i + 1, kind, options, "", "", [], name))
            continue
        start = i + 1
        while start < len(lines) and not lines[start].strip():
            start += 1
        if start >= len(lines) or not lines[start].startswith("```"):
            raise ValueError(f"{name} line {i + 1}: a readme-check marker must precede a fence")
        end = start + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        body = lines[start + 1:end]
        blocks.append(Block(i + 1, kind, options, lines[start][3:].strip(), "\n".join(body),
                            console_commands(body), name))
    return blocks


def console_commands(body: list[str]) -> list[Command]:
    """`$ ` lines (with their `\\` continuations, and the lines of a quote they open, such as a
    JSON body over several lines) and the output lines shown after each."""
    commands: list[Command] = []
    continuing = False
    for line in body:
        if line.startswith("$ ") or continuing:
            text = line[2:] if not continuing else line
            if continuing:
                commands[-1].text += "\n" + text
            else:
                commands.append(Command(text))
            continuing = line.rstrip().endswith("\\") or _open_quote(commands[-1].text)
        elif commands:
            commands[-1].expected.append(line)
    return commands


def _open_quote(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:  # "No closing quotation"
        return True
    return False


def missing_output(expected: list[str], output: str) -> list[str]:
    """The expected pieces (split at `...`) that `output` lacks; comments after `#` are prose."""
    flat = " ".join(output.split())
    missing = []
    for line in expected:
        for piece in line.split("..."):
            piece = " ".join(piece.split())
            if piece and piece not in flat:
                missing.append(piece)
    return missing


PROMISE = re.compile(r"#\s*->\s*(.+?)\s*$")


def python_promises(body: str) -> list[str]:
    """What a python block says it prints: the TEXT of each line's trailing `# -> TEXT`."""
    return [m.group(1) for m in map(PROMISE.search, body.splitlines()) if m]


def without_comment(command: str) -> str:
    """The command without a trailing `# ...` comment (the README explains commands inline)."""
    return re.sub(r"\s+#[^'\"]*$", "", command)


def overlapping_servers(blocks: list[Block]) -> list[str]:
    """Each `server` block that starts while an earlier one still runs (no `stop` between):
    a reader following the page in order would find its ports taken."""
    running: Block | None = None
    clashes = []
    for block in blocks:
        if block.kind == "stop":
            running = None
        elif block.kind == "server":
            if running is not None:
                clashes.append(f"{block.where} starts a server while the one of {running.where} "
                               f"still runs (the page must say to stop it: readme-check: stop)")
            running = block
    return clashes
