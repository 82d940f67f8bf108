# Types of pxrt/_slots.pyx (the per-step routing of generation) as Python sees it;
# pxrt/_slots_py.py is its pure-Python twin with the same API.
from typing import Any

STOP: str
LENGTH: str
CANCELLED: str
ERROR: str

class Generation:
    tokens: list[int]
    max_tokens: int
    stop_ids: frozenset
    finish_reason: str | None
    slot: int
    dispatched: int
    woken: bool
    t_first: float
    t_last: float
    def __init__(self, max_tokens: int, stop_ids: frozenset) -> None: ...

class SlotTable:
    @property
    def slots(self) -> int: ...
    owners: list[Any]
    free: list[int]
    busy: int
    def __init__(self, slots: int) -> None: ...
    def assign(self, gen: Generation, slot: int = -1) -> int: ...
    def release(self, gen: Generation) -> None: ...
    def dispatch(self, steps: int = 1) -> list: ...
    def route(self, tokens: Any, owners: list, now: float, woken: list, finished: list) -> int: ...
    def first(self, tokens: Any, gens: list, now: float, woken: list, finished: list) -> int: ...
