"""The request handle, now ``pxrt.decoder.request``: this module keeps the old import
path."""

from .decoder.request import Completion, DecoderClosed, Generation, QueueFull, wake_async

__all__ = ["Completion", "DecoderClosed", "Generation", "QueueFull", "wake_async"]
