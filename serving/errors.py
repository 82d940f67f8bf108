"""Errors a caller of the serving layer can get back, besides a request's own
TypeError/ValueError from validation."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine.repository import Repository


class ServingError(Exception):
    """Base of the serving layer's errors."""


class Overloaded(ServingError):
    """The model's queue is full; try again after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # pickled whole (Ray hands errors between processes)
        return type(self), (str(self), self.retry_after_s)


class DeadlineExceeded(ServingError, TimeoutError):
    """The request's deadline passed while it was queued; it was never executed."""


class ExecutionFailed(ServingError, RuntimeError):
    """The batch this request ran in failed; the message names the model and bucket."""


class ServerClosed(ServingError):
    """The server is closing or closed and accepts no new requests."""


class UnknownModel(ServingError, KeyError):
    """No model of that name is being served."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RepositoryError(ValueError):
    """A request the model repository cannot carry out (an unknown model, the wrong
    mode)."""


class NoRepository(RepositoryError):
    """A repository request to a server that has no repository."""

    def __init__(self) -> None:
        super().__init__("no model repository: start pxrt serve with --model-repository DIR")


def require(repository: Repository | None) -> Repository:
    """``repository``, or ``NoRepository`` when there is none (front ends' check)."""
    if repository is None:
        raise NoRepository()
    return repository


def no_model(name: str, served: list[str] | tuple[str, ...] | object) -> UnknownModel:
    """The error for a model ``name`` not among ``served`` (names)."""
    names = ", ".join(served) or "none"  # type: ignore[arg-type]
    return UnknownModel(f"no model named {name!r}; serving: {names}")


def no_version(name: str, version: str, versions: list[str]) -> UnknownModel:
    """The error for a ``version`` of ``name`` not among ``versions`` (oldest first)."""
    return UnknownModel(
        f"model {name!r} has no version {version!r}; serving versions {', '.join(versions)}"
    )
