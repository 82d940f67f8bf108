"""A request being generated, as its reader sees it: ``Generation`` (iterate it, sync or
async, or wait for its ``Completion``), and the errors a submit raises. Made by
``pxrt.decoder.engine.Decoder.submit``; the decoder's loop fills it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _ext
from ..finish import CANCELLED

_slots: Any = _ext.twin("pxrt._slots", "pxrt._slots_py")
if TYPE_CHECKING:  # both builds have the twin's API
    from .._slots_py import Generation as _GenerationBase
    from .engine import Decoder
else:
    _GenerationBase = _slots.Generation

log = logging.getLogger("pxrt")


class QueueFull(RuntimeError):
    """Too many prompts are waiting for a slot; try again after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DecoderClosed(RuntimeError):
    """The decoder was closed; its generations end with this error."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished generation: its tokens and why it ended (``"stop"``: a stop token,
    the last of ``tokens``; ``"length"``: ``max_tokens`` or the cache's end)."""

    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    ttft_s: float  # submit -> first token on the host
    total_s: float  # submit -> last token
    #: With ``logprobs``: per token, (its log-probability, the most likely tokens'
    #: (id, log-probability), most likely first); else None.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    #: With ``prompt_logprobs``: per prompt token the same (None for the first: nothing
    #: comes before it); else None.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None


