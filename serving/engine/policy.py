"""Which cell runs next, for a model with named dimensions: a pure function of what
waits, so it is tested directly (``tests/test_variable.py``).

A model with named dimensions has a lane per set of compiled lengths; each request waits
in the cheapest lane that holds it. ``choose_cell`` picks the lane whose batch goes
next, the shorter lanes whose requests ride along in it, and the most rows to take.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol

#: ``BatchQueue.lane_stats``: (rows, requests, sum of their waits in s, when the oldest
#: was queued) of what a batch taken from a lane now would hold.
LaneStats = tuple[int, int, float, float]


class Choice(NamedTuple):
    lane: int  # the lane whose batch goes
    fold: tuple[int, ...]  # the lanes whose requests ride along in it
    rows: int  # the most rows to take


def choose_cell(
    policy: str,
    stats: Sequence[LaneStats],
    caps: Sequence[int],
    exec_s: Callable[[int, int], float],
    fold_lanes: Sequence[Sequence[int]],
    full_only: bool,
    stale: Sequence[float] | None = None,
) -> Choice | None:
    """The batch to run next, or None (nothing waits; with ``full_only``, no lane fills
    a batch).

    Args:
      policy: ``"cost"`` or ``"oldest"``.
      stats: per lane, ``LaneStats`` of its first ``caps[lane]`` rows.
      caps: per lane, the most rows of its batch: the lane's cap (``"oldest"``) or the
        rows of its most efficient bucket within it (``"cost"``).
      exec_s: ``exec_s(lane, rows)``: the execution time measured at load of the bucket
        of ``lane`` that holds ``rows`` rows.
      fold_lanes: per lane, the shorter lanes whose requests may ride along in it (the
        nearest first).
      full_only: only a lane that fills its batch may go (a batch is in flight), or
        one whose oldest request was queued before ``stale[lane]`` (its wait bound
        passed: the batcher's is the lane's own batch time).

    ``"cost"``: each lane's batch is capped at its most efficient bucket (the least
    measured execution time per row; a bigger cell that costs more per row, as
    attention's does, is never filled for its own sake). Requests of a shorter lane ride
    along when that lowers the total wait: with ``T(lane, rows)`` the execution time
    measured at load, taking ``n_i`` requests of lane i into lane j's batch of ``n``
    costs every waiting request ``d = T(j, rows + r_i) - T(j, rows)`` more (0 while they
    fit the bucket's padding rows), and saves lane i's requests and everyone behind them
    the run of their own batch, ``T(i, r_i)``: they ride along when
    ``d * (n + n_i + m) < T(i, r_i) * (n_i + m)`` (``m``: requests waiting elsewhere).
    The lane of the oldest waiting request goes first.

    ``"oldest"``: the lane of the oldest waiting request, alone, up to its cap.
    """

    def waits(k: int, rows: int) -> bool:  # (busy, and lane k neither full nor stale)
        return full_only and rows < caps[k] and (stale is None or stats[k][3] >= stale[k])

    if policy == "oldest":
        k = min(range(len(stats)), key=lambda k: stats[k][3])
        if not stats[k][0] or waits(k, stats[k][0]):
            return None
        return Choice(k, (), caps[k])
    waiting = sum(st[1] for st in stats)
    best = None
    best_oldest = math.inf
    for j, (rows, requests, _, oldest) in enumerate(stats):
        if not rows:
            continue
        n: float = requests  # grows by fractions of folded lanes' requests
        t = exec_s(j, rows)
        fold = []
        for i in fold_lanes[j]:
            r_i, n_i, _, _ = stats[i]
            room = caps[j] - rows
            if room <= 0:
                break
            if not r_i:
                continue
            take = min(r_i, room)
            share = n_i * take / r_i
            t_new = exec_s(j, rows + take)
            others = waiting - n - share
            if (t_new - t) * (n + share + others) < exec_s(i, take) * (share + others):
                fold.append(i)
                rows += take
                n += share
                t = t_new
        if waits(j, rows):
            continue
        if oldest < best_oldest:  # the lane of the oldest request goes
            best, best_oldest = Choice(j, tuple(fold), caps[j]), oldest
    return best


class _Bucket(Protocol):
    @property
    def size(self) -> int: ...

    @property
    def exec_s(self) -> float: ...


#: Host work of one batch that its measured execution time leaves out: the hand-offs to
#: a pipeline worker and back to the loop, and answering its requests. About this on a
#: CPU core; it tips near-ties towards the bigger bucket (see ``efficient_cap``).
BATCH_HOST_S = 100e-6


def efficient_cap(buckets: Iterable[_Bucket], cap: int, fallback: int) -> int:
    """The rows of a lane's most efficient bucket (the least time per row, the bigger
    on a tie) of at most ``cap`` rows: the cost policy's batches in that lane go no
    bigger. ``fallback`` when none is that small (the bucket a cap runs in).

    A batch's time is its measured execution time plus ``BATCH_HOST_S``, so that two
    buckets close per row are not ranked by timing noise alone: the demo encoder's 8-
    and 32-row cells at 32 tokens run about 45 and 37 us a row on 4 virtual CPU
    devices, and with the cap at 8 instead of 32, 64 callers got 17k instead of 30k
    requests a second (alternated in one run)."""
    fits = [b for b in buckets if b.size <= cap]
    if not fits:
        return fallback
    return min(fits, key=lambda b: ((b.exec_s + BATCH_HOST_S) / b.size, -b.size)).size


__all__ = ["BATCH_HOST_S", "Choice", "LaneStats", "choose_cell", "efficient_cap"]
