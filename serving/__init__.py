"""pxrt's serving layer: dynamic batching on asyncio/uvloop over pxrt models."""

from .errors import (
    DeadlineExceeded,
    ExecutionFailed,
    Overloaded,
    ServerClosed,
    ServingError,
    UnknownModel,
)
from .server import BlockingServer, Server, new_event_loop

__all__ = [
    "BlockingServer",
    "DeadlineExceeded",
    "ExecutionFailed",
    "Overloaded",
    "Server",
    "ServerClosed",
    "ServingError",
    "UnknownModel",
    "new_event_loop",
]
