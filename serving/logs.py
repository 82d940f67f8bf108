"""Text for log lines from names and paths that clients or directories choose."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: object) -> str:
    """``text`` for one log line: control characters (newlines included) escaped, so a
    name or path from a client or a directory cannot forge another line."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


__all__ = ["printable"]
