"""``pxrt bench --url URL --model lm`` for a decoder: generation measured as genai-perf and
``vllm bench serve`` measure it, over the generate extension's server-sent events.

Each request is a prompt of token ids (lengths drawn from ``--prompt-tokens``, ids
below the vocabulary) asking for ``--output-tokens`` tokens (greedy), streamed from
``POST /v2/models/{m}/generate_stream``; every token is timed as its event arrives.
Closed-loop concurrency sweeps and open-loop schedules (``serving.bench.schedule``) as
for one-shot models. Reported per run:

- time to first token (TTFT: from the request's send to its first token);
- inter-token latency (ITL: between consecutive tokens of a stream, every pair);
- time per output token (TPOT: a request's (last - first) / (tokens - 1));
- requests and output tokens per second, errors, and the share sent late;

and, with an objective, the goodput: the highest rate whose TTFT (or ITL, or TPOT) p99
stays within it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import orjson

from ..loops import new_event_loop
from . import method
from .loadgen import clock, closed_loop, scheduled_run
from .schedule import Schedule, parse_lengths, plans
from .wire import make_client, request_bytes

PLATFORM = "pxrt_jax_decoder"
METRICS = ("ttft", "itl", "tpot")


class _Stream:
    """One request's response: its events parsed as they arrive, its tokens timed."""

    __slots__ = ("buf", "times", "error", "t0")

    def __init__(self) -> None:
        self.buf = b""
        self.times: list[float] = []
        self.error: str | None = None
        self.t0 = clock()

    def __call__(self, piece: bytes) -> None:
        now = clock()
        self.buf += piece
        while b"\n\n" in self.buf:
            event, _, self.buf = self.buf.partition(b"\n\n")
            if not event.startswith(b"data: "):
                continue
            doc = orjson.loads(event[6:])
            if "error" in doc:
                self.error = str(doc["error"])
            self.times.extend([now] * len(doc.get("output_ids", ())))


class GenTarget:
    """A decoder on a running server and the requests drawn for it (over HTTP's
    generate extension, or ``grpc://``: decoupled ``ModelStreamInfer``)."""

    def __init__(
        self, url: str, model: str, prompt_tokens: str, output_tokens: str, n: int = 512
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.n = n
        self.stream_url = f"{self.url}/v2/models/{model}/generate_stream"
        self.grpc = self.url.startswith("grpc://")
        self.wire: list[bytes] = []
        self.bodies: list[tuple[bytes, dict]] = []
        self.messages: list[bytes] = []  # gRPC: serialized ModelInferRequests
        self.config: dict = {}

    def client(self, connections: int) -> Any:
        if self.grpc:
            from .grpc import GrpcClient, GrpcTarget

            return GrpcClient(GrpcTarget(self.url, self.model, 1).address)
        return make_client(self.url, connections)

    async def _grpc_config(self) -> dict:
        from google.protobuf import json_format
        from tritonclient.grpc import service_pb2 as pb

        from .grpc import SERVICE

        client = self.client(1)
        try:
            call = client.channel.unary_unary(SERVICE + "ModelConfig")
            raw = await call(pb.ModelConfigRequest(name=self.model).SerializeToString())
        except Exception as exc:  # noqa: BLE001 - said as the HTTP path says it
            raise SystemExit(
                f"pxrt bench: {self.url} has no model {self.model!r} ({exc})"
            ) from None
        finally:
            await client.close()
        doc = json_format.MessageToDict(
            pb.ModelConfigResponse.FromString(raw), preserving_proto_field_name=True
        )
        return doc.get("config", {})

    async def prepare(self, session: Any) -> None:
        """Read the decoder's config (vocabulary, prefill lengths, cache length) and
        draw the requests: prompts within the longest prefill, outputs within the cache."""
        if self.grpc:
            self.config = await self._grpc_config()
        else:
            from .http import get_model_doc

            self.config = await get_model_doc(session, self.url, self.model, "/config")
        params = {
            k: v.get("string_value", "") for k, v in self.config.get("parameters", {}).items()
        }
        vocab = int(params.get("vocab") or 256)
        longest = int((params.get("prefill_lengths") or "64").split(",")[-1])
        max_length = int(params.get("max_length") or 2048)
        prompts = parse_lengths(self.prompt_tokens, longest, "--prompt-tokens")(self.n, 1)
        outputs = parse_lengths(self.output_tokens, max_length, "--output-tokens")(self.n, 2)
        rng = np.random.default_rng(3)
        headers = {"Content-Type": "application/json"}
        for p, o in zip(prompts, outputs):
            ids = rng.integers(0, min(vocab, 256), int(p))
            max_tokens = int(max(1, min(o, max_length - p)))
            if self.grpc:
                self.messages.append(_stream_request(self.model, ids, max_tokens))
                continue
            body = orjson.dumps({"input_ids": ids.tolist(), "max_tokens": max_tokens,
                                 "temperature": 0.0})  # fmt: skip
            self.bodies.append((body, headers))
            self.wire.append(request_bytes(self.stream_url, body, headers))

    async def call(self, client: Any, i: int, out: list) -> None:
        """Stream request ``i`` (of the drawn ones, in turn); its record goes to ``out``."""
        stream = _Stream()
        try:
            if self.grpc:
                await _grpc_stream(client, self.messages[i % self.n], stream)
                status = 200
            elif hasattr(client, "send"):
                status = await client.send(self.wire[i % self.n], stream)
            else:  # https: aiohttp, read whole (tokens timed as the body arrives)
                body, headers = self.bodies[i % self.n]
                async with client.session.post(self.stream_url, data=body, headers=headers) as r:
                    async for piece in r.content.iter_any():
                        stream(piece)
                    status = r.status
        except Exception as exc:  # noqa: BLE001 - counted
            stream.error = f"{type(exc).__name__}: {exc}"
            status = 0
        if status != 200 and stream.error is None:
            stream.error = f"HTTP {status}"
        out.append(stream)
        if stream.error is not None:
            raise RuntimeError(stream.error)


def _stream_request(model: str, ids: np.ndarray, max_tokens: int) -> bytes:
    """A decoupled generate request: ``input_ids`` (INT32), greedy, ``max_tokens``."""
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="input_ids", datatype="INT32", shape=[len(ids)])
    request.raw_input_contents.append(ids.astype(np.int32).tobytes())
    request.parameters["max_tokens"].int64_param = max_tokens
    request.parameters["temperature"].double_param = 0.0
    return request.SerializeToString()


