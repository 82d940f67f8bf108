"""In-process metrics of a Server, exposed through prometheus-client.

The hot path only touches plain numbers: the per-request outcomes are counted by the
model's ``BatchQueue`` (C integers) and the batcher, and per-request durations are
logged into C buffers that are binned thousands at a time (one ``np.searchsorted``
per drain, not one locked ``Histogram.observe`` per request, which cost ~9 us).
prometheus-client does the exposition: ``registry`` holds a collector that yields
standard counter, gauge and histogram families, named in Triton's spirit
(``pxrt_queue_duration_us`` ...) and labelled by model. ``snapshot()`` reads the same
numbers back as a dict, with percentiles interpolated within buckets.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

# 10 us .. ~80 s in x2 steps: fine enough for the percentiles of a serving path.
US_BUCKETS = tuple(10.0 * 2**i for i in range(24))
ROW_BUCKETS = tuple(float(2**i) for i in range(14))
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

OUTCOMES = ("success", "invalid", "rejected", "expired", "failed", "cancelled")

STAGES = {
    "queue": "time from submit until the request's batch went to the pipeline",
    "compute_input": "assembling a batch into staging and putting it on the devices",
    "compute_infer": "executing a batch, until its outputs are ready on the host",
    "compute_output": "splitting a batch's outputs into per-request results",
    "request": "end to end, submit to result",
}


class Histogram:
    """Bucket counts with Prometheus's ``le`` semantics (a value lands in the first
    bucket whose bound is >= it), plus sum and count. ``observe_many`` bins a whole
    array of values at once; values are multiplied by ``scale`` (seconds -> unit)."""

    __slots__ = ("bounds", "_bounds_np", "_counts", "_sum", "_count", "scale")

    def __init__(self, bounds: Iterable[float], scale: float = 1.0) -> None:
        self.bounds = list(bounds)
        self._bounds_np = np.asarray(self.bounds)
        self._counts = np.zeros(len(self.bounds) + 1, np.int64)  # the last one is +Inf
        self._sum = 0.0
        self._count = 0
        self.scale = scale

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._sum += value
        self._count += 1

    def observe_many(self, values: np.ndarray) -> None:
        if not len(values):
            return
        values = values * self.scale
        idx = np.searchsorted(self._bounds_np, values, side="left")
        self._counts += np.bincount(idx, minlength=len(self._counts))
        self._sum += float(values.sum())
        self._count += len(values)

    @property
    def count(self) -> int:
        return self._count

    @property
    def sum(self) -> float:
        return self._sum

    def cumulative(self) -> list[tuple[str, float]]:
        cum = np.cumsum(self._counts)
        labels = [_le(b) for b in self.bounds] + ["+Inf"]
        return list(zip(labels, cum.tolist()))

    def quantile(self, q: float) -> float:
        """Linear interpolation inside the bucket that holds quantile q."""
        if not self._count:
            return 0.0
        rank = q * self._count
        lower, seen = 0.0, 0
        for bound, n in zip(self.bounds, self._counts.tolist()):
            if seen + n >= rank and n:
                return lower + (bound - lower) * (rank - seen) / n
            lower, seen = bound, seen + n
        return lower  # in the +Inf bucket: the last finite bound is all we know

    def summary(self) -> dict:
        count, total = self.count, self.sum
        out = {"count": count, "mean": total / count if count else 0.0}
        for q in (0.5, 0.9, 0.99):
            out[f"p{round(q * 100)}"] = self.quantile(q)
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


class ModelSource(Protocol):
    """What a model's metrics read from the batcher that serves it."""

    def outcomes(self) -> dict[str, int]: ...  # outcome -> requests so far

    def queued_rows(self) -> int: ...

    def cache_counts(self) -> dict[str, float] | None: ...  # the response cache's, if used

    def compiles(self) -> int: ...

    def load_phases(self) -> dict[str, float]: ...  # phase ("total" too) -> seconds

    def instance_batches(self) -> list[int]: ...  # per instance (several): batches run

    def drain_timings(self) -> None: ...  # move logged durations into the histograms


