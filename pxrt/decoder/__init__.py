"""The generation engine: a decoder artifact exported, loaded and served.

- ``export``: ``export_decoder`` and the decoder artifact (``read``, ``DecoderArtifact``);
- ``programs``, ``load``: the programs built around the artifact's, compiled, warmed up
  and measured (``load_decoder``);
- ``engine``: ``Decoder``, the façade over the parts below, its public API;
- ``scheduler``: admission and its prices, the waiting queue and priorities, the choice
  of step (pure host code); ``placement``: a prefill beside the steps or between two, by
  the tokens/s each made; ``speculative``: prompt lookup and whether it pays;
  ``runner``: the programs and the device state (dispatch and read); ``loop``: the
  loop's thread, its turn, waking readers and failing them;
- ``request``: ``Generation``, the request handle; ``prefix``: the prefix cache's index;
  ``params``: ``SamplingParams``, a request's parameters, and their checks.

The artifact's names (``pxrt.decoder.export``) are re-exported here on first use
(PEP 562), so that ``from pxrt.decoder import LENGTH_DIM`` and ``pxrt.decoder.read``
work as when this was one module, while importing ``pxrt.decoder.request`` or
``pxrt.decoder.params`` (a front-end worker) does not import jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .export import (
        CHUNK_DIM,
        DECODE_FILE,
        EXTEND_FILE,
        KIND,
        LENGTH_DIM,
        PREFILL_FILE,
        SIGNATURE_KEYS,
        TOKEN_DTYPE,
        DecoderArtifact,
        cache_entries,
        check_decoder_manifest,
        export_decoder,
        extend_file,
        is_spec,
        prefill_file,
        program_names,
        read,
        sizes,
    )

#: ``pxrt.decoder.export``'s names, imported on first use.
__all__ = [
    "CHUNK_DIM",
    "DECODE_FILE",
    "EXTEND_FILE",
    "KIND",
    "LENGTH_DIM",
    "PREFILL_FILE",
    "SIGNATURE_KEYS",
    "TOKEN_DTYPE",
    "DecoderArtifact",
    "cache_entries",
    "check_decoder_manifest",
    "export_decoder",
    "extend_file",
    "is_spec",
    "prefill_file",
    "program_names",
    "read",
    "sizes",
]
_EXPORT = frozenset(__all__)


def __getattr__(name: str) -> Any:
    if name not in _EXPORT:
        raise AttributeError(f"module 'pxrt.decoder' has no attribute {name!r}")
    value = getattr(importlib.import_module(".export", __name__), name)
    globals()[name] = value
    return value
