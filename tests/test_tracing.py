"""Request tracing: an OpenTelemetry span per sampled request, its stages as events,
checked with the SDK's in-memory exporter: names, parents (the caller's traceparent
continued), timings in order, the sampling rate, Triton's trace settings endpoint."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from models import random_request, reference
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serving import Server, Tracing
from serving.http.app import create_app

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def _tracing(rate: int) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(rate, provider), exporter


def _body(request: dict) -> dict:
    return {
        "id": "r1",
        "inputs": [
            {"name": k, "datatype": "FP32", "shape": list(v.shape), "data": v.ravel().tolist()}
            for k, v in request.items()
        ],
    }


@pytest.mark.parametrize("way", ["direct", "api"])
def test_a_traced_request_has_a_span_per_stage_under_the_callers_trace(run, models, way):
    """Both ways of making the span (the SDK's provider: built whole; any other: through
    the span API) give the same span."""
    tracing, exporter = _tracing(1)
    if way == "api":
        tracing._direct = None  # (what a provider other than the SDK's gets)
    else:
        assert tracing._direct is not None
    request = random_request(models["mlp"].inputs, 2, np.random.default_rng(0))

    async def main():
        async with Server(tracing=tracing) as server:
            server.add_model("mlp", models["mlp"], response_cache=True)
            transport = httpx.ASGITransport(app=create_app(server))
            async with httpx.AsyncClient(transport=transport, base_url="http://pxrt") as http:
                first = await http.post(
                    "/v2/models/mlp/infer", json=_body(request),
                    headers={"traceparent": TRACEPARENT},
                )  # fmt: skip
                again = await http.post("/v2/models/mlp/infer", json=_body(request))
                bad = await http.post("/v2/models/mlp/infer", json={"inputs": []})
        return first, again, bad

    first, again, bad = run(main)
    assert first.status_code == 200 and again.status_code == 200 and bad.status_code == 400
    got = np.asarray(first.json()["outputs"][0]["data"], np.float32).reshape(2, -1)
    np.testing.assert_allclose(got, reference("mlp", request)["y"], rtol=1e-5, atol=1e-5)
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "pxrt.infer"]
    assert len(roots) == 3
    root = roots[0]
    # The caller's trace goes on: same trace id, its span the parent.
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_ID
    assert root.attributes["pxrt.model"] == "mlp" and root.attributes["pxrt.rows"] == 2
    assert root.attributes["pxrt.request_id"] == "r1"
    assert [s.name for s in spans] == ["pxrt.infer"] * 3  # (one span a request)
    events = list(root.events)
    assert [e.name for e in events] == [
        "decode", "queue", "assemble", "execute", "split", "encode",
    ]  # fmt: skip
    for a, b in zip(events, events[1:]):
        took = a.attributes["pxrt.duration_us"] * 1e3
        assert a.timestamp <= b.timestamp and a.timestamp + took <= b.timestamp + 1e5
    assert root.start_time <= events[0].timestamp and events[-1].timestamp <= root.end_time
    assert events[3].attributes["pxrt.batch_rows"] == 2
    # The repeat: its own trace, answered by the response cache.
    hit = roots[1]
    assert hit.parent is None and format(hit.context.trace_id, "032x") != TRACE_ID
    assert [e.name for e in hit.events] == ["response_cache_hit", "decode", "encode"]
    # The bad one: an error span saying why.
    assert not roots[2].status.is_ok and "input" in roots[2].status.description
    assert roots[2].events[-1].name == "exception"
    # What an OTLP exporter sends of them.
    otlp = pytest.importorskip("opentelemetry.exporter.otlp.proto.common.trace_encoder")
    encoded = otlp.encode_spans(roots).resource_spans[0].scope_spans[0].spans
    assert [len(s.events) for s in encoded] == [6, 3, len(roots[2].events)]
    assert encoded[0].parent_span_id.hex() == PARENT_ID


def test_one_request_in_rate_is_traced_and_settings_change_it(run, models):
    tracing, exporter = _tracing(3)
    request = random_request(models["mlp"].inputs, 1, np.random.default_rng(1))

    async def main():
        async with Server(tracing=tracing) as server:
            server.add_model("mlp", models["mlp"])
            transport = httpx.ASGITransport(app=create_app(server))
            async with httpx.AsyncClient(transport=transport, base_url="http://pxrt") as http:
                for _ in range(9):
                    await http.post("/v2/models/mlp/infer", json=_body(request))
                counted = len(exporter.get_finished_spans())
                settings = (await http.get("/v2/trace/setting")).json()
                off = await http.post("/v2/trace/setting", json={"trace_level": ["OFF"]})
                for _ in range(3):
                    await http.post("/v2/models/mlp/infer", json=_body(request))
                after_off = len(exporter.get_finished_spans())
                on = {"trace_rate": "1", "trace_level": ["TIMESTAMPS"]}
                every = await http.post("/v2/trace/setting", json=on)
                await asyncio.gather(
                    *(http.post("/v2/models/mlp/infer", json=_body(request)) for _ in range(2))
                )
                refused = await http.post("/v2/trace/setting", json={"trace_file": "x"})
                bad_rate = await http.post("/v2/trace/setting", json={"trace_rate": "-2"})
        roots = [s for s in exporter.get_finished_spans() if s.name == "pxrt.infer"]
        return counted, settings, off, after_off, every, roots, refused, bad_rate

    counted, settings, off, after_off, every, roots, refused, bad_rate = run(main)
    assert counted == 3  # three requests of nine
    assert settings["trace_rate"] == "3" and settings["trace_level"] == ["TIMESTAMPS"]
    assert settings["trace_mode"] == "opentelemetry"
    assert off.json()["trace_level"] == ["OFF"] and after_off == counted
    assert every.json()["trace_rate"] == "1" and len(roots) == 5
    assert refused.status_code == 400 and "trace_file" in refused.json()["error"]
    assert bad_rate.status_code == 400 and "trace_rate" in bad_rate.json()["error"]


def test_tracing_checks_its_rate():
    with pytest.raises(ValueError, match="trace rate must be an integer from 0 to 4294967295"):
        Tracing(-1)
    with pytest.raises(ValueError, match="trace rate must be an integer from 0 to 4294967295"):
        Tracing(2**32)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"trace_rate": str(2**64)}, r"trace_rate must be from 0 to 4294967295, got '1844"),
        ({"trace_rate": "4294967296"}, "trace_rate must be from 0 to 4294967295"),
        ({"trace_rate": "0"}, r"trace_rate must be from 1 to 4294967295 while trace_level is"),
        ({"trace_rate": ["0"], "trace_level": ["TIMESTAMPS"]}, "got 0: send trace_level"),
        ({"trace_rate": "-2"}, "trace_rate must be from 0 to"),
        ({"trace_rate": " 5"}, "trace_rate must be a string of decimal digits .*got ' 5'"),
        ({"trace_rate": "5\n"}, "trace_rate must be a string of decimal digits"),
        ({"trace_rate": "+5"}, "trace_rate must be a string of decimal digits"),
        ({"trace_rate": "1_000"}, "trace_rate must be a string of decimal digits"),
        ({"trace_rate": "\u0665"}, "trace_rate must be a string of decimal digits"),  # (Arabic 5)
        ({"trace_rate": "1e3"}, "trace_rate must be a string of decimal digits"),
        ({"trace_rate": "9" * 5000}, r"decimal digits .*got '9{56}\.\.\.$"),
        ({"trace_rate": 5.0}, "trace_rate must be a string of decimal digits"),
        ({"trace_rate": True}, "trace_rate must be a string of decimal digits"),
        ({"trace_rate": ["5", "6"]}, r"decimal digits .*got \['5', '6'\]"),
        ({"trace_rate": []}, "trace_rate must be a string of decimal digits"),
        ({"trace_count": "-2"}, "trace_count must be from -1 to 2147483647, got '-2'"),
        ({"trace_count": str(2**31)}, "trace_count must be from -1 to 2147483647"),
        ({"trace_count": "--1"}, "trace_count must be a string of decimal digits"),
        ({"trace_level": "OFF"}, r'trace_level must be \["OFF"\] or \["TIMESTAMPS"\]'),
        ({"log_frequency": "10"}, r"trace settings \['log_frequency'\] are not taken"),
        ({"trace_mode": "triton"}, r"\['trace_mode'\] are not taken"),
        ({"something": None}, r"\['something'\] are not taken"),
    ],
)
def test_trace_settings_are_parsed_strictly_and_bounded(doc, message):
    """Triton's settings are strings (or lists of one): a rate over its uint32, a "0"
    that left tracing on at 1000, Python's looser int() (spaces, signs, underscores,
    other scripts' digits) are refused, naming the setting and what came; a refused
    update changes nothing."""
    tracing, _ = _tracing(7)
    before = tracing.settings()
    with pytest.raises(ValueError, match=message):
        tracing.update(doc)
    assert tracing.settings() == before and tracing.begin("m") is None  # (1 of 7)


def test_trace_settings_take_triton_values_rate_count_and_level():
    tracing, _ = _tracing(1)
    # A document read back and sent again is taken (the settings pxrt reports).
    assert tracing.update(tracing.settings()) == tracing.settings()
    got = tracing.update({"trace_rate": ["4294967295"], "trace_count": "-1"})
    assert got["trace_rate"] == "4294967295" and got["trace_count"] == "-1"
    # Off with a rate of 0 (Triton takes it while tracing is off), and back on: refused
    # until the rate is one again.
    off = tracing.update({"trace_level": ["OFF"], "trace_rate": "0"})
    assert off["trace_rate"] == "0" and off["trace_level"] == ["OFF"]
    assert tracing.begin("m") is None
    with pytest.raises(ValueError, match="trace_rate must be from 1"):
        tracing.update({"trace_level": ["TIMESTAMPS"]})
    tracing.update({"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "3"})
    # trace_count: that many traces, then none (-1: no limit again).
    sampled = [tracing.begin("m") is not None for _ in range(5)]
    assert sampled == [True, True, True, False, False]
    assert tracing.settings()["trace_count"] == "0"
    tracing.update({"trace_count": "-1"})
    assert all(tracing.begin("m") is not None for _ in range(3))
    assert tracing.update({"trace_count": 0})["trace_count"] == "0"
    assert tracing.begin("m") is None


@pytest.mark.parametrize("way", ["direct", "api"])
def test_a_caller_trace_that_is_not_sampled_stays_unsampled(run, models, way):
    tracing, exporter = _tracing(1)
    if way == "api":
        tracing._direct = None
    request = random_request(models["mlp"].inputs, 1, np.random.default_rng(2))

    async def main():
        async with Server(tracing=tracing) as server:
            server.add_model("mlp", models["mlp"])
            transport = httpx.ASGITransport(app=create_app(server))
            async with httpx.AsyncClient(transport=transport, base_url="http://pxrt") as http:
                unsampled = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"}
                r = await http.post("/v2/models/mlp/infer", json=_body(request), headers=unsampled)
                assert r.status_code == 200
                await http.post("/v2/models/mlp/infer", json=_body(request))

    run(main)
    assert [format(s.context.trace_id, "032x") != TRACE_ID
            for s in exporter.get_finished_spans()] == [True]  # fmt: skip
