"""Request tracing with OpenTelemetry: a span per sampled inference request, with an
event for each stage pxrt already times (Triton's OpenTelemetry mode does the same).

Off unless a ``Tracing`` is given (``Server(tracing=...)``, ``pxrt serve --trace-rate``);
off, the request path pays one attribute check. On, one request in ``rate`` is traced
(Triton's ``trace_rate``): the stages' clocks are kept as the request goes (perf_counter
readings, as the batcher takes them already) and the spans are made once it is answered,
with those times, so no span is held open across the loop and the pipeline's threads.

A request's span is ``pxrt.infer`` (a SERVER span whose parent is the caller's W3C
``traceparent`` when it sends one); its events, each at the stage's start with its
``pxrt.duration_us``, in order::

    decode    the request's body into arrays (from when the front end handed it over)
    queue     waiting in the model's queue, until its batch was taken
    assemble  the batch into staging buffers and onto the devices
    execute   the program, until the outputs are on the host
    split     the batch's outputs into per-request answers
    encode    the answer for the transport

Events, not child spans: the SDK makes a span in about 25 us of Python and an event in
about 3, and a traced request's cost is what sampling multiplies. A request answered from
the response cache has the event ``response_cache_hit``, then ``decode`` and ``encode``;
one whose rows went in several batches has the batch stages of
each. ``opentelemetry-api`` and ``-sdk`` (``pip install 'pxrt[trace]'``) make the spans;
any exporter of the SDK sends them (``pxrt serve --trace-otlp-endpoint``: OTLP over
HTTP).
"""

from __future__ import annotations

import os
import time
from typing import Any

_clock = time.perf_counter

# What a trace settings update is answered without tracing (HTTP and gRPC).
NOT_SET_UP = (
    "tracing is not set up: start pxrt serve with --trace-rate (0: off until changed by "
    "a trace setting update) and the trace extra (pip install 'pxrt[trace]')"
)

# The stages made from a batch's clocks: (span, start clock, end clock).
_BATCH_STAGES = (
    ("assemble", "t_start", "t_dispatched"),
    ("execute", "t_dispatched", "t_fetched"),
    ("split", "t_fetched", "t_done"),
)


def traceparent_of(headers: Any) -> str | bytes | None:
    """The W3C ``traceparent`` of a request's (lower-case name, value) header pairs
    (bytes, as the HTTP and HTTP/2 parsers give them, or str: grpcio's metadata)."""
    for name, value in headers:
        if name == b"traceparent" or name == "traceparent":
            return value
    return None


def _missing() -> ImportError:
    return ImportError(
        "tracing needs OpenTelemetry: pip install 'pxrt[trace]' "
        "(opentelemetry-api and opentelemetry-sdk)"
    )


