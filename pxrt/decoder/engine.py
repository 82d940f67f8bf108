"""Generation: a decoder artifact loaded with every program compiled, served by a loop
that batches continuously over device-resident cache slots.

At load (``pxrt.load`` on a decoder artifact: ``pxrt.decoder.load``) pxrt builds and
compiles, around the user's two exported programs (``pxrt.decoder.programs``):

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
(``pxrt.sampling``). ``Decoder`` here is the façade over its parts, one object (mixins
sharing its attributes, ``pxrt.decoder.core``): ``pxrt.decoder.scheduler`` (admission,
prices, priorities, the steps' size), ``pxrt.decoder.speculative`` (prompt lookup),
``pxrt.decoder.runner`` (dispatch and read), ``pxrt.decoder.loop`` (the thread and its
turn); ``pxrt.decoder.request`` is the request handle.
"""

from __future__ import annotations

import collections
import math
import secrets
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import _ext, compiling, sampling
from .. import tokenizer as _tokenizer
from ..finish import CANCELLED, DEADLINE, ERROR, LENGTH, STOP
from . import grammar
from .export import DecoderArtifact
from .loop import TIMINGS, Loop
from .overlap import Overlap
from .params import SamplingParams, int_in
from .prefix import PrefixPool
from .relayout import Relayout
from .request import Completion, DecoderClosed, Generation, QueueFull
from .runner import Controls, PrefillCell, Runner, SplitPrefill
from .scheduler import Scheduler
from .speculative import Speculation

_slots: Any = _ext.twin("pxrt._slots", "pxrt._slots_py")


