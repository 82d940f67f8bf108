"""The serving loop under asyncio and uvloop: batching, queue policy, faults, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import jax
import numpy as np
import pytest
from models import MODELS, assert_matches, inject, random_request, reference

import pxrt
from serving import (
    BlockingServer,
    DeadlineExceeded,
    ExecutionFailed,
    Overloaded,
    Server,
    ServerClosed,
    UnknownModel,
)

# How batches split over the devices, and the Cython modules end to end: `make test`
# also runs this module on one device with the pure-Python twins (PXRT_NO_EXTENSIONS=1).
pytestmark = [pytest.mark.devices, pytest.mark.twins]


def batch_reference(name, requests):
    """Plain jax.jit of all requests at once, split back per request."""
    spec = MODELS[name]
    x64 = any(s.dtype.itemsize == 8 for s in spec["inputs"].values())
    joined = {k: np.concatenate([r[k] for r in requests]) for k in requests[0]}
    with jax.enable_x64(x64):
        out = jax.jit(spec["fn"])(spec["params"](), **joined)
    out = out if isinstance(out, dict) else {"output": out}
    out = {k: np.asarray(v) for k, v in out.items()}
    bounds = np.cumsum([len(next(iter(r.values()))) for r in requests])[:-1]
    return [dict(zip(out, parts)) for parts in zip(*(np.split(v, bounds) for v in out.values()))]


# --------------------------------------------------------------------------- correctness


def test_many_concurrent_callers_get_their_own_answers(run, models):
    """1200 concurrent requests, random row counts, a tenth of them invalid."""
    model = models["two_io"]
    rng = np.random.default_rng(0)
    good, bad = [], []
    requests = []
    for i in range(1200):
        rows = 2 * model.max_batch + 1 if i % 50 == 7 else int(rng.integers(1, 4))
        r = random_request(model.inputs, rows, rng)
        if i % 10 == 3:
            r = dict(r, features=r["features"].astype(np.float32))  # wrong dtype
            bad.append(i)
        else:
            good.append(i)
        requests.append(r)
    wants = dict(zip(good, batch_reference("two_io", [requests[i] for i in good])))
    compiles = pxrt.compile_count()

    async def main():
        async with Server() as server:
            server.add_model("two_io", model, max_delay_us=500, max_queue=1 << 20)

            async def call(r):
                await asyncio.sleep(0)
                return await server.infer("two_io", r)

            outs = await asyncio.gather(*(call(r) for r in requests), return_exceptions=True)
            return outs, server.metrics_snapshot()["two_io"]

    outs, snap = run(main)
    for i in bad:
        assert isinstance(outs[i], TypeError) and "'features'" in str(outs[i])
    for i in good:
        assert_matches(outs[i], wants[i], f"request {i}")
    assert snap["requests"]["success"] == len(good)
    assert snap["requests"]["invalid"] == len(bad)
    assert snap["batch_rows"]["mean"] > 4, "requests were not batched together"
    assert pxrt.compile_count() == compiles and model.compiles_after_load == 0


def test_requests_larger_than_a_batch_are_split(run, models):
    model = models["mlp"]
    rng = np.random.default_rng(1)
    requests = [random_request(model.inputs, n, rng) for n in (3 * model.max_batch + 5, 1, 40)]
    wants = batch_reference("mlp", requests)

    async def main():
        async with Server() as server:
            server.add_model("mlp", model, max_batch_size=8, max_delay_us=100)
            return await asyncio.gather(*(server.infer("mlp", r) for r in requests))

    for got, want in zip(run(main), wants):
        assert_matches(got, want)


def test_a_batch_closes_when_full_without_waiting(run, models):
    model = models["mlp"]
    x = np.ones((model.max_batch, 32), np.float32)

    async def main():
        async with Server() as server:
            server.add_model("mlp", model, max_delay_us=30e6)  # 30 s: only "full" can close it
            t0 = time.perf_counter()
            await asyncio.wait_for(server.infer("mlp", {"x": x}), 10)
            return time.perf_counter() - t0

    assert run(main) < 10


def test_validation_errors_are_raised_at_submit(run, models):
    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            with pytest.raises(ValueError, match="missing input 'x'"):
                await server.infer("mlp", {})
            with pytest.raises(UnknownModel, match="no model named 'nope'"):
                await server.infer("nope", {"x": np.ones((1, 32), np.float32)})
            snap = server.metrics_snapshot()["mlp"]
            assert snap["requests"]["invalid"] == 1 and snap.get("batches", 0) == 0

    run(main)


def test_a_lone_request_goes_at_once_by_default(run, models):
    """Eager when idle: with the default options nothing waits for a batch to fill (a
    30 s max_delay shows what waiting would look like: the wait_for would time out)."""
    model = models["mlp"]
    x = np.ones((1, 32), np.float32)

    async def main():
        async with Server() as server:
            server.add_model("mlp", model)
            assert server.options("mlp").max_delay_us == 0
            out = await asyncio.wait_for(server.infer("mlp", {"x": x}), 10)
            server.add_model("slow", model, max_delay_us=30e6)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(server.infer("slow", {"x": x}), 0.5)
            return out

    assert_matches(run(main), reference("mlp", {"x": x}))


def test_batches_grow_while_the_device_is_busy(run, models):
    """The first request goes alone; the ones that arrive while it runs go together."""
    model = models["mlp"]
    rng = np.random.default_rng(5)
    requests = [random_request(model.inputs, 1, rng) for _ in range(model.max_batch)]
    wants = batch_reference("mlp", requests)

    async def main():
        with inject(model, hold=True) as gate:
            async with Server() as server:
                server.add_model("mlp", model, max_inflight=1)
                first = server.infer("mlp", requests[0])
                await gate.wait_started()  # the first batch is executing
                rest = [server.infer("mlp", r) for r in requests[1:]]
                gate.release.set()
                outs = await asyncio.gather(first, *rest)
                return outs, server.metrics_snapshot()["mlp"]

    outs, snap = run(main)
    for got, want in zip(outs, wants):
        assert_matches(got, want)
    assert snap["batches"] == 2 and snap["batch_rows"]["count"] == 2
    assert snap["batch_rows"]["mean"] == model.max_batch / 2  # 1 row, then all the others


def test_a_deadline_closes_a_waiting_batch_early(run, models, monkeypatch):
    """A request whose deadline is shorter than max_delay is served, not expired."""
    model = models["mlp"]
    x = np.ones((1, 32), np.float32)
    # The batch closes the timer slack before the deadline (10 ms at first, then what
    # the loop's timers were seen to be late by): a loaded machine's loop, blocked past
    # that once, let the 2 s deadline pass first. Half a second of slack still closes it
    # seconds before max_delay.
    from serving.engine import batcher

    monkeypatch.setattr(batcher, "TIMER_SLACK_S", 0.5)

    async def main():
        async with Server() as server:
            # (a deadline of seconds, still well under max_delay: a loaded machine can
            # take longer than a 0.3 s one left after the batch is closed)
            server.add_model("mlp", model, max_delay_us=5e6)
            out = await asyncio.wait_for(server.infer("mlp", {"x": x}, timeout_s=2.0), 10)
            return out, server.metrics_snapshot()["mlp"]["requests"]

    out, counts = run(main)
    assert_matches(out, reference("mlp", {"x": x}))
    assert counts["success"] == 1 and counts["expired"] == 0


def test_infer_is_awaitable_like_a_coroutine(run, models):
    """create_task, gather (errors in place) and wait_for take what infer returns;
    nothing raises before it is awaited."""
    model = models["mlp"]
    x = np.ones((2, 32), np.float32)
    want = reference("mlp", {"x": x})

    async def main():
        async with Server() as server:
            server.add_model("mlp", model)
            task = asyncio.create_task(server.infer("mlp", {"x": x}))
            bad = server.infer("mlp", {"x": x.astype(np.float64)})  # does not raise here
            unknown = server.infer("nope", {"x": x})
            outs = await asyncio.gather(task, bad, unknown, return_exceptions=True)
            outs.append(await asyncio.wait_for(server.infer("mlp", {"x": x}), 10))
            return outs

    got, bad, unknown, again = run(main)
    assert_matches(got, want)
    assert_matches(again, want)
    assert isinstance(bad, TypeError) and "float64" in str(bad)
    assert isinstance(unknown, UnknownModel)


def test_requests_whose_callers_gave_up_hold_no_room(run, models):
    """Futures from Server.submit that their callers cancel free their queue rows for
    the requests that come next (no Overloaded caused by requests nobody awaits)."""
    model = models["mlp"]
    x = np.ones((1, 32), np.float32)

    async def main():
        with inject(model, hold=True) as gate:
            async with Server() as server:
                server.add_model("mlp", model, max_queue=4, max_inflight=1, max_batch_size=1)
                running = server.infer("mlp", {"x": x})
                await gate.wait_started()  # the device is busy; the queue fills
                doomed = [server.submit("mlp", {"x": x}) for _ in range(4)]
                with pytest.raises(Overloaded):
                    server.submit("mlp", {"x": x})
                for fut in doomed:
                    fut.cancel()
                later = [server.infer("mlp", {"x": x}) for _ in range(4)]
                gate.release.set()
                outs = await asyncio.gather(running, *later)
                return outs, server.metrics_snapshot()["mlp"]["requests"]

    outs, counts = run(main)
    assert len(outs) == 5
    assert counts["cancelled"] == 4 and counts["rejected"] == 1 and counts["success"] == 5


def test_a_request_larger_than_the_queue_is_refused_for_good(run, models):
    from serving.engine.batcher import RequestTooLarge

    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"], max_queue=4)
            with pytest.raises(RequestTooLarge, match="holds at most 4") as info:
                await server.infer("mlp", {"x": np.ones((5, 32), np.float32)})
            assert isinstance(info.value, ValueError)  # a client error, not Overloaded
            return server.metrics_snapshot()["mlp"]["requests"]

    counts = run(main)
    assert counts["invalid"] == 1 and counts["rejected"] == 0


# --------------------------------------------------------------------------- queue policy


def test_overload_rejects_at_once_with_retry_after(run, models):
    model = models["mlp"]
    x = np.ones((4, 32), np.float32)

    async def main():
        async with Server() as server:
            # 20 requests of 4 rows are queued in one go: 16 rows fit, the rest do not.
            server.add_model("mlp", model, max_batch_size=8, max_queue=16, max_inflight=1)
            outs = await asyncio.gather(
                *(server.infer("mlp", {"x": x}) for _ in range(20)), return_exceptions=True
            )
            return outs, server.metrics_snapshot()["mlp"]

    outs, snap = run(main)
    rejected = [o for o in outs if isinstance(o, Overloaded)]
    served = [o for o in outs if isinstance(o, dict)]
    assert rejected and served and len(rejected) + len(served) == 20
    assert all(o.retry_after_s > 0 and "overloaded" in str(o) for o in rejected)
    assert snap["requests"]["rejected"] == len(rejected)
    assert snap["requests"]["success"] == len(served)


def test_deadline_passing_in_the_queue_drops_the_request_unexecuted(run, models):
    model = models["mlp"]
    x = np.ones((1, 32), np.float32)

    async def main():
        with inject(model, hold=True) as gate:
            async with Server() as server:
                server.add_model("mlp", model, max_batch_size=1, max_inflight=1)
                first = asyncio.ensure_future(server.infer("mlp", {"x": x}))
                await gate.wait_started()  # the first batch is executing, held
                late = server.infer("mlp", {"x": x * 2}, timeout_s=0.05)
                with pytest.raises(DeadlineExceeded, match="was not executed"):
                    await late
                gate.release.set()
                await first
                return server.metrics_snapshot()["mlp"], gate.batches

    snap, batches = run(main)
    assert batches == 1  # the late one never ran
    assert snap["requests"]["expired"] == 1 and snap["requests"]["success"] == 1


def test_priority_levels_are_answered_first_and_over_http_and_grpc_messages(run, models):
    """priority_levels 2: while the device is busy, level 2 then level 1 requests queue;
    level 1 goes first (Triton's order: 1 is the highest), a request without a priority
    is at the default level, and a priority that is no level is refused."""
    from serving.kserve.core import InferRequest, InvalidRequest, start

    model = models["mlp"]
    x = np.ones((1, 32), np.float32)

    async def main():
        done: list[str] = []
        with inject(model, hold=True) as gate:
            async with Server() as server:
                server.add_model(
                    "mlp", model, max_batch_size=1, max_inflight=1, priority_levels=2,
                    default_priority_level=2,
                )  # fmt: skip
                first = asyncio.ensure_future(server.infer("mlp", {"x": x}))
                await gate.wait_started()  # the device is busy: the rest queue

                def queued(tag, priority):
                    future = start(
                        server, "mlp", None,
                        lambda m: InferRequest({"x": x}, [("y", False)], tag, None, priority),
                    ).future  # fmt: skip
                    future.add_done_callback(lambda _: done.append(tag))
                    return future

                waiting = [queued("low", 2), queued("default", 0), queued("high", 1)]
                with pytest.raises(InvalidRequest, match="priority 3 is not a level"):
                    queued("bad", 3)
                gate.release.set()
                await first
                await asyncio.gather(*waiting)
        return done

    assert run(main) == ["high", "low", "default"]


def test_cancelled_request_is_removed_before_dispatch(run, models):
    model = models["mlp"]
    x = np.ones((1, 32), np.float32)

    async def main():
        with inject(model, hold=True) as gate:
            async with Server() as server:
                server.add_model("mlp", model, max_batch_size=1, max_inflight=1)
                first = asyncio.ensure_future(server.infer("mlp", {"x": x}))
                await gate.wait_started()
                doomed = asyncio.ensure_future(server.infer("mlp", {"x": x}))
                after = asyncio.ensure_future(server.infer("mlp", {"x": x * 3}))
                await asyncio.sleep(0)  # the tasks await their requests
                doomed.cancel()
                await asyncio.sleep(0)  # the cancellation reaches the queue
                gate.release.set()
                out_first, out_after = await first, await after
                with pytest.raises(asyncio.CancelledError):
                    await doomed
                return out_first, out_after, server.metrics_snapshot()["mlp"], gate.batches

    out_first, out_after, snap, batches = run(main)
    assert batches == 2
    assert snap["requests"]["cancelled"] == 1 and snap["requests"]["success"] == 2
    assert not np.array_equal(out_first["y"], out_after["y"])


# --------------------------------------------------------------------------- faults, shutdown


def test_a_failing_batch_fails_alone(run, models):
    model = models["mlp"]
    rng = np.random.default_rng(2)
    good = [random_request(model.inputs, 2, rng) for _ in range(6)]
    poison = {"x": np.full((1, 32), -1, np.float32)}
    wants = batch_reference("mlp", good)

    def poisoned(slot):  # any batch holding a row of all -1 fails on "the device"
        return bool((slot.buffers[0] == -1).all(axis=1).any())

    async def main():
        with inject(model, fail_if=poisoned):
            async with Server() as server:
                # 2 + 1 rows fill a batch of 3: the first good request and the poison one
                # are dispatched together, for certain.
                server.add_model("mlp", model, max_batch_size=3, max_delay_us=50_000)
                first = await asyncio.gather(
                    server.infer("mlp", good[0]),
                    server.infer("mlp", poison),
                    return_exceptions=True,
                )
                rest = await asyncio.gather(*(server.infer("mlp", g) for g in good[1:]))
                return first, rest, server.metrics_snapshot()["mlp"]

    (first_good, failed), rest, snap = run(main)
    assert isinstance(failed, ExecutionFailed)
    assert "model 'mlp'" in str(failed) and "bucket" in str(failed) and "injected" in str(failed)
    # The good request in the same execution shares its fate, with the same error ...
    assert isinstance(first_good, ExecutionFailed) and str(first_good) == str(failed)
    # ... and the server keeps serving everyone after it.
    for got, want in zip(rest, wants[1:]):
        assert_matches(got, want)
    assert snap["requests"]["failed"] == 2 and snap["requests"]["success"] == len(rest)


def test_close_while_busy_answers_every_accepted_request(run, models):
    model = models["mlp"]
    rng = np.random.default_rng(3)
    requests = [random_request(model.inputs, int(rng.integers(1, 6)), rng) for _ in range(200)]
    wants = batch_reference("mlp", requests)

    async def main():
        with inject(model, hold=True) as gate:
            server = Server()
            server.add_model("mlp", model, max_batch_size=16, max_delay_us=1000, max_queue=1 << 20)
            tasks = [asyncio.ensure_future(server.infer("mlp", r)) for r in requests]
            await gate.wait_started()  # a batch is on the device, the rest queued
            closing = asyncio.ensure_future(server.close())
            await asyncio.sleep(0)
            assert not closing.done()
            gate.release.set()
            await closing
            assert all(t.done() for t in tasks), "close returned before answering everyone"
            with pytest.raises(ServerClosed):
                await server.infer("mlp", requests[0])
            return [t.result() for t in tasks]

    for got, want in zip(run(main), wants):
        assert_matches(got, want)


def test_blocking_server_from_many_threads(artifacts, models):
    model = models["mlp"]
    rng = np.random.default_rng(4)
    requests = [random_request(model.inputs, int(rng.integers(1, 9)), rng) for _ in range(64)]
    wants = batch_reference("mlp", requests)
    got = [None] * len(requests)

    with BlockingServer() as server:
        server.add_model("mlp", model, max_delay_us=1000)

        def worker(k):
            for i in range(k, len(requests), 8):
                got[i] = server.infer("mlp", requests[i])

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        snap = server.metrics_snapshot()["mlp"]
    for g, w in zip(got, wants):
        assert_matches(g, w)
    assert snap["requests"]["success"] == len(requests)


def test_metrics_page_counts_what_happened(run, models):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    model = models["mlp"]
    x = np.ones((3, 32), np.float32)

    async def main():
        async with Server() as server:
            server.add_model("mlp", model, max_delay_us=200)
            await asyncio.gather(*(server.infer("mlp", {"x": x}) for _ in range(7)))
            with pytest.raises(TypeError):
                await server.infer("mlp", {"x": x.astype(np.float64)})
            return generate_latest(server.metrics.registry).decode(), server.metrics_snapshot()

    page, snap = run(main)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }
    mv = (("model", "mlp"), ("version", "1"))
    success = (("model", "mlp"), ("outcome", "success"), ("version", "1"))
    invalid = (("model", "mlp"), ("outcome", "invalid"), ("version", "1"))
    assert samples[("pxrt_requests_total", success)] == 7
    assert samples[("pxrt_requests_total", invalid)] == 1
    assert samples[("pxrt_request_duration_us_count", mv)] == 7
    assert samples[("pxrt_batch_rows_sum", mv)] == 21
    assert samples[("pxrt_compiles_after_load", mv)] == 0
    load = {
        dict(labels)["phase"]: v
        for (name, labels), v in samples.items()
        if name == "pxrt_model_load_seconds"
    }
    assert load["total"] == model.load_s and set(load) == {"total", *model.load_phases}
    assert sum(model.load_phases.values()) <= model.load_s
    assert snap["mlp"]["requests"]["success"] == 7 and snap["mlp"]["batch_rows"]["count"] >= 1


def test_histogram_bins_arrays_exactly():
    from serving.engine.metrics import US_BUCKETS, Histogram

    rng = np.random.default_rng(9)
    hist = Histogram(US_BUCKETS, scale=1e6)
    values = []
    for _ in range(700):  # ~35k values in drains of every size, some on a bucket bound
        seconds = rng.uniform(0, 0.05, int(rng.integers(0, 100)))
        if len(seconds):
            seconds[0] = US_BUCKETS[int(rng.integers(len(US_BUCKETS)))] / 1e6
        hist.observe_many(seconds)
        values += list(seconds * 1e6)
    values = np.asarray(values)
    want = np.bincount(
        np.searchsorted(US_BUCKETS, values, side="left"), minlength=len(US_BUCKETS) + 1
    ).cumsum()
    assert [c for _, c in hist.cumulative()] == want.tolist()
    assert hist.count == len(values) and hist.sum == pytest.approx(values.sum())
    assert hist.quantile(0.5) == pytest.approx(np.median(values), rel=0.5)


def test_finished_batches_are_not_kept(run, models):
    """Once callers have their answers, no batch (with outputs that pin device buffers)
    stays alive in the pipeline or the loop."""
    import gc

    from pxrt.dispatch import Batch

    x = np.ones((3, 32), np.float32)

    async def main():
        async with Server() as server:
            server.add_model("mlp", models["mlp"])
            for _ in range(6):
                await server.infer("mlp", {"x": x})
            await server.close()  # the workers have finished their on_done calls
            gc.collect()
            return [o for o in gc.get_objects() if type(o) is Batch]

    assert run(main) == []


def test_every_cancellation_is_counted_once(run, models):
    """Callers that give up before dispatch, while their batch runs, or through the
    future of Server.submit: each counted exactly once, none answered."""
    model = models["mlp"]
    x = np.ones((1, 32), np.float32)

    async def main():
        with inject(model, hold=True) as gate:
            async with Server() as server:
                server.add_model("mlp", model, max_batch_size=4, max_inflight=1)
                tasks = [asyncio.ensure_future(server.infer("mlp", {"x": x})) for _ in range(40)]
                futures = [server.submit("mlp", {"x": x}) for _ in range(20)]
                await gate.wait_started()  # the first batch runs; the rest wait
                for t in tasks[::2]:
                    t.cancel()
                for f in futures[::2]:
                    f.cancel()
                gate.release.set()
                await asyncio.gather(*tasks, *futures, return_exceptions=True)
                await server.close()  # every batch has come back and been counted
                return server.metrics_snapshot()["mlp"]["requests"]

    counts = run(main)
    assert counts["cancelled"] == 30 and counts["success"] == 30, counts


def test_small_requests_are_not_held_behind_a_large_one(run, models):
    """A request split over many batches takes turns with the requests queued after it."""
    model = models["mlp"]
    big = {"x": np.ones((10 * model.max_batch, 32), np.float32)}
    small = {"x": np.ones((1, 32), np.float32)}
    order = []

    async def main():
        async with Server() as server:
            server.add_model("mlp", model, max_inflight=1)

            async def call(label, r):
                await server.infer("mlp", r)
                order.append(label)

            await asyncio.gather(call("big", big), *(call(f"small{i}", small) for i in range(3)))

    run(main)
    assert order[-1] == "big", order  # every small one finished before the big one


def test_a_warm_model_has_its_cell_times_measured_again_while_idle(
    run, artifacts, tmp_path, monkeypatch
):
    """Cell times a warm load read from an earlier one are timed again in the
    background, only while the model is idle; requests meanwhile are answered right."""
    from serving.engine import batcher

    monkeypatch.setattr(batcher, "REMEASURE_AFTER_S", 0.0)
    monkeypatch.setattr(batcher, "REMEASURE_POLL_S", 0.005)
    cache = str(tmp_path / "cache")
    pxrt.load(artifacts["mlp"], compilation_cache=cache)
    model = pxrt.load(artifacts["mlp"], compilation_cache=cache)
    assert model.stale_cells
    rng = np.random.default_rng(4)
    requests = [{"x": rng.standard_normal((n, 32)).astype(np.float32)} for n in (1, 5, 9) * 20]

    async def main():
        async with Server() as server:
            server.add_model("mlp", model, max_delay_us=100)
            got = await asyncio.gather(*(server.infer("mlp", r) for r in requests))
            for _ in range(2000):
                if not model.stale_cells:
                    break
                await asyncio.sleep(0.01)
            got += [await server.infer("mlp", requests[0])]
            return got

    got = run(main)
    assert not model.stale_cells
    for g, r in zip(got, requests + requests[:1]):
        assert_matches(g, reference("mlp", r))


def test_cell_times_are_not_measured_again_while_another_model_serves(
    run, artifacts, tmp_path, monkeypatch
):
    """Timed beside another model's batches, a cell's time is inflated (and the cost
    policy's caps follow it): a warm model re-measures only while the whole server is
    quiet."""
    from serving.engine import batcher

    monkeypatch.setattr(batcher, "REMEASURE_AFTER_S", 0.0)
    monkeypatch.setattr(batcher, "REMEASURE_POLL_S", 0.005)
    cache = str(tmp_path / "cache")
    pxrt.load(artifacts["mlp"], compilation_cache=cache)
    warm = pxrt.load(artifacts["mlp"], compilation_cache=cache)
    stale = len(warm.stale_cells)
    assert stale
    other = pxrt.load(artifacts["two_io"])
    x = random_request(other.inputs, 1, np.random.default_rng(0))

    async def main():
        async with Server() as server:
            with inject(other, hold=True) as gate:
                server.add_model("other", other)
                busy = asyncio.ensure_future(server.infer("other", x))
                await gate.wait_started()
                server.add_model("mlp", warm)
                assert not server._quiet()
                await asyncio.sleep(0.2)  # 40 polls: the other model still runs
                assert len(warm.stale_cells) == stale
                gate.release.set()
                await busy
            for _ in range(2000):
                if not warm.stale_cells:
                    break
                await asyncio.sleep(0.01)
            assert server._quiet()

    run(main)
    assert not warm.stale_cells