def otlp_tracing(rate: int, endpoint: str | None = None, fixed: str | None = None) -> Tracing:
    """A ``Tracing`` whose spans go to an OTLP collector over HTTP (``endpoint``; None:
    the SDK's ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else ``localhost:4318``), batched
    by the SDK, as service ``pxrt`` (``OTEL_SERVICE_NAME`` overrides)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise _missing() from None
    named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "pxrt"}
    provider = TracerProvider(resource=Resource.create(named))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return Tracing(rate, provider, fixed=fixed)


class Tracing:
    """Which requests are traced, and the tracer their spans go to.

    Args:
      rate: trace one request in ``rate`` (Triton's ``trace_rate``; 1: every one; 0: none
        until a trace setting update turns tracing on, at Triton's default of 1000).
      tracer_provider: an OpenTelemetry ``TracerProvider`` (default: the global one).
      fixed: why the settings may not change at run time (``update`` refuses, saying
        it), or None.
    """

    def __init__(
        self, rate: int = 1000, tracer_provider: Any = None, fixed: str | None = None
    ) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError:
            raise _missing() from None
        self.rate = _rate(rate)  # one request in it is traced (0: none)
        #: Triton's ``trace_level``: whether it traces at all (the rate stays as it is).
        self.on = bool(self.rate)
        self.rate = self.rate or 1000
        self._every = self.rate if self.on else 0  # (what ``begin`` reads)
        provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
        self._tracer = provider.get_tracer("pxrt")
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._count = 0
        self.fixed = fixed

    def begin(self, model: str, headers: Any = ()) -> Trace | None:
        """A ``Trace`` for this request if it is sampled (else None); ``headers``: its
        (name, value) pairs, whose W3C ``traceparent`` its span continues."""
        every = self._every
        if not every:
            return None
        self._count += 1
        if self._count < every:
            return None
        self._count = 0
        context = None
        traceparent = traceparent_of(headers)
        if traceparent:
            if isinstance(traceparent, bytes):
                traceparent = traceparent.decode("latin-1")
            context = self._propagator.extract({"traceparent": traceparent})
        return Trace(self, model, context)

    # ------------------------------------------------------------------ Triton's settings

    def settings(self) -> dict:
        """Triton's trace settings document (``/v2/trace/setting``)."""
        return {
            "trace_level": ["TIMESTAMPS"] if self.on else ["OFF"],
            "trace_rate": str(self.rate),
            "trace_count": "-1",
            "log_frequency": "0",
            "trace_file": "",
            "trace_mode": "opentelemetry",
        }

    def update(self, doc: Any) -> dict:
        """Apply a settings update (Triton's: ``trace_level`` ``["OFF"]`` or
        ``["TIMESTAMPS"]``, ``trace_rate``; null: left as it is); returns
        the settings now. A setting pxrt does not take is a ValueError naming it."""
        if self.fixed:
            raise ValueError(self.fixed)
        if not isinstance(doc, dict):
            raise ValueError(f"a trace setting update is a JSON object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - {"trace_level", "trace_rate"})
        if unknown:
            raise ValueError(
                f"trace settings {unknown} are not taken: pxrt traces to OpenTelemetry "
                "(trace_level and trace_rate are)"
            )
        rate, on = self.rate, self.on
        if "trace_rate" in doc and doc["trace_rate"] is not None:
            value = doc["trace_rate"]
            if not (isinstance(value, str) and value.isdigit()) and not (
                isinstance(value, int) and not isinstance(value, bool)
            ):
                raise ValueError(f"trace_rate must be a count of requests, got {value!r}")
            rate = _rate(int(value)) or 1000  # (0: Triton's default)
        if "trace_level" in doc and doc["trace_level"] is not None:
            level = doc["trace_level"]
            if level not in (["OFF"], ["TIMESTAMPS"]):
                raise ValueError(f'trace_level must be ["OFF"] or ["TIMESTAMPS"], got {level!r}')
            on = level == ["TIMESTAMPS"]
        self.rate, self.on = rate, on
        self._every = rate if on else 0
        return self.settings()


def _rate(rate: Any) -> int:
    if isinstance(rate, bool) or not isinstance(rate, int) or rate < 0:
        raise ValueError(f"trace rate must be an integer >= 0 (one request in it), got {rate!r}")
    return rate


class Trace:
    """One sampled request's clocks, made into spans by ``end``."""

    __slots__ = ("_tracing", "batches", "context", "hit", "marks", "model", "t0")

    def __init__(self, tracing: Tracing, model: str, context: Any) -> None:
        self._tracing = tracing
        self.model = model
        self.context = context
        self.t0 = _clock()
        self.marks: list[tuple[str, float, float]] = []  # (span, start, end)
        self.batches: list[tuple[float, Any]] = []  # (when queued, the batch)
        self.hit = False

    def stage(self, name: str, start: float, end: float | None = None) -> None:
        self.marks.append((name, start, _clock() if end is None else end))

    def batch(self, queued: float, batch: Any) -> None:
        """A batch that ran (some of) the request's rows (the batcher, on the loop)."""
        self.batches.append((queued, batch))

    def end(self, version: str, error: BaseException | None = None, **attributes: Any) -> None:
        """Make the spans (the request is answered now)."""
        t_end = _clock()
        offset = time.time_ns() - int(t_end * 1e9)

        def ns(t: float) -> int:
            return offset + int(t * 1e9)

        trace = self._tracing._trace
        tracer = self._tracing._tracer
        root = tracer.start_span(
            "pxrt.infer",
            context=self.context,
            kind=trace.SpanKind.SERVER,
            start_time=ns(self.t0),
            attributes={"pxrt.model": self.model, "pxrt.model_version": version, **attributes},
        )
        if self.hit:
            root.add_event("response_cache_hit", timestamp=ns(self.t0))
        stages: list[tuple[str, float, float, dict | None]] = [
            (name, start, stop, None) for name, start, stop in self.marks
        ]
        for queued, batch in self.batches:
            rows = {"pxrt.batch_rows": int(batch.rows)}
            stages.append(("queue", queued, batch.t_start, None))
            stages += [
                (name, getattr(batch, a), getattr(batch, b), rows) for name, a, b in _BATCH_STAGES
            ]
        for name, start, stop, attrs in sorted(stages, key=lambda s: s[1]):
            took = {"pxrt.duration_us": round((stop - start) * 1e6, 1)}
            root.add_event(name, {**took, **attrs} if attrs else took, timestamp=ns(start))
        if error is not None:
            root.set_status(trace.Status(trace.StatusCode.ERROR, str(error)[:200]))
            root.record_exception(error)
        root.end(end_time=ns(t_end))


__all__ = ["Trace", "Tracing", "otlp_tracing", "traceparent_of"]
