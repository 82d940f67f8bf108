"""Text for log lines from names and paths that clients or directories choose."""

from __future__ import annotations

import logging
import re

log = logging.getLogger("pxrt")

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: object) -> str:
    """``text`` for one log line: control characters (newlines included) escaped, so a
    name or path from a client or a directory cannot forge another line."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


class Throttled:
    """A warning for events that may come thousands a second (refused connections,
    failed handshakes): the first one logged at once, then at most one line per
    ``interval_s``, each with the count since the last."""

    def __init__(self, message: str, interval_s: float = 10.0) -> None:
        # str.format'ted with what ``event`` is given, ``count`` and ``interval``
        self.message = message
        self.interval_s = interval_s
        self.count = 0  # since the last line
        self.total = 0
        self._next = 0.0  # when the next line may be written

    def event(self, now: float, *args: object) -> None:
        self.count += 1
        self.total += 1
        if now >= self._next:
            text = self.message.format(*args, count=self.count, interval=self.interval_s)
            log.warning("%s", printable(text))
            self.count = 0
            self._next = now + self.interval_s


class RefusalLog(Throttled):
    """Connections refused beyond a listener's cap (a client refused 1,000 times a second
    writes one line, not 1,000)."""

    def __init__(self, interval_s: float = 10.0, kind: str = "HTTP") -> None:
        message = "pxrt: refused {count} KIND connection(s) in the last {interval:.0f} s: "
        super().__init__(message.replace("KIND", kind) + "{0} open, the limit", interval_s)
        self.kind = kind

    def refused(self, now: float, open_now: int) -> None:
        self.event(now, open_now)


__all__ = ["RefusalLog", "Throttled", "printable"]
