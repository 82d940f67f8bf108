"""The data plane, declared: what every transport and the request core call of what
serves the models.

Two things satisfy ``Backend``: ``serving.Server`` in process, and
``serving.workers.remote.RemoteServer``, a ``pxrt serve --workers`` worker's view of the device
process (its models and decoders as the device process described them; requests cross
by shared memory). Every transport is typed against ``Backend`` (HTTP's native and ASGI
paths, gRPC's native server, the workers' link, the request core), so mypy checks the
worker topology as it checks one process. The control plane (options, statistics,
metrics, the repository: what workers forward to the device process) stays on
``Server``. vLLM's ``EngineClient`` (``vllm/engine/protocol.py``) is the pattern.

Nothing here runs: the module only names the seam.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sized
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pxrt.decoder.params import SamplingParams

    from ..options import GenerationLimits
    from ..tracing import Trace, Tracing
    from .shm import SharedMemory


class TensorInfo(Protocol):
    """An input or output as a transport needs it: its dtype and per-example shape
    (named dimensions as their names)."""

    @property
    def dtype(self) -> Any: ...

    @property
    def shape(self) -> tuple: ...


class ServedModel(Protocol):
    """A version of a model served: ``pxrt.Model`` or a worker's ``RemoteModel``."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def inputs(self) -> Mapping[str, Any]: ...

    @property
    def outputs(self) -> Mapping[str, Any]: ...

    @property
    def buckets(self) -> tuple[int, ...]: ...

    @property
    def dim_buckets(self) -> Mapping[str, tuple[int, ...]]: ...


class ServedDecoder(Protocol):
    """A decoder served: what the front ends need to tokenize prompts, render chats and
    detokenize tokens (``pxrt.Decoder`` or a worker's ``RemoteDecoder``)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def tokenizer(self) -> Any:
        """``pxrt.tokenizer.Tokenizer``, or None: token ids in and out."""
        ...

    @property
    def chat_template(self) -> str | None: ...


class TokenStream(Protocol):
    """One generation as the front ends read it (``pxrt.Generation`` or a worker's
    ``RemoteGeneration``): ``async for`` its tokens, or ``listen`` and ``take``;
    ``cancel``; then ``finish_reason`` and ``error``; with ``logprobs``, each token's
    ``token_logprobs`` (there before the token is)."""

    @property
    def prompt(self) -> Sized: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def error(self) -> BaseException | None: ...

    @property
    def delivered(self) -> int:
        """Tokens its reader has taken."""
        ...

    def cancel(self, reason: str = ...) -> None: ...

    def listen(self, callback: Callable[[Any], None]) -> None: ...

    def take(self) -> list[int]: ...

    def token_logprobs(self, start: int, stop: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """Tokens ``start:stop``'s log-probabilities (a generation asked for them):
        each token's and its alternatives' (id, log-probability)."""
        ...

    def prompt_token_logprobs(self) -> list[tuple[float, list[tuple[int, float]]] | None] | None:
        """The prompt's tokens' (with ``prompt_logprobs``, from its first token on):
        as ``token_logprobs``, None for the first prompt token."""
        ...

    def __aiter__(self) -> AsyncIterator[int]: ...


class Backend(Protocol):
    """What serves the models, as the transports and the request core see it."""

    generation_limits: GenerationLimits
    #: Which requests are traced (``serving.tracing.Tracing``), or None: none.
    tracing: Tracing | None
    #: The system shared memory regions requests may name (``serving.kserve.shm``).
    shared_memory: SharedMemory

    # readiness
    def not_serving(self) -> str | None:
        """Why inference is refused now (loading, draining, a broken group), or None."""
        ...

    @property
    def draining(self) -> bool: ...

    async def wait_draining(self) -> None: ...

    # models
    @property
    def models(self) -> Mapping[str, ServedModel]: ...

    def model(self, name: str, version: str | None = None) -> ServedModel: ...

    def versions(self, name: str) -> list[str]: ...

    def submit(
        self,
        name: str,
        request: Mapping[str, Any],
        *,
        timeout_s: float | None = None,
        version: str | None = None,
        priority: int = 0,
        trace: Trace | None = None,
    ) -> asyncio.Future: ...

    def count(self, name: str, version: str, outcome: str) -> None:
        """A request answered before it reached the queue (``invalid``, ``failed``)."""
        ...

    # decoders
    def is_decoder(self, name: str) -> bool: ...

    @property
    def decoders(self) -> Mapping[str, ServedDecoder]: ...

    def decoder(self, name: str) -> ServedDecoder: ...

    async def open_generation(
        self, name: str, prompt: list[int], params: SamplingParams | None = None, **options: Any
    ) -> TokenStream:
        """Start a generation once it is accepted (its refusal raised here)."""
        ...


__all__ = ["Backend", "ServedDecoder", "ServedModel", "TensorInfo", "TokenStream"]
