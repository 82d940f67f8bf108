"""In-process metrics of a Server, kept in a private prometheus-client registry.

Names follow Triton's spirit (``pxrt_queue_duration_us`` ...), labelled by model.
``snapshot()`` reads them back as plain numbers, with percentiles estimated from the
histogram buckets; ``registry`` can be exposed as a Prometheus page as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# 10 us .. ~80 s, x2 steps: fine enough for percentiles of a serving path.
_US_BUCKETS = tuple(10.0 * 2**i for i in range(24))
_ROW_BUCKETS = tuple(float(2**i) for i in range(14))
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

OUTCOMES = ("success", "invalid", "rejected", "expired", "failed", "cancelled")

STAGES = {
    "queue": "time from submit to the batch being handed to the pipeline",
    "compute_input": "assembling the batch into staging and putting it on the devices",
    "compute_infer": "executing, until the outputs are ready on the host",
    "compute_output": "splitting the outputs into per-request results",
    "request": "end to end, submit to result",
}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pxrt_requests", "Requests by outcome", ["model", "outcome"], registry=r
        )
        self.batches = Counter("pxrt_batches", "Batches executed", ["model"], registry=r)
        self.durations = {
            stage: Histogram(
                f"pxrt_{stage}_duration_us",
                f"Microseconds: {doc}",
                ["model"],
                buckets=_US_BUCKETS,
                registry=r,
            )
            for stage, doc in STAGES.items()
        }
        self.batch_rows = Histogram(
            "pxrt_batch_rows",
            "Rows per executed batch",
            ["model"],
            buckets=_ROW_BUCKETS,
            registry=r,
        )
        self.padding = Histogram(
            "pxrt_batch_padding_ratio",
            "Padded share of a batch's bucket",
            ["model"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.queued_rows = Gauge(
            "pxrt_queued_rows", "Rows waiting in the queue", ["model"], registry=r
        )
        self.compiles = Gauge(
            "pxrt_compiles_after_load",
            "XLA compiles on the request path after load (must stay 0)",
            ["model"],
            registry=r,
        )

    def add_model(
        self, name: str, queued_rows: Callable[[], float], compiles: Callable[[], float]
    ) -> None:
        for outcome in OUTCOMES:
            self.requests.labels(name, outcome)
        self.batches.labels(name)
        self.queued_rows.labels(name).set_function(queued_rows)
        self.compiles.labels(name).set_function(compiles)

    def snapshot(self) -> dict[str, dict]:
        """model -> {"requests": {outcome: n}, "batches": n, "<stage>_us": {...}, ...}."""
        out: dict[str, dict] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                model = sample.labels.get("model")
                if model is None:
                    continue
                entry = out.setdefault(model, {"requests": {}})
                name = sample.name
                if name == "pxrt_requests_total":
                    entry["requests"][sample.labels["outcome"]] = int(sample.value)
                elif name == "pxrt_batches_total":
                    entry["batches"] = int(sample.value)
                elif family.type == "gauge":
                    entry[name.removeprefix("pxrt_")] = sample.value
        for key, hist in [
            *((f"{s}_us", h) for s, h in self.durations.items()),
            ("batch_rows", self.batch_rows),
            ("padding_ratio", self.padding),
        ]:
            for model in out:
                out[model][key] = _summary(hist, model)
        return out


def _summary(hist: Histogram, model: str) -> dict:
    buckets: list[tuple[float, float]] = []
    count = total = 0.0
    for family in hist.collect():
        for s in family.samples:
            if s.labels.get("model") != model:
                continue
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                count = s.value
            elif s.name.endswith("_sum"):
                total = s.value
    summary = {"count": int(count), "mean": total / count if count else 0.0}
    for q in (0.5, 0.9, 0.99):
        summary[f"p{round(q * 100)}"] = _quantile(buckets, count, q)
    return summary


def _quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    """Linear interpolation inside the cumulative bucket that holds quantile q."""
    if not count:
        return 0.0
    rank = q * count
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in sorted(buckets):
        if cumulative >= rank:
            if math.isinf(bound):
                return lower_bound
            width = cumulative - lower_count
            frac = (rank - lower_count) / width if width else 1.0
            return lower_bound + (bound - lower_bound) * frac
        lower_bound, lower_count = bound, cumulative
    return lower_bound
