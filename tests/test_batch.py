"""Batch plans (``BatchQueue``): the Cython module against its pure-Python twin, driven by
the same random sequences of operations, and the invariants both must keep."""

from __future__ import annotations

import concurrent.futures
import math
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pxrt import _batch_py, _handlers_py

# How batches split over the devices, and the Cython modules end to end: `make test`
# also runs this module on one device with the pure-Python twins (PXRT_NO_EXTENSIONS=1).
pytestmark = [pytest.mark.devices, pytest.mark.twins]


try:
    from pxrt import _batch as _batch_c
    from pxrt import _handlers as _handlers_c
except ImportError:  # pragma: no cover - only when the extension is not built
    _batch_c = _handlers_c = None

needs_ext = pytest.mark.skipif(_batch_c is None, reason="Cython extensions not built")
IMPLS = [
    pytest.param((_batch_py, _handlers_py), id="py"),
    pytest.param((_batch_c, _handlers_c), id="cython", marks=needs_ext),
]


class Policy:
    """Records what the queue tells the serving side; its errors say which request."""

    def __init__(self):
        self.kicks = 0
        self.sweeps: list[float] = []

    def kick(self):
        self.kicks += 1

    def arm_sweep(self, deadline):
        self.sweeps.append(deadline)

    def expired_error(self, r):
        return TimeoutError(f"expired {r.rows}")

    def refused_error(self, rows):
        return OverflowError(f"refused {rows}") if rows < 100 else ValueError("too large")

    def closed_error(self):
        return RuntimeError("closed")


def outputs_for(batch):
    """What the engine would hand back: per piece, its rows' values (row r of request k
    has value 1000 * k + r) as a read-only array."""
    out = []
    for arrays, start, count in zip(batch.pieces, batch.starts, batch.counts):
        arr = arrays[0][start : start + count].copy()
        arr.flags.writeable = False
        out.append({"y": arr})
    return out


def request(k, rows):
    return (np.arange(rows, dtype=np.int64) + 1000 * k,)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(1, 9), st.booleans()),
        st.tuples(st.just("take"), st.integers(1, 12), st.floats(0, 2)),
        st.tuples(st.just("deliver")),
        st.tuples(st.just("fail")),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("give_up"), st.integers(0, 50)),
        st.tuples(st.just("sweep"), st.floats(0, 2)),
    ),
    max_size=60,
)


