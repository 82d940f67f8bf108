"""``pxrt bench --url``: the same closed- and open-loop runs over HTTP against a running
KServe v2 server (pxrt serve, or any other), with binary tensors (``--json`` for JSON).

The server-side stage breakdown comes from the model's statistics endpoint, as deltas
over each run. Beyond the concurrency sweep (``bench_url``): open-loop runs on any
arrival schedule (``serving.bench.schedule``: rates, bursts, ramps, traces), closed-loop
runs measured until stable, the goodput search under a latency objective, and
``compare_urls``: two servers alternated with repeats, as ratios with intervals
(``serving.bench.method``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import aiohttp
import numpy as np

from ..loops import new_event_loop
from . import method
from .inputs import random_inputs, read_input_data
from .loadgen import Records, closed_loop, merge_windows, run_result, scheduled_run
from .procs import ClientPool
from .report import print_table, write_compare, write_csv, write_records, write_report
from .schedule import Schedule, plans
from .wire import RawClient, make_client, request_bytes


class Target:
    """A model on a running server, and its prepared request bodies: random ones of
    ``rows`` rows (``shapes``: named dimensions' lengths), or those of an input-data
    file (``serving.bench.inputs``), sent round robin."""

    def __init__(
        self,
        url: str,
        model: str,
        rows: int,
        binary: bool,
        shapes: dict[str, list[int]] | None = None,
        input_data: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.rows = rows
        self.binary = binary
        self.shapes = shapes or {}
        self.input_data = input_data
        self.infer_url = f"{self.url}/v2/models/{model}/infer"
        self.body = b""
        self.headers: dict[str, str] = {}
        self.meta: dict = {}
        self._bodies: dict[int, tuple[bytes, dict[str, str]]] = {}
        self._wire: dict[int, bytes] = {}  # rows -> the whole request, for RawClient
        self._data: list[tuple[bytes, dict[str, str], bytes]] = []  # an input-data file's
        self._next = 0

    mode = "http"

    @property
    def kind(self) -> str:
        return "HTTP binary" if self.binary else "HTTP JSON"

    def client(self, connections: int) -> Any:
        """The load's client (``serving.bench.wire``): up to ``connections``."""
        return make_client(self.url, connections)

    async def aclose(self) -> None:
        pass

    async def prepare(self, session: aiohttp.ClientSession) -> None:
        self.meta = await get_model_doc(session, self.url, self.model, "")
        self.load_bodies()

    def load_bodies(self) -> None:
        """Build the request bodies once the metadata is in."""
        if self.input_data:
            for request in read_input_data(self.input_data, self.meta, self.rows):
                body, headers = self._encode(request)
                self._data.append((body, headers, request_bytes(self.infer_url, body, headers)))
            self.body, self.headers, _ = self._data[0]
        else:
            self.body, self.headers = self._make(self.rows)

    def _make(self, rows: int) -> tuple[bytes, dict[str, str]]:
        """A request body of ``rows`` rows (random values) and its headers."""
        return self._encode(random_inputs(self.meta, rows, self.shapes, seed=rows))

    def _encode(self, values: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
        """A request body carrying ``values`` (binary tensors, or JSON) and its headers."""
        inputs = []
        blobs = []
        for spec in self.meta["inputs"]:
            x = values[spec["name"]]
            dtype = x.dtype
            shape = list(x.shape)
            entry = {"name": spec["name"], "datatype": spec["datatype"], "shape": shape}
            if self.binary:
                entry["parameters"] = {"binary_data_size": x.nbytes}
                blobs.append(x.tobytes())
            else:
                entry["data"] = (
                    x.astype(np.float32).ravel().tolist()
                    if dtype.kind == "f"
                    else x.ravel().tolist()
                )
            inputs.append(entry)
        doc: dict[str, Any] = {"inputs": inputs}
        if self.binary:
            doc["parameters"] = {"binary_data_output": True}
        header = json.dumps(doc).encode()
        headers = {
            "Content-Type": "application/octet-stream" if self.binary else "application/json"
        }
        if self.binary:
            headers["Inference-Header-Content-Length"] = str(len(header))
        return header + b"".join(blobs), headers

    def _request(self, rows: int | None) -> tuple[bytes, dict[str, str]]:
        if rows is None or rows == self.rows:
            return self.body, self.headers
        if rows not in self._bodies:
            self._bodies[rows] = self._make(rows)
        return self._bodies[rows]

    async def call(self, client: Any, rows: int | None = None) -> None:
        """One inference request through ``client`` (``serving.bench.wire``); an
        answer other than 200 raises."""
        if self._data:  # an input-data file's requests, in turn
            body, headers, data = self._data[self._next % len(self._data)]
            self._next += 1
            if isinstance(client, RawClient):
                status = await client.send(data)
            else:
                status = await client.post(self.infer_url, body, headers)
            if status != 200:
                raise RuntimeError(f"HTTP {status}")
            return
        if isinstance(client, RawClient):
            wire = self._wire.get(rows or self.rows)
            if wire is None:
                wire = self._wire[rows or self.rows] = request_bytes(
                    self.infer_url, *self._request(rows)
                )
            status = await client.send(wire)
        else:
            status = await client.post(self.infer_url, *self._request(rows))
        if status != 200:
            raise RuntimeError(f"HTTP {status}")

    async def stats(self, session: aiohttp.ClientSession) -> dict | None:
        try:
            async with session.get(f"{self.url}/v2/models/{self.model}/stats") as r:
                if r.status != 200:
                    return None
                return (await r.json())["model_stats"][0]
        except (aiohttp.ClientError, KeyError, IndexError):
            return None


async def get_model_doc(session: Any, url: str, model: str, what: str) -> dict:
    """``GET {url}/v2/models/{model}{what}`` as JSON; exits naming the model if the
    server has none by that name."""
    async with session.get(f"{url}/v2/models/{model}{what}") as r:
        if r.status != 200:
            raise SystemExit(
                f"pxrt bench: {url} has no model {model!r} ({r.status}: {await r.text()})"
            )
        return await r.json()


def make_target(
    url: str,
    model: str,
    rows: int,
    binary: bool = True,
    shapes: dict[str, list[int]] | None = None,
    input_data: str | None = None,
) -> Any:
    """``Target`` for ``http(s)://``, ``serving.bench.grpc.GrpcTarget`` for ``grpc://``."""
    if url.startswith("grpc://"):
        from .grpc import GrpcTarget

        return GrpcTarget(url, model, rows, shapes, input_data)
    return Target(url, model, rows, binary, shapes, input_data)


def _stage_delta(before: dict | None, after: dict | None) -> dict:
    if not before or not after:
        return {}
    out: dict[str, Any] = {}
    b, a = before["inference_stats"], after["inference_stats"]
    stages = {}
    for k in ("queue", "compute_input", "compute_infer", "compute_output"):
        n = a[k]["count"] - b[k]["count"]
        stages[k] = (a[k]["ns"] - b[k]["ns"]) / n / 1e3 if n else 0.0
    out["stages_us"] = stages
    batches = after.get("execution_count", 0) - before.get("execution_count", 0)
    rows = after.get("inference_count", 0) - before.get("inference_count", 0)
    if batches:
        out["batch_rows"] = rows / batches
        out["batches"] = batches
    return out


def _session(concurrency: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency, force_close=False),
        timeout=aiohttp.ClientTimeout(total=60),
    )


async def _measured(target: Any, connections: int, drive: Any) -> tuple[Any, dict]:
    """``await drive(client)`` (``serving.bench.wire``: up to ``connections``
    connections) with the connection path warm; returns its result and the server's
    stage breakdown over the run (from its statistics endpoint)."""
    client = target.client(connections)
    try:
        async with _session(1) as session:
            await target.call(client)  # warm the connection path
            before = await target.stats(session)
            out = await drive(client)
            after = await target.stats(session)
    finally:
        await client.close()
    return out, _stage_delta(before, after)


def _client(cpu_s: float, requests: int, pool: ClientPool | None) -> dict:
    """What the client cost: its processes and CPU microseconds per request."""
    return {
        "client_procs": pool.procs if pool is not None else 1,
        "client_cpu_us": 1e6 * cpu_s / max(requests, 1),
    }


async def run_closed(
    target: Target, concurrency: int, duration: float, pool: ClientPool | None = None
) -> dict:
    """``concurrency`` clients back to back (split over ``pool``'s processes if given)."""

    async def drive(client: Any) -> tuple[list[float], float, int, float]:
        if pool is not None:
            return await pool.closed(target, concurrency, duration)
        cpu0 = time.process_time()
        latencies, elapsed, errors = await closed_loop(
            lambda _: target.call(client), None, concurrency, duration, count_errors=True
        )
        return latencies, elapsed, errors, time.process_time() - cpu0

    (latencies, elapsed, errors, cpu), stages = await _measured(
        target, concurrency if pool is None else 1, drive
    )
    return run_result(
        f"{target.mode}-closed",
        f"{target.kind}: {concurrency} clients",
        latencies,
        target.rows,
        elapsed,
        concurrency=concurrency,
        errors=errors,
        **stages,
        **_client(cpu, len(latencies) + errors, pool),
    )


async def run_scheduled(
    target: Target,
    plan: Schedule,
    duration: float,
    connections: int,
    seed: int = 0,
    pool: ClientPool | None = None,
) -> tuple[dict, Records]:
    """Open loop: a request at each time of ``plan`` (latency from its scheduled send;
    the sends dealt over ``pool``'s processes if given); the run's row and its
    per-request records."""
    times = plan.times(duration, seed)
    rows = plan.rows[: len(times)] if plan.rows else None

    async def drive(client: Any) -> tuple[Records, float, float]:
        if pool is not None:
            return await pool.open(target, times, rows)
        cpu0 = time.process_time()
        if rows is None:
            out = await scheduled_run(lambda _: target.call(client), None, times, rows=target.rows)
        else:
            sizes = iter(rows)
            out = await scheduled_run(
                lambda _: target.call(client, next(sizes)), None, times, rows=rows
            )
        return (*out, time.process_time() - cpu0)

    (records, elapsed, cpu), stages = await _measured(
        target, connections if pool is None else 1, drive
    )
    span = max(float(times[-1]) if len(times) else 0.0, 1e-9)
    result = run_result(
        f"{target.mode}-open",
        f"{target.kind}: {plan.label}",
        records.latencies(),
        target.rows,
        max(elapsed, span),
        offered_per_s=len(times) / span,
        errors=len(records.errors),
        late_share=records.late_share(),
        **stages,
        **_client(cpu, len(times), pool),
    )
    if rows is not None:  # (a trace's own sizes)
        result["rows_per_s"] = float(np.sum(np.asarray(rows)[records.ok])) / max(elapsed, span)
    return result, records


async def run_open(target: Target, rate: float, duration: float, concurrency: int) -> dict:
    """Poisson arrivals at ``rate``."""
    result, _ = await run_scheduled(target, Schedule("poisson", rate), duration, concurrency)
    return result


def run_stable(
    loop: asyncio.AbstractEventLoop,
    target: Target,
    concurrency: int,
    duration: float,
    threshold: float,
    max_windows: int,
    pool: ClientPool | None = None,
) -> dict:
    """A closed-loop run measured in windows of ``duration`` until the last three agree
    within ``threshold`` (throughput and mean latency), as perf_analyzer does; the
    result merges those three and says whether they agreed (``stable``)."""
    windows, ok = method.stable(
        lambda: loop.run_until_complete(run_closed(target, concurrency, duration, pool)),
        threshold=threshold,
        max_windows=max_windows,
    )
    return merge_windows(windows) | {"stable": ok}


def search_goodput(
    loop: asyncio.AbstractEventLoop,
    target: Target,
    plan: Schedule,
    objective_ms: float,
    high: float,
    duration: float,
    connections: int,
    percentile: str = "p99_ms",
    pool: ClientPool | None = None,
) -> dict:
    """The highest rate (of ``plan``'s shape) whose ``percentile`` latency is within
    ``objective_ms`` (``method.goodput``: bisection between ``high`` / 64 and ``high``)."""
    rows: list[dict] = []

    def probe(rate: float) -> float:
        result, _ = loop.run_until_complete(
            run_scheduled(target, plan.at(rate), duration, connections, pool=pool)
        )
        rows.append(result)
        return result[percentile] if not result["errors"] else float("inf")

    best, probed = method.goodput(probe, objective_ms, high / 64, high)
    return {
        "objective_ms": objective_ms,
        "percentile": percentile,
        "goodput_per_s": best,
        "at_least": best >= high,  # met at the highest rate searched
        "probes": [{"rate": r, percentile: v} for r, v in probed],
        "runs": rows,
    }


def bench_url(
    url: str,
    model: str,
    *,
    concurrency: list[int],
    rows: int,
    duration: float,
    binary: bool,
    out_dir: str | None,
    arrival: str = "poisson",
    rates: list[float] | None = None,
    stability: tuple[float, int] | None = None,
    goodput_ms: float | None = None,
    csv_path: str | None = None,
    records_path: str | None = None,
    client_procs: int = 1,
    shapes: dict[str, list[int]] | None = None,
    input_data: str | None = None,
) -> dict:
    """The closed-loop sweep (each until stable with ``stability``: (threshold, max
    windows)), then open loop on ``arrival``'s shape at each of ``rates`` (default: half
    the best closed-loop rate; a trace at its own), then the goodput search under
    ``goodput_ms`` (p99). ``client_procs`` > 1: the load comes from that many processes
    (``serving.bench.procs``)."""
    from tqdm.auto import tqdm

    plans(arrival, rates, 1.0)  # a bad spec fails before any run
    loop = new_event_loop()
    pool = ClientPool(client_procs, make_target) if client_procs > 1 else None
    results: list[dict] = []
    recorded: list[tuple[str, Records]] = []
    search = None
    try:
        target = make_target(url, model, rows, binary, shapes, input_data)

        async def prepare() -> None:
            async with _session(1) as session:
                await target.prepare(session)

        loop.run_until_complete(prepare())
        steps = len(concurrency) + len(rates or [None]) + (1 if goodput_ms else 0)
        with tqdm(total=steps, desc="pxrt bench", unit="run", leave=False) as bar:
            for c in concurrency:
                bar.set_postfix_str(f"HTTP x{c}")
                if stability is not None:
                    results.append(run_stable(loop, target, c, duration, *stability, pool=pool))
                else:
                    results.append(loop.run_until_complete(run_closed(target, c, duration, pool)))
                bar.update()
            best = max((r["requests_per_s"] for r in results), default=0.0)
            runs = plans(arrival, rates, best / 2 if best else 100.0)
            connections = max(concurrency, default=64)
            for plan in runs:
                bar.set_postfix_str(plan.label)
                result, records = loop.run_until_complete(
                    run_scheduled(target, plan, duration, connections, pool=pool)
                )
                results.append(result)
                recorded.append((result["label"], records))
                if result["late_share"] > 0.05:
                    print(
                        f"pxrt bench: warning: {result['late_share']:.0%} of the requests of "
                        f"{plan.label} were sent over 2 ms late: the load generator could "
                        "not keep up, so this rate was not offered",
                        file=sys.stderr,
                    )
                bar.update()
            if goodput_ms:
                bar.set_postfix_str(f"goodput under p99 {goodput_ms:g} ms")
                high = 1.5 * (best or max(p.rate for p in runs))
                shape = runs[0] if runs[0].kind != "trace" else Schedule("poisson", 1.0)
                search = search_goodput(
                    loop, target, shape, goodput_ms, high, duration, connections, pool=pool
                )
                bar.update()
    finally:
        if "target" in locals():
            loop.run_until_complete(target.aclose())
        loop.close()
        if pool is not None:
            pool.close()
    report = {
        "url": url,
        "model": model,
        "binary": binary,
        "rows_per_request": rows,
        "duration_s": duration,
        "results": results,
    }
    if search is not None:
        report["goodput"] = search
    print(
        f"\n{url} model {model!r}, {rows}-row requests, "
        f"{'binary' if binary or url.startswith('grpc://') else 'JSON'} tensors, "
        f"{duration:g} s per run"
    )
    print_table(results)
    costs = ", ".join(f"{r['client_cpu_us']:.0f}" for r in results if "client_cpu_us" in r)
    print(
        f"client: {client_procs} process(es), CPU per request by run: {costs} us "
        "(a client near its cores' limit measures itself: raise --client-procs)"
    )
    for r in results:
        if r.get("stable") is False:
            print(f"unstable: {r['label']} (the last 3 of {r['windows']} windows disagree)")
        if r.get("late_share"):
            print(f"sent late (over 2 ms): {r['late_share']:.1%} of {r['label']}")
    if search is not None:
        print(
            f"goodput: {'at least ' if search['at_least'] else ''}"
            f"{search['goodput_per_s']:,.0f} req/s keep p99 within "
            f"{goodput_ms:g} ms ({len(search['probes'])} probes)"
        )
    write_report(report, results, out_dir)
    if csv_path:
        write_csv(csv_path, results)
        print(f"wrote {csv_path}")
    if records_path:
        write_records(records_path, recorded)
        print(f"wrote {records_path}")
    return report


def compare_urls(
    urls: tuple[str, str],
    model: str,
    *,
    concurrency: list[int],
    rows: int,
    duration: float,
    binary: bool,
    repeats: int,
    out_dir: str | None,
    client_procs: int = 1,
    shapes: dict[str, list[int]] | None = None,
    input_data: str | None = None,
) -> dict:
    """Two servers (the same model) at each concurrency, alternated ``repeats`` times
    (A B, B A, ...); each pair gives a ratio B / A of throughput and of p50 and p99, and
    the report gives their geometric means with 95% intervals."""
    from tqdm.auto import tqdm

    loop = new_event_loop()
    pool = ClientPool(client_procs, make_target) if client_procs > 1 else None
    rows_out: list[dict] = []
    try:
        targets = [make_target(u, model, rows, binary, shapes, input_data) for u in urls]

        async def prepare() -> None:
            async with _session(1) as session:
                for t in targets:
                    await t.prepare(session)

        loop.run_until_complete(prepare())
        with tqdm(total=len(concurrency) * repeats * 2, desc="pxrt bench --compare",
                  unit="run", leave=False) as bar:  # fmt: skip
            for c in concurrency:
                runs: list[list[dict]] = [[], []]
                for rep in range(repeats):
                    order = (0, 1) if rep % 2 == 0 else (1, 0)
                    for i in order:
                        runs[i].append(
                            loop.run_until_complete(run_closed(targets[i], c, duration, pool))
                        )
                        bar.update()
                rows_out.append(method.compare_row(c, runs[0], runs[1]))
    finally:
        if "targets" in locals():
            for t in targets:
                loop.run_until_complete(t.aclose())
        loop.close()
        if pool is not None:
            pool.close()
    report = {"urls": list(urls), "model": model, "repeats": repeats, "compare": rows_out}
    method.print_compare(urls, repeats, rows_out)
    write_compare(report, out_dir)
    return report
