"""A request's parameters: ``SamplingParams``, checked once where it is made (a front
end, before any process boundary; ``Decoder.submit`` for its keyword arguments), and
the checks themselves (numbers and ints within bounds, or a ValueError naming the
parameter). Pure Python (no jax): a front-end worker imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np

from .grammar import StructuredOutput

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


def _temperature(value: Any) -> float:
    if isinstance(value, np.floating):
        value = float(value)
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise ValueError(f"temperature must be a number >= 0, got {value!r:.40}")
    if not (math.isfinite(value) and 0 <= value <= MAX_TEMPERATURE):
        raise ValueError(
            f"temperature must be a number from 0 to {MAX_TEMPERATURE:g}, got {value!r}"
        )
    return float(value)


def _top_p(value: Any) -> float:
    if isinstance(value, np.floating):
        value = float(value)
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < value <= 1.0):
        raise ValueError(f"top_p must be a number in (0, 1], got {value!r:.40}")
    return float(value)


def _stop_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise ValueError(f"stop_ids must be a list of token ids, got {value!r:.80}")
    return tuple(int_in("stop_ids", t, 0, None) for t in value)


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must map token ids to numbers, got {value!r:.80}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: {len(value)} entries; at most {MAX_LOGIT_BIAS}")
    bias = {}
    for key, number in value.items():
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)  # (JSON's keys are strings)
        bias[int_in("logit_bias: a token id", key, 0, None)] = number_in(
            f"logit_bias[{key}]", number, -100.0, 100.0
        )
    return bias or None


class SamplingParams(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """How one prompt is generated; every field is checked when it is made (a
    ValueError naming the first bad one), so a front end refuses a bad request before
    it crosses to the device's process. ``Decoder.submit`` takes one, or the same
    fields as keyword arguments, and checks what depends on the model (token ids
    within its vocabulary, ``max_tokens`` within its cache, ``priority`` within its
    levels). It crosses processes as itself (a msgspec struct).

    - ``max_tokens`` (>= 1): tokens generated at most; fewer at a stop token (the
      artifact's end-of-sequence and stop ids, and ``stop_ids``; the stop token is the
      last one returned) or when the cache is full (``max_length`` positions in all).
    - ``temperature`` (0 .. ``MAX_TEMPERATURE``): 0 is greedy; ``top_k`` (>= 0) and
      ``top_p`` ((0, 1]): 0 and 1 do not cut. ``seed`` (0 .. 2**32-1; None: random at
      submit) fixes the sampled tokens whatever else is generated at the same time.
    - ``prefix_cache`` False: neither reuse nor keep this prompt's cached start.
    - ``logprobs`` (0 .. 20; None: none): every token comes with its log-probability
      and that many of the most likely tokens' (``Generation.logprobs``), of the
      model's distribution (a log-softmax of its logits, before the controls below).
    - ``prompt_logprobs`` (0 .. 20; None: none): the same for every prompt token but
      the first (``Completion.prompt_logprobs``), as the model scores each after the
      ones before it; the prompt goes in chunks (the decoder's ``extend`` program) and
      neither uses nor fills the prefix cache.
    - The controls, applied on the device before sampling: ``logit_bias`` (token id ->
      -100 .. 100, added to its logit; at most 300 entries), ``repetition_penalty``
      ((0, 2]; over the prompt's and the generated tokens), ``presence_penalty`` and
      ``frequency_penalty`` (-2 .. 2; over the generated tokens), ``min_tokens`` (no
      stop token before that many tokens).
    - ``priority``: the prompt's level among the waiting ones (1 the highest, up to the
      decoder's ``priority_levels``; 0: its ``default_priority_level``).
    - ``structured``: a ``pxrt.StructuredOutput`` (a JSON schema, JSON mode, a regex, a
      choice, a grammar) the text is held to, by masking on the device every token the
      grammar does not allow; the decoder needs its tokenizer and an end token.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    prefix_cache: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    priority: int = 0
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Checked in this order, each value made the plain Python type it names.
        checked = {
            "max_tokens": int_in("max_tokens", self.max_tokens, 1, None),
            "temperature": _temperature(self.temperature),
            "top_k": int_in("top_k", self.top_k, 0, None),
            "top_p": _top_p(self.top_p),
            "seed": None if self.seed is None else int_in("seed", self.seed, 0, 2**32 - 1),
            "stop_ids": _stop_ids(self.stop_ids),
            "logprobs": (
                None
                if self.logprobs is None
                else int_in("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
            ),
            "prompt_logprobs": (
                None
                if self.prompt_logprobs is None
                else int_in("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
            ),
            "presence_penalty": number_in("presence_penalty", self.presence_penalty, -2.0, 2.0),
            "frequency_penalty": number_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0),
            "repetition_penalty": number_in(
                "repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True
            ),
            "logit_bias": _logit_bias(self.logit_bias),
            "min_tokens": int_in("min_tokens", self.min_tokens, 0, None),
            "priority": int_in("priority", self.priority, 0, None),
        }
        if not isinstance(self.prefix_cache, (bool, np.bool_)):
            raise ValueError(f"prefix_cache must be true or false, got {self.prefix_cache!r:.40}")
        checked["prefix_cache"] = bool(self.prefix_cache)
        if isinstance(self.structured, Mapping):  # (its fields: ``{"json": schema}``)
            checked["structured"] = StructuredOutput(**self.structured)
        elif self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(
                f"structured must be a pxrt.StructuredOutput, got {type(self.structured).__name__}"
            )
        for name, value in checked.items():
            msgspec.structs.force_setattr(self, name, value)

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> SamplingParams:
        """The parameters ``options`` names (field -> value), checked; an unknown name
        is a ValueError that lists the known ones (a misspelt option must not run the
        request with its default, unsaid)."""
        for name in options:
            if name not in cls.__struct_fields__:
                raise ValueError(
                    f"unknown sampling option {name!r:.60}; known: "
                    + ", ".join(cls.__struct_fields__)
                )
        return cls(**options)

    @classmethod
    def resolve(cls, params: Any, options: Mapping[str, Any]) -> SamplingParams:
        """A call's parameters: ``params`` (a ``SamplingParams``) or its fields as keyword
        ``options`` (checked by ``of``), not both."""
        if params is None:
            return cls.of(options)
        if options:
            raise ValueError(
                f"give the sampling options in params or as keyword arguments, not both "
                f"(got params and {', '.join(options)})"
            )
        if not isinstance(params, cls):
            raise ValueError(f"params must be a pxrt.SamplingParams, got {type(params).__name__}")
        return params

    @property
    def has_penalties(self) -> bool:
        """Whether it asks for the penalties, a logit bias or ``min_tokens``."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def has_controls(self) -> bool:
        """Whether it asks for any of the controls (penalties, bias, ``min_tokens``, a
        structured output)."""
        return self.has_penalties or self.structured is not None

    def with_seed(self, seed: int) -> SamplingParams:
        """The same parameters with ``seed``."""
        return msgspec.structs.replace(self, seed=seed)
