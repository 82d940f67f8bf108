"""The native HTTP path (`serving.http.native`) held to the Starlette app's answers: the
same raw requests to `pxrt serve` (native, the default) and `pxrt serve
--no-native-http` get the same status, headers (but the date) and body, byte for byte;
pipelined and kept-alive requests, 100-continue, HTTP/1.0, chunked bodies, hang-ups."""

from __future__ import annotations

import asyncio
import json
import socket

import numpy as np
import pytest
from models import MODELS, assert_matches, random_request, reference
from test_http import ERRORS, X, _binary_request, infer_json


def exchange(port: int, raw: bytes, responses: int = 1) -> list[tuple[str, dict, bytes]]:
    """Send ``raw`` on one connection; read ``responses`` responses (1xx skipped):
    (status line, headers without the date, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        buf = b""
        out = []
        while len(out) < responses:
            while b"\r\n\r\n" not in buf:
                chunk = sock.recv(65536)
                assert chunk, f"the server closed the connection after {out}"
                buf += chunk
            head, _, buf = buf.partition(b"\r\n\r\n")
            status, *lines = head.decode("latin-1").split("\r\n")
            headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines)}
            if status.split()[1].startswith("1"):
                continue
            length = int(headers.get("content-length", "0"))
            while len(buf) < length:
                chunk = sock.recv(65536)
                assert chunk
                buf += chunk
            body, buf = buf[:length], buf[length:]
            headers.pop("date", None)
            out.append((status, headers, body))
        return out


def request(path: str, body: bytes = b"", method: str = "POST", headers: dict | None = None,
            version: str = "1.1") -> bytes:  # fmt: skip
    lines = [f"{method} {path} HTTP/{version}", "Host: x"]
    if method == "POST" and "Transfer-Encoding" not in (headers or {}):
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _binary(x: np.ndarray) -> tuple[bytes, dict]:
    return _binary_request(x, x.nbytes)


rng = np.random.default_rng(7)
XS = rng.standard_normal((3, 32)).astype(np.float32)
BINARY_BODY, BINARY_HEADERS = _binary(XS)

CASES = [(label, request(path, body, headers=headers)) for label, path, body, headers, *_ in ERRORS]
CASES += [
    ("json", request("/v2/models/mlp/infer", infer_json([X]))),
    ("json with id", request("/v2/models/mlp/infer", infer_json([X], id="r-1"))),
    ("binary", request("/v2/models/mlp/infer", BINARY_BODY, headers=BINARY_HEADERS)),
    ("versioned", request("/v2/models/mlp/versions/1/infer", infer_json([X]))),
    ("percent-encoded name", request("/v2/models/ml%70/infer", infer_json([X]))),
    ("query string", request("/v2/models/mlp/infer?a=1", infer_json([X]))),
    ("live", request("/v2/health/live", method="GET")),
    ("ready", request("/v2/health/ready", method="GET")),
    ("get on infer", request("/v2/models/mlp/infer", method="GET")),
    ("metadata", request("/v2/models/mlp", method="GET")),
    ("empty name", request("/v2/models//infer", infer_json([X]))),
    ("empty body", request("/v2/models/mlp/infer")),
    ("binary: bad header length",
     request("/v2/models/mlp/infer", BINARY_BODY,
             headers={"Inference-Header-Content-Length": "x1"})),
    ("binary: header length past the body",
     request("/v2/models/mlp/infer", BINARY_BODY,
             headers={"Inference-Header-Content-Length": str(len(BINARY_BODY) + 1)})),
    ("declared length over the limit",
     b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (2 << 20)),
    ("http/1.0", request("/v2/models/mlp/infer", infer_json([X]), version="1.0")),
    ("connection: close", request("/v2/models/mlp/infer", infer_json([X]),
                                  headers={"Connection": "close"})),
    ("chunked", request("/v2/models/mlp/infer", b"%x\r\n%s\r\n0\r\n\r\n"
                        % (len(infer_json([X])), infer_json([X])),
                        headers={"Transfer-Encoding": "chunked"})),
]  # fmt: skip


def _close(a, b) -> bool:
    """JSON documents equal, floats within the tolerance of the JAX comparisons."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return bool(np.isclose(a, b, rtol=1e-5, atol=1e-6))
    return a == b


