"""How a generation ends: its ``finish_reason``. Plain strings in a module without jax,
so that front ends running without it (``pxrt serve --workers``) compare against the
same names the engine sets."""

from __future__ import annotations

STOP = "stop"  # a stop token (end of sequence included), or a front end's stop string
LENGTH = "length"  # max_tokens, or the cache is full
CANCELLED = "cancelled"  # cancelled by its caller (a client that hung up)
DEADLINE = "deadline"  # cancelled because its deadline passed (answered as a deadline error)
ERROR = "error"  # its step failed, or its decoder closed under it

__all__ = ["CANCELLED", "DEADLINE", "ERROR", "LENGTH", "STOP"]
