"""A request's parameters as the engine checks them: numbers and ints within bounds, or
a ValueError naming the parameter. Pure Python (no jax): a front end may check a
request before it crosses a process boundary.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import numpy as np

#: Temperatures below this are greedy (dividing by them would overflow float32).
MIN_TEMPERATURE = 1e-5
#: The highest temperature taken: the logits are divided by it in float32 (1e300 would
#: overflow to a uniform draw), and beyond it sampling is near uniform already.
MAX_TEMPERATURE = 100.0

#: The most alternatives ``scores`` gives per token (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20
#: The most ``logit_bias`` entries a request may give.
MAX_LOGIT_BIAS = 300
#: The most stop ids ``min_tokens`` bans (the artifact's and the request's together).
MAX_BANNED = 64


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


def sampling_values(
    temperature: Any, top_k: Any, top_p: Any, seed: Any
) -> tuple[float, int, float, int]:
    """A request's sampling parameters, checked in this order: (temperature, top-k,
    top-p, seed; a random seed when it is None), or a ValueError naming the first bad
    one."""
    if isinstance(temperature, np.floating):
        temperature = float(temperature)
    if isinstance(top_p, np.floating):
        top_p = float(top_p)
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not (math.isfinite(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        raise ValueError(
            f"temperature must be a number from 0 to {MAX_TEMPERATURE:g}, got {temperature!r}"
        )
    k = int_in("top_k", top_k, 0, None)
    if not (isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if seed is None:
        seed = secrets.randbits(32)
    seed = int_in("seed", seed, 0, 2**32 - 1)
    return float(temperature), k, float(top_p), seed


def stop_ids_in(stop_ids: Any, vocab: int) -> list[int]:
    """A request's own stop ids, each a token id of the vocabulary."""
    try:
        return [int_in("stop_ids", t, 0, vocab - 1) for t in stop_ids]
    except TypeError:
        raise ValueError(f"stop_ids must be a list of token ids, got {stop_ids!r}") from None
