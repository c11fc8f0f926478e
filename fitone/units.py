"""Memory sizes: bytes in and out of GiB, and the sizes a user writes ('24GiB', '24GB', '512MiB'); parameter
counts as people write them (968K, 6.74B).

Imports nothing of fitone but its errors, so every module (memory included) can use it.
"""

from __future__ import annotations

import re

from fitone.errors import ConfigError

GIB = 1024**3

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": GIB, "tib": 1024**4,
}


def gib(n_bytes: float, digits: int | None = None) -> float:
    """Bytes in GiB; rounded to `digits` decimals when given (what a plan's JSON and tables show)."""
    value = n_bytes / GIB
    return value if digits is None else round(value, digits)


def parse_size(text: str | int | float | None, what: str = "memory size") -> int | None:
    """Bytes from '24GiB', '24GB' (10^9), '23.5 gib', '512MiB' or a plain number of bytes."""
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = int(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(f"cannot read {what} {text!r}: write it like 24GiB, 24GB or 512MiB")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    return value


def count_text(n: int) -> str:
    """A parameter count as people write it, to three significant digits: 512, 968K, 1.2M, 6.74B."""
    rounded = float(f"{n:.3g}")  # first, so 999,999 reads 1M rather than 1e+03K
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if rounded >= size:
            return f"{rounded / size:.3g}{unit}"
    return str(int(n))
