"""``pxrt bench --url``: the same closed- and open-loop runs over HTTP against a running
KServe v2 server (pxrt serve, or any other), with binary tensors (``--json`` for JSON).

The server-side stage breakdown comes from the model's statistics endpoint, as deltas
over each run.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import numpy as np

from .. import codec
from ..server import new_event_loop
from .loadgen import closed_loop, open_loop, run_result
from .report import print_table, write_report


class Target:
    """A model on a running server, and one prepared request body for it."""

    def __init__(self, url: str, model: str, rows: int, binary: bool) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.rows = rows
        self.binary = binary
        self.infer_url = f"{self.url}/v2/models/{model}/infer"
        self.body = b""
        self.headers: dict[str, str] = {}

    async def prepare(self, session: aiohttp.ClientSession) -> None:
        async with session.get(f"{self.url}/v2/models/{self.model}") as r:
            if r.status != 200:
                raise SystemExit(
                    f"pxrt bench: {self.url} has no model {self.model!r} "
                    f"({r.status}: {await r.text()})"
                )
            meta = await r.json()
        rng = np.random.default_rng(0)
        inputs = []
        blobs = []
        for spec in meta["inputs"]:
            dtype = codec.DATATYPES[spec["datatype"]]
            shape = [self.rows, *spec["shape"][1:]]
            if dtype.kind == "f" or spec["datatype"] == "BF16":
                x = rng.standard_normal(shape).astype(dtype)
            elif dtype.kind == "b":
                x = rng.random(shape) < 0.5
            else:
                x = rng.integers(0, 10, shape).astype(dtype)
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
        self.body = header + b"".join(blobs)
        self.headers = {
            "Content-Type": "application/octet-stream" if self.binary else "application/json"
        }
        if self.binary:
            self.headers["Inference-Header-Content-Length"] = str(len(header))

    async def call(self, session: aiohttp.ClientSession) -> None:
        async with session.post(self.infer_url, data=self.body, headers=self.headers) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}")

    async def stats(self, session: aiohttp.ClientSession) -> dict | None:
        try:
            async with session.get(f"{self.url}/v2/models/{self.model}/stats") as r:
                if r.status != 200:
                    return None
                return (await r.json())["model_stats"][0]
        except (aiohttp.ClientError, KeyError, IndexError):
            return None


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


async def _measured(target: Target, connections: int, drive: Any) -> tuple[Any, dict]:
    """``await drive(session)`` over a warm connection pool; returns its result and the
    server's stage breakdown over the run (from its statistics endpoint)."""
    async with _session(connections) as session:
        await target.call(session)  # warm the connection path
        before = await target.stats(session)
        out = await drive(session)
        after = await target.stats(session)
    return out, _stage_delta(before, after)


async def run_closed(target: Target, concurrency: int, duration: float) -> dict:
    (latencies, elapsed, errors), stages = await _measured(
        target,
        concurrency,
        lambda session: closed_loop(
            lambda _: target.call(session), None, concurrency, duration, count_errors=True
        ),
    )
    kind = "binary" if target.binary else "JSON"
    return run_result(
        "http-closed",
        f"HTTP {kind}: {concurrency} clients",
        latencies,
        target.rows,
        elapsed,
        concurrency=concurrency,
        errors=errors,
        **stages,
    )


async def run_open(target: Target, rate: float, duration: float, concurrency: int) -> dict:
    (latencies, errors), stages = await _measured(
        target,
        concurrency,
        lambda session: open_loop(
            lambda _: asyncio.ensure_future(target.call(session)), None, rate, duration
        ),
    )
    kind = "binary" if target.binary else "JSON"
    return run_result(
        "http-open",
        f"HTTP {kind}: Poisson at {rate:,.0f} req/s",
        latencies,
        target.rows,
        duration,
        offered_per_s=rate,
        errors=errors,
        **stages,
    )


def bench_url(
    url: str,
    model: str,
    *,
    concurrency: list[int],
    rows: int,
    duration: float,
    binary: bool,
    out_dir: str | None,
) -> dict:
    """The closed-loop sweep, then open loop at half the best closed-loop rate."""
    from tqdm.auto import tqdm

    loop = new_event_loop()
    results: list[dict] = []
    try:
        target = Target(url, model, rows, binary)

        async def prepare() -> None:
            async with _session(1) as session:
                await target.prepare(session)

        loop.run_until_complete(prepare())
        with tqdm(total=len(concurrency) + 1, desc="pxrt bench", unit="run", leave=False) as bar:
            for c in concurrency:
                bar.set_postfix_str(f"HTTP x{c}")
                results.append(loop.run_until_complete(run_closed(target, c, duration)))
                bar.update()
            best = max(r["requests_per_s"] for r in results)
            bar.set_postfix_str("open loop")
            results.append(
                loop.run_until_complete(run_open(target, best / 2, duration, max(concurrency)))
            )
            bar.update()
    finally:
        loop.close()
    report = {
        "url": url,
        "model": model,
        "binary": binary,
        "rows_per_request": rows,
        "duration_s": duration,
        "results": results,
    }
    print(
        f"\n{url} model {model!r}, {rows}-row requests, "
        f"{'binary' if binary else 'JSON'} tensors, {duration:g} s per run"
    )
    print_table(results)
    write_report(report, results, out_dir)
    return report
