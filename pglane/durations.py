"""Durations on the command line: the one parser every duration option uses.

Accepted: a number followed by a unit, or several run together from the largest down: ``250ms``,
``90s``, ``10m``, ``1h30m``, ``7d``, ``2w`` (``min`` is ``m``; decimals allowed: ``1.5h``). A bare
number is seconds only where the caller allows it (timeouts, whose meaning is established); where a
bare number is ambiguous (``prune --older-than 7``: days?) it is refused with an example.
"""

from __future__ import annotations

import math
import re

UNITS: dict[str, float] = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0,
                           "w": 604800.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|min|s|m|h|d|w)")
_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")
EXAMPLES = "e.g. 250ms, 90s, 10m, 1h30m or 7d"


def parse(text: str, *, bare_seconds: bool = True, allow_zero: bool = False, example: str = "90s") -> float:
    """Seconds from ``text``; ValueError in one line that says what is accepted."""
    raw = text.strip().lower()
    if _NUMBER.fullmatch(raw):
        if not bare_seconds:
            raise ValueError(f"{text!r} has no unit: say which, e.g. {example}")
        value = float(raw)
    else:
        value, pos, last = 0.0, 0, math.inf
        for match in _PART.finditer(raw):
            size = UNITS[match.group(2)]
            if match.start() != pos or size >= last:  # a gap, or units out of order (1m1h, 1s1s)
                break
            value, pos, last = value + float(match.group(1)) * size, match.end(), size
        if pos != len(raw) or not raw:
            raise ValueError(f"{text!r} is not a duration; use a number and a unit, {EXAMPLES}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{text!r} must be a {'non-negative' if allow_zero else 'positive'}, finite duration, "
                         f"{EXAMPLES}")
    return value


def format_seconds(seconds: float) -> str:
    """A duration as the parser reads it back, shortest first: 90 -> '1m30s', 0.25 -> '250ms'."""
    if seconds < 1 and seconds != 0:
        return f"{seconds * 1000:g}ms"
    out, rest = "", seconds
    for unit in ("d", "h", "m"):
        size = UNITS[unit]
        if rest >= size:
            whole = int(rest // size)
            out, rest = out + f"{whole}{unit}", rest - whole * size
    rest = round(rest, 3)
    return out + (f"{rest:g}s" if rest or not out else "")