class ModelMetrics:
    """One model's numbers. Updated on the event loop's thread only."""

    def __init__(self, source: ModelSource) -> None:
        self.source = source
        self.batches = 0
        self.stages = {stage: Histogram(US_BUCKETS, scale=1e6) for stage in STAGES}
        self.batch_rows = Histogram(ROW_BUCKETS)
        self.padding = Histogram(RATIO_BUCKETS)

    @property
    def requests(self) -> dict[str, int]:
        return self.source.outcomes()

    def snapshot(self) -> dict:
        self.source.drain_timings()
        out: dict = {"requests": self.requests, "batches": self.batches}
        for stage, hist in self.stages.items():
            out[f"{stage}_us"] = hist.summary()
        out["batch_rows"] = self.batch_rows.summary()
        out["padding_ratio"] = self.padding.summary()
        out["queued_rows"] = self.source.queued_rows()
        out["compiles_after_load"] = self.source.compiles()
        cache = self.source.cache_counts()
        if cache is not None:
            out["response_cache"] = cache
        return out


GENERATION_TIMINGS = {
    "step": "between two decode steps read back: the inter-token latency of every busy slot",
    "prefill": "a prefill batch, from dispatch until its first tokens are on the host",
    "ttft": "a generation's time to first token, submit to the first token on the host",
    "tpot": "a generation's time per output token after the first",
}