class Generation(_GenerationBase):
    """A request being generated: iterate it (``for``/``async for``) for its tokens as
    they come, or wait for all of them (``result``, ``wait``); ``cancel`` frees its slot
    at the next step. Made by ``Decoder.submit``. One reader at a time (any thread, or
    one event loop)."""

    __slots__ = (
        "prompt",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "bucket",
        "keys",
        "start",
        "hit",
        "reserved",
        "use_prefix",
        "logprobs",
        "top_logprobs",
        "prompt_parts",
        "prompt_logprobs",
        "prompt_top",
        "controls",
        "lookup",
        "loop",
        "counted",
        "waiter",
        "event",
        "error",
        "t_submit",
        "t_admit",
        "level",
        "_decoder",
        "_read",
        "listener",
    )

    def __init__(
        self,
        decoder: Decoder,
        prompt: np.ndarray,
        limit: int,
        stops: frozenset,
        sampling: tuple[float, int, float, int],
        bucket: int,
        use_prefix: bool = True,
    ) -> None:
        super().__init__(limit, stops)
        self.prompt = prompt
        self.temperature, self.top_k, self.top_p, self.seed = sampling
        self.bucket = bucket  # the prefill length it runs at; 0: longer, chunked
        # The prefix cache: may it use it; its blocks' keys (computed when admitted);
        # prompt tokens in its slot's cache so far, and how many came from the cache;
        # the slot it fills chunk by chunk before it joins the steps (-1: none).
        self.use_prefix = use_prefix
        self.keys: list[bytes] | None = None
        self.start = 0
        self.hit = 0
        self.reserved = -1
        # With ``logprobs``: a scores row (``pxrt.sampling.scores``) per token, each
        # there before its token; how many alternatives to give; the sampling controls.
        self.logprobs: list | None = None
        self.top_logprobs = 0
        # With ``prompt_logprobs``: its chunks' scores (array, row, start, count) until
        # its first token is read, then a scores row per prompt token (None first).
        self.prompt_parts: list | None = None
        self.prompt_logprobs: list | None = None
        self.prompt_top = 0
        self.controls: Any = None
        self.lookup: Any = None  # (speculative decoding) its pxrt.decoder.speculative.PromptLookup
        # The event loop of its async reader (set by ``__anext__``): woken there too.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.counted = False  # its outcome is in the decoder's ``outcomes``
        self._decoder = weakref.ref(decoder)
        self._read = 0
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.listener: Any = None  # see ``listen``
        self.event = threading.Event()
        self.t_submit = time.perf_counter()
        self.t_admit = 0.0  # when its prompt's first prefill (or chunk) was dispatched
        self.level = 1  # its priority level (1 the highest; ``Decoder.set_priorities``)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def delivered(self) -> int:
        """Tokens its reader has taken (of ``tokens``)."""
        return self._read

    def cancel(self, reason: str = CANCELLED) -> None:
        """Stop generating (the slot is freed before the next step); no-op when done.
        ``reason`` is the finish reason it ends with (a front end that found a stop
        string ends it with ``"stop"``)."""
        decoder = self._decoder()
        if decoder is None:
            if self.finish_reason is None:
                self.finish_reason = reason
            return
        decoder._cancel(self, reason)

    # ------------------------------------------------------------------ sync

    def __iter__(self) -> Iterator[int]:
        while True:
            tokens = self.tokens
            while self._read < len(tokens):
                self._read += 1
                yield tokens[self._read - 1]
            if self.finish_reason is not None and self._read >= len(self.tokens):
                if self.error is not None:
                    raise self.error
                return
            self.event.wait()
            self.event.clear()

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the whole generation (sync); raises its error if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.finish_reason is None:
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not self.event.wait(left):
                raise TimeoutError(f"generation not finished after {timeout} s")
            self.event.clear()
        return self._completion()

    def _completion(self) -> Completion:
        if self.error is not None:
            raise self.error
        assert self.finish_reason is not None
        tokens = list(self.tokens)
        return Completion(
            tokens,
            self.finish_reason,
            len(self.prompt),
            max(self.t_first - self.t_submit, 0.0) if tokens else 0.0,
            max(self.t_last - self.t_submit, 0.0) if tokens else 0.0,
            None if self.logprobs is None else self.token_logprobs(0, len(tokens)),
            self.prompt_token_logprobs(),
        )

    def prompt_token_logprobs(self) -> list[tuple[float, list[tuple[int, float]]] | None] | None:
        """The prompt's tokens' log-probabilities (with ``prompt_logprobs``, once the
        first token is in; else None): per token, as ``token_logprobs`` gives them, None
        for the first."""
        from ..sampling import unpack

        if self.prompt_logprobs is None:
            return None
        top = self.prompt_top
        return [None if row is None else unpack(row, top) for row in self.prompt_logprobs]

    def token_logprobs(self, start: int, stop: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """Tokens ``start:stop``'s log-probabilities (with ``logprobs``): per token, its
        own and the ``top_logprobs`` most likely tokens' (id, log-probability)."""
        from ..sampling import unpack

        assert self.logprobs is not None, "this generation was not asked for logprobs"
        return [unpack(row, self.top_logprobs) for row in self.logprobs[start:stop]]

    # ------------------------------------------------------------------ async

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> int:
        if self.loop is None:  # before reading the tokens: see Decoder._wake
            self.loop = asyncio.get_running_loop()
        while True:
            if self._read < len(self.tokens):
                self._read += 1
                return self.tokens[self._read - 1]
            if self.finish_reason is not None:
                if self.error is not None:
                    raise self.error
                raise StopAsyncIteration
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            except asyncio.CancelledError:
                self.cancel()
                raise
            finally:
                self.waiter = None

    async def wait(self) -> Completion:
        """Wait for the whole generation (async)."""
        async for _ in self:
            pass
        return self._completion()

    # ------------------------------------------------------------------ callbacks

    def listen(self, callback: Any) -> None:
        """Instead of iterating: ``callback(self)`` is called on the running event loop
        after each step that gave it tokens and once it has ended (and soon after this
        call if either already happened); it reads them with ``take``. What a front end
        that writes each step's tokens from a callback uses: no task or future per
        token. Exceptions of the callback are logged."""
        self.listener = callback
        self.loop = asyncio.get_running_loop()  # (after the listener: see wake_async)
        if self._read < len(self.tokens) or self.finish_reason is not None:
            self.loop.call_soon(_listen_once, self)

    def take(self) -> list[int]:
        """The tokens not taken yet (by ``take`` or iteration), now taken."""
        tokens = self.tokens[self._read :]
        self._read += len(tokens)
        return tokens


def wake_async(gens: list) -> None:
    """On an event loop: resume the generations' readers (or call their listener)."""
    for gen in gens:
        gen.woken = False
        if gen.listener is not None:
            _listen_once(gen)
            continue
        waiter = gen.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _listen_once(gen: Generation) -> None:
    try:
        gen.listener(gen)
    except Exception:  # noqa: BLE001 - one reader's bug: the others are woken
        log.exception("pxrt: a generation's listener failed")
