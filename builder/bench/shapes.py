"""A workload shape `IN/OUT@C[xN][~R]`: random prompts of IN tokens, OUT new tokens each, C
requests in flight, N prompts in all (default 3 per unit of concurrency, at least 6), lengths
drawn within a ratio R around IN and OUT (default 0: fixed). The shape matrix drives it through
the front door (`matrix.py`), the engine-level profile in-process (`inprocess.closed_loop`)."""
from __future__ import annotations

import re
from dataclasses import dataclass

SHAPE = re.compile(r"^(\d+)/(\d+)@(\d+)(?:x(\d+))?(?:~([0-9.]+))?$")
DEFAULT_SHAPES = "128/128@16,512/64@8,1024/128@8,2048/128@4,512/128@16~0.5"


@dataclass(frozen=True)
class Shape:
    input_len: int
    output_len: int
    concurrency: int
    prompts: int
    range_ratio: float = 0.0

    @property
    def label(self) -> str:
        mixed = f" ~{self.range_ratio:g}" if self.range_ratio else ""
        return f"{self.input_len}/{self.output_len} c={self.concurrency}{mixed}"

    @property
    def key(self) -> str:
        return f"{self.input_len}-{self.output_len}-c{self.concurrency}" + (
            f"-r{self.range_ratio:g}" if self.range_ratio else "")


def parse_shapes(text: str, option: str = "--shapes") -> list[Shape]:
    """`IN/OUT@C[xN][~R]`, comma-separated; ValueError naming the option and the bad one."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = SHAPE.match(item)
        if not match:
            raise ValueError(f"{option}: {item!r} is not IN/OUT@C[xN][~R] (e.g. 512/64@8x24)")
        size, out, c, n, ratio = match.groups()
        concurrency, range_ratio = int(c), float(ratio or 0)
        if not (int(size) > 0 and int(out) > 0 and concurrency > 0 and 0 <= range_ratio < 1):
            raise ValueError(f"{option}: {item!r}: lengths and concurrency must be >= 1 and the "
                             f"range ratio in [0, 1)")
        shapes.append(Shape(int(size), int(out), concurrency,
                            int(n) if n else max(6, 3 * concurrency), range_ratio))
    if not shapes:
        raise ValueError(f"{option}: no shape given")
    return shapes