def play(batch_mod, script, max_queued_rows):
    """Run ``script`` on one implementation; returns everything observable."""
    queue = batch_mod.BatchQueue(max_queued_rows, None, Policy(), None)
    requests, taken, log = [], [], []
    for op in script:
        if op[0] == "push":
            _, rows, with_deadline = op
            k = len(requests)
            fut = concurrent.futures.Future()
            deadline = 1.0 if with_deadline else math.inf
            r = queue.push(request(k, rows), rows, fut, deadline)
            requests.append((r, fut))
            log.append(("push", r is not None))
        elif op[0] == "take":
            batch = queue.take(op[1], op[2])
            if batch is not None:
                taken.append(batch)
                log.append(
                    (
                        "take",
                        batch.rows,
                        list(batch.starts),
                        list(batch.counts),
                        list(batch.offsets),
                        [int(p[0][0]) // 1000 for p in batch.pieces],
                    )
                )
            else:
                log.append(("take", None))
        elif op[0] in ("deliver", "fail") and taken:
            batch = taken.pop(0)
            if op[0] == "deliver":
                batch.outputs = outputs_for(batch)
                log.append(("deliver", queue.deliver(batch, False)))
            else:
                log.append(("fail", queue.fail(batch, KeyError("batch failed"))))
        elif op[0] == "cancel" and requests:
            r, _ = requests[op[1] % len(requests)]
            log.append(("cancel", r is not None and queue.cancel(r)))
        elif op[0] == "give_up" and requests:
            _, fut = requests[op[1] % len(requests)]
            log.append(("give_up", fut.cancel()))
        elif op[0] == "sweep":
            log.append(("sweep", queue.sweep(op[1])))
        log.append(("rows", queue.queued_rows, len(queue)))
    answers = []
    for r, fut in requests:
        if r is None:
            answers.append("refused")
        elif fut.cancelled():
            answers.append("cancelled")
        elif fut.done() and fut.exception() is not None:
            answers.append(repr(fut.exception()))
        elif fut.done():
            answers.append(fut.result()["y"].tolist())
        else:
            answers.append("pending")
    counts = (queue.expired, queue.cancelled, queue.invalid, queue.rejected)
    return log, answers, counts, queue.drain_waits(), queue.drain_latencies()


@needs_ext
@settings(max_examples=200, deadline=None)
@given(script=ops, max_queued_rows=st.sampled_from([0, 5, 20]))
def test_both_implementations_behave_the_same(script, max_queued_rows):
    py = play(_batch_py, script, max_queued_rows)
    c = play(_batch_c, script, max_queued_rows)
    assert py[:3] == c[:3]
    assert len(py[3]) == len(c[3]) and len(py[4]) == len(c[4])


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=100, deadline=None)
@given(script=ops, max_queued_rows=st.sampled_from([0, 5, 20]))
def test_every_answer_is_whole_and_given_once(impl, script, max_queued_rows):
    batch_mod, _ = impl
    log, answers, _, _, _ = play(batch_mod, script, max_queued_rows)
    for k, answer in enumerate(answers):
        if isinstance(answer, list):  # a request's rows, in order, joined from its pieces
            assert answer == list(range(1000 * k, 1000 * k + len(answer)))
    # Rows waiting never go negative, and an empty queue has none.
    for entry in log:
        if entry[0] == "rows":
            assert entry[1] >= 0 and (entry[2] or entry[1] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_split_request_is_joined_in_row_order_read_only(impl):
    batch_mod, _ = impl
    queue = batch_mod.BatchQueue()
    fut = concurrent.futures.Future()
    queue.push(request(3, 10), 10, fut)
    batches = []
    while (b := queue.take(4, 0.0)) is not None:
        batches.append(b)
    assert [b.counts for b in batches] == [[4], [4], [2]]
    for b in reversed(batches):  # pieces may come back in any order
        b.outputs = outputs_for(b)
        queue.deliver(b)
    y = fut.result()["y"]
    assert y.tolist() == list(range(3000, 3010)) and not y.flags.writeable


@pytest.mark.parametrize("impl", IMPLS)
def test_deadline_passing_in_the_queue_answers_without_running(impl):
    batch_mod, _ = impl
    policy = Policy()
    queue = batch_mod.BatchQueue(0, None, policy, None)
    late, soon = concurrent.futures.Future(), concurrent.futures.Future()
    queue.push(request(0, 2), 2, late, 5.0)
    queue.push(request(1, 1), 1, soon, 1.0)
    assert queue.earliest_deadline == 1.0
    assert queue.sweep(2.0) == 5.0
    assert isinstance(soon.exception(), TimeoutError) and queue.expired == 1
    batch = queue.take(10, 2.0)
    assert batch.rows == 2 and queue.queued_rows == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_requests_given_up_never_hold_room(impl):
    batch_mod, _ = impl
    queue = batch_mod.BatchQueue(4, None, Policy(), None)
    futures = [concurrent.futures.Future() for _ in range(4)]
    for k, fut in enumerate(futures):
        assert queue.push(request(k, 1), 1, fut) is not None
    assert queue.push(request(9, 1), 1, concurrent.futures.Future()) is None  # full
    assert queue.refused_rows == 1
    futures[1].cancel()  # a caller gives up: the next push finds room
    assert queue.push(request(9, 1), 1, concurrent.futures.Future()) is not None
    assert queue.cancelled == 1 and queue.queued_rows == 4


@pytest.mark.parametrize("impl", IMPLS)
def test_submit_admits_counts_and_kicks(impl):
    batch_mod, handlers = impl
    handler = handlers.InputHandler("m", ["x"], [np.float32], [(2,)])
    policy = Policy()
    queue = batch_mod.BatchQueue(8, handler, policy, concurrent.futures.Future)
    queue.default_timeout = 10.0
    x = np.zeros((3, 2), np.float32)
    r = queue.submit({"x": x})
    assert r.rows == 3 and r.deadline - r.t_enqueue == pytest.approx(10.0)
    assert policy.kicks == 1 and policy.sweeps == [r.deadline]
    queue.submit({"x": x}, 20.0)  # no kick until the policy re-arms; later deadline
    assert policy.kicks == 1 and len(policy.sweeps) == 1
    queue.kick_rows = 7
    queue.submit({"x": x[:1]})
    assert policy.kicks == 2  # 7 rows wait
    with pytest.raises(TypeError, match="float32"):
        queue.submit({"x": x.astype(np.float64)})
    with pytest.raises(OverflowError, match="refused 3"):
        queue.submit({"x": x})
    big = np.zeros((100, 2), np.float32)
    with pytest.raises(ValueError, match="too large"):
        queue.submit({"x": big})
    queue.closed = True
    with pytest.raises(RuntimeError, match="closed"):
        queue.submit({"x": x})
    assert (queue.invalid, queue.rejected) == (2, 1)


@pytest.mark.parametrize("impl", IMPLS)
def test_timings_are_logged_and_drained(impl):
    batch_mod, _ = impl
    queue = batch_mod.BatchQueue()
    started = time.perf_counter()  # (the queue's clock)
    for k in range(3):
        queue.push(request(k, 1), 1, concurrent.futures.Future())
    spread = time.perf_counter() - started  # (a loaded machine spaces the pushes)
    t0 = queue.oldest
    batch = queue.take(10, t0 + 0.5)
    batch.outputs = outputs_for(batch)
    assert queue.deliver(batch, False, t0 + 2.0) == 3
    waits, latencies = queue.drain_waits(), queue.drain_latencies()
    assert waits.dtype == latencies.dtype == np.float64
    assert len(waits) == len(latencies) == 3
    assert (waits <= 0.5).all() and (waits >= 0.5 - spread - 1e-9).all()
    assert (latencies >= 2.0 - spread - 1e-9).all() and (latencies <= 2.0).all()
    assert queue.timings_pending == 0 and len(queue.drain_waits()) == 0


@needs_ext
def test_queue_does_not_leak_references():
    arrays = request(0, 2)
    before = sys.getrefcount(arrays)
    queue = _batch_c.BatchQueue()
    for _ in range(200):
        fut = concurrent.futures.Future()
        queue.push(arrays, 2, fut)
        batch = queue.take(3, 0.0)
        batch.outputs = outputs_for(batch)
        queue.deliver(batch)
        del batch, fut
    assert sys.getrefcount(arrays) == before


# --------------------------------------------------------------------------- the inline cache


@needs_ext
def test_inline_signature_cache_never_admits_what_the_full_check_refuses():
    """After a good request primes the one-entry cache, every variant gets exactly the
    answer of the pure-Python handler (which has no such cache)."""
    args = ("m", ["a", "b"], [np.float32, np.int32], [(2,), ()])
    good = {"a": np.zeros((3, 2), np.float32), "b": np.arange(3, dtype=np.int32)}
    variants = {
        "same": good,
        "other key objects": {"".join(["a"]): good["a"], "".join(["b"]): good["b"]},
        "reordered": {"b": good["b"], "a": good["a"]},
        "wrong dtype": dict(good, a=good["a"].astype(np.float64)),
        "big-endian": dict(good, a=good["a"].astype(">f4")),
        "wrong shape": dict(good, a=np.zeros((3, 3), np.float32)),
        "extra rank": dict(good, b=np.zeros((3, 1), np.int32)),
        "rows disagree": dict(good, b=np.arange(4, dtype=np.int32)),
        "zero rows": {"a": good["a"][:0], "b": good["b"][:0]},
        "strided": dict(good, a=np.zeros((6, 2), np.float32)[::2]),
        "subclass": dict(good, a=np.ma.zeros((3, 2), np.float32)),
        "missing": {"a": good["a"]},
        "extra": dict(good, c=good["b"]),
        "renamed": {"a": good["a"], "c": good["b"]},
    }
    cython = _handlers_c.InputHandler(*args)
    python = _handlers_py.InputHandler(*args)
    for label, req in variants.items():
        cython.prepare(good)  # primes the cache with the good signature
        answers = []
        for handler in (cython, python):
            try:
                arrays, rows = handler.prepare(req)
                answers.append(("ok", rows, [a.tobytes() for a in arrays]))
            except (TypeError, ValueError) as exc:
                answers.append((type(exc), str(exc)))
        assert answers[0] == answers[1], label


@pytest.mark.parametrize("impl", IMPLS)
def test_priority_levels_go_first_and_an_aged_request_before_them(impl):
    """Level 1 first, then 2, each in arrival order; a request of any level that has
    waited ``aging`` goes before them all (no level starves); 0 is the default level; a
    priority that is no level is a ValueError naming the levels."""
    batch_mod, _ = impl
    queue = batch_mod.BatchQueue(0, None, Policy(), None, 1, 3)
    queue.default_level = 2
    order = [(0, 3), (1, 2), (2, 1), (3, 0), (4, 1), (5, 3)]  # (request, priority)
    for k, priority in order:
        queue.push(request(k, 1), 1, None, math.inf, 0, priority)
        time.sleep(0.002)
    now = time.perf_counter()
    batch = queue.take(10, now)
    assert [int(p[0][0]) // 1000 for p in batch.pieces] == [2, 4, 1, 3, 0, 5]
    assert [r.level for r in batch.requests] == [1, 1, 2, 2, 3, 3]
    marks = []  # a time after each push: request k was queued before marks[k]
    for k, priority in order:
        queue.push(request(k, 1), 1, None, math.inf, 0, priority)
        marks.append(time.perf_counter())
    now = time.perf_counter()
    queue.aging = now - marks[1]  # requests 0 and 1 have aged, 2 has not (whatever the load)
    batch = queue.take(2, now)  # the two oldest: aged, before level 1
    assert [int(p[0][0]) // 1000 for p in batch.pieces] == [0, 1]
    queue.aging = math.inf
    assert [int(p[0][0]) // 1000 for p in queue.take(10, 0.0).pieces] == [2, 4, 3, 5]
    with pytest.raises(ValueError, match="priority 4 is not a level of this model: 1"):
        queue.push(request(9, 1), 1, None, math.inf, 0, 4)
    # (past a C integer too: the same refusal, not an OverflowError)
    for huge in (2**63, -(2**64)):
        with pytest.raises(ValueError, match=f"priority {huge} is not a level of this model"):
            queue.push(request(9, 1), 1, None, math.inf, 0, huge)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_split_request_takes_turns_with_the_requests_behind_it(impl):
    batch_mod, _ = impl
    queue = batch_mod.BatchQueue()
    big, a, b = (concurrent.futures.Future() for _ in range(3))
    queue.push(request(0, 10), 10, big)
    queue.push(request(1, 1), 1, a)
    queue.push(request(2, 1), 1, b)
    plan = []
    while (batch := queue.take(4, 0.0)) is not None:
        plan.append(
            [
                (int(p[0][0]) // 1000, s, c)
                for p, s, c in zip(batch.pieces, batch.starts, batch.counts)
            ]
        )
        batch.outputs = outputs_for(batch)
        queue.deliver(batch)
    assert plan == [[(0, 0, 4)], [(1, 0, 1), (2, 0, 1), (0, 4, 2)], [(0, 6, 4)]]
    assert big.result()["y"].tolist() == list(range(10))


# --------------------------------------------------------------------------- lanes


def _lane(raw, lanes):
    """A drawn lane: mostly one of the queue's, sometimes one just outside it."""
    return -1 if raw == 18 else lanes if raw == 19 else raw % lanes


def _outcome(fn, *args):
    """(True, result) or (False, (type, message)): errors compared like results."""
    try:
        return True, fn(*args)
    except Exception as exc:
        return False, (type(exc), str(exc))


def _describe(batch, numbers):
    """A batch as comparable data, its requests by number (``numbers``: id -> number);
    each piece's inputs are its request's."""
    if batch is None:
        return None
    assert all(r.arrays is p for r, p in zip(batch.requests, batch.pieces))
    return (
        batch.lane,
        batch.rows,
        list(batch.starts),
        list(batch.counts),
        list(batch.offsets),
        [numbers[id(r)] for r in batch.requests],
        [r.lane for r in batch.requests],
        [r.level for r in batch.requests],
    )


def _answers(requests):
    """Each request's answer: its rows, its error, or what became of it."""
    answers = []
    for r, fut in requests:
        if r is None:
            answers.append("refused")
        elif fut.cancelled():
            answers.append("cancelled")
        elif fut.done() and fut.exception() is not None:
            answers.append(repr(fut.exception()))
        elif fut.done():
            answers.append(fut.result()["y"].tolist())
        else:
            answers.append("pending")
    return answers


raw_lane = st.sampled_from(range(20))
lane_op_kinds = {
    "push": st.tuples(
        st.just("push"),
        st.sampled_from([1, 1, 2, 2, 3, 4, 6, 9, 0]),
        raw_lane,
        st.sampled_from([math.inf, math.inf, 1.0, 1.5]),
        st.sampled_from([0, 0, 1, 2, 3, 5]),  # priority (5: beyond every queue's levels)
    ),
    "take": st.tuples(
        st.just("take"),
        st.sampled_from([*range(1, 17), 0, -1]),
        st.floats(0, 2),
        raw_lane,
        st.sampled_from([None, "others"]) | st.lists(raw_lane, max_size=4).map(tuple),
    ),
    "stats": st.tuples(st.just("stats"), raw_lane, st.integers(-1, 12), st.floats(0, 2)),
    "deliver": st.tuples(st.just("deliver")),
    "fail": st.tuples(st.just("fail")),
    "cancel": st.tuples(st.just("cancel"), st.integers(0, 50)),
    "give_up": st.tuples(st.just("give_up"), st.integers(0, 50)),
    "sweep": st.tuples(st.just("sweep"), st.floats(0, 2)),
}
# Weighted: enough pushes and takes that batches form in every lane.
lane_ops = st.lists(
    st.sampled_from(["push"] * 6 + ["take"] * 3 + ["deliver"] * 2 + list(lane_op_kinds)).flatmap(
        lane_op_kinds.__getitem__
    ),
    min_size=20,
    max_size=80,
)


def play_lanes(batch_mod, script, lanes, max_queued_rows, levels=1, aging=math.inf):
    """Run ``script`` on a queue of ``lanes`` lanes and ``levels`` priority levels;
    returns everything observable, with times as request numbers (and the ages of
    ``lane_stats`` apart: clock-dependent), and the run's seconds."""
    queue = batch_mod.BatchQueue(max_queued_rows, None, Policy(), None, lanes, levels)
    queue.aging = aging
    requests, taken, log, ages = [], [], [], []
    numbers, by_time = {}, {}  # request id, t_enqueue (unique: see below) -> number
    t0 = time.perf_counter()  # ages are reported from the run's start: runs compare

    def which(t):
        return None if t == math.inf else by_time[t]

    for op in script:
        if op[0] == "push":
            _, rows, lane, deadline, priority = op
            k = len(requests)
            fut = concurrent.futures.Future()
            lane = _lane(lane, lanes)
            ok, r = _outcome(queue.push, request(k, rows), rows, fut, deadline, lane, priority)
            if ok and r is not None:
                numbers[id(r)], by_time[r.t_enqueue] = k, k
                level = priority or levels
                assert (r.rows, r.lane, r.deadline, r.level) == (rows, lane, deadline, level)
                while time.perf_counter() <= r.t_enqueue:  # the next push is strictly later
                    pass
            requests.append((r if ok else None, fut))
            log.append(("push", r is not None if ok else r))
        elif op[0] == "take":
            _, max_rows, now, lane, fold = op
            lane = _lane(lane, lanes)
            if fold == "others":  # what serving folds: every other lane, longest first
                fold = tuple(k for k in reversed(range(lanes)) if k != lane)
            elif fold is not None:
                fold = tuple(_lane(k, lanes) for k in fold)
            ok, batch = _outcome(queue.take, max_rows, now, lane, fold)
            if ok and batch is not None:
                taken.append(batch)
            log.append(("take", _describe(batch, numbers) if ok else batch))
        elif op[0] == "stats":
            _, lane, max_rows, now = op
            ok, stats = _outcome(queue.lane_stats, _lane(lane, lanes), max_rows, now)
            if ok:
                rows, n, age_sum, oldest = stats
                ages.append((n, now, age_sum + n * t0))  # sum of now - (t_enqueue - t0)
                stats = (rows, n, which(oldest))
            log.append(("stats", stats))
            log.append(("lane_rows", _outcome(queue.lane_rows, _lane(lane, lanes))))
        elif op[0] in ("deliver", "fail") and taken:
            batch = taken.pop(0)
            if op[0] == "deliver":
                batch.outputs = outputs_for(batch)
                log.append(("deliver", queue.deliver(batch, False)))
            else:
                log.append(("fail", queue.fail(batch, KeyError("batch failed"))))
        elif op[0] == "cancel" and requests:
            r, _ = requests[op[1] % len(requests)]
            log.append(("cancel", r is not None and queue.cancel(r)))
        elif op[0] == "give_up" and requests:
            _, fut = requests[op[1] % len(requests)]
            log.append(("give_up", fut.cancel()))
        elif op[0] == "sweep":
            log.append(("sweep", queue.sweep(op[1])))
        per_lane = [queue.lane_rows(k) for k in range(lanes)]
        assert sum(per_lane) == queue.queued_rows
        log.append(
            (
                "state",
                queue.queued_rows,
                len(queue),
                per_lane,
                queue.earliest_deadline,
                which(queue.oldest),
                (queue.expired, queue.cancelled, queue.refused_rows),
            )
        )
    return log, _answers(requests), ages, time.perf_counter() - t0


@needs_ext
@settings(max_examples=150, deadline=None)
@given(
    script=lane_ops,
    lanes=st.integers(1, 4),
    max_queued_rows=st.sampled_from([0, 6, 20]),
    levels=st.sampled_from([1, 1, 2, 3]),
    aging=st.sampled_from([math.inf, -math.inf]),  # (-inf: every request aged: arrival order)
)
def test_lanes_and_folds_behave_the_same_in_both_implementations(
    script, lanes, max_queued_rows, levels, aging
):
    """Per-lane pushes at priority levels, takes with folded lanes, lane stats and rows,
    and their errors."""
    py_log, py_answers, py_ages, py_s = play_lanes(
        _batch_py, script, lanes, max_queued_rows, levels, aging
    )
    c_log, c_answers, c_ages, c_s = play_lanes(
        _batch_c, script, lanes, max_queued_rows, levels, aging
    )
    assert py_log == c_log
    assert py_answers == c_answers
    # Ages are sums of now - (t_enqueue - the run's start): the same requests, so the
    # same up to the clock: each request's t_enqueue - start lies within its run, so
    # the two differ by at most the longer run per request counted (measured, not a
    # bound on the machine's pace).
    slack = max(py_s, c_s) + 1e-6
    for (n, _now, a), (m, _, b) in zip(py_ages, c_ages):
        assert n == m and a == pytest.approx(b, abs=n * slack, rel=0)


# --------------------------------------------------------------------------- submit

submit_op_kinds = {
    "submit": st.tuples(
        st.just("submit"),
        st.sampled_from([1, 2, 3, 5, 100]),  # 100 rows: more than a queue may hold
        st.sampled_from([1, 2, 3, 4, 7, 8, 9]),  # 9: over the largest compiled length
        st.sampled_from(["float32", "float32", "float32", "float64", "missing"]),
        # Deadlines a script cannot outlive, even on a loaded machine: a request that
        # expired mid-script in one implementation and not the other (the queue drops
        # expired requests to make room) would make the two runs differ by the clock.
        st.sampled_from([None, None, 60.0, 3000.0]),
    ),
    "take": st.tuples(st.just("take"), st.integers(1, 12), st.integers(0, 2)),
    "deliver": st.tuples(st.just("deliver")),
    "kick_rows": st.tuples(st.just("kick_rows"), st.integers(0, 12)),
    "close": st.tuples(st.just("close"), st.booleans()),
}
submit_ops = st.lists(
    st.sampled_from(["submit"] * 6 + list(submit_op_kinds)).flatmap(submit_op_kinds.__getitem__),
    min_size=10,
    max_size=60,
)


def play_submits(impl, script, max_queued_rows):
    """Run ``script`` through ``submit`` on a three-lane queue (one named dimension
    compiled at 2, 4 and 8); returns everything observable, deadlines as timeouts."""
    batch_mod, handlers = impl
    handler = handlers.InputHandler(
        "m", ["x", "w"], [np.float32, np.int32], [("s",), (2,)], 8, [(2, 4, 8)], [0, 1, 2]
    )
    policy = Policy()
    queue = batch_mod.BatchQueue(max_queued_rows, handler, policy, concurrent.futures.Future, 3)
    queue.default_timeout = 600.0
    log, taken = [], []
    for k, op in enumerate(script):
        if op[0] == "submit":
            _, rows, length, dtype, timeout = op
            req = {"w": np.full((rows, 2), k, np.int32)}
            if dtype != "missing":
                req["x"] = np.full((rows, length), k, dtype)
            ok, r = _outcome(queue.submit, req, timeout)
            log.append(
                ("submit", (r.rows, r.lane, round(r.deadline - r.t_enqueue, 6)) if ok else r)
            )
        elif op[0] == "take":
            batch = queue.take(op[1], 0.0, op[2], None)
            if batch is not None:
                taken.append(batch)
                log.append(("take", batch.lane, batch.rows, list(batch.counts)))
        elif op[0] == "deliver" and taken:
            batch = taken.pop(0)
            batch.outputs = [
                {"x": a[0][s : s + c]} for a, s, c in zip(batch.pieces, batch.starts, batch.counts)
            ]
            log.append(("deliver", queue.deliver(batch, False)))
        elif op[0] == "kick_rows":
            queue.kick_rows = op[1]
        elif op[0] == "close":
            queue.closed = op[1]
        log.append(
            (
                queue.queued_rows,
                [queue.lane_rows(k) for k in range(3)],
                queue.kick_rows,
                (queue.invalid, queue.rejected, queue.refused_rows),
                policy.kicks,
                len(policy.sweeps),
            )
        )
    return log


@needs_ext
@settings(max_examples=100, deadline=None)
@given(script=submit_ops, max_queued_rows=st.sampled_from([0, 8, 20]))
def test_submit_behaves_the_same_in_both_implementations(script, max_queued_rows):
    """Admission through ``submit``: validation, lanes, deadlines, refusals and their
    counts, kicks and sweeps armed, closing; each error's type and words."""
    impls = [(_batch_py, _handlers_py), (_batch_c, _handlers_c)]
    py_log, c_log = (play_submits(impl, script, max_queued_rows) for impl in impls)
    assert py_log == c_log
