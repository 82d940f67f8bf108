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

A generation request's span is ``pxrt.generate``, made when its reader is done, from the
engine's clocks: ``queue`` (until its prompt's first prefill or chunk was dispatched),
``prefill`` (until its first token; ``pxrt.cached_tokens``: what the prefix cache gave),
``decode`` (the steps as one event: ``pxrt.tokens``, ``pxrt.inter_token_us``) and
``detokenize`` (the front end's time making tokens into text), with the prompt's and
output's token counts and the finish reason. (A ``--workers`` worker has only its own
clocks: its span has ``detokenize``.)

Events, not child spans, and the span made whole: a traced request's cost is what
sampling multiplies, and the SDK's span API (start, an event at a time, end) takes about
57 us of Python for this span. With the SDK's ``TracerProvider`` (its default sampler),
the finished span is built at once as the SDK's ``ReadableSpan`` and handed to the
provider's span processors, as ``Span.end`` hands it: about 8 us, the same span for every
exporter. (Its processors' ``on_start`` is not called: the span is never open. Any other
provider, or another sampler, gets the span through the API.) A request answered from
the response cache has the event ``response_cache_hit``, then ``decode`` and ``encode``;
one whose rows went in several batches has the batch stages of
each. ``opentelemetry-api`` and ``-sdk`` (``pip install 'pxrt[trace]'``) make the spans;
any exporter of the SDK sends them (``pxrt serve --trace-otlp-endpoint``: OTLP over
HTTP).
"""

from __future__ import annotations

import operator
import os
import re
import time
from typing import Any

_clock = time.perf_counter

# What a trace settings update is answered without tracing (HTTP and gRPC).
NOT_SET_UP = (
    "tracing is not set up: start pxrt serve with --trace-rate (0: off until changed by "
    "a trace setting update) and the trace extra (pip install 'pxrt[trace]')"
)

_first = operator.itemgetter(0)

# Triton's bounds: its trace_rate is a uint32, its trace_count an int32 (-1: no limit).
MAX_RATE = 2**32 - 1
MAX_COUNT = 2**31 - 1
# A setting's integer: decimal digits as Triton's strings give them (no sign but a
# count's -1, no spaces, no other digits Python's int() would read).
_DECIMAL = re.compile(r"-?[0-9]{1,20}")


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
      rate: trace one request in ``rate`` (Triton's ``trace_rate``, up to 2^32 - 1; 1:
        every one; 0: none until a trace setting update turns tracing on, at Triton's
        default of 1000).
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
        #: Triton's ``trace_count``: the traces left to make (-1: no limit).
        self.count = -1
        self._every = self.rate if self.on else 0  # (what ``begin`` reads)
        provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
        self._tracer = provider.get_tracer("pxrt")
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._count = 0
        self.fixed = fixed
        self._direct = _Direct.of(provider)  # (None: through the API)

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
        if self.count > 0:  # (a trace_count: this is one of them; none after the last)
            self.count -= 1
            if not self.count:
                self._every = 0
        context = self._context(headers)
        return Trace(self, model, context)

    def begin_generation(self, model: str, headers: Any = ()) -> GenerationTrace | None:
        """A ``GenerationTrace`` for this generation request if it is sampled (the same
        count as ``begin``'s), else None."""
        sampled = self.begin(model, headers)
        return None if sampled is None else GenerationTrace(self, model, sampled.context)

    def _context(self, headers: Any) -> Any:
        traceparent = traceparent_of(headers)
        if not traceparent:
            return None
        if isinstance(traceparent, bytes):
            traceparent = traceparent.decode("latin-1")
        return self._propagator.extract({"traceparent": traceparent})

    def _emit(
        self,
        name: str,
        context: Any,
        attributes: dict,
        events: list[tuple[str, dict, int]],
        start: int,
        end: int,
        error: BaseException | None,
    ) -> None:
        """A finished SERVER span (times in epoch nanoseconds), the fast way if it can."""
        if self._direct is not None:
            self._direct.span(name, context, attributes, events, start, end, error)
            return
        trace = self._trace
        span = self._tracer.start_span(
            name, context=context, kind=trace.SpanKind.SERVER, start_time=start,
            attributes=attributes,
        )  # fmt: skip
        for event, attrs, when in events:
            span.add_event(event, attrs, timestamp=when)
        if error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)[:200]))
            span.record_exception(error)
        span.end(end_time=end)

    # ------------------------------------------------------------------ Triton's settings

    def settings(self) -> dict:
        """Triton's trace settings document (``/v2/trace/setting``)."""
        return {
            "trace_level": ["TIMESTAMPS"] if self.on else ["OFF"],
            "trace_rate": str(self.rate),
            "trace_count": str(self.count),
            "log_frequency": "0",
            "trace_file": "",
            "trace_mode": "opentelemetry",
        }

    def update(self, doc: Any) -> dict:
        """Apply a settings update (Triton's: ``trace_level`` ``["OFF"]`` or
        ``["TIMESTAMPS"]``; ``trace_rate``, 1 to 2^32 - 1 while tracing is on;
        ``trace_count``, the traces left to make, -1: no limit; each a string of digits,
        or a list of one as gRPC sends it; null: left as it is); returns the settings
        now. A setting pxrt does not take is a ValueError naming it, unless it is sent
        with the value ``settings`` reports (a document read back and sent again)."""
        if self.fixed:
            raise ValueError(self.fixed)
        if not isinstance(doc, dict):
            raise ValueError(f"a trace setting update is a JSON object, got {type(doc).__name__}")
        now = self.settings()
        unknown = sorted(
            k for k in set(doc) - {"trace_level", "trace_rate", "trace_count"}
            if k not in now or doc[k] not in (now[k], [now[k]])
        )  # fmt: skip
        if unknown:
            raise ValueError(
                f"trace settings {[str(k)[:40] for k in unknown[:5]]} are not taken: pxrt "
                "traces to OpenTelemetry (trace_level, trace_rate and trace_count are)"
            )
        rate, on, count = self.rate, self.on, self.count
        if doc.get("trace_rate") is not None:
            rate = _setting_int("trace_rate", doc["trace_rate"], 0, MAX_RATE)
        if doc.get("trace_count") is not None:
            count = _setting_int("trace_count", doc["trace_count"], -1, MAX_COUNT)
        if doc.get("trace_level") is not None:
            level = doc["trace_level"]
            if level not in (["OFF"], ["TIMESTAMPS"]):
                raise ValueError(
                    f'trace_level must be ["OFF"] or ["TIMESTAMPS"], got {_shown(level)}'
                )
            on = level == ["TIMESTAMPS"]
        if on and not rate:
            # (Triton's rule: a rate of 0 is taken only with tracing off.)
            raise ValueError(
                f'trace_rate must be from 1 to {MAX_RATE} while trace_level is ["TIMESTAMPS"], '
                'got 0: send trace_level ["OFF"] to stop tracing'
            )
        self.rate, self.on, self.count = rate, on, count
        self._every = rate if on and count else 0
        return self.settings()


