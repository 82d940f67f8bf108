"""HTTP: the ASGI app (``app``: ``create_app``, the app to mount), the native path from
the parser (``native``), the connection guard (``limits``).

``create_app`` and ``KServeApp`` are imported on first use (PEP 562), so that importing
the package does not import Starlette."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import KServeApp, create_app

_LAZY = {"KServeApp", "create_app"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'serving.http' has no attribute {name!r}")
    value = getattr(importlib.import_module(".app", __name__), name)
    globals()[name] = value
    return value


__all__ = ["KServeApp", "create_app"]
