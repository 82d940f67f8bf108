"""Chooses the Cython modules (handlers, batch plans) or their pure-Python twins,
once per process.

``PXRT_NO_EXTENSIONS=1`` forces the pure-Python ones; a missing build falls back to
them with one warning.
"""

from __future__ import annotations

import collections.abc
import os
import warnings

if os.environ.get("PXRT_NO_EXTENSIONS", "") not in ("", "0"):
    from . import _batch_py as batch
    from . import _handlers_py as handlers

    EXTENSIONS = False
else:
    try:
        from pxrt import _batch as batch  # type: ignore[no-redef]
        from pxrt import _handlers as handlers  # type: ignore[no-redef]

        EXTENSIONS = True
    except ImportError as exc:
        warnings.warn(
            f"pxrt: the Cython extensions are not built ({exc}); using the "
            "pure-Python handlers, which are slower. Build them with "
            "`pip install -e .` (or `make`).",
            RuntimeWarning,
            stacklevel=2,
        )
        from . import _batch_py as batch
        from . import _handlers_py as handlers

        EXTENSIONS = False

# Requests with futures are awaitables that asyncio takes where it takes coroutines.
collections.abc.Coroutine.register(batch.Request)

Batch = batch.Batch
BatchQueue = batch.BatchQueue
Request = batch.Request
InputHandler = handlers.InputHandler
ResultHandler = handlers.ResultHandler


def twin(extension: str, pure: str):
    """The Cython module ``extension`` (a dotted name), or its pure-Python twin ``pure``
    with PXRT_NO_EXTENSIONS=1 or when the extensions are not built, as above."""
    import importlib

    if EXTENSIONS:
        try:
            return importlib.import_module(extension)
        except ImportError as exc:  # a build older than this module
            warnings.warn(
                f"pxrt: the Cython module {extension} is not built ({exc}); using its "
                "pure-Python twin. Rebuild with `pip install -e .` (or `make`).",
                RuntimeWarning,
                stacklevel=2,
            )
    return importlib.import_module(pure)


def using_extensions() -> bool:
    """True when the Cython handlers and keys are live, False for the pure-Python twins."""
    return EXTENSIONS
