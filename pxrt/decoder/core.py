"""What the parts of a ``Decoder`` share, for the type checker only.

``pxrt.decoder.engine.Decoder`` is one object made of four parts, each a mixin in its
own module: ``Scheduler`` (admission, prices, priorities, the steps' size: no jax),
``Speculation`` (prompt lookup: no jax), ``Runner`` (the programs and the device
state: dispatch and read) and ``Loop`` (the thread and its turn). They share the
decoder's attributes (set by ``Decoder.__init__``) and call each other's methods; each
part derives from ``Core`` while type checking (from ``object`` at run time), so that
mypy knows both. Nothing here runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import collections
    import threading

    import numpy as np

    from .export import DecoderArtifact
    from .placement import Placement
    from .prefix import PrefixPool
    from .request import Generation
    from .runner import PrefillCell


class Core(Protocol):
    # The artifact and the sizes (``Decoder._wire_artifact``, ``_wire_sizes``).
    artifact: DecoderArtifact
    name: str
    devices: list
    vocab: int
    slots: int
    max_length: int
    prefill_lengths: tuple[int, ...]
    prefill_batches: tuple[int, ...]
    chunk_lengths: tuple[int, ...]
    chunk_batches: tuple[int, ...]
    chunk_tokens: int
    priority_levels: int
    default_priority_level: int
    priority_wait_s: float
    # The programs and the state (``_wire_programs``, ``_wire_windows``).
    _params: Any
    _state: Any
    _make_state: Any
    _cells: dict[tuple[int, int], PrefillCell]
    _extends: dict[tuple[int, int], PrefillCell]
    _rows_per_device: int
    _steps: dict[int, Any]
    _order: dict[int, list[int]]
    _windows: dict[tuple[int, int], Any]
    step_slots: tuple[int, ...]
    step_lengths: tuple[int, ...]
    _move: Any
    _control: Any
    _full_step: Any
    _special: bool
    _forwarded: Any
    _verify: Any
    speculative_tokens: int
    _spec: dict[str, float]
    prefix: PrefixPool | None
    # The length tiers (``_wire_tiers``): each slot's cache length, and the slots the
    # turn's admission chose.
    tiers: tuple[tuple[int, int], ...]
    _slot_length: tuple[int, ...]
    _chosen: dict[Generation, int]
    _need_counts: list[collections.Counter]
    # A change of layout into tiers (``pxrt.decoder.relayout``).
    auto_tiers: bool
    relayout_status: str
    relayout_wait_s: float
    relayout_scale: float
    _tiered: tuple | None
    deferred: int
    program_sources: dict[str, int]
    step_compile_s: float
    _itl_bound_ms: float | None
    # The queue, the slots and the loop's thread (``_wire_queue``).
    _chunking: collections.deque[Generation]
    _table: Any  # a SlotTable (pxrt._slots, or its twin pxrt._slots_py)
    _waiting: collections.deque[Generation]
    _cancels: list[Generation]
    _pending: collections.deque[tuple]
    _cond: threading.Condition
    _thread: threading.Thread | None
    _closed: bool
    _idle: bool
    _arrivals: list[tuple[Any, BaseException | None, int]]
    multi_step: int
    # Prefill beside the steps (``pxrt.decoder.overlap``).
    overlap_prefill: bool
    _placement: Placement | None
    _prefilling: list[Any]
    _prefilled: list[Any]
    _in_prefill: set[Generation]
    # Counters, timings, the multi-host group (``_wire_counters``).
    counters: dict[str, float]
    outcomes: dict[str, int]
    _timings: dict[str, list[float]]
    _last_step: float
    group: Any
    _gather: Any
    # The scheduler's prices (``Scheduler._price_programs``).
    costs: dict[str, float]
    _priced: int
    _prefill_cost: dict[tuple[int, int], float]
    _step_cost: dict[int, float]
    _step_prices: dict[tuple[int, int], float]
    _forward_prices: dict[int, float]
    _launch_s: float
    itl_bound_s: float

    # What one part calls on another.

    def _admit(self) -> list[tuple[list, int, int, int]]: ...

    def _unreserve(self, gen: Generation) -> None: ...

    def _sample_needs(self) -> None: ...

    def suggested_length_tiers(self, quantile: float = 0.99, whole: bool = False) -> str | None: ...

    def _maybe_auto(self) -> None: ...

    def _try_relayout(self) -> None: ...

    def _start(self) -> None: ...

    def wait_programs(self, timeout: float | None = None) -> bool: ...

    def _wire_programs(
        self, params_dev: Any, state: Any, step: Any, make_state: Any, cells: list,
        parts: dict[int, Any] | None, move: Any, control: Any, full_step: Any,
    ) -> None: ...  # fmt: skip

    def _wire_windows(self, windows: Any, extends: Any) -> None: ...

    def _wire_tiers(self, tiers: Any) -> None: ...

    def _tier_slot(self, gen: Any, chosen: Any) -> int: ...

    def _price_programs(self, costs: Any, itl_bound_ms: float | None) -> None: ...

    def _window(self) -> int: ...

    def _block_size(self, rows: int, window: int) -> int: ...

    def _fewest_rows(self, need: int) -> int: ...
    def _cheapest_step(self, rows: int) -> tuple[int, int]: ...

    def _drafts(self) -> np.ndarray | None: ...

    def _route_verified(
        self, tokens: np.ndarray, accepted: np.ndarray, owners: list, now: float,
        woken: list, finished: list,
    ) -> int: ...  # fmt: skip

    def _write_controls(self, gen: Generation, slot: int) -> None: ...

    def _save_prefixes(self, done: list[tuple[Generation, int]]) -> None: ...
    def _save_columns(self, rows: list[tuple[int, Generation]], ints: np.ndarray) -> None: ...
    def _bound(self, cells: list[PrefillCell]) -> list[PrefillCell]: ...

    @staticmethod
    def _scores(gens: list, scores: Any) -> Any: ...

    def _finish_with(self, gens: list, error: BaseException) -> None: ...

    def _prefill_beside(self, unit: Any) -> None: ...

    def _insert(self, unit: Any) -> None: ...

    def _insertable(self, units: list[Any]) -> list[Any]: ...

    def _stop_prefiller(self) -> None: ...

    def _load_prefixes(self, loads: list[tuple[int, list[int]]]) -> None: ...

    def _prefill(self, batch: list, length: int, size: int = 0, beside: int = 0) -> None: ...

    def _extend(self, budget: int) -> int: ...

    def _dispatch_step(self) -> None: ...

    def _dispatch_verify(self, drafts: np.ndarray) -> None: ...

    def _constrained(self) -> list[tuple[Any, int]]: ...

    def _peek_grammars(self, entry: tuple) -> None: ...

    def _dispatch_split(self) -> None: ...

    def _launch(self, index: int, program: Any, *args: Any) -> tuple[Any, Any]: ...

    def _read(self, entry: tuple) -> None: ...

    def _wake(self, gens: list) -> None: ...

    def _finished(self, gens: list) -> None: ...

    def _fail(self, error: BaseException) -> None: ...

    def _install(self, got: Any, error: BaseException | None, left: int = 0) -> None: ...
