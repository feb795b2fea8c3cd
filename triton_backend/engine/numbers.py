"""Type checks for counts, sizes and rates read from JSON, YAML and requests.

Python's `bool` is a subclass of `int`, so `isinstance(True, int)` holds; a `true` in a spec or a
request is still never a count or a rate. Pure Python, importable from the builder and the
Triton models alike.
"""
from __future__ import annotations


def is_int(value) -> bool:
    """An `int` that is not a `bool`."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An `int` or a `float` that is not a `bool`."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