class DecoderSource(Protocol):
    """What a decoder's metrics read from it (``pxrt.generate.Decoder``)."""

    counters: dict
    outcomes: dict
    slots: int

    @property
    def busy_slots(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def compiles_after_load(self) -> int: ...

    load_s: float

    def drain_timings(self) -> dict[str, list[float]]: ...


class DecoderMetrics:
    """One decoder's numbers: counters read from it, durations binned from its log."""

    def __init__(self, source: DecoderSource) -> None:
        self.source = source
        self.timings = {k: Histogram(US_BUCKETS, scale=1e6) for k in GENERATION_TIMINGS}

    def drain(self) -> None:
        for kind, values in self.source.drain_timings().items():
            if values:
                self.timings[kind].observe_many(np.asarray(values))

    def snapshot(self) -> dict:
        self.drain()
        src = self.source
        out: dict = {
            "generations": dict(src.outcomes),
            "tokens": src.counters["tokens"],
            "steps": src.counters["steps"],
            "prefills": src.counters["prefills"],
            "prefill_chunks": src.counters["chunks"],
            "prompt_tokens": src.counters["prompt_tokens"],
            "prefix_hit_tokens": src.counters["prefix_hit_tokens"],
            "slots": src.slots,
            "slots_busy": src.busy_slots,
            "waiting": src.waiting,
            "compiles_after_load": src.compiles_after_load,
        }
        for kind, hist in self.timings.items():
            out[f"{kind}_us"] = hist.summary()
        return out


class CacheSource(Protocol):
    """What the metrics read from the server's response cache."""

    evictions: int

    @property
    def bytes(self) -> int: ...

    def __len__(self) -> int: ...


class Metrics:
    """All models' metrics, per model and version, and a prometheus-client registry that
    exposes them (labels ``model`` and ``version``); the server's response cache's, if
    it has one."""

    def __init__(self, cache: CacheSource | None = None) -> None:
        self.cache = cache
        #: (name, version) -> its metrics, for every version served.
        self.versions: dict[tuple[str, str], ModelMetrics] = {}
        #: name -> the metrics of the version that unversioned requests reach.
        self.models: dict[str, ModelMetrics] = {}
        #: (name, version) -> the metrics of a decoder served.
        self.decoders: dict[tuple[str, str], DecoderMetrics] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def add_model(self, name: str, source: ModelSource, version: str = "") -> ModelMetrics:
        m = self.versions[(name, version)] = ModelMetrics(source)
        self.models.setdefault(name, m)
        return m

    def add_decoder(self, name: str, source: DecoderSource, version: str = "") -> DecoderMetrics:
        m = self.decoders[(name, version)] = DecoderMetrics(source)
        return m

    def remove_decoder(self, name: str, version: str) -> None:
        self.decoders.pop((name, version), None)

    def set_default(self, name: str, version: str | None) -> None:
        """Which version's metrics ``snapshot()[name]`` shows (None: the model is gone)."""
        if version is None:
            self.models.pop(name, None)
        else:
            self.models[name] = self.versions[(name, version)]

    def remove_model(self, name: str, version: str, source: ModelSource) -> None:
        """Forget a version's metrics, if they are still ``source``'s (the same version
        may be served again by then)."""
        m = self.versions.get((name, version))
        if m is not None and m.source is source:
            del self.versions[(name, version)]

    def snapshot(self) -> dict[str, dict]:
        """model -> {"requests": {outcome: n}, "batches": n, "<stage>_us": {...}, ...}, for
        the version unversioned requests reach."""
        out = {name: m.snapshot() for name, m in self.models.items()}
        for (name, _), d in self.decoders.items():
            out[name] = d.snapshot()
        return out

    def snapshot_of(self, name: str, version: str) -> dict:
        """The snapshot of one version."""
        return self.versions[(name, version)].snapshot()

    def snapshot_versions(self) -> dict[tuple[str, str], dict]:
        """(model, version) -> its snapshot, for every version served."""
        return {key: m.snapshot() for key, m in self.versions.items()}


def _stage_of(stage: str) -> Callable[[ModelMetrics], Histogram]:
    return lambda m: m.stages[stage]


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        models = list(self._metrics.versions.items())
        requests = CounterMetricFamily(
            "pxrt_requests", "Requests by outcome", labels=["model", "version", "outcome"]
        )
        batches = CounterMetricFamily(
            "pxrt_batches", "Batches executed", labels=["model", "version"]
        )
        queued = GaugeMetricFamily(
            "pxrt_queued_rows", "Rows waiting in the queue", labels=["model", "version"]
        )
        compiles = GaugeMetricFamily(
            "pxrt_compiles_after_load",
            "XLA compiles on the request path after load (stays 0)",
            labels=["model", "version"],
        )
        load = GaugeMetricFamily(
            "pxrt_model_load_seconds",
            "Seconds the model's load took, in total and by phase (read, params, compile, "
            "verify, time)",
            labels=["model", "version", "phase"],
        )
        instance_batches = CounterMetricFamily(
            "pxrt_instance_batches",
            "Batches run per instance of a model loaded as several (placement replicated)",
            labels=["model", "version", "instance"],
        )
        for (name, version), m in models:
            m.source.drain_timings()
            for outcome, n in m.requests.items():
                requests.add_metric([name, version, outcome], n)
            batches.add_metric([name, version], m.batches)
            queued.add_metric([name, version], m.source.queued_rows())
            compiles.add_metric([name, version], m.source.compiles())
            for phase, seconds in m.source.load_phases().items():
                load.add_metric([name, version, phase], seconds)
            per_instance = m.source.instance_batches()
            if len(per_instance) > 1:
                for i, n in enumerate(per_instance):
                    instance_batches.add_metric([name, version, str(i)], n)
        for (name, version), d in self._metrics.decoders.items():
            load.add_metric([name, version, "total"], d.source.load_s)
        yield from (requests, batches, queued, compiles, load, instance_batches)
        yield from self._cache_families(models)
        yield from self._generation_families()
        families: list[tuple[str, str, Callable[[ModelMetrics], Histogram]]] = [
            (f"pxrt_{stage}_duration_us", f"Microseconds: {doc}", _stage_of(stage))
            for stage, doc in STAGES.items()
        ]
        families += [
            ("pxrt_batch_rows", "Rows per executed batch", lambda m: m.batch_rows),
            (
                "pxrt_batch_padding_ratio",
                "Padded share of a batch's cell (rows; lengths too for named dimensions)",
                lambda m: m.padding,
            ),
        ]
        for metric, doc, pick in families:
            family = HistogramMetricFamily(metric, doc, labels=["model", "version"])
            for (name, version), m in models:
                hist = pick(m)
                family.add_metric([name, version], hist.cumulative(), hist.sum)
            yield family

    def _cache_families(
        self, models: list[tuple[tuple[str, str], ModelMetrics]]
    ) -> Iterator[Metric]:
        cache = self._metrics.cache
        if cache is None:
            return
        labels = ["model", "version"]
        hits = CounterMetricFamily(
            "pxrt_cache_hits", "Requests answered from the response cache", labels=labels
        )
        misses = CounterMetricFamily(
            "pxrt_cache_misses", "Requests of cached models the cache did not hold", labels=labels
        )
        for (name, version), m in models:
            counts = m.source.cache_counts()
            if counts is not None:
                hits.add_metric([name, version], counts["hits"])
                misses.add_metric([name, version], counts["misses"])
        yield hits
        yield misses
        yield GaugeMetricFamily(
            "pxrt_cache_bytes", "Bytes of outputs the response cache holds", value=cache.bytes
        )
        yield GaugeMetricFamily(
            "pxrt_cache_entries", "Answers the response cache holds", value=len(cache)
        )
        yield CounterMetricFamily(
            "pxrt_cache_evictions",
            "Answers evicted from the response cache (least recently used first)",
            value=cache.evictions,
        )

    def _generation_families(self) -> Iterator[Metric]:
        decoders = list(self._metrics.decoders.items())
        if not decoders:
            return
        labels = ["model", "version"]
        generations = CounterMetricFamily(
            "pxrt_generations", "Generations ended, by finish reason", labels=[*labels, "reason"]
        )
        tokens = CounterMetricFamily("pxrt_generated_tokens", "Tokens generated", labels=labels)
        steps = CounterMetricFamily("pxrt_decode_steps", "Decode steps executed", labels=labels)
        prompt = CounterMetricFamily("pxrt_prompt_tokens", "Prompt tokens admitted", labels=labels)
        reused = CounterMetricFamily(
            "pxrt_prefix_cache_hit_tokens",
            "Prompt tokens whose cache rows were copied from the prefix cache",
            labels=labels,
        )
        chunks = CounterMetricFamily(
            "pxrt_prefill_chunks", "Extend programs run (chunks of prompts)", labels=labels
        )
        slots = GaugeMetricFamily("pxrt_slots", "Decode slots", labels=labels)
        busy = GaugeMetricFamily("pxrt_slots_busy", "Decode slots generating", labels=labels)
        waiting = GaugeMetricFamily(
            "pxrt_prompts_waiting", "Prompts waiting for a free slot", labels=labels
        )
        compiles = GaugeMetricFamily(
            "pxrt_decoder_compiles_after_load",
            "XLA compiles while generating (stays 0)",
            labels=labels,
        )
        for (name, version), d in decoders:
            d.drain()
            src = d.source
            for reason, n in src.outcomes.items():
                generations.add_metric([name, version, reason], n)
            tokens.add_metric([name, version], src.counters["tokens"])
            steps.add_metric([name, version], src.counters["steps"])
            prompt.add_metric([name, version], src.counters["prompt_tokens"])
            reused.add_metric([name, version], src.counters["prefix_hit_tokens"])
            chunks.add_metric([name, version], src.counters["chunks"])
            slots.add_metric([name, version], src.slots)
            busy.add_metric([name, version], src.busy_slots)
            waiting.add_metric([name, version], src.waiting)
            compiles.add_metric([name, version], src.compiles_after_load)
        yield from (generations, tokens, steps, prompt, reused, chunks, slots, busy, waiting)
        yield compiles
        names = {
            "step": "pxrt_decode_step_duration_us",
            "prefill": "pxrt_prefill_duration_us",
            "ttft": "pxrt_time_to_first_token_us",
            "tpot": "pxrt_time_per_output_token_us",
        }
        for kind, doc in GENERATION_TIMINGS.items():
            family = HistogramMetricFamily(names[kind], f"Microseconds: {doc}", labels=labels)
            for (name, version), d in decoders:
                hist = d.timings[kind]
                family.add_metric([name, version], hist.cumulative(), hist.sum)
            yield family
