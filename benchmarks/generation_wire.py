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

The serving side's CPU per token is read too: the `pxrt serve` process tree's (workers
included) against this process's own for the in-process API (both include the decode
steps' compute), and its front end's alone (``loop``: the main thread, where the event
loop runs, plus any workers; in process: the callers' loop); the SSE client's CPU per
token beside it. ``--configs`` picks the `pxrt serve` set-ups streamed from, alternated
with the in-process API: ``one`` (one process, streams on its native HTTP path),
``asgi`` (``--no-native-http``: through the Starlette app), ``workers2`` (two front-end
workers). ``--burn 0.2`` adds the control: the in-process API beside a process spinning
that share of a core, which is what the wire's CPU alone costs the decode steps when the
server, the client and XLA share the cores.

    python benchmarks/generation_wire.py [--requests 256] [--repeats 3] [--fraction 0.5]
                                         [--configs one,asgi,workers2] [--burn 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
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


CONFIGS = {"one": [], "asgi": ["--no-native-http"], "workers2": ["--workers", "2"]}


def _stat_cpu_s(path: str) -> float:
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int, with_children: bool = True) -> tuple[float, float]:
    """CPU seconds (user + system) of ``pid`` and its children (``--workers``), and of
    their front ends alone: ``pid``'s main thread (its event loop) and the children."""
    from servers import children

    kids = sum(_stat_cpu_s(f"/proc/{p}/stat") for p in children(pid)) if with_children else 0.0
    return _stat_cpu_s(f"/proc/{pid}/stat") + kids, _stat_cpu_s(
        f"/proc/{pid}/task/{pid}/stat"
    ) + kids


_BURN = """
import sys, time
duty, period = float(sys.argv[1]), 0.002
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < duty * period:
        pass
    time.sleep(period * (1 - duty))
"""


def _burner(share: float) -> subprocess.Popen:
    """A process spinning ``share`` of a core (2 ms periods)."""
    return subprocess.Popen([sys.executable, "-c", _BURN, str(share)])


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
    p.add_argument(
        "--burn",
        type=float,
        default=0.0,
        help="also run in process beside a process spinning this share of a core (the "
        "control: what the wire's CPU alone would cost, e.g. 0.2)",
    )
    p.add_argument(
        "--configs",
        default="one",
        help=f"comma-separated pxrt serve set-ups to stream from, of {sorted(CONFIGS)}",
    )
    args = p.parse_args()
    configs = args.configs.split(",")
    for name in configs:
        if name not in CONFIGS:
            p.error(f"unknown config {name!r}; expected one of {sorted(CONFIGS)}")
    with tempfile.TemporaryDirectory(prefix="pxrt-wire-") as tmp:
        path = demo.export_lm(os.path.join(tmp, "lm"), slots=32)
        # One cache everywhere: tiers learned while serving would switch at other times
        # in each process, beside the runs that compare them.
        dec = pxrt.load(path, length_tiers="off")
        config = os.path.join(tmp, "pxrt.toml")
        with open(config, "w") as f:
            f.write('[models.lm]\nlength_tiers = "off"\n')
        served = {
            name: ServeProcess([path, "--config", config, *CONFIGS[name]]) for name in configs
        }
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
                runs: dict = {"in-process": [], **{f"sse {n}": [] for n in configs}}
                if args.burn:
                    runs["in-process+burn"] = []
                limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
                async with httpx.AsyncClient(timeout=120, limits=limits) as client:

                    async def local(prompt, m, record):
                        await generation.one("pxrt", dec, prompt, m, record)

                    path = "/v2/models/lm/generate_stream"

                    def wire(proc):
                        async def one(prompt, m, record):
                            if args.client == "raw":
                                await sse_raw("127.0.0.1", proc.port, path, prompt, m, record)
                            else:
                                await sse_one(client, proc.url + path, prompt, m, record)

                        return one

                    async def step_sum(proc) -> tuple[float, float]:
                        """The serving decoder's step intervals so far: (sum us, count)."""
                        text = (await client.get(f"{proc.url}/metrics")).text
                        sums = [
                            x
                            for x in text.splitlines()
                            if x.startswith("pxrt_decode_step_duration_us_")
                        ]

                        def get(key: str) -> float:
                            return float(next(x for x in sums if x.startswith(key)).split()[-1])

                        return (
                            get("pxrt_decode_step_duration_us_sum"),
                            get("pxrt_decode_step_duration_us_count"),
                        )

                    for proc in served.values():
                        await poisson(wire(proc), work[:16], rate, 99)  # warm the connections
                    order = ["in-process", *configs] + (["in-process+burn"] if args.burn else [])
                    for rep in range(args.repeats):
                        for kind in order if rep % 2 == 0 else order[::-1]:
                            proc = served.get(kind)
                            dec.drain_timings()
                            burner = _burner(args.burn) if kind == "in-process+burn" else None
                            if proc is None:
                                (cpu0, loop0), client0 = _cpu_s(os.getpid(), False), 0.0
                                r = await poisson(local, work, rate, rep)
                                cpu1, loop1 = _cpu_s(os.getpid(), False)
                                step = 1e3 * float(np.mean(dec.drain_timings()["step"]))
                                client_cpu = 0.0
                            else:
                                before = await step_sum(proc)
                                (cpu0, loop0), client0 = _cpu_s(proc.proc.pid), time.process_time()
                                r = await poisson(wire(proc), work, rate, rep)
                                cpu1, loop1 = _cpu_s(proc.proc.pid)
                                client_cpu = time.process_time() - client0
                                after = await step_sum(proc)
                                step = (after[0] - before[0]) / max(after[1] - before[1], 1) / 1e3
                            if burner is not None:
                                burner.kill()
                                burner.wait()
                            runs[kind if proc is None else f"sse {kind}"].append(
                                generation.summary(r)
                                | {
                                    "step ms": step,
                                    # the serving side's CPU (in process: all of it)
                                    "cpu us/tok": 1e6 * (cpu1 - cpu0) / r["tokens"],
                                    # its event loop's (in process: the callers')
                                    "loop us/tok": 1e6 * (loop1 - loop0) / r["tokens"],
                                    "client us/tok": 1e6 * client_cpu / r["tokens"],
                                }
                            )
                return runs

            runs = asyncio.run(bench())
        finally:
            for proc in served.values():
                proc.stop()
            dec.close()
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    cols = ("tok/s", "ttft p50", "itl p50", "itl p99", "step ms", "cpu us/tok", "loop us/tok")
    print(f"{'':<16}" + "".join(f"{c:>12}" for c in cols) + f"{'client us/tok':>15}")
    for kind, m in med.items():
        print(
            f"{kind:<16}" + "".join(f"{m[c]:>12.2f}" for c in cols) + f"{m['client us/tok']:>15.1f}"
        )
    base = med["in-process"]
    for kind in [f"sse {c}" for c in configs] + (["in-process+burn"] if args.burn else []):
        a = med[kind]
        label = kind.removeprefix("sse ").replace("in-process+", "") + " / local"
        print(f"{label:<16}" + "".join(f"{a[c] / base[c]:>11.2f}x" for c in cols))


if __name__ == "__main__":
    main()