@pytest.mark.parametrize("label,raw", CASES, ids=[c[0] for c in CASES])
def test_native_answers_as_the_asgi_app_does(served, served_asgi, label, raw):
    (native,) = exchange(served.port, raw)
    (asgi,) = exchange(served_asgi.port, raw)
    assert native[0] == asgi[0], (native, asgi)
    if label == "declared length over the limit":
        # Refused before its body: the native path closes after the answer (the ASGI
        # path reads the body it will not use and keeps the connection).
        assert native[1].pop("connection") == "close"
    if native[2] == asgi[2]:
        assert native[1] == asgi[1], (native, asgi)
    elif label == "deadline":  # the message says how late, which varies
        assert b"deadline" in native[2] and native[1].keys() == asgi[1].keys()
    else:  # outputs computed twice: equal within float tolerance (their text may differ)
        assert native[0].split()[1] == "200", (native, asgi)
        assert _close(json.loads(native[2]), json.loads(asgi[2])), (native, asgi)
        assert {**native[1], "content-length": ""} == {**asgi[1], "content-length": ""}


def test_binary_answers_match_jax_on_a_kept_alive_connection(served):
    # The same header every time with new tensor bytes (the decode plan is reused):
    # every answer is its own request's.
    spec = MODELS["mlp"]["inputs"]
    requests = [random_request(spec, 3, np.random.default_rng(i)) for i in range(6)]
    raws = []
    for r in requests:
        body, headers = _binary(r["x"])
        raws.append(request("/v2/models/mlp/infer", body, headers=headers))
    for i, raw in enumerate(raws):  # one connection, one request after another
        ((status, headers, body),) = exchange(served.port, raw)
        assert status == "HTTP/1.1 200 OK"
        n = int(headers["inference-header-content-length"])
        y = np.frombuffer(body[n:], np.float32).reshape(3, 32)
        assert_matches({"y": y}, reference("mlp", requests[i]))
    answers = exchange(served.port, b"".join(raws), responses=len(raws))  # pipelined
    for (_, headers, body), r in zip(answers, requests):
        n = int(headers["inference-header-content-length"])
        assert_matches({"y": np.frombuffer(body[n:], np.float32).reshape(3, 32)},
                       reference("mlp", r))  # fmt: skip


def test_pipelined_requests_are_answered_in_order(served):
    raws = [
        request("/v2/models/mlp/infer", infer_json([X], id="a")),
        request("/v2/models/nope/infer", infer_json([X])),
        request("/v2/health/live", method="GET"),
        request("/v2/models/mlp", method="GET"),
        request("/v2/models/mlp/infer", infer_json([X], id="b")),
    ]
    answers = exchange(served.port, b"".join(raws), responses=len(raws))
    assert [a[0].split()[1] for a in answers] == ["200", "404", "200", "200", "200"]
    assert json.loads(answers[0][2])["id"] == "a" and json.loads(answers[4][2])["id"] == "b"
    assert json.loads(answers[2][2]) == {"live": True}


def test_expect_100_continue_gets_its_interim_answer(served):
    body = infer_json([X])
    head = request("/v2/models/mlp/infer", headers={"Expect": "100-continue"})
    head = head.replace(b"Content-Length: 0", b"Content-Length: %d" % len(body))
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        sock.sendall(head)  # headers only: the body follows the interim answer
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        answer = b""
        while b'"outputs"' not in answer:
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 OK"), answer


def test_restricted_inference_on_the_native_path(artifacts):
    from servers import ServeProcess

    proc = ServeProcess([str(artifacts["mlp"]), "--restricted-api", "inference:k=s3"])
    try:
        raw = request("/v2/models/mlp/infer", infer_json([X]))
        ((status, _, text),) = exchange(proc.port, raw)
        assert status == "HTTP/1.1 403 Forbidden" and b"restricted" in text, text
        keyed = request("/v2/models/mlp/infer", infer_json([X]), headers={"k": "s3"})
        ((status, _, _),) = exchange(proc.port, keyed)
        assert status == "HTTP/1.1 200 OK"
        ((status, _, _),) = exchange(proc.port, request("/v2/health/live", method="GET"))
        assert status == "HTTP/1.1 200 OK"  # health is open
    finally:
        proc.stop()


