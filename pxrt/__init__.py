"""pxrt: an embedded runtime for serving precompiled JAX/XLA programs.

Export once (``pxrt.export``), load with every batch bucket compiled ahead of time on a
device mesh (``pxrt.load``), then run requests (``Model.run`` / ``Model.run_batch``);
nothing compiles on the request path. Decoders (``pxrt.export_decoder``) load as a
``Decoder`` that generates with continuous batching (``Decoder.generate``). Importing
pxrt changes nothing in jax's config, and imports jax only when something that needs it
is first used (``pxrt serve``'s front-end workers never do).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._ext import using_extensions

if TYPE_CHECKING:
    from .artifact import Artifact, ArtifactError, TensorSpec, export
    from .artifact import read as read_artifact
    from .compiling import example_inputs
    from .decoder.engine import Decoder
    from .decoder.export import export_decoder
    from .decoder.grammar import StructuredOutput
    from .decoder.params import SamplingParams
    from .decoder.request import Completion, Generation
    from .executable import Model
    from .loader import load
    from .multihost import Distributed
    from .recipes import per_slot

__version__ = "0.1.0"

# name -> (module, attribute): imported on first use (PEP 562).
_LAZY = {
    "Artifact": (".artifact", "Artifact"),
    "ArtifactError": (".artifact", "ArtifactError"),
    "TensorSpec": (".artifact", "TensorSpec"),
    "export": (".artifact", "export"),
    "read_artifact": (".artifact", "read"),
    "Model": (".executable", "Model"),
    "example_inputs": (".compiling", "example_inputs"),
    "load": (".loader", "load"),
    "export_decoder": (".decoder.export", "export_decoder"),
    "Decoder": (".decoder.engine", "Decoder"),
    "Generation": (".decoder.request", "Generation"),
    "Completion": (".decoder.request", "Completion"),
    "SamplingParams": (".decoder.params", "SamplingParams"),
    "StructuredOutput": (".decoder.grammar", "StructuredOutput"),
    "Distributed": (".multihost", "Distributed"),
    "per_slot": (".recipes", "per_slot"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pxrt' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module, __name__), attribute)
    globals()[name] = value
    return value


def compile_count() -> int:
    """XLA backend compiles in this process since pxrt first loaded a model."""
    from ._xla import compile_counter

    return compile_counter.total


__all__ = [
    "Artifact",
    "ArtifactError",
    "Completion",
    "Decoder",
    "Distributed",
    "Generation",
    "Model",
    "SamplingParams",
    "StructuredOutput",
    "TensorSpec",
    "compile_count",
    "example_inputs",
    "export",
    "export_decoder",
    "load",
    "per_slot",
    "read_artifact",
    "using_extensions",
]
