"""The validation every settings dataclass shares: one message shape, "Owner.field=value is invalid: expected ...", so a
bad value reads the same whichever config, flag or keyword it came through. Standard library only, so the torch-free
leaves (planner, sandbox) may use it too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NoReturn


def fail(owner: str, name: str, value: Any, expected: str) -> NoReturn:
    raise ValueError(f"{owner}.{name}={value!r} is invalid: expected {expected}")


def _range(kind: str, low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"{kind} in [{low}, {high}]"
    if low is not None:
        return f"{kind} >= {low}"
    if high is not None:
        return f"{kind} <= {high}"
    return kind


def check_int(owner: str, name: str, value: Any, low: float | None = None, high: float | None = None, optional: bool = False) -> None:
    """An int (a bool is not one) within [low, high]; None passes when `optional`."""
    if value is None and optional:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        fail(owner, name, value, ("None or " if optional else "") + _range("an integer", low, high))


def check_number(owner: str, name: str, value: Any, low: float | None = None, high: float | None = None, optional: bool = False) -> None:
    """A finite real number (int or float, not bool) within [low, high]; None passes when `optional`."""
    if value is None and optional:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        fail(owner, name, value, ("None or " if optional else "") + _range("a finite number", low, high))


def check_choice(owner: str, name: str, value: Any, choices: Iterable[Any]) -> None:
    allowed = list(choices)
    if value not in allowed:
        fail(owner, name, value, f"one of {allowed}")