def _rate(rate: Any) -> int:
    if isinstance(rate, bool) or not isinstance(rate, int) or not 0 <= rate <= MAX_RATE:
        raise ValueError(
            f"trace rate must be an integer from 0 to {MAX_RATE} (one request in it), got {rate!r}"
        )
    return rate


def _setting_int(name: str, value: Any, low: int, high: int) -> int:
    """A trace setting's integer from ``low`` to ``high``: Triton's string of decimal
    digits, or a list of one such string (a JSON integer is taken too)."""
    given = value
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, str) and _DECIMAL.fullmatch(value):
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        raise ValueError(
            f"{name} must be a string of decimal digits (from {low} to {high}), got {_shown(given)}"
        )
    if not low <= number <= high:
        raise ValueError(f"{name} must be from {low} to {high}, got {_shown(given)}")
    return number


def _shown(value: Any) -> str:
    """``value`` for an error message, cut short: it came from a request."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
        """Make the span (the request is answered now)."""
        t_end = _clock()
        offset = time.time_ns() - int(t_end * 1e9)  # perf_counter -> epoch nanoseconds
        stages: list[tuple[float, str, dict]] = [  # (start, name, attributes)
            (start, name, {"pxrt.duration_us": (stop - start) * 1e6})
            for name, start, stop in self.marks
        ]
        for queued, batch in self.batches:
            rows = int(batch.rows)
            t0, t1, t2, t3 = batch.t_start, batch.t_dispatched, batch.t_fetched, batch.t_done
            stages += [
                (queued, "queue", {"pxrt.duration_us": (t0 - queued) * 1e6}),
                (t0, "assemble", {"pxrt.duration_us": (t1 - t0) * 1e6, "pxrt.batch_rows": rows}),
                (t1, "execute", {"pxrt.duration_us": (t2 - t1) * 1e6, "pxrt.batch_rows": rows}),
                (t2, "split", {"pxrt.duration_us": (t3 - t2) * 1e6, "pxrt.batch_rows": rows}),
            ]
        stages.sort(key=_first)
        events = [(name, attrs, offset + int(t * 1e9)) for t, name, attrs in stages]
        if self.hit:
            events.insert(0, ("response_cache_hit", {}, offset + int(self.t0 * 1e9)))

        def ns(t: float) -> int:
            return offset + int(t * 1e9)

        attributes = {"pxrt.model": self.model, "pxrt.model_version": version, **attributes}
        self._tracing._emit(
            "pxrt.infer", self.context, attributes, events, offset + int(self.t0 * 1e9),
            offset + int(t_end * 1e9), error,
        )  # fmt: skip


class GenerationTrace:
    """One sampled generation request: made into a ``pxrt.generate`` span when its
    reader is done (``end``), from the generation's own clocks."""

    __slots__ = ("_tracing", "context", "detokenize_s", "model", "t0", "version")

    def __init__(self, tracing: Tracing, model: str, context: Any) -> None:
        self._tracing = tracing
        self.model = model
        self.context = context
        self.t0 = _clock()
        self.detokenize_s = 0.0  # the front end's time making its tokens into text
        self.version = ""  # the decoder's version, once known

    def failed(self, error: BaseException) -> None:
        """The request was refused before it was submitted."""
        t_end = _clock()
        offset = time.time_ns() - int(t_end * 1e9)
        self._tracing._emit(
            "pxrt.generate", self.context, {"pxrt.model": self.model}, [],
            offset + int(self.t0 * 1e9), offset + int(t_end * 1e9), error,
        )  # fmt: skip

    def end(self, gen: Any) -> None:
        """The span of ``gen`` (a ``pxrt.Generation``, or a worker's stream: the device's
        clocks it does not have are left out)."""
        t_end = _clock()
        offset = time.time_ns() - int(t_end * 1e9)
        n = len(gen.tokens)
        t_submit = getattr(gen, "t_submit", 0.0) or self.t0
        t_admit = getattr(gen, "t_admit", 0.0)
        t_first = getattr(gen, "t_first", 0.0) if n else 0.0
        t_last = getattr(gen, "t_last", 0.0) if n else 0.0
        events: list[tuple[str, dict, int]] = []

        def event(name: str, start: float, stop: float, **attrs: Any) -> None:
            took = {"pxrt.duration_us": (stop - start) * 1e6}
            events.append((name, {**took, **attrs}, offset + int(start * 1e9)))

        if t_admit:
            event("queue", t_submit, t_admit)
            if t_first:
                cached = int(getattr(gen, "hit", 0))
                event("prefill", t_admit, t_first, **{"pxrt.cached_tokens": cached})
        if t_first and n > 1:
            # The decode steps batched into one event: how many, and their mean interval.
            event("decode", t_first, t_last, **{"pxrt.tokens": n - 1,
                  "pxrt.inter_token_us": (t_last - t_first) / (n - 1) * 1e6})  # fmt: skip
        if self.detokenize_s:
            events.append(("detokenize", {"pxrt.duration_us": self.detokenize_s * 1e6},
                           offset + int((t_last or t_end) * 1e9)))  # fmt: skip
        attributes = {
            "pxrt.model": self.model,
            "pxrt.model_version": self.version,
            "pxrt.prompt_tokens": len(gen.prompt),
            "pxrt.output_tokens": n,
            "pxrt.finish_reason": str(gen.finish_reason),
        }
        self._tracing._emit(
            "pxrt.generate", self.context, attributes, events,
            offset + int(self.t0 * 1e9), offset + int(t_end * 1e9), gen.error,
        )  # fmt: skip


