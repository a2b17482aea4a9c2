"""One place that checks user-given numbers, so every check words its error the same way.

Each function returns the value it accepts and raises ``VerispecError`` (never ``TypeError`` or a
silent coercion) for anything else: ``True`` is not an integer here, and ``3.0`` is not one either.
"""

from __future__ import annotations

import math
from typing import Any

from verispec.errors import VerispecError


def is_int(value: Any) -> bool:
    """A real integer (``bool`` is excluded: ``True`` is a flag, not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(value: Any, what: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer in [minimum, maximum] (either bound optional)."""
    ok = is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        bounds = (f" >= {minimum}" if maximum is None else f" in [{minimum}, {maximum}]") if minimum is not None \
            else (f" <= {maximum}" if maximum is not None else "")
        raise VerispecError(f"{what} must be an integer{bounds}, got {value!r}")
    return value


def positive_int(value: Any, what: str) -> int:
    return integer(value, what, minimum=1)


def number(value: Any, what: str, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> float:
    """A finite number in the interval given (open or closed at each end)."""
    if not is_number(value) or math.isnan(value) or math.isinf(value):
        raise VerispecError(f"{what} must be a finite number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        raise VerispecError(f"{what} must be in {left}{lo}, {hi}{right}, got {value!r}")
    return value
