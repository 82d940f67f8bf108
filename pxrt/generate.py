"""Generation: a decoder artifact loaded with every program compiled, served by a loop
that batches continuously over device-resident cache slots.

At load (``pxrt.load`` on a decoder artifact) pxrt builds and compiles, around the
user's two exported programs:

- ``step(params, state) -> (state, tokens)``: one decode step for every slot, with
  sampling fused in; the state (the cache, each slot's next token, position and
  sampling parameters) is donated, so the cache is updated in place, never copied;
- ``prefill_insert[b, L](params, state, tokens, ints, floats) -> (state, first)``: for
  each prefill cell (``b`` prompts of up to ``L`` tokens), prefill, sample each prompt's
  first token and write the rows, the token and the sampling parameters into the given
  slots, in place as well.

The loop (one thread per decoder) repeats: admit waiting prompts into free slots (one
prefill batch per step, so a burst of prompts delays a step by one prefill at most),
dispatch the next step, then read the previous step's tokens, whose copy to the host
was started when it was dispatched: the device always has the next step queued while
the host routes the last one. Routing (``SlotTable.route``, Cython) hands every slot's
token to its generation, applies the stop conditions and frees finished slots in one
call; the generations it touched are woken once per step (one ``call_soon_threadsafe``
per event loop).

Sampling (greedy, temperature, top-k, top-p) runs per slot on the device
(``pxrt.sampling``). The files: ``pxrt.generation`` (the request handle),
``pxrt.sampling`` (device sampling), this module (the decoder and its loop),
``pxrt.decoder.load`` (building and compiling the programs: ``load_decoder``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import logging
import math
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from . import _ext, _xla, compiling, sampling
from . import tokenizer as _tokenizer
from .decoder.export import LENGTH_DIM, DecoderArtifact, is_spec
from .decoder.params import int_in, number_in
from .decoder.prefix import PrefixPool
from .decoder.request import Completion, DecoderClosed, Generation, QueueFull, wake_async
from .finish import CANCELLED, DEADLINE, ERROR, LENGTH, STOP
from .sampling import MAX_TEMPERATURE, MAX_TOP_LOGPROBS, MIN_TEMPERATURE, sample

_slots: Any = _ext.twin("pxrt._slots", "pxrt._slots_py")

__all__ = [
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "TIMINGS",
    "Completion",
    "Decoder",
    "DecoderClosed",
    "Generation",
    "PrefillCell",
    "QueueFull",
    "sample",
]


log = logging.getLogger("pxrt")

_PREFILL, _STEP, _VERIFY = 0, 1, 2
# Speculative decoding's measure of whether it pays: a moving average's weight, and how
# many turns run plain steps between two verifies while it does not.
_EMA, _PROBE = 0.1, 32
#: What ``Decoder.drain_timings`` returns durations of (seconds).
TIMINGS = ("step", "prefill", "ttft", "tpot")


@dataclasses.dataclass
class PrefillCell:
    """A compiled prefill (``batch`` prompts of ``length`` tokens) or extend (``batch``
    rows of ``length`` new tokens) program."""

    batch: int
    length: int
    compiled: Any
    compile_s: float
    index: int = 0  # in the decoder's programs: what a multi-host leader's header names


class PromptLookup:
    """Speculative decoding's drafts for one generation, by prompt lookup: the tokens
    that followed the last earlier occurrence of its text's last 3 tokens (else 2), its
    text being the prompt and the tokens generated so far. Each n-gram is indexed once,
    as the text grows, so a draft costs a dictionary lookup."""

    __slots__ = ("text", "after", "prompt", "hit")

    def __init__(self, prompt: np.ndarray) -> None:
        self.hit = False  # its last draft found something
        self.text: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> where the next token is
        self.prompt = len(prompt)
        self._extend(prompt.tolist())

    def _extend(self, tokens: list[int]) -> None:
        text, after = self.text, self.after
        for token in tokens:
            end = len(text)  # the n-grams ending at the last token are followed by this
            if end >= 2:
                after[(text[-2], text[-1])] = end
                if end >= 3:
                    after[(text[-3], text[-2], text[-1])] = end
            text.append(token)

    def draft(self, generated: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to try after ``generated`` (the generation's tokens)."""
        self._extend(generated[len(self.text) - self.prompt :])
        text = self.text
        at = self.after.get(tuple(text[-3:])) if len(text) >= 3 else None
        if at is None and len(text) >= 2:
            at = self.after.get((text[-2], text[-1]))
        return [] if at is None else text[at : at + k]


@dataclasses.dataclass
class Controls:
    """A request's sampling controls as the programs take them: the penalties
    (presence, frequency, repetition), the position before which its stop ids are
    banned, the control program's rows (logit bias ids and values, banned ids) and
    its prompt (padded with an id out of the vocabulary)."""

    penalties: tuple[float, float, float]
    until: int
    rows: tuple[np.ndarray, np.ndarray, np.ndarray]
    prompt: np.ndarray


@dataclasses.dataclass
class _Scan:
    """What one turn's admission has met so far: the prefix blocks that prompts
    admitted before will cache, the prompts held until they are, the cached starts to
    copy in, and the prompts admitted to go in chunks."""

    filling: set[bytes]
    held: list[Generation]
    loads: list[tuple[int, list[int]]]
    chunked: list[Generation] = dataclasses.field(default_factory=list)


