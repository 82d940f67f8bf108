"""The pure-Python twin of ``serving.kserve._shmguard``, with its API: Python cannot
catch a fault (its signal handlers run between bytecodes, and the faulting access would
run again first), so nothing is protected (``PROTECTS`` is False) and ``shm`` reads and
writes a region through its segment's descriptor instead (a copy per read: slower, as
the other twins are, and as safe)."""

from __future__ import annotations

from typing import Any

PROTECTS = False
SLOTS = 0


def protect(mapping: Any) -> int:
    return -1


def release(slot: int) -> None:
    return None


def broken(slot: int) -> bool:
    return False


def faults() -> int:
    return 0