class _Direct:
    """Finished spans made as the SDK's ``ReadableSpan`` and handed to the provider's
    span processors (``Tracing``'s fast way; see the module)."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.processor = provider._active_span_processor
        self.resource = provider.resource
        self.ids = provider.id_generator
        self.scope = InstrumentationScope("pxrt")
        self.event = Event
        self.readable = ReadableSpan
        self.trace = trace
        self.sampled = trace.TraceFlags(trace.TraceFlags.SAMPLED)

    @classmethod
    def of(cls, provider: Any) -> _Direct | None:
        """The fast way for ``provider``, if it is the SDK's with its default sampler."""
        try:
            from opentelemetry.sdk.trace import TracerProvider, sampling
        except ImportError:
            return None
        if not isinstance(provider, TracerProvider) or not hasattr(
            provider, "_active_span_processor"
        ):
            return None
        if provider.sampler.get_description() != sampling.DEFAULT_ON.get_description():
            return None
        return cls(provider)

    def span(
        self,
        name: str,
        context: Any,
        attributes: dict,
        events: list[tuple[str, dict, int]],
        start: int,
        end: int,
        error: BaseException | None,
    ) -> None:
        trace = self.trace
        parent = trace.get_current_span(context).get_span_context() if context else None
        if parent is not None and parent.is_valid:
            if not parent.trace_flags.sampled:
                return  # the caller's trace is not sampled (the default sampler's rule)
            trace_id = parent.trace_id
        else:
            parent, trace_id = None, self.ids.generate_trace_id()
        made = [self.event(name, attrs, when) for name, attrs, when in events]
        status = trace.Status()
        if error is not None:
            status = trace.Status(trace.StatusCode.ERROR, str(error)[:200])
            made.append(
                self.event(
                    "exception",
                    {"exception.type": type(error).__name__,
                     "exception.message": str(error)[:200]},
                    end,
                )
            )  # fmt: skip
        context = trace.SpanContext(trace_id, self.ids.generate_span_id(), False, self.sampled)
        self.processor.on_end(
            self.readable(
                name=name, context=context, parent=parent, resource=self.resource,
                attributes=attributes, events=tuple(made), kind=trace.SpanKind.SERVER,
                status=status, start_time=start, end_time=end,
                instrumentation_scope=self.scope,
            )
        )  # fmt: skip


__all__ = ["GenerationTrace", "Trace", "Tracing", "otlp_tracing", "traceparent_of"]
