"""pxrt: an embedded runtime for serving precompiled JAX/XLA programs.

Export once (``pxrt.export``), load with every batch bucket compiled ahead of time on a
device mesh (``pxrt.load``), then run requests (``Model.run`` / ``Model.run_batch``);
nothing compiles on the request path. Importing pxrt changes nothing in jax's config.
"""

from ._ext import using_extensions
from .artifact import Artifact, ArtifactError, TensorSpec, export
from .artifact import read as read_artifact
from .executable import Model, example_inputs, load

__version__ = "0.1.0"


def compile_count() -> int:
    """XLA backend compiles in this process since pxrt first loaded a model."""
    from ._xla import compile_counter

    return compile_counter.total


__all__ = [
    "Artifact",
    "ArtifactError",
    "Model",
    "TensorSpec",
    "compile_count",
    "example_inputs",
    "export",
    "load",
    "read_artifact",
    "using_extensions",
]