async def _grpc_stream(client: Any, message: bytes, stream: _Stream) -> None:
    """One request on its own ``ModelStreamInfer`` stream; each response's tokens are
    timed as it arrives, until the final one (or an error)."""
    from tritonclient.grpc import service_pb2 as pb

    from .grpc import SERVICE

    call = client.channel.stream_stream(SERVICE + "ModelStreamInfer")(iter([message]))
    async for raw in call:
        now = clock()
        response = pb.ModelStreamInferResponse.FromString(raw)
        if response.error_message:
            stream.error = response.error_message
            break
        infer = response.infer_response
        if infer.raw_output_contents:
            stream.times.extend([now] * (len(infer.raw_output_contents[0]) // 4))
        if infer.parameters["triton_final_response"].bool_param:
            break
    call.cancel()


def summarize(mode: str, label: str, streams: list, elapsed: float, **extra: Any) -> dict:
    """One run's row: rates and the TTFT, ITL and TPOT percentiles (ms)."""
    ok = [s for s in streams if s.error is None and s.times]
    ttft = [s.times[0] - s.t0 for s in ok]
    itl = [d for s in ok for d in np.diff(s.times).tolist()]
    tpot = [(s.times[-1] - s.times[0]) / (len(s.times) - 1) for s in ok if len(s.times) > 1]

    def q(xs: list, p: float) -> float:
        return float(np.percentile(xs, p) * 1e3) if xs else float("nan")

    out = {
        "mode": mode,
        "label": label,
        "requests_per_s": len(ok) / elapsed,
        "output_tokens_per_s": sum(len(s.times) for s in ok) / elapsed,
        "errors": len(streams) - len(ok),
    }
    for name, xs in (("ttft", ttft), ("itl", itl), ("tpot", tpot)):
        out |= {f"{name}_p50_ms": q(xs, 50), f"{name}_p99_ms": q(xs, 99)}
        out[f"{name}_mean_ms"] = float(np.mean(xs) * 1e3) if xs else float("nan")
    return out | extra


async def run_closed(target: GenTarget, concurrency: int, duration: float) -> dict:
    streams: list = []
    client = target.client(concurrency)
    counter = iter(range(1 << 62))
    try:
        _, elapsed, _ = await closed_loop(
            lambda _: target.call(client, next(counter), streams),
            None,
            concurrency,
            duration,
            count_errors=True,
        )
    finally:
        await client.close()
    return summarize(
        "generate-closed",
        f"generate: {concurrency} streams",
        streams,
        elapsed,
        concurrency=concurrency,
    )


async def run_open(
    target: GenTarget, plan: Schedule, duration: float, connections: int
) -> tuple[dict, list]:
    streams: list = []
    client = target.client(connections)
    times = plan.times(duration)
    counter = iter(range(len(times)))
    try:
        records, elapsed = await scheduled_run(
            lambda _: target.call(client, next(counter), streams), None, times
        )
    finally:
        await client.close()
    span = max(float(times[-1]) if len(times) else 0.0, 1e-9)
    row = summarize(
        "generate-open",
        f"generate: {plan.label}",
        streams,
        max(elapsed, span),
        offered_per_s=len(times) / span,
        late_share=records.late_share(),
    )
    return row, streams


def print_table(results: list[dict]) -> None:
    head = (
        f"{'run':<46} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>8} "
        f"{'ITL p50':>8} {'p99':>8} {'TPOT p50':>9} {'p99':>8} {'errors':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r['label']:<46} {r['requests_per_s']:>8,.1f} {r['output_tokens_per_s']:>10,.0f} "
            f"{r['ttft_p50_ms']:>9.2f} {r['ttft_p99_ms']:>8.2f} {r['itl_p50_ms']:>8.2f} "
            f"{r['itl_p99_ms']:>8.2f} {r['tpot_p50_ms']:>9.2f} {r['tpot_p99_ms']:>8.2f} "
            f"{r['errors']:>6}"
        )


def is_decoder(url: str, model: str) -> bool:
    """Whether ``model`` on ``url`` is a decoder (its metadata says so)."""
    import urllib.request

    if url.startswith("grpc://"):
        return _grpc_is_decoder(url, model)

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v2/models/{model}", timeout=10) as r:
            return json.loads(r.read()).get("platform") == PLATFORM
    except Exception:  # noqa: BLE001 - not reachable or not a decoder: the infer bench says
        return False


def _grpc_is_decoder(url: str, model: str) -> bool:
    from .grpc import GrpcTarget

    target = GrpcTarget(url, model, 1)
    loop = new_event_loop()
    try:
        loop.run_until_complete(target.prepare())
    except SystemExit as exc:
        return "is a decoder" in str(exc)
    finally:
        loop.close()
    return False


def bench_generate(
    url: str,
    model: str,
    *,
    concurrency: list[int],
    duration: float,
    prompt_tokens: str,
    output_tokens: str,
    arrival: str = "poisson",
    rates: list[float] | None = None,
    goodput_ms: float | None = None,
    goodput_metric: str = "ttft",
    records_path: str | None = None,
    out_dir: str | None = None,
) -> dict:
    """The closed-loop sweep, open loop at each rate (default: half the best closed-loop
    request rate), and the goodput search on ``goodput_metric``'s p99."""
    import aiohttp
    from tqdm.auto import tqdm

    plans(arrival, rates, 1.0)  # a bad spec fails before any run
    loop = new_event_loop()
    target = GenTarget(url, model, prompt_tokens, output_tokens)
    results: list[dict] = []
    recorded: list[tuple[str, list]] = []
    search: dict[str, Any] | None = None
    try:

        async def prepare() -> None:
            async with aiohttp.ClientSession() as session:
                await target.prepare(session)

        loop.run_until_complete(prepare())
        steps = len(concurrency) + len(rates or [None]) + (1 if goodput_ms else 0)
        with tqdm(total=steps, desc="pxrt bench (generate)", unit="run", leave=False) as bar:
            for c in concurrency:
                results.append(loop.run_until_complete(run_closed(target, c, duration)))
                bar.update()
            best = max((r["requests_per_s"] for r in results), default=0.0)
            connections = max(concurrency, default=64) * 4
            runs = plans(arrival, rates, best / 2 if best else 1.0)
            for plan in runs:
                row, streams = loop.run_until_complete(
                    run_open(target, plan, duration, connections)
                )
                results.append(row)
                recorded.append((row["label"], streams))
                bar.update()
            if goodput_ms:
                key = f"{goodput_metric}_p99_ms"

                def probe(rate: float) -> float:
                    shape = runs[0] if runs[0].kind != "trace" else Schedule("poisson", 1.0)
                    row, _ = loop.run_until_complete(
                        run_open(target, shape.at(rate), duration, connections)
                    )
                    return row[key] if not row["errors"] else float("inf")

                high = 1.5 * (best or max(p.rate for p in runs))
                rate, probed = method.goodput(probe, goodput_ms, high / 64, high)
                search = {
                    "objective_ms": goodput_ms,
                    "metric": key,
                    "goodput_per_s": rate,
                    "at_least": rate >= high,  # met at the highest rate searched
                    "probes": [{"rate": r, key: v} for r, v in probed],
                }
                bar.update()
    finally:
        loop.close()
    print(
        f"\n{url} decoder {model!r}: prompts {prompt_tokens} tokens, outputs {output_tokens} "
        f"tokens (greedy), {duration:g} s per run; times in ms"
    )
    print_table(results)
    for r in results:
        if r.get("late_share", 0) > 0.05:
            print(f"warning: {r['late_share']:.0%} of {r['label']} were sent over 2 ms late")
    if search is not None:
        print(
            f"goodput: {'at least ' if search['at_least'] else ''}"
            f"{search['goodput_per_s']:,.1f} req/s keep {goodput_metric.upper()} p99 "
            f"within {goodput_ms:g} ms ({len(search['probes'])} probes)"
        )
    report = {
        "url": url,
        "model": model,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "duration_s": duration,
        "results": results,
    }
    if search is not None:
        report["goodput"] = search
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {out_dir}/bench.json")
    if records_path:
        with open(records_path, "w") as f:
            for label, streams in recorded:
                for s in streams:
                    row = {"run": label, "tokens": len(s.times)}
                    if s.error is not None:
                        row["error"] = s.error
                    if s.times:
                        row["ttft_ms"] = round((s.times[0] - s.t0) * 1e3, 4)
                        row["latency_ms"] = round((s.times[-1] - s.t0) * 1e3, 4)
                    f.write(json.dumps(row) + "\n")
        print(f"wrote {records_path}")
    sys.stdout.flush()
    return report


class LocalTarget:
    """A decoder loaded in this process (``pxrt.load``), driven through its async API
    (``Decoder.agenerate``) with requests drawn as ``GenTarget`` draws them."""

    def __init__(self, decoder: Any, prompt_tokens: str, output_tokens: str, n: int = 512):
        self.decoder = decoder
        self.n = n
        prompts = parse_lengths(prompt_tokens, decoder.max_prompt, "--prompt-tokens")(n, 1)
        outputs = parse_lengths(output_tokens, decoder.max_length, "--output-tokens")(n, 2)
        rng = np.random.default_rng(3)
        self.requests = [
            (
                rng.integers(0, min(decoder.vocab, 256), int(p)).astype(np.int32),
                int(max(1, min(o, decoder.max_length - p))),
            )
            for p, o in zip(prompts, outputs)
        ]

    async def call(self, _client: Any, i: int, out: list) -> None:
        stream = _Stream()
        ids, max_tokens = self.requests[i % self.n]
        try:
            async for _ in self.decoder.agenerate(ids, max_tokens=max_tokens, temperature=0.0):
                stream.times.append(clock())
        except Exception as exc:  # noqa: BLE001 - counted
            stream.error = f"{type(exc).__name__}: {exc}"
        out.append(stream)
        if stream.error is not None:
            raise RuntimeError(stream.error)


def bench_local(
    decoder: Any,
    *,
    concurrency: list[int],
    duration: float,
    prompt_tokens: str,
    output_tokens: str,
    arrival: str = "poisson",
    rates: list[float] | None = None,
    out_dir: str | None = None,
) -> dict:
    """``pxrt bench models/lm``: the decoder in this process, the same runs and table as
    over the wire (what the wire adds is the difference)."""
    plans(arrival, rates, 1.0)  # a bad spec fails before any run
    target = LocalTarget(decoder, prompt_tokens, output_tokens)
    loop = new_event_loop()
    results: list[dict] = []

    async def closed(c: int) -> dict:
        streams: list = []
        counter = iter(range(1 << 62))
        _, elapsed, _ = await closed_loop(
            lambda _: target.call(None, next(counter), streams), None, c, duration,
            count_errors=True,
        )  # fmt: skip
        return summarize("generate-closed", f"in process: {c} streams", streams, elapsed,
                         concurrency=c)  # fmt: skip

    async def opened(plan: Schedule) -> dict:
        streams: list = []
        times = plan.times(duration)
        counter = iter(range(len(times)))
        records, elapsed = await scheduled_run(
            lambda _: target.call(None, next(counter), streams), None, times
        )
        span = max(float(times[-1]) if len(times) else 0.0, 1e-9)
        return summarize("generate-open", f"in process: {plan.label}", streams,
                         max(elapsed, span), offered_per_s=len(times) / span,
                         late_share=records.late_share())  # fmt: skip

    try:
        for c in concurrency:
            results.append(loop.run_until_complete(closed(c)))
        best = max((r["requests_per_s"] for r in results), default=0.0)
        for plan in plans(arrival, rates, best / 2 if best else 1.0):
            results.append(loop.run_until_complete(opened(plan)))
    finally:
        loop.close()
    print(
        f"\ndecoder {decoder.name!r} in process ({decoder.slots} slots): prompts "
        f"{prompt_tokens} tokens, outputs {output_tokens} tokens (greedy), {duration:g} s "
        "per run; times in ms"
    )
    print_table(results)
    report = {"model": decoder.name, "slots": decoder.slots, "results": results}
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {out_dir}/bench.json")
    return report


__all__ = ["METRICS", "GenTarget", "LocalTarget", "bench_generate", "bench_local", "is_decoder",
           "summarize"]  # fmt: skip
