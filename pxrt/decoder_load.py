"""Loading a decoder artifact, now ``pxrt.decoder.load`` (``load_decoder``) and
``pxrt.decoder.programs`` (``DecoderPrograms``): this module keeps the old import
path."""

from .decoder.load import PREFIX_BLOCK, check_memory, load_decoder
from .decoder.programs import DecoderPrograms

__all__ = ["PREFIX_BLOCK", "DecoderPrograms", "check_memory", "load_decoder"]