class Decoder:
    """A loaded decoder: the prefill cells, the insert and the decode step compiled, the
    cache resident on the devices, served by one loop thread (started on first use).

    ``generate`` (sync, whole), ``stream`` (sync, token by token), ``agenerate`` (async
    iterator of tokens; leaving it early cancels the generation) and ``submit`` (a
    ``Generation`` handle) all share that loop: requests from any of them are batched
    together. Thread-safe. ``close`` stops the loop.
    """

    def __init__(
        self,
        art: DecoderArtifact,
        devices: list,
        params_dev: Any,
        state: Any,
        step: Any,
        cells: list[PrefillCell],
        make_state: Any,
        *,
        extends: Sequence[PrefillCell] = (),
        prefix: PrefixPool | None = None,
        chunk_tokens: int | None = None,
        parts: dict[int, Any] | None = None,
        windows: Mapping[tuple[int, int], Any] | None = None,
        move: Any = None,
        control: Any = None,
        verify: Any = None,
        speculative_tokens: int = 0,
        full_step: Any = None,
        slots: int,
        max_length: int,
        max_waiting: int,
        step_compile_s: float,
        load_s: float,
        costs: Mapping[str, float] | None = None,
        itl_bound_ms: float | None = None,
        deferred: int = 0,
        wanted: Mapping[str, Any] | None = None,
        prefill_lengths: Sequence[int] = (),
    ) -> None:
        self.artifact = art
        self.name: str = art.name
        self.version: str = art.manifest["version"]
        self.devices = devices
        config = art.config
        self.vocab: int = config["vocab"]
        self.slots = slots
        self.max_length = max_length
        self.stop_ids = frozenset(config["stop_ids"])
        self.eos_id: int | None = config["eos_id"]
        #: The artifact's tokenizer (``pxrt.tokenizer``), or None: token ids only.
        self.tokenizer = _tokenizer.load(config.get("tokenizer"), art.path)
        #: The artifact's chat template (Jinja), or None.
        self.chat_template: str | None = config.get("chat_template")
        # (the load's: its cells may come after it, with ``defer``)
        self.prefill_lengths = tuple(sorted(prefill_lengths or {c.length for c in cells}))
        self.prefill_batches = tuple(sorted({c.batch for c in cells}))
        self.chunk_lengths = tuple(sorted({c.length for c in extends}))
        self.chunk_batches = tuple(sorted({c.batch for c in extends}))
        #: The longest prompt prefilled in one program; longer ones are chunked (with an
        #: extend program) up to ``max_length - 1`` tokens, or refused.
        self.max_prompt = self.prefill_lengths[-1]
        #: New prompt tokens the extend programs may take in one turn of the loop (each
        #: turn also runs a decode step): by default one chunk of the largest length, so
        #: a long prompt delays the running streams by one chunk at a time.
        self.chunk_tokens = (chunk_tokens or self.chunk_lengths[-1]) if extends else 0
        self.max_waiting = max_waiting
        #: Request priorities (``set_priorities``): levels (1 the highest), the level of
        #: a request that names none, and the wait (s) after which a prompt of any level
        #: goes before every level, oldest first, so that none starves.
        self.priority_levels = 1
        self.default_priority_level = 1
        self.priority_wait_s = math.inf
        self.load_s = load_s
        self.program_sources: dict[str, int] = {}
        #: Seconds per phase of the load: reading the artifact, its programs (traced and
        #: compiled, or loaded), their warm-up.
        self.load_phases: dict[str, float] = {}
        self.step_compile_s = step_compile_s
        #: XLA compiles on this decoder's loop (counted by ``_xla.compile_counter``).
        self.request_path_compiles = 0
        self._params = params_dev
        self._state = state
        self._step = step
        self._make_state = make_state
        self._cells = {(c.batch, c.length): c for c in cells}
        # The steps by rows per device (the full one: slots / devices): the loop runs the
        # fewest rows that hold the busy slots, kept at the low rows of each device's
        # share (``_compact``, with the ``move`` program).
        n_dev = len(devices)
        self._rows_per_device = slots // n_dev
        self._steps = {n // n_dev: p for n, p in (parts or {}).items()}
        self._steps[self._rows_per_device] = step
        self._move = move
        self._control = control
        # The step with the sampling controls and scores, run instead of the plain ones
        # while a busy slot has controls or wants logprobs (``_special``: one was
        # admitted since the last step that found none).
        self._full_step = full_step
        self._special = False
        # Speculative decoding (prompt lookup, greedy): the verify program and the
        # drafts it takes per slot (0: off).
        self._verify = verify
        self.speculative_tokens = speculative_tokens if verify is not None else 0
        # Whether it pays, measured as it runs (moving averages): the tokens a verify
        # gives per busy slot beyond the step's one, and the time between two verifies
        # and between two steps read. While 1 + gain < verify / step time, plain steps
        # run, with a verify every ``_PROBE`` turns to measure again.
        self._spec = {"gain": 1.0, "verify_s": 0.0, "step_s": 0.0, "skip": 0}
        #: The slots a step over ``rows`` per device computes, in its tokens' order.
        self._order = {
            rows: [d * self._rows_per_device + r for d in range(n_dev) for r in range(rows)]
            for rows in self._steps
        }
        #: Slot counts the decode step is compiled for.
        self.step_slots = tuple(sorted(rows * n_dev for rows in self._steps))
        # The steps over the first positions of the cache only, by (rows per device,
        # window): run when every busy slot's position is within the window.
        self._windows = {(n // n_dev, w): p for (n, w), p in (windows or {}).items()}
        #: The cache windows the steps are compiled for (positions; the whole cache too).
        self.step_lengths = tuple(sorted({w for _, w in self._windows}))
        self._extends = {(c.batch, c.length): c for c in extends}
        #: Generations filling their reserved slot chunk by chunk, oldest first.
        self._chunking: collections.deque[Generation] = collections.deque()
        self.prefix = prefix
        if prefix is not None:
            prefix.pool = prefix.make()
        self._table = _slots.SlotTable(slots)
        self._waiting: collections.deque[Generation] = collections.deque()
        self._cancels: list[Generation] = []
        self._pending: collections.deque[tuple] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._idle = True
        #: Counters since load: steps, prefills, tokens; the loop's wall seconds in turns
        #: that dispatched a step, and its thread's CPU seconds in them (the host's own
        #: work: on the device's side the programs run on the runtime's threads).
        self.counters = {
            "steps": 0,
            "busy_slot_steps": 0,
            "prefills": 0,
            "prefill_rows": 0,
            "tokens": 0,
            "generations": 0,
            "step_wall_s": 0.0,
            "step_host_cpu_s": 0.0,
            "chunks": 0,
            "chunk_rows": 0,
            "prefix_loads": 0,
            "stepped_slots": 0,
            "window_steps": 0,
            "moves": 0,
            "prompt_tokens": 0,
            "prefix_hit_tokens": 0,
            "verifies": 0,
            "drafted_tokens": 0,
            "accepted_tokens": 0,
        }
        #: Outcome -> generations that ended so (stop, length, cancelled, deadline, error).
        self.outcomes = dict.fromkeys((STOP, LENGTH, CANCELLED, DEADLINE, ERROR), 0)
        # Durations in seconds since the last ``drain_timings``: one entry per step read
        # (the interval between steps, which every busy slot sees between two tokens),
        # per prefill (dispatch -> its first tokens on the host), per finished
        # generation (time to first token; time per output token after the first).
        self._timings: dict[str, list[float]] = {k: [] for k in TIMINGS}
        self._last_step = 0.0
        #: A multi-host load's ``pxrt.multihost.Group`` (its followers run every program
        #: this decoder runs, in the same order), else None.
        self.group: Any = None
        self._gather: Any = None  # (multi-host) a step's tokens, whole: a RowGather
        self._itl_bound_ms = itl_bound_ms
        self._price_programs(costs or {}, itl_bound_ms)
        #: Programs still compiling after the load (``pxrt.load(defer=True)``): the loop
        #: takes them between two turns (``install``); 0 once it has.
        self.deferred = deferred
        #: Why the programs compiled after the load are missing, when they failed.
        self.deferred_error: BaseException | None = None
        self._arrivals: list[tuple[Any, BaseException | None]] = []
        self._programs = threading.Event()
        if not deferred:
            self._programs.set()
        # What the load asked for and may not be compiled yet: the sampling controls'
        # programs, speculation's drafts per slot.
        self._wanted = dict(wanted or {})

    def __repr__(self) -> str:
        return (
            f"Decoder({self.name!r}, version={self.version!r}, slots={self.slots}, "
            f"max_length={self.max_length}, prefill_lengths={self.prefill_lengths}, "
            f"devices={len(self.devices)})"
        )

    @property
    def compiles_after_load(self) -> int:
        """XLA compiles that happened while generating (must stay 0)."""
        return self.request_path_compiles

    @property
    def busy_slots(self) -> int:
        return self._table.busy

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def state(self) -> Any:
        """The device state (the cache and the per-slot arrays): for inspection only;
        it is replaced (its buffers donated) at every step."""
        return self._state

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        prompt: Sequence[int] | np.ndarray,
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_ids: Sequence[int] = (),
        prefix_cache: bool = True,
        logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        min_tokens: int = 0,
        priority: int = 0,
    ) -> Generation:
        """Queue one prompt (token ids) for generation; returns its ``Generation``.

        Generation stops after ``max_tokens`` tokens, at a stop token (the artifact's
        end-of-sequence and stop ids, and ``stop_ids``; the stop token is the last one
        returned), or when the cache is full (``max_length`` positions in all).
        ``temperature`` 0 is greedy (``MAX_TEMPERATURE`` at most); ``top_k`` 0 and
        ``top_p`` 1 do not cut. ``seed`` (0 .. 2**32-1; default random) fixes the
        sampled tokens whatever else is generated at the same time. ``prefix_cache``
        False: neither reuse nor keep this prompt's cached start.

        ``logprobs`` (0 .. 20; None: none): every token comes with its log-probability
        and that many of the most likely tokens' (``Generation.logprobs``), of the
        model's distribution (a log-softmax of its logits, before the controls below).
        The controls, applied on the device before sampling: ``logit_bias`` (token id
        -> -100 .. 100, added to its logit; at most 300), ``repetition_penalty`` (0 ..
        2; over the prompt's and the generated tokens), ``presence_penalty`` and
        ``frequency_penalty`` (-2 .. 2; over the generated tokens), ``min_tokens`` (no
        stop token before that many tokens).

        ``priority``: the prompt's level among the waiting ones (1 the highest, up to
        ``priority_levels``; 0: ``default_priority_level``; see ``set_priorities``).

        Raises ValueError naming the parameter for a bad request, ``QueueFull`` when
        ``max_waiting`` prompts already wait, ``DecoderClosed`` after ``close``.
        """
        level = int_in("priority", priority, 0, self.priority_levels)
        tokens = self._check_prompt(prompt)
        limit = int_in("max_tokens", max_tokens, 1, None)
        limit = min(limit, self.max_length - len(tokens))
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
        if not (
            isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0.0 < top_p <= 1.0
        ):
            raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
        if seed is None:
            seed = secrets.randbits(32)
        seed = int_in("seed", seed, 0, 2**32 - 1)
        stops = self.stop_ids
        try:
            extra = [int_in("stop_ids", t, 0, self.vocab - 1) for t in stop_ids]
        except TypeError:
            raise ValueError(f"stop_ids must be a list of token ids, got {stop_ids!r}") from None
        if extra:
            stops = stops | frozenset(extra)
        if not isinstance(prefix_cache, (bool, np.bool_)):
            raise ValueError(f"prefix_cache must be true or false, got {prefix_cache!r}")
        top = None if logprobs is None else int_in("logprobs", logprobs, 0, MAX_TOP_LOGPROBS)
        controls = self._controls(
            tokens, limit, stops, presence_penalty, frequency_penalty, repetition_penalty,
            logit_bias, min_tokens,
        )  # fmt: skip
        coming = self.deferred and self._wanted.get("controls")
        if (top is not None or controls is not None) and self._control is None and not coming:
            raise ValueError(
                f"decoder {self.name!r} does not give logprobs or apply logit_bias, "
                "penalties or min_tokens: it was loaded with sampling_controls=False, or "
                "is served by a multi-host group"
            )
        gen = Generation(
            self,
            tokens,
            limit,
            stops,
            (float(temperature), min(k, self.vocab), float(top_p), seed),
            next((n for n in self.prefill_lengths if n >= len(tokens)), 0),
            bool(prefix_cache) and self.prefix is not None,
        )
        gen.logprobs = None if top is None else []
        gen.top_logprobs = top or 0
        gen.controls = controls
        gen.level = level or self.default_priority_level
        with self._cond:
            if self._closed:
                raise DecoderClosed(f"decoder {self.name!r} is closed")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(
                    f"decoder {self.name!r}: {len(self._waiting)} prompts are waiting for a "
                    f"slot (max_waiting={self.max_waiting}); retry later"
                )
            self._waiting.append(gen)
            self.counters["generations"] += 1
            if self._thread is None:
                self._start()
            elif self._idle:
                self._cond.notify()
        return gen

    def set_priorities(self, levels: int, default_level: int = 0, wait_s: float = 0.1) -> None:
        """Admit waiting prompts by priority: ``levels`` levels (1 the highest), a
        prompt without one at ``default_level`` (0: the lowest), and any prompt that has
        waited ``wait_s`` seconds before every level, oldest first (the batcher's
        ``priority_levels``, ``default_priority_level`` and ``priority_wait_ms``).
        Within a level prompts keep their order. ``levels`` 1: one queue, in order."""
        levels = int_in("priority_levels", levels, 1, None)
        default = int_in("default_priority_level", default_level, 0, levels) or levels
        wait = number_in("priority_wait_s", wait_s, 0.0, math.inf, low_open=True)
        with self._cond:
            self.priority_levels, self.default_priority_level = levels, default
            self.priority_wait_s = wait if levels > 1 else math.inf

    def generate(self, prompt: Sequence[int] | np.ndarray, **options: Any) -> Completion:
        """Generate for one prompt and wait for all of it (sync). ``options`` as for
        ``submit``."""
        return self.submit(prompt, **options).result()

    def stream(self, prompt: Sequence[int] | np.ndarray, **options: Any) -> Iterator[int]:
        """The generated tokens of one prompt as they come (sync); closing the iterator
        early cancels the generation."""
        gen = self.submit(prompt, **options)
        try:
            yield from gen
        finally:
            gen.cancel()

    async def agenerate(
        self, prompt: Sequence[int] | np.ndarray, **options: Any
    ) -> AsyncIterator[int]:
        """The generated tokens of one prompt as they come (async); leaving the loop
        early, or cancelling the task, cancels the generation and frees its slot."""
        gen = self.submit(prompt, **options)
        try:
            async for token in gen:
                yield token
        finally:
            gen.cancel()

    def _controls(
        self,
        prompt: np.ndarray,
        limit: int,
        stops: frozenset,
        presence: Any,
        frequency: Any,
        repetition: Any,
        bias: Any,
        min_tokens: Any,
    ) -> Controls | None:
        """A request's sampling controls, checked (None: it has none)."""
        presence = number_in("presence_penalty", presence, -2.0, 2.0)
        frequency = number_in("frequency_penalty", frequency, -2.0, 2.0)
        repetition = number_in("repetition_penalty", repetition, 0.0, 2.0, low_open=True)
        min_tokens = int_in("min_tokens", min_tokens, 0, None)
        if min_tokens > limit:
            raise ValueError(
                f"min_tokens must be at most max_tokens ({limit}, or the room the cache "
                f"leaves after the prompt), got {min_tokens}"
            )
        if bias is None:
            bias = {}
        if not isinstance(bias, Mapping):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r:.80}")
        if len(bias) > sampling.MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: {len(bias)} entries; at most {sampling.MAX_LOGIT_BIAS}")
        ids = np.full(sampling.MAX_LOGIT_BIAS, self.vocab, np.int32)  # out of range: none
        values = np.zeros(sampling.MAX_LOGIT_BIAS, np.float32)
        for i, (key, value) in enumerate(bias.items()):
            if isinstance(key, str) and key.strip().isdigit():
                key = int(key)  # (JSON's keys are strings)
            ids[i] = int_in("logit_bias: a token id", key, 0, self.vocab - 1)
            values[i] = number_in(f"logit_bias[{key}]", value, -100.0, 100.0)
        if not (presence or frequency or repetition != 1.0 or bias or min_tokens):
            return None
        banned = np.full(sampling.MAX_BANNED, self.vocab, np.int32)
        if min_tokens:
            if len(stops) > sampling.MAX_BANNED:
                raise ValueError(
                    f"min_tokens holds back {len(stops)} stop ids; at most {sampling.MAX_BANNED}"
                )
            banned[: len(stops)] = sorted(stops)
        prompted = np.full((1, self.max_length), self.vocab, np.int32)
        prompted[0, : len(prompt)] = prompt
        return Controls(
            (presence, frequency, repetition), len(prompt) + min_tokens,
            (ids[None], values[None], banned[None]), prompted,
        )  # fmt: skip

    def _check_prompt(self, prompt: Any) -> np.ndarray:
        try:
            arr = np.asarray(prompt)
        except Exception as exc:  # noqa: BLE001 - anything unreadable is a bad prompt
            raise ValueError(
                f"prompt: expected a list of token ids, got {type(prompt).__name__}"
            ) from exc
        if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise ValueError(
                f"prompt: expected a 1-D sequence of integer token ids, got "
                f"{arr.dtype.name}{list(arr.shape)}"
            )
        n = arr.shape[0]
        if n == 0:
            raise ValueError("prompt: is empty; give at least one token id")
        if n >= self.max_length:
            raise ValueError(
                f"prompt: {n} tokens leave no room in a cache of {self.max_length} positions "
                f"(at most {self.max_length - 1} prompt tokens)"
            )
        if n > self.max_prompt and not self._extends:
            raise ValueError(
                f"prompt: {n} tokens is longer than the longest prefill length of "
                f"{self.name!r} ({self.max_prompt}), and it has no extend program to "
                "prefill it in chunks: shorten it, or export with extend= (or longer "
                "prefill_lengths)"
            )
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high >= self.vocab:
            bad = low if low < 0 else high
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {self.vocab})")
        return arr.astype(np.int32)

    def _cancel(self, gen: Generation, reason: str) -> None:
        with self._cond:
            if gen.finish_reason is not None:
                return
            gen.finish_reason = reason
            self._cancels.append(gen)
            if self._idle:
                self._cond.notify()
        self._wake([gen])

    # ------------------------------------------------------------------ the loop

    def _start(self) -> None:
        _LIVE.add(self)
        self._thread = threading.Thread(
            target=_serve,
            args=(weakref.ref(self), self.artifact.x64),
            name=f"pxrt-generate-{self.name}",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Stop the loop; every unfinished generation ends with ``DecoderClosed``."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._fail(DecoderClosed(f"decoder {self.name!r} was closed"))
        if self.group is not None:
            self.group.close()  # its followers stop

    def load_summary(self) -> str:
        """One line on where this decoder's load went (for logs): ``load_phases`` and
        where each program's executable came from."""
        return compiling.load_summary(
            self.load_s, self.load_phases, self.program_sources, "programs"
        )

    def __enter__(self) -> Decoder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def wait_programs(self, timeout: float | None = None) -> bool:
        """Wait until the programs compiled after the load are in use (at once when
        there were none); False if ``timeout`` seconds passed first."""
        return self._programs.wait(timeout)

    def install(self, got: Any, error: BaseException | None = None) -> None:
        """Hand the loop the programs compiled after the load (``pxrt.decoder.load``'s,
        from its compiling thread): it takes them between two turns."""
        with self._cond:
            if self._closed:
                self._programs.set()
                return
            self._arrivals.append((got, error))
            if self._thread is None:
                self._start()
            elif self._idle:
                self._cond.notify()

    def _install(self, got: Any, error: BaseException | None) -> None:
        """(the loop's thread) Put the programs compiled after the load to use: the
        steps over fewer slots or positions, the larger cells (timed first, on rows
        dropped: nothing of the state changes), the sampling controls', the prefix
        cache's and speculation's programs; then price again."""
        if got is not None:
            n_dev = len(self.devices)
            self._steps.update({n // n_dev: p for n, p in got.parts.items()})
            self._move = got.move or self._move
            self._order = {
                rows: [d * self._rows_per_device + r for d in range(n_dev) for r in range(rows)]
                for rows in self._steps
            }
            self.step_slots = tuple(sorted(rows * n_dev for rows in self._steps))
            self._windows.update({(n // n_dev, w): p for (n, w), p in got.windows.items()})
            self.step_lengths = tuple(sorted({w for _, w in self._windows}))
            self._extends.update({(c.batch, c.length): c for c in got.extends})
            self.chunk_batches = tuple(sorted({b for b, _ in self._extends}))
            self._control = got.control or self._control
            self._full_step = got.full_step or self._full_step
            if got.verify is not None:
                self._verify = got.verify
                self.speculative_tokens = got.verify_width
            if got.prefix is not None:
                self.prefix = got.prefix
                got.prefix.pool = got.prefix.make()
            timed = self._time_cells(got.cells)
            self._cells.update({(c.batch, c.length): c for c in got.cells})
            self.prefill_batches = tuple(sorted({b for b, _ in self._cells}))
            for kind, n in got.sources.items():
                self.program_sources[kind] = self.program_sources.get(kind, 0) + n
            self._price_programs(self.costs | timed, self._itl_bound_ms)
        self.deferred = 0
        self.deferred_error = error
        self._programs.set()

    def _time_cells(self, cells: list) -> dict[str, float]:
        """Each prefill cell's seconds a run (the median of 3, after one), all its rows
        dropped, on the state in use: the same shapes and work as a real call, and
        nothing of the state changes."""
        c = sampling
        costs = {}
        for cell in cells:
            ints = np.zeros((cell.batch, c.INTS), np.int32)
            ints[:, c.LEN] = 1
            ints[:, c.SLOT] = self.slots  # out of range: dropped
            floats = np.ones((cell.batch, c.FLOATS), np.float32)
            tokens = np.zeros((cell.batch, cell.length), np.int32)
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                self._state, first, _ = cell.compiled(
                    self._params, self._state, tokens, ints, floats
                )
                jax.block_until_ready(first)
                times.append(time.perf_counter() - t0)
            costs[f"prefill[{cell.batch},{cell.length}]"] = float(np.median(times[1:]))
        return costs

    def _has_work(self) -> bool:
        return bool(
            self._arrivals
            or self._cancels
            or self._table.busy
            or self._pending
            or self._waiting
            or self._chunking
            or self._closed
        )

    def _iterate(self) -> bool:
        """One turn of the loop (see the module docstring); False once closed. Idle, it
        waits for work for up to a second."""
        table = self._table
        pending = self._pending
        with self._cond:
            if not self._has_work():
                self._idle = True
                self._cond.wait(1.0)
                if not self._has_work():
                    return True
            self._idle = False
            if self._closed:
                return False
            cancels, self._cancels = self._cancels, []
            arrivals, self._arrivals = self._arrivals, []
        for got, error in arrivals:
            self._install(got, error)
        batch: tuple[list, int, int] | None = None
        units: list[tuple[list, int, int]] = []
        with _xla.compile_counter.request_path(self):
            try:
                for gen in cancels:
                    if gen.slot < 0:  # still waiting: it no longer counts
                        with contextlib.suppress(ValueError):
                            self._waiting.remove(gen)
                    self._unreserve(gen)
                    table.release(gen)
                    if not gen.counted:
                        gen.counted = True
                        self.outcomes[gen.finish_reason or CANCELLED] += 1  # (set: cancelled)
                t0, c0 = time.perf_counter(), time.thread_time()
                units = self._admit()
                while units:
                    batch = units[0]
                    self._prefill(*batch)
                    batch = None  # in _pending now
                    units.pop(0)
                budget = self.chunk_tokens
                while self._chunking and budget > 0:
                    budget -= self._extend(budget)
                drafts = None
                if self.speculative_tokens and table.busy and not self._chunking:
                    drafts = self._drafts()
                stepped = table.busy > 0
                if drafts is not None:
                    self._dispatch_verify(drafts)
                elif stepped:
                    self._dispatch_step()
                while len(pending) > stepped:
                    self._read(pending[0])
                    pending.popleft()
                if stepped:
                    self.counters["step_wall_s"] += time.perf_counter() - t0
                    self.counters["step_host_cpu_s"] += time.thread_time() - c0
            except Exception as exc:  # noqa: BLE001 - a failed step fails its generations
                if units and batch is not None:  # (the prefills not begun wait again)
                    self._waiting.extendleft(reversed([g for u in units[1:] for g in u[0]]))
                self._recover(exc, batch[0] if batch else [])
        return True

    def _admit(self) -> list[tuple[list, int, int]]:
        """This turn's prefills, each (prompts, length, batch cell): waiting prompts in
        order, each unit up to the first that needs a longer prefill than its head's (it
        leads the next unit), at the cell the measured prices choose (``_price``), for
        as long as the turn's prefill budget lasts (one unit at least). A prompt longer
        than the longest prefill, or whose start is in the prefix cache, takes a slot
        of its own to fill chunk by chunk (``_extend``); cached starts are copied in at
        once. A prompt whose next block a prompt admitted before will cache waits for
        it."""
        waiting = self._waiting
        free = self._table.free
        if not waiting or not free:
            return []
        if self.priority_levels > 1 and len(waiting) > 1:
            self._by_priority()
        if len(self._steps) > 1:  # the lowest rows first (popped from the end)
            rows = self._rows_per_device
            free.sort(key=lambda s: (s % rows, s // rows), reverse=True)
        # Blocks that prompts admitted before will cache (being chunked, or admitted in
        # this turn: they are saved once prefilled).
        base = self._filling_keys() if self.prefix is not None else set()
        scan = _Scan(set(base), [], [])
        units: list[tuple[list, int, int]] = []
        taken, left = 0, self._prefill_budget()
        while waiting and len(free) > taken:  # (the units' slots are taken later)
            batch, length = self._gather_unit(scan, taken)
            if not batch:
                break
            size, rows, cost = self._price(len(batch), length, left, first=not units)
            waiting.extendleft(reversed(batch[rows:]))  # (they lead the next unit)
            if self.prefix is not None and rows < len(batch):
                scan.filling = base | {
                    k for g in [*scan.chunked, *batch[:rows]] if g.use_prefix and g.keys
                    for k in g.keys
                }  # fmt: skip
            for gen in batch[:rows]:
                self._admitted(gen)
            if rows:
                units.append((batch[:rows], length, size))
                taken, left = taken + rows, left - cost
                self.counters["priced_prefills"] += self._priced
            if not rows or not self._priced:  # (unpriced: one unit a turn)
                break
        waiting.extendleft(reversed(scan.held))
        if scan.loads:
            self._load_prefixes(scan.loads)
        return units

    def _gather_unit(self, scan: _Scan, taken: int) -> tuple[list, int]:
        """The next unit's prompts (up to the largest prefill batch, from the queue's
        head; none may need a longer prefill than the first) and its length; admits the
        prompts met on the way that go in chunks (into ``_chunking``)."""
        waiting, free = self._waiting, self._table.free
        block, copies = (self.prefix.index.block, self.prefix.rows) if self.prefix else (0, 0)
        filling, held = scan.filling, scan.held
        batch: list[Generation] = []
        length = 0
        while waiting and len(free) > taken + len(batch):
            gen = waiting[0]
            if gen.finish_reason is not None:  # cancelled while waiting
                waiting.popleft()
                continue
            if self._control is None and (gen.controls is not None or gen.logprobs is not None):
                held.append(waiting.popleft())  # (until its programs are compiled)
                if len(held) >= self.slots:
                    break
                continue
            entries = self._lookup(gen)
            if filling and gen.keys and len(entries) < len(gen.keys):
                if gen.keys[len(entries)] in filling:
                    # A prompt admitted before will cache more of this one's start: this
                    # one waits for it (at the head of the queue; the others go on)
                    # rather than compute the same blocks again.
                    held.append(waiting.popleft())
                    if len(held) >= self.slots:  # (a bounded scan per turn)
                        break
                    continue
            if entries or not gen.bucket or not self._cells:  # (no cell yet: in chunks)
                if entries and len(scan.loads) >= copies:
                    break  # one copy program per turn
                waiting.popleft()
                gen.reserved = free.pop()
                self._write_controls(gen, gen.reserved)
                gen.start = gen.hit = len(entries) * block
                if entries:
                    scan.loads.append((gen.reserved, entries))
                self._admitted(gen)
                self._chunking.append(gen)
                scan.chunked.append(gen)
                if gen.use_prefix and gen.keys:
                    filling.update(gen.keys)
                continue
            if len(batch) >= self.prefill_batches[-1] or (length and gen.bucket > length):
                break
            length = length or gen.bucket
            batch.append(waiting.popleft())
            if gen.use_prefix and gen.keys:
                filling.update(gen.keys)
        return batch, length

    def _price_programs(self, costs: Mapping[str, float], itl_bound_ms: float | None) -> None:
        """The scheduler's prices from the times measured at load (``costs``: seconds
        per ``prefill[b,L]``, ``step[slots]``, and ``dispatch``), and the turn's bound
        (``itl_bound_ms``; default: a full step and the longest single-prompt
        prefill, each as measured, its dispatch included). Without them (a multi-host
        group) each turn runs one prefill sized by the queue."""
        #: The programs' measured seconds, as measured at load.
        self.costs = dict(costs)
        pre = {(b, n): costs.get(f"prefill[{b},{n}]") for b, n in self._cells}
        steps = {n: costs.get(f"step[{n}]") for n in self.step_slots}
        self._priced = int(
            bool(pre) and all(v is not None for v in (*pre.values(), steps[self.slots]))
        )
        self._prefill_cost = {k: v or 0.0 for k, v in pre.items()}
        # (a step not timed, compiled after the load: priced as the whole one)
        self._step_cost = {n: v if v is not None else steps[self.slots] or 0.0
                           for n, v in steps.items()}  # fmt: skip
        if itl_bound_ms is not None:
            self.itl_bound_s = itl_bound_ms * 1e-3
        elif self._priced:
            least = self.prefill_batches[0]
            longest = max(self._prefill_cost[(least, n)] for n in self.prefill_lengths)
            self.itl_bound_s = self._step_cost[self.slots] + longest
        else:
            self.itl_bound_s = math.inf
        self.counters.setdefault("priced_prefills", 0)

    def _prefill_budget(self) -> float:
        """Seconds of prefill this turn may take: the bound less the coming step's
        price (the fewest slots that hold the busy ones and no more); no bound while no
        slot is busy (no stream waits for its next token: the prompts go in at the
        densest cells)."""
        busy = self._table.busy
        if not self._priced or not busy:
            return math.inf if self._priced else self.itl_bound_s
        step = next((self._step_cost[n] for n in self.step_slots if n >= busy), 0.0)
        return self.itl_bound_s - step

    def _price(self, n: int, length: int, left: float, *, first: bool) -> tuple[int, int, float]:
        """(batch cell, prompts it takes, its price) for a unit of ``n`` prompts at
        ``length`` with ``left`` seconds of the turn's budget: the cell giving the most
        prompts per second among those that fit (a padded cell pays for its padding);
        when none fits, the cheapest if it is the turn's first unit (so every turn
        admits), else none. Unpriced: the smallest cell that holds them all."""
        if not self._priced:
            return next(b for b in self.prefill_batches if b >= n), n, 0.0
        best: tuple[float, int, int, float] | None = None
        cheapest: tuple[float, int, int] | None = None
        for b in self.prefill_batches:
            cost, rows = self._prefill_cost[(b, length)], min(b, n)
            if cheapest is None or cost < cheapest[0]:
                cheapest = (cost, b, rows)
            if cost <= left and (best is None or rows / cost > best[0]):
                best = (rows / cost, b, rows, cost)
        if best is not None:
            return best[1], best[2], best[3]
        if first and cheapest is not None:
            return cheapest[1], cheapest[2], cheapest[0]
        return 0, 0, 0.0

    def _by_priority(self) -> None:
        """Order the waiting prompts: those that waited ``priority_wait_s`` first,
        oldest first; then by level, each level in order of arrival."""
        aged = time.perf_counter() - self.priority_wait_s
        with self._cond:  # (submit appends from other threads)
            order = sorted(
                self._waiting,
                key=lambda g: (0 if g.t_submit <= aged else g.level, g.t_submit),
            )
            self._waiting.clear()
            self._waiting.extend(order)

    def _filling_keys(self) -> set[bytes]:
        """The blocks the prompts being prefilled in chunks will cache when done."""
        return {key for gen in self._chunking if gen.use_prefix and gen.keys for key in gen.keys}

    def _admitted(self, gen: Generation) -> None:
        self.counters["prompt_tokens"] += len(gen.prompt)
        self.counters["prefix_hit_tokens"] += gen.hit
        if self.prefix is not None and gen.use_prefix:
            self.prefix.index.record(len(gen.prompt), gen.hit)

    def _lookup(self, gen: Generation) -> list[int]:
        """The pool entries of ``gen``'s cached start (none: the prefix cache is off for
        it, or nothing of it is cached)."""
        prefix = self.prefix
        if prefix is None or not gen.use_prefix:
            return []
        if gen.keys is None:
            gen.keys = prefix.index.keys(gen.prompt)
        return prefix.index.match(gen.keys) if gen.keys else []

    def _load_prefixes(self, loads: list[tuple[int, list[int]]]) -> None:
        """Copy cached blocks into the start of slots (one program)."""
        prefix = self.prefix
        assert prefix is not None
        slots = np.full(prefix.rows, self.slots, np.int32)  # out of range: dropped
        entries = np.zeros((prefix.rows, prefix.width), np.int32)
        for i, (slot, got) in enumerate(loads):
            slots[i] = slot
            entries[i, : len(got)] = got
        self._state, _ = self._launch(-1, prefix.load, self._state, prefix.pool, slots, entries)
        self.counters["prefix_loads"] += 1

    def _save_prefixes(self, done: list[tuple[Generation, int]]) -> None:
        """Keep the full blocks of freshly prefilled prompts (``(generation, slot)``)
        that the pool lacks: programs of ``width`` blocks each, dispatched after the
        prefill that wrote them and before anything may overwrite the slots."""
        prefix = self.prefix
        if prefix is None:
            return
        pairs = []
        for gen, slot in done:  # (admission computed the keys of those that use it)
            if gen.use_prefix and gen.keys:
                first = gen.hit // prefix.index.block
                pairs += [(slot, i, e) for i, e in prefix.index.add(gen.keys, first)]
        width, none = prefix.width, prefix.index.blocks
        for at in range(0, len(pairs), width):
            part = pairs[at : at + width]
            slots = np.zeros(width, np.int32)
            blocks = np.zeros(width, np.int32)
            entries = np.full(width, none, np.int32)  # out of range: dropped
            for i, (slot, block, entry) in enumerate(part):
                slots[i], blocks[i], entries[i] = slot, block, entry
            prefix.pool, _ = self._launch(
                -1, prefix.save, prefix.pool, self._state, slots, blocks, entries
            )

    def _extend(self, budget: int) -> int:
        """One chunk for up to ``chunk_batches[-1]`` of the slots being filled, oldest
        first, within ``budget`` tokens (one row at least): ``k`` tokens each, the
        largest chunk length or the smallest that holds what every row has left. A row
        whose prompt this chunk ends samples its first token and joins the steps.
        Returns the tokens it took."""
        table = self._table
        rows: list[Generation] = []
        for gen in self._chunking:
            rows.append(gen)
            if len(rows) == self.chunk_batches[-1]:
                break
        left = max(len(g.prompt) - g.start for g in rows)
        k = next((n for n in self.chunk_lengths if n >= left), self.chunk_lengths[-1])
        rows = rows[: max(1, budget // k)]
        size = next(b for b in self.chunk_batches if b >= len(rows))
        cell = self._extends[(size, k)]
        rows.sort(key=lambda g: len(g.prompt) - g.start > k)  # the prompts it ends first
        tokens, ints, floats = self._host_rows(
            size, k, sampling.CHUNK_INTS, sampling.CHUNK_COUNT, sampling.CHUNK_SLOT
        )
        finals: list[Generation] = []
        done: list[tuple[Generation, int]] = []
        for i, gen in enumerate(rows):
            prompt = gen.prompt
            # The chunk ends inside the cache: near its end, it starts earlier and
            # computes some of the prompt's tokens again (the same rows).
            start = min(gen.start, self.max_length - k)
            count = min(len(prompt) - start, k)
            tokens[i, :count] = prompt[start : start + count]
            final = start + count >= len(prompt)
            ints[i, : sampling.CHUNK_WANT] = (
                start, count, gen.reserved, gen.top_k, _seed_bits(gen.seed), final
            )  # fmt: skip
            self._sampling_row(gen, ints[i, sampling.CHUNK_WANT :], floats[i])
            gen.start = start + count
            if final:
                finals.append(gen)
        t0 = time.perf_counter()
        for gen in rows:
            gen.t_admit = gen.t_admit or t0
        (self._state, first, scores), sync = self._launch(
            -1, cell.compiled, self._params, self._state, tokens, ints, floats
        )
        for gen in finals:
            self._chunking.remove(gen)
            slot, gen.reserved = gen.reserved, -1
            table.assign(gen, slot)
            done.append((gen, slot))
        if finals:
            first.copy_to_host_async()
            self._pending.append((_PREFILL, first, finals, t0, self._scores(finals, scores), sync))
            self._save_prefixes(done)
        self.counters["chunks"] += 1
        self.counters["chunk_rows"] += len(rows)
        return len(rows) * k

    def _unreserve(self, gen: Generation) -> None:
        """``gen`` no longer fills a slot chunk by chunk: the slot is free again."""
        if gen.reserved >= 0:
            with contextlib.suppress(ValueError):
                self._chunking.remove(gen)
            self._table.free.append(gen.reserved)
            gen.reserved = -1

    def _host_rows(
        self, size: int, length: int, columns: int, count: int, slot: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A prefill or extend call's host arrays for ``size`` rows of ``length``
        tokens, every row padding until filled in: one token (column ``count``), a
        slot out of range (column ``slot``: the row is dropped), top-p 1."""
        tokens = np.zeros((size, length), np.int32)
        ints = np.zeros((size, columns), np.int32)
        ints[:, count] = 1
        ints[:, slot] = self.slots
        floats = np.zeros((size, sampling.FLOATS), np.float32)
        floats[:, sampling.TOPP] = 1.0
        floats[:, sampling.REPETITION] = 1.0
        return tokens, ints, floats

    def _sampling_row(self, gen: Generation, ints: np.ndarray, floats: np.ndarray) -> None:
        """``gen``'s sampling parameters into its row of a prefill or extend call:
        ``ints`` from WANT on (WANT, CTRL, UNTIL), ``floats`` whole."""
        controls = gen.controls
        ints[0] = gen.logprobs is not None
        if controls is not None or gen.logprobs is not None:
            self._special = True  # (the steps that follow its first token: the full one)
        floats[sampling.TEMP] = gen.temperature
        floats[sampling.TOPP] = gen.top_p
        if controls is not None:
            ints[1:3] = (1, controls.until)
            floats[sampling.PRESENCE :] = controls.penalties

    def _write_controls(self, gen: Generation, slot: int) -> None:
        """Before ``gen``'s prompt goes into ``slot``: the slot's control rows (its
        prompt's tokens, logit bias, banned ids; no token counted yet), when it has
        controls."""
        controls = gen.controls
        if controls is None:
            return
        slots = np.full(1, slot, np.int32)
        self._state, _ = self._launch(
            -1, self._control, self._state, slots, controls.prompt, *controls.rows
        )

    @staticmethod
    def _scores(gens: list, scores: Any) -> Any:
        """A program's scores, copied to the host, when one of ``gens`` wants them;
        else None (they are not read)."""
        if not any(gen is not None and gen.logprobs is not None for gen in gens):
            return None
        scores.copy_to_host_async()
        return scores

    def _prefill(self, batch: list, length: int, size: int = 0) -> None:
        n = len(batch)
        size = size or next(b for b in self.prefill_batches if b >= n)
        cell = self._cells[(size, length)]
        tokens, ints, floats = self._host_rows(
            size, length, sampling.INTS, sampling.LEN, sampling.SLOT
        )
        assign = self._table.assign
        done = []
        for i, gen in enumerate(batch):
            prompt = gen.prompt
            tokens[i, : len(prompt)] = prompt
            ints[i, sampling.LEN] = len(prompt)
            ints[i, sampling.SLOT] = slot = assign(gen)
            ints[i, sampling.TOPK] = gen.top_k
            ints[i, sampling.SEED] = _seed_bits(gen.seed)
            self._sampling_row(gen, ints[i, sampling.WANT :], floats[i])
            self._write_controls(gen, slot)
            done.append((gen, slot))
        t0 = time.perf_counter()
        for gen in batch:
            gen.t_admit = t0
        (self._state, first, scores), sync = self._launch(
            cell.index, cell.compiled, self._params, self._state, tokens, ints, floats
        )
        first.copy_to_host_async()
        self._pending.append((_PREFILL, first, batch, t0, self._scores(batch, scores), sync))
        self.counters["prefills"] += 1
        self.counters["prefill_rows"] += n
        self._save_prefixes(done)

    def _dispatch_step(self) -> None:
        busy = self._table.busy
        program = None
        if self._special:
            if any(
                g is not None and (g.controls is not None or g.logprobs is not None)
                for g in self._table.owners
            ):
                program, rows = self._full_step, self._rows_per_device
            else:
                self._special = False
        if program is None:
            rows = self._compact() if len(self._steps) > 1 else self._rows_per_device
            program = self._steps[rows]
            if self.step_lengths:
                window = self._window()
                if window:
                    program = self._windows[(rows, window)]
                    self.counters["window_steps"] += 1
        (self._state, tokens, scores), sync = self._launch(
            len(self._cells), program, self._params, self._state
        )
        tokens.copy_to_host_async()
        owners = self._table.dispatch()
        if rows < self._rows_per_device:  # the step's tokens are these slots'
            owners = [owners[s] for s in self._order[rows]]
        # (only the full step computes scores)
        scores = self._scores(owners, scores) if program is self._full_step else None
        self._pending.append((_STEP, tokens, owners, 0.0, scores, sync))
        self.counters["steps"] += 1
        self.counters["busy_slot_steps"] += busy
        self.counters["stepped_slots"] += len(owners)

    def _drafts(self) -> np.ndarray | None:
        """Speculative decoding: each busy slot's drafts (prompt lookup: what followed
        the last earlier occurrence of its last 3, else 2, tokens), ``[slots, k]``,
        -1 past a slot's; or None: a plain step instead (a busy slot samples, has
        controls or logprobs, or lacks room in the cache for k more; or no slot has a
        draft). The programs in flight are read first: drafts continue the tokens."""
        k = self.speculative_tokens
        spec = self._spec
        if spec["verify_s"] and spec["step_s"]:
            if (1 + spec["gain"]) * spec["step_s"] < spec["verify_s"]:
                spec["skip"] += 1
                if spec["skip"] < _PROBE:
                    return None
            spec["skip"] = 0
        owners = self._table.owners
        for gen in owners:
            if gen is not None and (
                gen.temperature >= MIN_TEMPERATURE
                or gen.controls is not None
                or gen.logprobs is not None
            ):
                return None
        if not any(g is not None and g.lookup is not None and g.lookup.hit for g in owners):
            # No slot found a draft last time: the step in flight is not waited for
            # unless one might (a slot new to the lookup).
            if all(g is None or g.lookup is not None for g in owners):
                for gen in owners:
                    if gen is not None:
                        gen.lookup.hit = bool(gen.lookup.draft(gen.tokens, k))
                if not any(g is not None and g.lookup.hit for g in owners):
                    return None
        pending = self._pending
        while pending:
            self._read(pending[0])
            pending.popleft()
        drafts = np.full((self.slots, k), -1, np.int32)
        found = False
        for slot, gen in enumerate(owners):
            if gen is None:
                continue
            if len(gen.prompt) + len(gen.tokens) + k > self.max_length:
                return None
            lookup = gen.lookup
            if lookup is None:
                lookup = gen.lookup = PromptLookup(gen.prompt)
            draft = lookup.draft(gen.tokens, k)
            lookup.hit = bool(draft)
            if draft:
                drafts[slot, : len(draft)] = draft
                found = True
        return drafts if found else None

    def _dispatch_verify(self, drafts: np.ndarray) -> None:
        busy = self._table.busy
        (self._state, tokens, accepted), sync = self._launch(
            -1, self._verify, self._params, self._state, drafts
        )
        tokens.copy_to_host_async()
        accepted.copy_to_host_async()
        owners = self._table.dispatch()
        self._pending.append((_VERIFY, tokens, owners, 0.0, accepted, sync))
        counters = self.counters
        counters["steps"] += 1
        counters["verifies"] += 1
        counters["busy_slot_steps"] += busy
        counters["stepped_slots"] += self.slots
        counters["drafted_tokens"] += int((drafts >= 0).sum())

    def _route_verified(
        self, tokens: np.ndarray, accepted: np.ndarray, owners: list, now: float,
        woken: list, finished: list,
    ) -> int:  # fmt: skip
        """A verify program's tokens: a slot's first ``accepted + 1``, column by column
        (stop conditions apply to each)."""
        accepted = np.asarray(accepted)
        routed = 0
        for j in range(tokens.shape[1]):
            column = [
                g if g is not None and accepted[i] >= j else None for i, g in enumerate(owners)
            ]
            if not any(g is not None for g in column):
                break
            routed += self._table.route(
                np.ascontiguousarray(tokens[:, j]), column, now, woken, finished
            )
        busy = 0
        gained = 0
        for i, gen in enumerate(owners):
            if gen is not None:
                gen.dispatched += int(accepted[i])  # (dispatch counted one)
                gained += int(accepted[i])
                busy += 1
        self.counters["accepted_tokens"] += gained
        spec = self._spec
        spec["gain"] += _EMA * (gained / max(busy, 1) - spec["gain"])
        return routed

    def _compact(self) -> int:
        """The rows per device the next step runs: the fewest compiled that hold every
        device's busy slots. When fewer would hold them than the busy slots' rows reach,
        the busy slots above are moved down into free rows first (one program, ordered
        before the step on the device; tokens of steps in flight still go by their
        snapshots)."""
        table = self._table
        owners = table.owners
        per = self._rows_per_device
        n_dev = len(self.devices)
        high, busy, held = [0] * n_dev, [0] * n_dev, [0] * n_dev
        for slot, gen in enumerate(owners):
            if gen is not None:
                d, r = divmod(slot, per)
                busy[d] += 1
                high[d] = max(high[d], r + 1)
        for gen in self._chunking:  # slots being filled hold their row too
            held[gen.reserved // per] += 1
        fits = self._fewest_rows
        rows = fits(max(high))
        target = fits(max(max(b + h for b, h in zip(busy, held)), 1))
        if target >= rows:
            return rows
        free = set(table.free)
        moves: list[tuple[int, int]] = []
        for d in range(n_dev):
            base = d * per
            holes = [base + r for r in range(target) if base + r in free]
            movers = [base + r for r in range(target, high[d]) if owners[base + r] is not None]
            moves += zip(movers, holes)
        src = np.full(self.slots, self.slots, np.int32)  # out of range: dropped
        dst = src.copy()
        for i, (a, b) in enumerate(moves):
            src[i], dst[i] = a, b
            gen = owners[a]
            owners[b], owners[a] = gen, None
            gen.slot = b
            free.discard(b)
            free.add(a)
        table.free[:] = sorted(free, reverse=True)
        self._state, _ = self._launch(-1, self._move, self._state, src, dst)
        self.counters["moves"] += len(moves)
        return target

    def _window(self) -> int:
        """The smallest cache window every busy slot's next position is under (0: the
        whole cache). A slot's position on the device runs ahead of the tokens read by
        the steps and the prefill not read yet (and a verify's drafts): bounded here by
        its prompt, its tokens read and that margin."""
        margin = 3 + self.speculative_tokens
        need = max(
            (len(g.prompt) + len(g.tokens) for g in self._table.owners if g is not None),
            default=0,
        )
        return next((w for w in self.step_lengths if w >= need + margin), 0)

    def _fewest_rows(self, need: int) -> int:
        return min(rows for rows in self._steps if rows >= need)

    def _launch(self, index: int, program: Any, *args: Any) -> tuple[Any, Any]:
        """Start ``program(*args)``: (its outputs, the group's step or None). A
        multi-host leader sends program ``index`` and its host inputs (the numpy
        arrays of ``args``) to the followers first, under the group's lock."""
        group = self.group
        if group is None:
            return program(*args), None
        host = [a for a in args if isinstance(a, np.ndarray)]
        with group.lock:
            sync = group.send(index, [host] * len(group.peers))
            return group.launched(sync, lambda: program(*args)), sync

    def _read(self, entry: tuple) -> None:
        kind, array, owners, t0, scores, sync = entry
        if sync is None:
            tokens = np.asarray(array)
        else:
            replies = self.group.wait(sync)  # every follower ran it: nothing diverged
            if kind == _STEP:  # sharded by slot: the followers sent their slots' tokens
                tokens = self._gather(array, replies)
            else:
                tokens = np.asarray(array.addressable_data(0))
        woken: list = []
        finished: list = []
        now = time.perf_counter()
        timings = self._timings
        if scores is not None and kind != _VERIFY:  # (each before its token: both read)
            rows = np.asarray(scores)
            for i, gen in enumerate(owners):
                if gen is not None and gen.logprobs is not None and gen.finish_reason is None:
                    gen.logprobs.append(rows[i])
        if kind == _PREFILL:
            routed = self._table.first(tokens, owners, now, woken, finished)
            timings["prefill"].append(now - t0)
        else:
            if kind == _VERIFY:  # (``scores``: how many drafts each slot accepted)
                routed = self._route_verified(tokens, scores, owners, now, woken, finished)
            else:
                routed = self._table.route(tokens, owners, now, woken, finished)
            if self._last_step:
                timings["step"].append(now - self._last_step)
                if self.speculative_tokens:
                    which = "verify_s" if kind == _VERIFY else "step_s"
                    spec = self._spec
                    spec[which] += _EMA * (now - self._last_step - spec[which])
            self._last_step = now
        self.counters["tokens"] += routed
        if woken:
            self._wake(woken)
        if finished:
            self._finished(finished)
        if not self._table.busy:
            self._last_step = 0.0  # idle: the next step's interval starts afresh

    def _finished(self, gens: list) -> None:
        ttft, tpot = self._timings["ttft"], self._timings["tpot"]
        outcomes = self.outcomes
        for gen in gens:
            gen.event.set()  # a sync reader of an async-woken generation (see _wake)
            if not gen.counted:
                gen.counted = True
                outcomes[gen.finish_reason] += 1
            ttft.append(gen.t_first - gen.t_submit)
            n = len(gen.tokens)
            if n > 1:
                tpot.append((gen.t_last - gen.t_first) / (n - 1))

    def drain_timings(self) -> dict[str, list[float]]:
        """The durations (seconds) logged since the last call, by kind (``TIMINGS``):
        ``step``: between two steps read back (the inter-token latency of every busy
        slot); ``prefill``: a prefill's dispatch to its first tokens on the host;
        ``ttft``: a finished generation's time to first token; ``tpot``: its time per
        output token after the first."""
        out, self._timings = self._timings, {k: [] for k in TIMINGS}
        return out

    def _wake(self, gens: list) -> None:
        """Wake the readers of ``gens``: on the event loop of an async reader, once per
        loop for all its generations; otherwise the event (a sync reader; ``_finished``
        sets it for every generation that ends, so ``result`` works whoever reads). An
        async reader records its loop before it first looks at the tokens, and the
        tokens are appended before this reads ``gen.loop``: one of the two sees the
        other."""
        by_loop: dict[Any, list] = {}
        for gen in gens:
            loop = gen.loop
            if loop is None:
                gen.woken = False
                gen.event.set()
            else:
                by_loop.setdefault(loop, []).append(gen)
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(wake_async, group)
            except RuntimeError:  # the loop was closed: nobody waits there
                for gen in group:
                    gen.woken = False

    def _in_flight(self) -> list:
        """Every generation that may still get a token: in a slot, or in a step or
        prefill not read yet (a slot is given back when its last token is dispatched)."""
        gens = [g for g in self._table.owners if g is not None]
        gens.extend(self._chunking)
        for _, _, who, _, _, _ in self._pending:
            gens.extend(g for g in who if g is not None)
        return gens

    def _recover(self, exc: BaseException, batch: list) -> None:
        """A device call failed: fail every generation in a slot or in flight (and the
        prefill batch being dispatched), and start again from a fresh state (the old one
        may have been donated)."""
        error = RuntimeError(f"decoder {self.name!r}: generation failed: {exc!r}")
        error.__cause__ = exc
        victims = self._in_flight() + list(batch)
        self._drop_pending()
        self._last_step = 0.0
        self._finish_with(victims, error)
        self._state = None  # before allocating another (after an out-of-memory error)
        try:
            if self.group is not None:
                self.group.check()  # a broken group runs nothing more
            self._state, sync = self._launch(len(self._cells) + 1, self._make_state)
            if sync is not None:
                self.group.wait(sync)
            if self.prefix is not None:  # it may have been donated to the failed call
                self.prefix.pool = None
                self.prefix.index.clear()
                self.prefix.pool = self.prefix.make()
        except Exception as again:  # noqa: BLE001 - nothing more can run
            with self._cond:
                self._closed = True
            self._fail(RuntimeError(f"decoder {self.name!r} cannot recover: {again!r}"))

    def _fail(self, error: BaseException) -> None:
        """End everything with ``error``: in flight and waiting (the loop has stopped)."""
        victims = self._in_flight()
        self._drop_pending()
        while self._waiting:
            victims.append(self._waiting.popleft())
        victims.extend(self._cancels)
        self._cancels = []
        self._finish_with(victims, error)

    def _drop_pending(self) -> None:
        """Forget the programs in flight (a multi-host group: their answers too)."""
        if self.group is not None:
            for entry in self._pending:
                self.group.forget(entry[-1])
        self._pending.clear()

    def _finish_with(self, gens: list, error: BaseException) -> None:
        done = []
        for gen in dict.fromkeys(gens):
            self._unreserve(gen)
            self._table.release(gen)
            if gen.finish_reason is None:
                # Its own error (one traceback per reader), caused by the shared one.
                gen.error = type(error)(*error.args)
                gen.error.__cause__ = error.__cause__ or error
                gen.finish_reason = ERROR
            if not gen.counted:
                gen.counted = True
                self.outcomes[gen.finish_reason] += 1
            done.append(gen)
        self._wake(done)

    # ------------------------------------------------------------------ introspection

    @property
    def cache_bytes(self) -> int:
        """Device memory of the cache (all slots, all devices together)."""
        at = {LENGTH_DIM: self.max_length}
        specs = jax.tree.leaves(self.artifact.cache, is_leaf=is_spec)
        return self.slots * sum(spec.nbytes_at(at) for spec in specs)

    @property
    def pool_bytes(self) -> int:
        """Device memory of the prefix cache's pool (per device: it is replicated)."""
        if self.prefix is None:
            return 0
        at = {LENGTH_DIM: self.prefix.index.block}
        specs = jax.tree.leaves(self.artifact.cache, is_leaf=is_spec)
        return self.prefix.index.blocks * sum(spec.nbytes_at(at) for spec in specs)

    def describe(self) -> dict:
        """The manifest, the compiled programs (compile time, XLA's memory analysis) and
        the cache's size."""

        def memory(compiled: Any) -> dict:
            try:
                mem = compiled.memory_analysis()
            except Exception:  # noqa: BLE001 - optional per backend
                return {}
            if mem is None:
                return {}
            return {
                "argument_bytes": mem.argument_size_in_bytes,
                "output_bytes": mem.output_size_in_bytes,
                "temp_bytes": mem.temp_size_in_bytes,
                "alias_bytes": getattr(mem, "alias_size_in_bytes", 0),
                "generated_code_bytes": mem.generated_code_size_in_bytes,
            }

        n_dev = len(self.devices)
        run = lambda key: (  # noqa: E731
            {"run_ms": round(self.costs[key] * 1e3, 4)} if key in self.costs else {}
        )
        programs = [
            {"program": "step", "slots": rows * n_dev}
            | ({"compile_s": round(self.step_compile_s, 4)} if step is self._step else {})
            | run(f"step[{rows * n_dev}]")
            | {"memory": memory(step)}
            for rows, step in sorted(self._steps.items(), reverse=True)
        ]
        programs += [
            {"program": "step", "slots": rows * n_dev, "length": window}
            | run(f"step[{rows * n_dev},{window}]")
            | {"memory": memory(step)}
            for (rows, window), step in sorted(self._windows.items(), reverse=True)
        ]
        if self._full_step is not None:  # (while a busy slot has controls or logprobs)
            programs.append(
                {"program": "step", "slots": self.slots, "sampling_controls": True}
                | {"memory": memory(self._full_step)}
            )
        for name, cells in (("prefill_insert", self._cells), ("extend_insert", self._extends)):
            for (b, length), cell in sorted(cells.items()):
                programs.append(
                    {
                        "program": name,
                        "batch": b,
                        "length": length,
                        "compile_s": round(cell.compile_s, 4),
                    }
                    | (run(f"prefill[{b},{length}]") if name == "prefill_insert" else {})
                    | {"memory": memory(cell.compiled)}
                )
        prefix = self.prefix
        if prefix is not None:
            cached = {
                "blocks": prefix.index.blocks,
                "block_tokens": prefix.index.block,
                "cached_blocks": len(prefix.index),
                "pool_bytes": self.pool_bytes,
                "copy_memory": memory(prefix.load),
                "save_memory": memory(prefix.save),
            }
        return {
            "manifest": self.artifact.manifest,
            "kind": "decoder",
            "devices": [str(d) for d in self.devices],
            "load_s": round(self.load_s, 4),
            "load_phases": dict(self.load_phases),
            "extensions": _ext.using_extensions(),
            "slots": self.slots,
            "max_length": self.max_length,
            "cache_bytes": self.cache_bytes,
            "programs": programs,
            "prefix_cache": cached if prefix is not None else None,
            "speculative_tokens": self.speculative_tokens,
            "scheduler": self.scheduler_choices(),
            "deferred": self.deferred,
        }

    def scheduler_choices(self) -> dict:
        """How the loop's scheduler chooses, from the times measured at load: the
        turn's bound, and for 1, 2, 4... prompts of each prefill length waiting, the
        first prefill it runs (batch cell and prompts taken) with no slot busy and with
        every slot busy."""
        if not self._priced:
            return {"priced": False}
        full = self.itl_bound_s - self._step_cost[self.slots]
        waiting = sorted({1, 2, *self.prefill_batches})
        choices = []
        for length in self.prefill_lengths:
            for n in waiting:
                idle = self._price(n, length, math.inf, first=True)
                busy = self._price(n, length, full, first=True)
                choices.append(
                    {"waiting": n, "length": length, "idle": list(idle[:2]), "busy": list(busy[:2])}
                )
        return {
            "priced": True,
            "itl_bound_ms": round(self.itl_bound_s * 1e3, 4),
            "dispatch_ms": round(self.costs.get("dispatch", 0.0) * 1e3, 4),
            "choices": choices,
        }


def _serve(ref: weakref.ref, x64: bool) -> None:
    """A decoder's loop thread: its turns while it is open. It holds the decoder while
    there is work and lets go when idle, so a decoder dropped without ``close`` is
    collected (its device memory freed) once its generations are done, and the thread
    ends within a second."""
    with _xla.x64_scope(x64):
        while True:
            decoder = ref()
            if decoder is None:
                return
            try:
                while decoder._iterate():
                    if not decoder._has_work():
                        break
                else:
                    return
            except BaseException as exc:  # the loop itself broke: end what it served
                with decoder._cond:
                    decoder._closed = True
                decoder._fail(RuntimeError(f"decoder {decoder.name!r}: its loop failed: {exc!r}"))
                raise
            del decoder


def _seed_bits(seed: int) -> int:
    """A uint32 seed as the int32 with its bits (the programs bitcast it back)."""
    return seed - (1 << 32) if seed >= 1 << 31 else seed


# Decoders whose loop runs: closed at interpreter exit, before jax tears its backends
# down under a loop thread that still holds their executables (a C++ abort otherwise).
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    for decoder in list(_LIVE):
        with contextlib.suppress(Exception):
            decoder.close()