class Decoder(Loop, Overlap, Relayout, Runner, Speculation, Scheduler):
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
        overlap_prefill: bool = False,
        measured_placement: bool = False,
        multi_step: int = 1,
        tiers: Sequence[tuple[int, int]] = (),
        deferred: int = 0,
        wanted: Mapping[str, Any] | None = None,
        prefill_lengths: Sequence[int] = (),
    ) -> None:
        self._wire_artifact(art, devices, slots, max_length)
        self._wire_sizes(cells, extends, prefill_lengths, chunk_tokens, max_waiting)
        self.load_s = load_s
        self.program_sources: dict[str, int] = {}
        #: Seconds per phase of the load: reading the artifact, its programs (traced and
        #: compiled, or loaded), their warm-up.
        self.load_phases: dict[str, float] = {}
        self.step_compile_s = step_compile_s
        #: XLA compiles on this decoder's loop (counted by ``_xla.compile_counter``).
        self.request_path_compiles = 0
        self._wire_programs(
            params_dev, state, step, make_state, cells, parts, move, control, full_step
        )
        # Speculative decoding (prompt lookup, greedy): the verify program and the
        # drafts it takes per slot (0: off).
        self._verify = verify
        self.speculative_tokens = speculative_tokens if verify is not None else 0
        # Whether it pays, measured as it runs (moving averages): the tokens a verify
        # gives per busy slot beyond the step's one, and the time between two verifies
        # and between two steps read. While 1 + gain < verify / step time, plain steps
        # run, with a verify every ``_PROBE`` turns to measure again.
        self._spec = {"gain": 1.0, "verify_s": 0.0, "step_s": 0.0, "skip": 0}
        self._wire_windows(windows, extends)
        self._wire_queue(prefix)
        self._wire_counters()
        self._wire_overlap(overlap_prefill, measured_placement)
        #: Steps a plain decode program may run (``pxrt.load(multi_step=...)``; 1: one).
        self.multi_step = multi_step
        self._wire_tiers(tiers)
        self._wire_relayout(None, False)  # (``pxrt.decoder.load`` gives the way to tiers)
        self._itl_bound_ms = itl_bound_ms
        self._price_programs(costs or {}, itl_bound_ms)
        #: Programs still compiling after the load (``pxrt.load(defer=True)``): the loop
        #: takes them between two turns (``install``); 0 once it has.
        self.deferred = deferred
        #: Why the programs compiled after the load are missing, when they failed.
        self.deferred_error: BaseException | None = None
        self._arrivals: list[tuple[Any, BaseException | None, int]] = []
        self._programs = threading.Event()
        if not deferred:
            self._programs.set()
        # What the load asked for and may not be compiled yet: the sampling controls'
        # programs, speculation's drafts per slot.
        self._wanted = dict(wanted or {})

    def _wire_artifact(
        self, art: DecoderArtifact, devices: list, slots: int, max_length: int
    ) -> None:
        """What the artifact says: its name, vocabulary, stop ids, tokenizer."""
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
        # Its tokenizer as the grammar engine sees it (``pxrt.decoder.grammar``), made
        # on the first structured output.
        self._grammars: grammar.Grammars | None = None

    def _wire_sizes(
        self,
        cells: list[PrefillCell],
        extends: Sequence[PrefillCell],
        prefill_lengths: Sequence[int],
        chunk_tokens: int | None,
        max_waiting: int,
    ) -> None:
        """The prompts' sizes (prefill and chunk cells), the queue's bound, priorities."""
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

    def _wire_programs(
        self,
        params_dev: Any,
        state: Any,
        step: Any,
        make_state: Any,
        cells: list[PrefillCell],
        parts: dict[int, Any] | None,
        move: Any,
        control: Any,
        full_step: Any,
    ) -> None:
        """The params, the state and the programs: the steps by rows per device."""
        self._params = params_dev
        self._state = state
        self._step = step
        self._make_state = make_state
        self._cells = {(c.batch, c.length): c for c in cells}
        self._timed_busy: set[tuple[int, int]] = set()  # (``_install``)
        # The steps by rows per device (the full one: slots / devices): the loop runs the
        # fewest rows that hold the busy slots, kept at the low rows of each device's
        # share (``_compact``, with the ``move`` program).
        n_dev = len(self.devices)
        self._rows_per_device = self.slots // n_dev
        self._steps = {n // n_dev: p for n, p in (parts or {}).items()}
        self._steps[self._rows_per_device] = step
        self._move = move
        self._control = control
        # The step with the sampling controls and scores, run instead of the plain ones
        # while a busy slot has controls or wants logprobs (``_special``: one was
        # admitted since the last step that found none).
        self._full_step = full_step
        self._special = False
        # (structured outputs) The step's forward in flight without its pick: (its
        # logits, the slots' owners when it was dispatched), or None.
        self._forwarded: Any = None

    def _wire_windows(
        self, windows: Mapping[tuple[int, int], Any] | None, extends: Sequence[PrefillCell]
    ) -> None:
        """The steps' slot orders and cache windows, and the extend cells."""
        n_dev = len(self.devices)
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

    def _wire_queue(self, prefix: PrefixPool | None) -> None:
        """The prefix cache's pool, the slot table, the waiting queue and the loop's
        thread state."""
        #: Generations filling their reserved slot chunk by chunk, oldest first.
        self._chunking: collections.deque[Generation] = collections.deque()
        self.prefix = prefix
        self._table = _slots.SlotTable(self.slots)
        self._waiting: collections.deque[Generation] = collections.deque()
        self._cancels: list[Generation] = []
        self._pending: collections.deque[tuple] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._idle = True

    def _wire_counters(self) -> None:
        """The counters, outcomes and timings, and a multi-host group's parts (none)."""
        #: Counters since load: steps (decode steps: a block of k counts k; its
        #: programs are ``step_programs``), prefills, tokens; the loop's wall seconds in turns
        #: that dispatched a step, and its thread's CPU seconds in them (the host's own
        #: work: on the device's side the programs run on the runtime's threads).
        self.counters = {
            "steps": 0,
            "busy_slot_steps": 0,
            "prefills": 0,
            "prefill_rows": 0,
            "prefills_ahead": 0,
            "tokens": 0,
            "generations": 0,
            "step_wall_s": 0.0,
            "step_host_cpu_s": 0.0,
            "chunks": 0,
            "chunk_rows": 0,
            "prefix_loads": 0,
            "stepped_slots": 0,
            "window_steps": 0,
            "step_programs": 0,
            "moves": 0,
            "prompt_tokens": 0,
            "prefix_hit_tokens": 0,
            "verifies": 0,
            "drafted_tokens": 0,
            "accepted_tokens": 0,
            "masked_steps": 0,
            "grammar_s": 0.0,
            "relayouts": 0,
            "beside_prefills": 0,
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
        prompt: Sequence[int] | np.ndarray | str,
        params: SamplingParams | None = None,
        **options: Any,
    ) -> Generation:
        """Queue one prompt for generation: token ids, or text where the artifact
        carries a tokenizer (encoded as the front ends encode it); returns its
        ``Generation`` (its tokens are ids: ``decoder.tokenizer.decode`` them).

        ``params``: how (a ``pxrt.SamplingParams``, checked when it was made), or its
        fields as keyword arguments (``max_tokens=64, temperature=0.7``), not both. What
        depends on this decoder is checked here: the prompt, token ids within the
        vocabulary, ``max_tokens`` within the cache (cut to the room the prompt
        leaves), ``priority`` within ``priority_levels``, and logprobs or controls only
        where it was loaded with them.

        Raises ValueError naming the parameter for a bad request, ``QueueFull`` when
        ``max_waiting`` prompts already wait, ``DecoderClosed`` after ``close``.
        """
        params = SamplingParams.resolve(params, options)
        level = int_in("priority", params.priority, 0, self.priority_levels)
        tokens = self._check_prompt(prompt)
        limit = min(params.max_tokens, self.max_length - len(tokens))
        stops = self.stop_ids
        for t in params.stop_ids:
            int_in("stop_ids", t, 0, self.vocab - 1)
        if params.stop_ids:
            stops = stops | frozenset(params.stop_ids)
        controls = self._controls(tokens, limit, stops, params)
        coming = self.deferred and self._wanted.get("controls")
        wants = params.logprobs is not None or controls is not None
        if wants and self._control is None and not coming:
            raise ValueError(
                f"decoder {self.name!r} does not give logprobs or apply logit_bias, "
                "penalties or min_tokens: it was loaded with sampling_controls=False, or "
                "is served by a multi-host group"
            )
        seed = secrets.randbits(32) if params.seed is None else params.seed
        gen = Generation(
            self,
            tokens,
            limit,
            stops,
            (params.temperature, min(params.top_k, self.vocab), params.top_p, seed),
            next((n for n in self.prefill_lengths if n >= len(tokens)), 0),
            params.prefix_cache and self.prefix is not None,
        )
        gen.logprobs = None if params.logprobs is None else []
        gen.top_logprobs = params.logprobs or 0
        if params.prompt_logprobs is not None:  # (in chunks, each position scored)
            if not self.chunk_lengths:
                raise ValueError(
                    f"prompt_logprobs: decoder {self.name!r} has no extend program to score "
                    "its prompts with (export it with extend=)"
                )
            gen.bucket, gen.use_prefix = 0, False
            gen.prompt_parts, gen.prompt_top = [], params.prompt_logprobs
        gen.controls = controls
        gen.level = level or self.default_priority_level
        self._enqueue(gen)
        return gen

    def _enqueue(self, gen: Generation) -> None:
        """Queue ``gen`` for a slot (the loop's thread started on first use)."""
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

    def generate(
        self,
        prompt: Sequence[int] | np.ndarray | str,
        params: SamplingParams | None = None,
        **options: Any,
    ) -> Completion:
        """Generate for one prompt and wait for all of it (sync). ``params`` or
        ``options`` as for ``submit``."""
        return self.submit(prompt, params, **options).result()

    def stream(
        self,
        prompt: Sequence[int] | np.ndarray | str,
        params: SamplingParams | None = None,
        **options: Any,
    ) -> Iterator[int]:
        """The generated tokens of one prompt as they come (sync); closing the iterator
        early cancels the generation."""
        gen = self.submit(prompt, params, **options)
        try:
            yield from gen
        finally:
            gen.cancel()

    async def agenerate(
        self,
        prompt: Sequence[int] | np.ndarray | str,
        params: SamplingParams | None = None,
        **options: Any,
    ) -> AsyncIterator[int]:
        """The generated tokens of one prompt as they come (async); leaving the loop
        early, or cancelling the task, cancels the generation and frees its slot."""
        gen = self.submit(prompt, params, **options)
        try:
            async for token in gen:
                yield token
        finally:
            gen.cancel()

    def _controls(
        self, prompt: np.ndarray, limit: int, stops: frozenset, params: SamplingParams
    ) -> Controls | None:
        """A request's sampling controls, as the step programs take them (None: it has
        none); what ``params`` could not check without the model checked here."""
        if not params.has_controls:  # (most requests: nothing to build)
            return None
        if params.min_tokens > limit:
            raise ValueError(
                f"min_tokens must be at most max_tokens ({limit}, or the room the cache "
                f"leaves after the prompt), got {params.min_tokens}"
            )
        ids = np.full(sampling.MAX_LOGIT_BIAS, self.vocab, np.int32)  # out of range: none
        values = np.zeros(sampling.MAX_LOGIT_BIAS, np.float32)
        for i, (key, value) in enumerate((params.logit_bias or {}).items()):
            ids[i] = int_in("logit_bias: a token id", key, 0, self.vocab - 1)
            values[i] = value
        banned = np.full(sampling.MAX_BANNED, self.vocab, np.int32)
        if params.min_tokens:
            if len(stops) > sampling.MAX_BANNED:
                raise ValueError(
                    f"min_tokens holds back {len(stops)} stop ids; at most {sampling.MAX_BANNED}"
                )
            banned[: len(stops)] = sorted(stops)
        prompted = np.full((1, self.max_length), self.vocab, np.int32)
        prompted[0, : len(prompt)] = prompt
        penalties = (params.presence_penalty, params.frequency_penalty, params.repetition_penalty)
        matcher = None
        if params.structured is not None:  # (the grammar's matcher; its first token's mask)
            matcher, allowed = grammar.grammars_of(self).matcher(params.structured)
        else:
            allowed = np.full((1, grammar.words(self.vocab)), -1, np.int32)
        rows = (ids[None], values[None], banned[None], allowed)
        bits = (sampling.GRAMMAR if matcher is not None else 0) | (
            sampling.PENALTIES if params.has_penalties else 0
        )
        until = len(prompt) + params.min_tokens
        return Controls(penalties, until, rows, prompted, matcher, bits=bits)

    def _check_prompt(self, prompt: Any) -> np.ndarray:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt: text needs a tokenizer and decoder {self.name!r} has none: "
                    "give token ids (or export it with tokenizer=)"
                )
            prompt = self.tokenizer.encode(prompt)
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

    # ------------------------------------------------------------------ life

    def close(self) -> None:
        """Stop the loop; every unfinished generation ends with ``DecoderClosed``."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._stop_prefiller()
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

    def install(self, got: Any, error: BaseException | None = None, left: int = 0) -> None:
        """Hand the loop the programs compiled after the load (``pxrt.decoder.load``'s,
        from its compiling thread): it takes them between two turns. ``left``: programs
        still compiling, handed over later (0: these are the last)."""
        with self._cond:
            if self._closed:
                self._programs.set()
                return
            self._arrivals.append((got, error, left))
            if self._thread is None:
                self._start()
            elif self._idle:
                self._cond.notify()

    def _install(self, got: Any, error: BaseException | None, left: int = 0) -> None:
        """(the loop's thread) Put the programs compiled after the load to use: the
        steps over fewer slots or positions, the larger cells (timed first, on rows
        dropped: nothing of the state changes; those timed while more programs were
        still compiling, timed again once the last are in), the sampling controls',
        the prefix cache's and speculation's programs; then price again."""
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
            cells = self._bound(got.cells)
            timed = self._time_cells(cells)
            if left:  # timed while the programs still to come compile on the same cores
                self._timed_busy.update((c.batch, c.length) for c in cells)
            elif self._timed_busy:  # (1.5-2x high then: timed again, on quiet cores)
                busy = [c for key, c in self._cells.items() if key in self._timed_busy]
                timed |= self._time_cells(busy)
                self._timed_busy.clear()
            self._cells.update({(c.batch, c.length): c for c in cells})
            self.prefill_batches = tuple(sorted({b for b, _ in self._cells}))
            for kind, n in got.sources.items():
                self.program_sources[kind] = self.program_sources.get(kind, 0) + n
            self._price_programs(self.costs | timed | got.step_costs, self._itl_bound_ms)
        self.deferred = left
        if not left:
            self.deferred_error = error
            self._programs.set()

    # ------------------------------------------------------------------ introspection

    def describe(self) -> dict:
        """The manifest, the compiled programs (compile time, XLA's memory analysis) and
        the cache's size."""
        n_dev = len(self.devices)
        run = lambda key: (  # noqa: E731
            {"run_ms": round(self.costs[key] * 1e3, 4)} if key in self.costs else {}
        )
        programs = [
            {"program": "step", "slots": rows * n_dev}
            | ({"compile_s": round(self.step_compile_s, 4)} if step is self._step else {})
            | run(f"step[{rows * n_dev}]")
            | {"memory": _memory(step)}
            for rows, step in sorted(self._steps.items(), reverse=True)
        ]
        programs += [
            {"program": "step", "slots": rows * n_dev, "length": window}
            | run(f"step[{rows * n_dev},{window}]")
            | {"memory": _memory(step)}
            for (rows, window), step in sorted(self._windows.items(), reverse=True)
        ]
        if self._full_step is not None:  # (while a busy slot has controls or logprobs)
            programs.append(
                {"program": "step", "slots": self.slots, "sampling_controls": True}
                | {"memory": _memory(self._full_step)}
            )
            programs += [  # (its two halves: the forward by cache window, and the pick)
                {"program": "forward", "slots": self.slots}
                | ({"length": window} if window else {})
                | run(f"forward[{window}]")
                | {"memory": _memory(forward)}
                for window, forward in sorted(self._full_step.forwards.items(), reverse=True)
            ]
        for name, cells in (("prefill_insert", self._cells), ("extend_insert", self._extends)):
            for (b, length), cell in sorted(cells.items()):
                program = {
                    "program": name,
                    "batch": b,
                    "length": length,
                    "compile_s": round(cell.compile_s, 4),
                } | (run(f"prefill[{b},{length}]") if name == "prefill_insert" else {})
                if isinstance(cell.compiled, SplitPrefill):  # (its rows beside the steps)
                    programs.append(program | {"memory": _memory(cell.compiled.insert)})
                    programs.append(
                        {"program": "prefill_rows", "batch": b, "length": length}
                        | {"memory": _memory(cell.compiled.rows)}
                    )
                else:
                    programs.append(program | {"memory": _memory(cell.compiled)})
        prefix = self.prefix
        if prefix is not None:
            cached = {
                "blocks": prefix.index.blocks,
                "block_tokens": prefix.index.block,
                "cached_blocks": len(prefix.index),
                "pool_bytes": self.pool_bytes,
                "copy_memory": _memory(prefix.load),
                "save_memory": _memory(prefix.save),
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


def _memory(compiled: Any) -> dict:
    """XLA's memory analysis of a compiled program (empty where the backend has none)."""
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
