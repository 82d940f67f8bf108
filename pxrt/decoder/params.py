"""A request's parameters as the engine checks them: numbers and ints within bounds, or
a ValueError naming the parameter. Pure Python (no jax): a front end may check a
request before it crosses a process boundary.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def number_in(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    """``value`` as a float within [low, high] (``low_open``: above ``low``), or a
    ValueError naming it."""
    if isinstance(value, np.generic):
        value = value.item()
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (low < value if low_open else low <= value)
        and value <= high
    ):
        return float(value)
    span = f"above {low:g} and at most {high:g}" if low_open else f"from {low:g} to {high:g}"
    raise ValueError(f"{name} must be a number {span}, got {value!r:.40}")


def int_in(name: str, value: Any, low: int, high: int | None) -> int:
    if isinstance(value, np.integer):
        value = int(value)
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        span = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {span}, got {value!r}")
    return value
