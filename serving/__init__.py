"""pxrt's serving layer: dynamic batching on asyncio/uvloop over pxrt models.

The server (``Server``, ``BlockingServer``) is imported on first use (PEP 562): the
front-end modules import without jax, as ``pxrt serve``'s workers run them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    DeadlineExceeded,
    ExecutionFailed,
    Overloaded,
    ServerClosed,
    ServingError,
    UnknownModel,
)
from .options import BatchingOptions, HttpLimits, OptionError
from .tracing import Tracing

if TYPE_CHECKING:
    from .engine.server import BlockingServer, Server, new_event_loop

_LAZY = {"BlockingServer", "Server", "new_event_loop"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(".engine.server", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "BatchingOptions",
    "BlockingServer",
    "DeadlineExceeded",
    "ExecutionFailed",
    "HttpLimits",
    "OptionError",
    "Overloaded",
    "Server",
    "ServerClosed",
    "ServingError",
    "Tracing",
    "UnknownModel",
    "new_event_loop",
]
