"""Render `${name}` templates (the `config.pbtxt` files under `model_repository/templates/`).

Unlike a filler that leaves what it does not know, rendering here is all or nothing: a
placeholder without a value, a value without a placeholder (a typo on either side) and any
`${` left in the result are errors naming every offending key. A repository that renders is a
repository without placeholders.
"""
from __future__ import annotations

import re
from typing import Mapping

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class TemplateError(ValueError):
    """A template and its values do not match; the message names the keys and the template."""


def placeholders(template: str) -> set[str]:
    """The placeholder names used in `template`."""
    return set(PLACEHOLDER.findall(template))


def _format(value: object, key: str, source: str) -> str:
    if isinstance(value, bool):  # pbtxt booleans are lower case
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        text = str(value)
        if "${" in text:
            raise TemplateError(f"{source}: value of {key} contains '${{': {text!r}")
        if isinstance(value, str) and not isinstance(value, Raw):
            text = pbtxt_escape(text)  # every plain string goes between double quotes
        return text
    raise TemplateError(f"{source}: value of {key} must be str, int, float or bool, "
                        f"got {type(value).__name__}")


class Raw(str):
    """A value inserted as it is (already-formatted pbtxt lines), not escaped."""


def pbtxt_escape(text: str) -> str:
    """Escape a string for the inside of a protobuf text-format "..." literal."""
    return (text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            .replace("\r", "\\r").replace("\t", "\\t"))


def render(template: str, values: Mapping[str, object], source: str = "<template>") -> str:
    """Substitute every `${key}` in `template` from `values`.

    Raises TemplateError if a placeholder has no value, a value has no placeholder, or the result
    still contains `${` (e.g. a malformed placeholder such as `${ key}`).
    """
    used = placeholders(template)
    missing = sorted(used - set(values))
    if missing:
        raise TemplateError(f"{source}: no value for placeholder(s) {', '.join(missing)}")
    unused = sorted(set(values) - used)
    if unused:
        raise TemplateError(f"{source}: value(s) given for unknown placeholder(s) "
                            f"{', '.join(unused)}")
    formatted = {key: _format(values[key], key, source) for key in used}
    result = PLACEHOLDER.sub(lambda match: formatted[match.group(1)], template)
    leftover = result.find("${")
    if leftover >= 0:
        line = result.count("\n", 0, leftover) + 1
        raise TemplateError(f"{source}: line {line}: unfilled or malformed placeholder "
                            f"{result[leftover:leftover + 40].splitlines()[0]!r}")
    return result
