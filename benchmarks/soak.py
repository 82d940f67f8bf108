"""A soak of `pxrt serve` under mixed good and bad traffic: is anything leaking?

For ``--minutes`` (default 5), at once: good clients (JSON and binary tensors, checked
against the model), clients sending malformed or invalid requests, slowloris sockets that
never finish their headers, clients that hang up mid-request, oversized headers, and
idle sockets; and every ``--reload-every-s`` (default 20) the model is reloaded: the
server serves it from a model repository (explicit mode) and a version 2 directory
appears or goes before each ``POST /v2/repository/models/mlp/load``, so the served
version alternates (load the new one, retire the old one) under the traffic. gRPC
clients send bursts of requests down streams (Triton's client), and a flood of sockets
beyond ``--max-connections`` is refused now and then. Every few seconds it samples the
server's resident memory and open file descriptors. At the end the server gets SIGTERM
while all of this goes on: it must drain (every request sent is answered, or its stream
ended with UNAVAILABLE, or its connection refused before it was sent). The report:
requests by outcome, unanswered requests and 5xx on established connections (there must
be none), and memory and descriptors at the start of the second minute (after warm-up)
and at the end.

The attacks of the hardening work run beside them: an HTTP/2 connection that opens 200
streams and floods SETTINGS frames, a gRPC client advertising a zero window that never
reads its answers, resets the server is made to send, requests to upgrade the
connection, trailing slashes with a forged Host, generate requests with a million stop
strings (to the demo decoder, served too). A client reads /v2/health/ready every 50 ms
throughout: its latency percentiles are reported (the goal: p99 under 50 ms).

The MLP keeps its answers in the response cache (``--response-cache-mb``, default 16),
and two priority levels. Shared-memory clients (``shm_race``, with ``--allow-client-shm``;
not with ``--workers``) name their region in requests while a thread of theirs rewrites
its bytes and now and then shrinks the segment to nothing and back; beside them, askers
send the region's first contents as JSON and check every answer against the model run
in plain JAX: an answer to bytes the racer wrote, cached under the asker's, would show
there (``POISONED``). ``bad_values`` sends out-of-range and mistyped values the parsers
must refuse by name (priorities past 2**63, unknown generate fields, float token ids,
trace settings). The memory check: from the end of the first minute to the end, RSS
may grow by the response cache's budget plus 10% at most.

    python benchmarks/soak.py [--minutes 5] [--reload-every-s 20] [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import Counter

import httpx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import queue  # noqa: E402
import signal  # noqa: E402

import tritonclient.grpc as grpcclient  # noqa: E402
from servers import ServeProcess  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from pxrt import demo  # noqa: E402
from serving.grpc import h2  # noqa: E402


def _tree(pid: int) -> list[int]:
    """The server's processes: itself and its children (--workers' workers)."""
    from servers import children

    return [pid, *children(pid)]


def rss_mb(pid: int) -> float:
    """Resident memory of the server's processes, summed."""
    total = 0.0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024
        except (FileNotFoundError, StopIteration):
            continue
    return total


def open_fds(pid: int) -> int:
    """Open file descriptors of the server's processes, summed."""
    total = 0
    for p in _tree(pid):
        try:
            total += len(os.listdir(f"/proc/{p}/fd"))
        except FileNotFoundError:
            continue
    return total


