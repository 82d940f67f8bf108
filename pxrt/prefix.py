"""The prefix cache's index, now ``pxrt.decoder.prefix``: this module keeps the old
import path."""

from .decoder.prefix import PrefixIndex

__all__ = ["PrefixIndex"]