@pytest.mark.parametrize("native", [True, False], ids=["native", "asgi"])
def test_a_hung_up_client_takes_its_request_out_of_the_queue(run, models, native):
    """pxrt serve's protocol, both paths: requests of clients that disconnect before
    their batch is dispatched never run, and nobody's answer is lost."""
    import uvicorn
    from models import inject, until
    from servers import free_port

    from serving import Server
    from serving.http.app import create_app
    from serving.http.limits import guarded_protocol
    from serving.options import HttpLimits

    model = models["mlp"]
    port = free_port()
    raw = request("/v2/models/mlp/infer", infer_json([X]))

    async def main():
        with inject(model, hold=True) as gate:
            async with Server() as server:
                server.add_model("mlp", model, max_inflight=1, max_batch_size=1)
                app = create_app(server)
                protocol = guarded_protocol(HttpLimits(), server,
                                            native=app.state.pxrt if native else None)  # fmt: skip
                config = uvicorn.Config(app, port=port, log_level="error", lifespan="off",
                                        http=protocol)  # fmt: skip
                uv = uvicorn.Server(config)
                serving = asyncio.ensure_future(uv.serve())
                await until(lambda: uv.started)
                first_reader, first = await asyncio.open_connection("127.0.0.1", port)
                first.write(raw)
                await gate.wait_started()  # the first batch is on the device, held
                writers = []
                for _ in range(5):  # five clients send a request...
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(raw)
                    writers.append(writer)
                await until(lambda: server.stats("mlp")["queued_rows"] == 5)
                for writer in writers:  # ...and hang up while it waits
                    writer.close()
                # Their connections close (each cancels its request's future on the way);
                # the queue counts them cancelled when it next takes a batch.
                await until(lambda: len(uv.server_state.connections) == 1)
                gate.release.set()
                answer = await first_reader.readuntil(b"\r\n\r\n")
                answer += await first_reader.read(200)
                first.close()
                uv.should_exit = True
                await serving
                return answer, server.stats("mlp")["requests"], gate.batches

    answer, counts, batches = run(main)
    assert answer.startswith(b"HTTP/1.1 200 OK"), answer
    assert counts["cancelled"] == 5 and counts["success"] == 1, counts
    assert batches == 1  # the hung-up requests never ran


def test_an_unknown_model_with_100_continue_gets_one_answer_and_a_close(served):
    # The client waits to be asked for its body: the error is its answer, the
    # connection closes (no 100, no second answer when the body never comes).
    head = request("/v2/models/nope/infer", headers={"Expect": "100-continue"})
    head = head.replace(b"Content-Length: 0", b"Content-Length: 100")
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 404 ") and answer.count(b"HTTP/1.1") == 1, answer
    assert b"connection: close" in answer


def _in_process(run, model, limits, check, keep_alive_s=5.0):
    """``check(port, server, gate)`` against pxrt serve's protocol (native path) in this
    process, the model's batches held until ``gate.release``."""
    import uvicorn
    from models import inject, until
    from servers import free_port

    from serving import Server
    from serving.http.app import create_app
    from serving.http.limits import guarded_protocol

    port = free_port()

    async def main():
        with inject(model, hold=True) as gate:
            async with Server() as server:
                server.add_model("mlp", model, max_inflight=1, max_batch_size=1)
                app = create_app(server)
                config = uvicorn.Config(
                    app, port=port, log_level="error", lifespan="off",
                    http=guarded_protocol(limits, server, native=app.state.pxrt),
                    timeout_keep_alive=keep_alive_s,
                )  # fmt: skip
                uv = uvicorn.Server(config)
                serving = asyncio.ensure_future(uv.serve())
                await until(lambda: uv.started)
                try:
                    return await check(port, server, gate)
                finally:
                    gate.release.set()
                    uv.should_exit = True
                    await serving

    return run(main)


def test_an_answer_written_while_parsing_does_not_time_out_the_next_request(run, models):
    # Health answered from the parser armed the keep-alive timer (1 s here); the infer
    # parsed from the same read, held 1.5 s on the device, must still be answered.
    from serving.options import HttpLimits

    async def check(port, server, gate):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("/v2/health/live", method="GET")
                     + request("/v2/models/mlp/infer", infer_json([X])))  # fmt: skip
        await gate.wait_started()
        await asyncio.sleep(1.5)
        gate.release.set()
        answers = (await asyncio.wait_for(reader.read(1 << 16), 10)).decode()
        while answers.count("HTTP/1.1") < 2:
            chunk = await asyncio.wait_for(reader.read(1 << 16), 10)
            assert chunk, answers
            answers += chunk.decode()
        writer.close()
        return answers

    answers = _in_process(run, models["mlp"], HttpLimits(), check, keep_alive_s=1.0)
    assert answers.count("HTTP/1.1 200 OK") == 2, answers


def test_a_pipelined_request_timed_out_behind_a_native_one_breaks_nothing(run, models):
    # The second request's headers time out (408, the connection half-closed) while
    # the first is on the device: the first's reply is dropped quietly (the run fixture
    # fails on any error the loop logs).
    from serving.options import HttpLimits

    async def check(port, server, gate):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("/v2/models/mlp/infer", infer_json([X])) + b"POST /v2/mo")
        await gate.wait_started()
        answer = await asyncio.wait_for(reader.read(1 << 16), 10)
        gate.release.set()
        await asyncio.sleep(0.2)  # the first request's reply is made now
        writer.close()
        return answer

    answer = _in_process(run, models["mlp"], HttpLimits(header_timeout_s=0.5), check)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