ATTACKS = ("settings_flood", "zero_window", "made_you_reset", "odd_http", "shm_race",
           "bad_values")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument(
        "--reload-every-s", type=float, default=20.0, help="seconds between reloads (0: none)"
    )
    parser.add_argument("--workers", type=int, default=1, help="pxrt serve --workers")
    parser.add_argument(
        "--attacks", default="all",
        help="the hardening attacks to run beside the traffic: all, none, or a comma-separated "
        f"list of {', '.join(ATTACKS)}",
    )  # fmt: skip
    parser.add_argument(
        "--response-cache-mb", type=float, default=16.0, help="pxrt serve --response-cache-mb"
    )
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="pxrt-soak-")
    repo = os.path.join(work, "repo")
    demo.export_demo(os.path.join(repo, "mlp", "1"))
    demo.export_lm(os.path.join(repo, "lm", "1"))
    spare = shutil.copytree(os.path.join(repo, "mlp", "1"), os.path.join(work, "spare"))
    conf = os.path.join(work, "serve.toml")
    with open(conf, "w") as f:
        f.write("[models.mlp]\nresponse_cache = true\npriority_levels = 2\n")
    shm = args.workers == 1  # (shared memory is not served with --workers)
    proc = ServeProcess(
        ["--model-repository", repo, "--model-control-mode", "explicit", "--load-model", "mlp",
         "--load-model", "lm", "--header-timeout-s", "2", "--body-timeout-s", "2",
         "--max-connections", "72", "--workers", str(args.workers), "--config", conf,
         "--response-cache-mb", str(args.response_cache_mb),
         *(["--allow-client-shm"] if shm else [])],
        grpc=True,
    )  # fmt: skip
    url, port, pid = proc.url, proc.port, proc.proc.pid
    stop = time.monotonic() + args.minutes * 60
    draining = threading.Event()  # SIGTERM sent: the clients go on until refused
    over = threading.Event()  # the server is gone: the clients stop
    flooding = threading.Lock()  # held while the flood's sockets are open
    outcomes: Counter = Counter()
    lock = threading.Lock()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    good_json = json.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [3, 256], "data": x.ravel().tolist()}
            ]
        }
    )
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [3, 256],
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    bad_bodies = [
        b"{not json",
        json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 256], "data": [True] * 768}]}
        ).encode(),
        json.dumps(
            {"inputs": [{"name": "q", "datatype": "FP32", "shape": [1], "data": [1]}]}
        ).encode(),
        json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP64", "shape": [1, 256], "data": [0.5] * 256}]}
        ).encode(),
        json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2**62, 0], "data": []}]}
        ).encode(),
    ]

    def count(key: str) -> None:
        count_n(key, 1)

    def count_n(key: str, n: int) -> None:
        if n:
            with lock:
                outcomes[key] += n

    def key(who: str, r: httpx.Response) -> str:
        """An answer's outcome: refusals at connect (the budget) and answers while
        draining apart, so the 5xx left are errors."""
        if r.status_code == 503 and b"too many connections" in r.content:
            return f"{who} 503 (connection budget)"
        return f"{who} {r.status_code}{' (draining)' if draining.is_set() else ''}"

    def good() -> None:
        # A well-behaved client: it stops once told the server drains (503 + close).
        with httpx.Client(base_url=url, timeout=30) as http:
            while not over.is_set():
                try:
                    if random.random() < 0.5:
                        r = http.post("/v2/models/mlp/infer", content=good_json)
                    else:
                        r = http.post(
                            "/v2/models/mlp/infer",
                            content=header + x.tobytes(),
                            headers={"Inference-Header-Content-Length": str(len(header))},
                        )
                except httpx.ConnectError:  # not sent: the listener is closed (draining)
                    count("good refused (not sent)")
                    return
                except httpx.HTTPError as exc:  # sent, and no answer
                    count(f"good UNANSWERED ({exc!r:.80})")
                    continue
                count(key("good", r))
                if r.status_code == 503 and draining.is_set():
                    return

    def stream() -> None:
        inputs = [grpcclient.InferInput("x", [3, 256], "FP32")]
        inputs[0].set_data_from_numpy(x)
        while not over.is_set():
            answers: queue.Queue = queue.Queue()
            try:
                client = grpcclient.InferenceServerClient(proc.grpc_url)
                client.start_stream(lambda result, error, answers=answers: answers.put(error))
            except Exception:  # noqa: BLE001 - the server is gone
                count("stream refused (not sent)")
                return
            sent = 0
            for i in range(200):
                try:
                    client.async_stream_infer("mlp", inputs, request_id=str(i))
                except InferenceServerException:
                    break  # the stream ended (its error is in answers)
                sent += 1
            answered, ended = 0, None
            while answered < sent and ended is None:
                try:
                    error = answers.get(timeout=30)
                except queue.Empty:
                    ended = "no answer in 30 s"
                    break
                if error is None:
                    answered += 1
                elif error.status() is None:  # that request's own error; the stream goes on
                    answered += 1
                    count(f"stream answered an error ({error.message():.60})")
                elif "UNAVAILABLE" in str(error.status()):
                    ended = "UNAVAILABLE"
                else:
                    ended = f"{error.status()}: {error.message():.80}"
            client.stop_stream()
            client.close()
            count_n("stream answered (errors included)", answered)
            if ended == "UNAVAILABLE":  # drained: told to go elsewhere, so it does
                count_n("stream ended UNAVAILABLE (not answered)", sent - answered)
                return
            count_n(f"stream UNANSWERED ({ended})", sent - answered)

    def flood() -> None:
        # Now and then, more sockets than the budget at once: those beyond it are
        # answered 503 at once; the rest are closed by us. The samples wait for it.
        while not draining.wait(15):
            with flooding:
                socks, refused = [], 0
                for _ in range(80):
                    try:
                        socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                    except OSError:
                        refused += 1
                for s in socks:
                    s.settimeout(2)
                    try:
                        reply = s.recv(64)
                        count(f"flood {reply[9:12].decode() or 'closed'}")
                    except OSError:
                        count("flood open")  # within the budget
                    s.close()
                count_n("flood refused at connect", refused)
                time.sleep(1)  # the server sees them closed

    def bad() -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            while not draining.is_set():
                try:
                    r = http.post("/v2/models/mlp/infer", content=random.choice(bad_bodies))
                except httpx.HTTPError as exc:
                    count("bad refused (not sent)" if draining.is_set() else f"bad {exc!r:.80}")
                    continue
                count(key("bad", r))

    def raw(kind: str) -> None:
        while not draining.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                    if kind == "slowloris":
                        s.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n")
                    elif kind == "hangup":
                        s.sendall(
                            b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "
                            + str(len(good_json)).encode()
                            + b"\r\n\r\n"
                            + good_json.encode()
                        )
                        time.sleep(0.001)
                        count("hangup")
                        continue
                    elif kind == "big-header":
                        s.sendall(b"GET /v2 HTTP/1.1\r\nX-A: " + b"a" * 100_000 + b"\r\n\r\n")
                    # idle: nothing at all
                    reply = s.recv(64)
                    count(f"{kind} {reply[9:12].decode() or 'closed'}")
            except OSError:
                count(f"{kind} reset")

    grpc_port = int(proc.grpc_url.rsplit(":", 1)[1])
    health_ms: list[float] = []

    def health() -> None:
        # The latency a load balancer's probe sees, every 50 ms (a connection kept).
        with httpx.Client(base_url=url, timeout=30) as http:
            while not draining.is_set():
                t0 = time.perf_counter()
                try:
                    r = http.get("/v2/health/ready")
                except httpx.HTTPError:
                    count("health UNANSWERED")
                    continue
                health_ms.append((time.perf_counter() - t0) * 1e3)
                if r.status_code != 200:
                    count(f"health {r.status_code}")
                time.sleep(0.05)

    def h2_connection() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", grpc_port), timeout=10)
        s.sendall(h2.PREFACE + h2.frame_head(h2.SETTINGS, 0, 0, 0))
        return s

    def h2_open(sid: int, method: str, end: bool = False) -> bytes:
        path = f"/inference.GRPCInferenceService/{method}".encode()
        block = h2.encode_headers(
            [(b":method", b"POST"), (b":path", path), (b"content-type", b"application/grpc")]
        )
        flags = h2.END_HEADERS | (h2.END_STREAM if end else 0)
        return h2.frame_head(h2.HEADERS, flags, sid, len(block)) + block

    def until_closed(s: socket.socket, seconds: float) -> bytes:
        """What the server sends until it closes (or ``seconds`` pass)."""
        s.settimeout(seconds)
        got = b""
        try:
            while chunk := s.recv(1 << 16):
                got += chunk
        except OSError:
            pass
        return got

    def settings_flood() -> None:
        # 200 open streams, then SETTINGS(INITIAL_WINDOW_SIZE) as fast as it takes them.
        setting = [b"\0\4\0\0\0\0", b"\0\4\0\1\0\0"]
        frames = b"".join(h2.frame_head(h2.SETTINGS, 0, 0, 6) + setting[i % 2] for i in range(5000))
        while not draining.wait(2):
            try:
                with h2_connection() as s:
                    s.sendall(b"".join(h2_open(2 * i + 1, "ModelStreamInfer") for i in range(200)))
                    try:
                        for _ in range(20):
                            s.sendall(frames)
                    except OSError:
                        pass  # sent away mid-flood
                    got = until_closed(s, 10)
                    count("settings flood sent away" if b"too many control frames" in got
                          else "settings flood NOT SENT AWAY")  # fmt: skip
            except OSError as exc:
                count(f"settings flood {type(exc).__name__}")

    def zero_window() -> None:
        # Calls whose answers (64 KB each) a client with a zero window never takes.
        big = np.ones((64, 256), np.float32)
        request = grpcclient.service_pb2.ModelInferRequest(model_name="mlp")
        request.inputs.add(name="x", datatype="FP32", shape=[64, 256])
        request.raw_input_contents.append(big.tobytes())
        message = request.SerializeToString()
        framed = b"\0" + len(message).to_bytes(4, "big") + message
        while not draining.wait(1):
            try:
                with socket.create_connection(("127.0.0.1", grpc_port), timeout=10) as s:
                    zero = b"\0\4\0\0\0\0"  # SETTINGS_INITIAL_WINDOW_SIZE 0
                    s.sendall(h2.PREFACE + h2.frame_head(h2.SETTINGS, 0, 0, 6) + zero)
                    out = b""
                    for i in range(100):
                        sid = 2 * i + 1
                        out += h2_open(sid, "ModelInfer")
                        out += h2.frame_head(h2.DATA, h2.END_STREAM, sid, len(framed)) + framed
                    s.sendall(out)
                    time.sleep(5)  # holding what it was answered, reading none of it
                count("zero-window client")
            except OSError as exc:
                count(f"zero-window client {type(exc).__name__}")

    def made_you_reset() -> None:
        # Streams the server is made to reset (a zero WINDOW_UPDATE each).
        zero = b"\0\0\0\0"
        while not draining.wait(2):
            try:
                with h2_connection() as s:
                    frames = b"".join(
                        h2_open(2 * i + 1, "ModelInfer")
                        + h2.frame_head(h2.WINDOW_UPDATE, 0, 2 * i + 1, 4)
                        + zero
                        for i in range(3000)
                    )
                    try:
                        s.sendall(frames)
                    except OSError:
                        pass
                    got = until_closed(s, 10)
                    count("reset flood sent away" if b"too many streams reset" in got
                          else "reset flood NOT SENT AWAY")  # fmt: skip
            except OSError as exc:
                count(f"reset flood {type(exc).__name__}")

    def odd_http() -> None:
        # Upgrades, trailing slashes with a forged Host, a million stop strings.
        upgrade = (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                   b"Upgrade: websocket\r\nContent-Length: %d\r\n\r\n" % len(good_json)
                   + good_json.encode())  # fmt: skip
        stops = json.dumps({"text_input": "hi", "stop": ["x"] * 1_000_000}).encode()
        with httpx.Client(base_url=url, timeout=30) as http:
            while not draining.wait(0.5):
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                        s.sendall(upgrade)
                        count(f"upgrade {until_closed(s, 10)[9:12].decode() or 'closed'}")
                    r = http.get("/v2/models/mlp/ready/", headers={"Host": "evil.example"})
                    count(f"trailing slash {r.status_code}"
                          + (" REDIRECTED" if "location" in r.headers else ""))  # fmt: skip
                    r = http.post("/v2/models/lm/generate", content=stops)
                    count(key("stop flood", r))
                except httpx.HTTPError as exc:
                    count(f"odd http {type(exc).__name__}")

    expected = np.asarray(demo.mlp(demo.make_params(), x)["y"])

    def shm_race(index: int) -> None:
        # A client whose requests name its region while its own thread rewrites the
        # bytes and now and then shrinks the segment to nothing and back.
        region, size = f"soak-race-{index}", 2 * x.nbytes
        path = f"/dev/shm/pxrt-soak-race-{os.getpid()}-{index}"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, size)
        os.pwrite(fd, x.tobytes(), 0)
        racing = threading.Event()

        def racer() -> None:
            # (a write each millisecond, the segment shrunk to nothing and back every
            # 200 ms: a tight loop would only measure two cores shared with it)
            noise = np.random.default_rng(index).standard_normal(x.shape).astype(np.float32)
            noise = noise.tobytes()
            n = 0
            while not racing.wait(0.001):
                n += 1
                os.pwrite(fd, noise if n % 2 else x.tobytes(), 0)
                if n % 200 == 0:
                    os.ftruncate(fd, 0)
                    time.sleep(0.001)
                    os.ftruncate(fd, size)

        body = json.dumps({
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 256], "parameters": {
                "shared_memory_region": region, "shared_memory_byte_size": x.nbytes}}],
            "outputs": [{"name": "y", "parameters": {
                "shared_memory_region": region, "shared_memory_offset": x.nbytes,
                "shared_memory_byte_size": x.nbytes}}],
        })  # fmt: skip
        where = {"key": os.path.basename(path), "offset": 0, "byte_size": size}
        thread = threading.Thread(target=racer)
        try:
            with httpx.Client(base_url=url, timeout=30) as http:
                r = http.post(f"/v2/systemsharedmemory/region/{region}/register", json=where)
                count(key("shm register", r))
                thread.start()
                while not draining.is_set():
                    try:
                        r = http.post("/v2/models/mlp/infer", content=body)
                    except httpx.HTTPError as exc:
                        count("shm refused (not sent)" if draining.is_set()
                              else f"shm UNANSWERED ({exc!r:.60})")  # fmt: skip
                        continue
                    count(key("shm", r))
                    if r.status_code in (400, 404):
                        # (a region that shrank stays refused: register it again; while
                        # the segment is shrunk, that is refused too)
                        http.post(f"/v2/systemsharedmemory/region/{region}/unregister")
                        r = http.post(
                            f"/v2/systemsharedmemory/region/{region}/register", json=where
                        )
                        count(key("shm register", r))
        finally:
            racing.set()
            if thread.is_alive():
                thread.join()
            os.close(fd)
            os.unlink(path)

    def asker() -> None:
        # The racers' first contents as JSON: every answer is the model's for them.
        with httpx.Client(base_url=url, timeout=30) as http:
            while not draining.is_set():
                try:
                    r = http.post("/v2/models/mlp/infer", content=good_json)
                except httpx.HTTPError as exc:
                    count("asker refused (not sent)" if draining.is_set()
                          else f"asker UNANSWERED ({exc!r:.60})")  # fmt: skip
                    continue
                if r.status_code == 200:
                    y = np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(3, 256)
                    ok = np.allclose(y, expected, rtol=1e-4, atol=1e-5)
                    count("asker 200" if ok else "asker 200 POISONED")
                else:
                    count(key("asker", r))

    mlp_doc = {"inputs": json.loads(good_json)["inputs"]}
    bad_values = [  # (path, body): each must be a 400 naming what is wrong
        ("/v2/models/mlp/infer", {**mlp_doc, "parameters": {"priority": 2**64}}),
        ("/v2/models/mlp/infer", {**mlp_doc, "parameters": {"priority": 2**63}}),
        ("/v2/models/mlp/infer", {**mlp_doc, "parameters": {"priority": 3}}),
        ("/v2/models/mlp/infer", {**mlp_doc, "parameters": {"priority": "1"}}),
        ("/v2/models/lm/generate", {"text_input": "hi", "max_token": 4}),
        ("/v2/models/lm/generate", {"text_input": "hi", "parameters": {"priority": 2**64}}),
        ("/v2/models/lm/generate", {"input_ids": [72.5, 3.0], "max_tokens": 2}),
        ("/v1/completions", {"model": "lm", "prompt": "hi", "max_tokens": 2, "priority": 2**70}),
        ("/v2/trace/setting", {"trace_rate": str(2**64)}),
    ]

    def bad_value() -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            while not draining.wait(0.05):
                path, doc = random.choice(bad_values)
                try:
                    r = http.post(path, content=json.dumps(doc))
                except httpx.HTTPError as exc:
                    count(f"values {type(exc).__name__}")
                    continue
                count(key("values", r))

    def reload() -> None:
        version2 = os.path.join(repo, "mlp", "2")
        with httpx.Client(base_url=url, timeout=300) as http:
            while time.monotonic() + args.reload_every_s < stop:
                time.sleep(args.reload_every_s)
                if os.path.isdir(version2):
                    shutil.rmtree(version2)  # back to version 1
                else:
                    shutil.copytree(spare, version2)
                r = http.post("/v2/repository/models/mlp/load")
                count(key("reload", r))

    threads = [threading.Thread(target=good) for _ in range(4)]
    if args.reload_every_s > 0:
        threads.append(threading.Thread(target=reload))
    threads += [threading.Thread(target=bad) for _ in range(2)]
    threads += [threading.Thread(target=stream) for _ in range(2)]
    threads.append(threading.Thread(target=flood))
    attacks = {
        "settings_flood": settings_flood, "zero_window": zero_window,
        "made_you_reset": made_you_reset, "odd_http": odd_http, "bad_values": bad_value,
    }  # fmt: skip
    chosen = ATTACKS if args.attacks == "all" else [a for a in args.attacks.split(",") if a]
    if args.attacks == "none":
        chosen = []
    threads += [threading.Thread(target=health)]
    threads += [threading.Thread(target=attacks[a]) for a in chosen if a in attacks]
    if "shm_race" in chosen and shm:
        threads += [threading.Thread(target=shm_race, args=(i,)) for i in range(2)]
        threads += [threading.Thread(target=asker) for _ in range(2)]
    threads += [
        threading.Thread(target=raw, args=(k,))
        for k in ("slowloris", "slowloris", "hangup", "big-header", "idle")
    ]
    for t in threads:
        t.start()
    samples = []
    t0 = time.monotonic()

    def sample() -> int:
        with flooding:  # not while a flood holds sockets
            samples.append((time.monotonic() - t0, rss_mb(pid), open_fds(pid)))
            return httpx.get(url + "/v2/health/ready", timeout=10).status_code

    while time.monotonic() < stop:
        sample()
        time.sleep(5)
    healthy = sample()
    # SIGTERM under the traffic: the server drains and exits.
    draining.set()
    proc.proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.proc.wait(90)
    finally:
        over.set()
    for t in threads:
        t.join(60)
    proc.stop()
    shutil.rmtree(work, ignore_errors=True)

    after_warmup = next((s for s in samples if s[0] >= 60), samples[0])
    end = samples[-1]
    print(f"\nsoak: {args.minutes:g} min, server exit code {rc}, ready afterwards: {healthy}")
    for key, n in sorted(outcomes.items()):
        print(f"  {key:<22} {n:>9,}")
    # 5xx on requests sent on established connections (503s to sockets beyond the
    # connection budget and to requests arriving while draining are refusals, by design).
    fives = sum(
        n
        for k, n in outcomes.items()
        if k.split()[0] in ("good", "bad", "reload", "stop", "shm", "asker", "values")
        and k.split()[-1].startswith("5")
        and "(" not in k  # not while draining, not beyond the connection budget
    )  # fmt: skip
    if health_ms:
        p50, p99 = np.percentile(health_ms, [50, 99])
        print(f"  health: {len(health_ms)} probes, p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
              f"max {max(health_ms):.0f} ms")  # fmt: skip
    draining_503 = sum(n for k, n in outcomes.items() if k.endswith("503 (draining)"))
    unanswered = sum(n for k, n in outcomes.items() if "UNANSWERED" in k)
    print(f"  5xx answers: {fives} (503 while draining: {draining_503}); unanswered: {unanswered}")
    poisoned = sum(n for k, n in outcomes.items() if "POISONED" in k)
    print(f"  poisoned answers: {poisoned}")
    budget = args.response_cache_mb + 0.1 * after_warmup[1]
    grown = end[1] - after_warmup[1]
    print(
        f"RSS MB: start {samples[0][1]:.0f}, at {after_warmup[0]:.0f} s {after_warmup[1]:.0f}, "
        f"end {end[1]:.0f}, max {max(s[1] for s in samples):.0f} "
        f"(end / after warm-up {end[1] / after_warmup[1]:.3f}x; grew {grown:.0f} MB, "
        f"within the cache's budget + 10%: {'yes' if grown <= budget else 'NO'})"
    )
    print(
        f"open fds: start {samples[0][2]}, at {after_warmup[0]:.0f} s {after_warmup[2]}, "
        f"end {end[2]}, max {max(s[2] for s in samples)}"
    )


if __name__ == "__main__":
    main()
