"""Parsing of human sizes ("4GiB", "512MB", "1048576") with errors that say what to change."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, field: str = "size") -> int:
    """Bytes in `text`. Raises ValueError naming `field` on anything else."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{field}: cannot read {text!r} as a size; write a number with an optional unit "
            "such as 4GiB, 512MiB, 20GB or 1048576"
        )
    return int(float(match.group(1)) * _UNITS[unit])
