"""pxrt's serving layer: dynamic batching on asyncio/uvloop over pxrt models."""

from .errors import (
    DeadlineExceeded,
    ExecutionFailed,
    Overloaded,
    ServerClosed,
    ServingError,
    UnknownModel,
)
from .options import BatchingOptions, HttpLimits, OptionError
from .server import BlockingServer, Server, new_event_loop

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
    "UnknownModel",
    "new_event_loop",
]
