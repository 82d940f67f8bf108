"""What the wire adds to generation: server-sent events from `pxrt serve` against the
in-process API on the same model, side by side.

The demo decoder (32 slots) is served by `pxrt serve`; the same artifact is loaded in
this process. Prompts and output lengths are long-tailed (as in ``generation.py``);
greedy. First the in-process closed-loop rate (64 callers) sets the saturated rate; then
Poisson arrivals at ``--fraction`` of it (default half), alternated ``--repeats`` times:

- in-process: ``Decoder.agenerate``;
- SSE: ``POST /v2/models/lm/generate_stream`` with ``input_ids``, one connection per
  request, read by a minimal client (asyncio streams, orjson: ``--client raw``, the
  default) or by httpx's async client (``--client httpx``); tokens are timed as their
  events arrive.

Reported: time to first token and inter-token latency, p50 and p99, the decoder's mean
interval between steps (the serving process's, from its ``/metrics``), and the ratios
wire / in-process. The client runs in this process on the same cores as the server, so the
ratios include the client's own cost (the minimal client keeps it small).

    python benchmarks/generation_wire.py [--requests 256] [--repeats 3] [--fraction 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import httpx
import numpy as np
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

import generation  # noqa: E402
from servers import ServeProcess  # noqa: E402

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402


async def sse_one(
    client: httpx.AsyncClient, url: str, prompt, max_tokens: int, record: dict
) -> None:
    t0 = time.perf_counter()
    times = []
    body = {"input_ids": [int(t) for t in prompt], "max_tokens": max_tokens}
    async with client.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                doc = json.loads(line[6:])
                now = time.perf_counter()
                times.extend([now] * len(doc.get("output_ids", ())))
    record["ttft"].append(times[0] - t0)
    record["itl"].extend(np.diff(times).tolist())
    record["tokens"] += len(times)


async def sse_raw(host: str, port: int, path: str, prompt, max_tokens: int, record: dict) -> None:
    """The same request from a minimal client (asyncio streams, HTTP/1.1 chunks, orjson):
    far less CPU per event than httpx, so that the server's cost is what is measured."""
    t0 = time.perf_counter()
    body = orjson.dumps({"input_ids": [int(t) for t in prompt], "max_tokens": max_tokens})
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n"
        % (path.encode(), host.encode(), len(body))
        + body
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.decode(errors="replace"))
    times: list[float] = []
    buffer = b""
    while True:
        size = int((await reader.readline()).strip(), 16)
        if size == 0:
            break
        buffer += (await reader.readexactly(size + 2))[:-2]
        now = time.perf_counter()
        while b"\n\n" in buffer:
            event, _, buffer = buffer.partition(b"\n\n")
            if event.startswith(b"data: "):
                times.extend([now] * len(orjson.loads(event[6:]).get("output_ids", ())))
    writer.close()
    if not times:
        raise RuntimeError("a stream without tokens")
    record["ttft"].append(times[0] - t0)
    record["itl"].extend(np.diff(times).tolist())
    record["tokens"] += len(times)


async def poisson(one, work, rate: float, seed: int) -> dict:
    record: dict = {"ttft": [], "itl": [], "tokens": 0, "stamps": []}
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(work))
    t0 = at = time.perf_counter()
    tasks = []
    for (prompt, m), gap in zip(work, gaps):
        at += gap
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(prompt, m, record)))
    await asyncio.gather(*tasks)
    record["elapsed"] = time.perf_counter() - t0
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="the SSE client: a minimal one (default), or httpx",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pxrt-wire-") as tmp:
        path = demo.export_lm(os.path.join(tmp, "lm"), slots=32)
        dec = pxrt.load(path)
        served = ServeProcess([path])
        url = f"{served.url}/v2/models/lm/generate_stream"
        work = generation.workload(args.requests, 0, 64, 192)
        try:

            async def bench() -> dict:
                closed = await generation.closed("pxrt", dec, work, 64)
                mean_out = np.mean([m for _, m in work])
                rate = args.fraction * closed["tokens"] / closed["elapsed"] / mean_out
                print(
                    f"saturated in process: {closed['tokens'] / closed['elapsed']:,.0f} tok/s; "
                    f"Poisson at {rate:.1f} requests/s"
                )
                runs: dict = {"in-process": [], "sse": []}
                limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
                async with httpx.AsyncClient(timeout=120, limits=limits) as client:

                    async def local(prompt, m, record):
                        await generation.one("pxrt", dec, prompt, m, record)

                    host, port = "127.0.0.1", served.port
                    path = "/v2/models/lm/generate_stream"

                    async def wire(prompt, m, record):
                        if args.client == "raw":
                            await sse_raw(host, port, path, prompt, m, record)
                        else:
                            await sse_one(client, url, prompt, m, record)

                    async def step_sum() -> tuple[float, float]:
                        """The serving decoder's step intervals so far: (sum us, count)."""
                        text = (await client.get(f"{served.url}/metrics")).text
                        sums = [
                            x
                            for x in text.splitlines()
                            if x.startswith("pxrt_decode_step_duration_us_")
                        ]
                        get = lambda k: float(
                            next(x for x in sums if x.startswith(k)).rsplit(" ", 1)[1]
                        )  # noqa: E731
                        return get("pxrt_decode_step_duration_us_sum"), get(
                            "pxrt_decode_step_duration_us_count"
                        )

                    await poisson(wire, work[:16], rate, 99)  # warm the connections
                    for rep in range(args.repeats):
                        order = [("in-process", local), ("sse", wire)]
                        for kind, one in order if rep % 2 == 0 else order[::-1]:
                            dec.drain_timings()
                            before = await step_sum()
                            r = await poisson(one, work, rate, rep)
                            if kind == "sse":
                                after = await step_sum()
                                step = (after[0] - before[0]) / max(after[1] - before[1], 1) / 1e3
                            else:
                                step = 1e3 * float(np.mean(dec.drain_timings()["step"]))
                            runs[kind].append(generation.summary(r) | {"step ms": step})
                return runs

            runs = asyncio.run(bench())
        finally:
            served.stop()
            dec.close()
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    cols = ("tok/s", "ttft p50", "ttft p99", "itl p50", "itl p99", "step ms")
    print(f"{'':<12}" + "".join(f"{c:>10}" for c in cols))
    for kind, m in med.items():
        print(f"{kind:<12}" + "".join(f"{m[c]:>10.2f}" for c in cols))
    a, b = med["sse"], med["in-process"]
    print(f"{'sse / local':<12}" + "".join(f"{a[c] / b[c]:>9.2f}x" for c in cols))


if __name__ == "__main__":
    main()
