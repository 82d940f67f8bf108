"""The generation engine, now the package ``pxrt.decoder`` (``Decoder`` in
``pxrt.decoder.engine``, with its scheduler, runner and loop beside it): this module
keeps the old import path."""

from .decoder.engine import Decoder
from .decoder.loop import TIMINGS
from .decoder.params import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams, int_in, number_in
from .decoder.prefix import PrefixPool
from .decoder.request import Completion, DecoderClosed, Generation, QueueFull
from .decoder.runner import Controls, PrefillCell
from .decoder.speculative import PromptLookup
from .sampling import sample

__all__ = [
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "TIMINGS",
    "Completion",
    "Controls",
    "Decoder",
    "DecoderClosed",
    "Generation",
    "PrefillCell",
    "PrefixPool",
    "PromptLookup",
    "QueueFull",
    "SamplingParams",
    "int_in",
    "number_in",
    "sample",
]
