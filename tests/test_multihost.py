"""Multi-host serving (pxrt.multihost) on loopback: groups of 2 processes x 2 virtual CPU
devices over jax.distributed with gloo, against plain JAX and a one-process load; the
lockstep protocol's checks against fake peers; pxrt serve's leader and followers, a
follower killed or stalled mid-traffic, a leader killed, a group restarted."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import jax
import multihost_group
import numpy as np
import pytest
from models import MODELS, RAGGED, assert_matches, ragged_reference, random_request, reference
from servers import ROOT, free_ports

from pxrt import multihost
from pxrt.multihost import HEADER, REPLY, Distributed, GroupBroken, LeaderGone

SECRET = "a-test-secret-of-the-group-0123456789"
# Two devices a process; the suite's other XLA flags kept (its results are compared with
# this process's, compiled with them).
_FLAGS = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
GROUP_ENV = dict(
    os.environ,
    XLA_FLAGS=" ".join([*_FLAGS, "--xla_force_host_platform_device_count=2"]),
    PXRT_GROUP_SECRET=SECRET,
)
GROUP_ENV.pop("PXRT_NO_EXTENSIONS", None)


def _ports() -> tuple[str, int]:
    coordinator, control = free_ports(2)
    return f"127.0.0.1:{coordinator}", control


def _start_group(artifact, tmp_path, processes=2, **leader):
    """A group loading ``artifact`` (tests/multihost_group.py, ``leader``: what the
    leader runs), run to its end: every process exits 0."""
    coordinator, control = _ports()
    procs = []
    for pid in range(processes):
        spec = dict(
            coordinator=coordinator,
            num_processes=processes,
            process_id=pid,
            control_port=control,
            artifact=str(artifact),
            **leader,
        )
        (tmp_path / f"spec{pid}.json").write_text(json.dumps(spec))
        procs.append(
            subprocess.Popen(
                [sys.executable, "tests/multihost_group.py", str(tmp_path / f"spec{pid}.json")],
                cwd=ROOT,
                env=GROUP_ENV,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=180)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    for pid, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"process {pid} exited {proc.returncode}:\n{log[-3000:]}"


def _run_group(artifact, requests, tmp_path):
    """Run ``requests`` on a group loading ``artifact``: the leader's outputs."""
    multihost_group.save(
        tmp_path / "requests.npz",
        {f"{i}/{k}": v for i, r in enumerate(requests) for k, v in r.items()},
    )
    out_path = tmp_path / "out.npz"
    _start_group(artifact, tmp_path, requests=str(tmp_path / "requests.npz"), out=str(out_path))
    out = multihost_group.load(out_path)
    errors = dict(json.loads(str(out.pop("errors"))))
    per = {"batch": {}, "alone": {}}
    for key, value in out.items():
        how, i, name = key.split("/")
        per[how].setdefault(int(i), {})[name] = value
    return per, errors


def _single_process(model, request):
    """The same request on a one-process load over 4 devices: the same program per
    device, so the same bits (None when this run has another device count)."""
    if len(jax.devices()) != 4:
        return None
    return model.run(request)


@pytest.mark.parametrize("name", ["two_io", "bf16"])
def test_group_matches_plain_jax_and_one_process(artifacts, models, tmp_path, name):
    rng = np.random.default_rng(7)
    sizes = [1, 3, 4, 8, 13, 2]  # largest bucket 8: 13 rows is split over two batches
    requests = [random_request(MODELS[name]["inputs"], n, rng) for n in sizes]
    first = next(iter(MODELS[name]["inputs"]))  # its dtype is float16 or bfloat16
    requests.insert(2, dict(requests[1], **{first: requests[1][first].astype(np.float32)}))
    got, errors = _run_group(artifacts[name], requests, tmp_path)
    assert list(errors) == [2], errors
    assert first in errors[2] and "float32" in errors[2], errors[2]
    for i, request in enumerate(requests):
        if i == 2:
            continue
        want = reference(name, request)
        assert_matches(got["batch"][i], want, f"{name} batch {i}")
        assert_matches(got["alone"][i], want, f"{name} alone {i}")
        one = _single_process(models[name], request)
        if one is not None:
            for k in want:
                np.testing.assert_array_equal(got["alone"][i][k], one[k])


def test_group_runs_a_variable_length_model(var_artifacts, tmp_path):
    rng = np.random.default_rng(3)
    cases = [(1, 3), (4, 8), (3, 5), (6, 2)]  # rows, length (buckets 1, 4; seq 4, 8)
    requests = [
        {
            "x": rng.uniform(-10, 10, (rows, 3, length)).astype(np.float32),
            "w": rng.integers(-50, 50, (rows, length)).astype(np.int32),
        }
        for rows, length in cases
    ]
    got, errors = _run_group(var_artifacts["ragged"], requests, tmp_path)
    assert not errors, errors
    for i, request in enumerate(requests):
        want = ragged_reference(request)
        assert_matches(got["batch"][i], want, f"ragged batch {i}")
        assert_matches(got["alone"][i], want, f"ragged alone {i}")
    assert RAGGED["dim_buckets"]["seq"] == (4, 8)


def test_group_generates_like_plain_jax(tmp_path):
    """A decoder in lockstep: every prefill and decode step on both processes, the
    cache sharded by slot over the 4 devices; continuous batching over more prompts
    than slots; greedy tokens equal plain JAX one prompt at a time."""
    from pxrt import demo

    sizes = dict(dim=32, heads=2, layers=2)
    path = demo.export_lm(
        str(tmp_path / "lm"), slots=4, max_length=64, prefill_lengths=(8, 32),
        prefill_batches=(1, 4), extend=False, **sizes,  # (a group chunks nothing)
    )  # fmt: skip
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, int(k)).tolist() for k in rng.integers(1, 33, 7)]
    out = tmp_path / "tokens.json"
    options = {"step_slots": [], "sampling_controls": False}  # (fewer programs: test_generate.py)
    _start_group(path, tmp_path, prompts=prompts, max_tokens=9, out=str(out), load_options=options)
    got = json.loads(out.read_text())
    params = demo.make_lm_params(**sizes)
    for prompt, tokens in zip(prompts, got):
        assert tokens == demo.lm_reference(np.array(prompt, np.int32), 9, params, 64)


# --------------------------------------------------------------------------- pxrt serve


class Group:
    """``pxrt serve`` as a multi-host group: process 0 serves on ``url``."""

    def __init__(self, artifact, *extra: str, processes: int = 2, ports=None) -> None:
        self.artifact = artifact
        self.extra = extra
        self.coordinator, self.control = _ports()
        self.http = ports or free_ports(processes)
        self.url = f"http://127.0.0.1:{self.http[0]}"
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        self.start()

    def start(self) -> None:
        self.procs, self.logs = [], []
        for pid, port in enumerate(self.http):
            # A file, not a pipe: nobody reads a pipe while the test runs.
            log = tempfile.TemporaryFile("w+")
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "serving.cli",
                        "serve",
                        str(self.artifact),
                        "--port",
                        str(port),
                        "--coordinator",
                        self.coordinator,
                        "--num-processes",
                        str(len(self.http)),
                        "--process-id",
                        str(pid),
                        "--control-port",
                        str(self.control),
                        *self.extra,
                    ],
                    cwd=ROOT,
                    env=GROUP_ENV,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
            )
        deadline = time.time() + 120
        while not (self.ready(0) and all(self.ready(i) for i in range(1, len(self.http)))):
            for pid, proc in enumerate(self.procs):
                assert proc.poll() is None, f"process {pid} exited: {self.output(pid)}"
            assert time.time() < deadline, f"the group did not get ready: {self.output(0)}"
            time.sleep(0.1)

    def get(self, pid: int, path: str, timeout: float = 5.0) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.http[pid]}{path}", timeout=timeout)

    def ready(self, pid: int) -> bool:
        try:
            return self.get(pid, "/v2/health/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def infer(self, x: np.ndarray, timeout: float = 60.0) -> httpx.Response:
        body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                            "data": x.ravel().tolist()}]}  # fmt: skip
        return httpx.post(f"{self.url}/v2/models/mlp/infer", json=body, timeout=timeout)

    def output(self, pid: int) -> str:
        self.logs[pid].flush()
        self.logs[pid].seek(0)
        return self.logs[pid].read()[-4000:]

    def wait(self, pid: int, timeout: float) -> int:
        return self.procs[pid].wait(timeout)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)
        for log in self.logs:
            log.close()


def _y(x: np.ndarray) -> np.ndarray:
    return reference("mlp", {"x": x})["y"]


def _check(response: httpx.Response, x: np.ndarray) -> None:
    assert response.status_code == 200, response.text
    out = response.json()["outputs"][0]
    got = np.array(out["data"], np.float32).reshape(out["shape"])
    np.testing.assert_allclose(got, _y(x), rtol=1e-5, atol=1e-5)


def test_serve_follower_killed_mid_traffic_then_the_group_restarts(artifacts):
    group = Group(artifacts["mlp"])
    try:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((5, 32)).astype(np.float32)
        _check(group.infer(x), x)
        # A follower answers health only, and says where requests go.
        state = group.get(1, "/v2/health/ready").json()
        assert state["role"] == "follower" and state["state"] == "following", state
        refused = group.get(1, "/v2/models/mlp")
        assert refused.status_code == 503 and "leader" in refused.json()["error"]

        answers: list[int] = []
        stop = threading.Event()

        def caller(seed: int) -> None:
            local = np.random.default_rng(seed)
            while not stop.is_set():
                xi = local.standard_normal((int(local.integers(1, 9)), 32)).astype(np.float32)
                r = group.infer(xi)
                if r.status_code == 200:
                    _check(r, xi)
                else:
                    assert r.status_code in (500, 503), r.text
                    assert "group is broken" in r.json()["error"], r.text
                answers.append(r.status_code)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            calls = [pool.submit(caller, s) for s in range(6)]
            deadline = time.time() + 30
            while answers.count(200) < 30:
                assert time.time() < deadline
                time.sleep(0.01)
            group.procs[1].kill()
            killed = time.time()
            while group.ready(0):  # not ready within a bound: the connection closing
                assert time.time() - killed < 5, "the leader still says ready"
                time.sleep(0.02)
            failed_at = len(answers)
            while len(answers) < failed_at + 12:
                assert time.time() - killed < 30 and not any(c.done() for c in calls), [
                    c.exception() for c in calls if c.done()
                ]
                time.sleep(0.01)
            stop.set()
            for call in calls:
                call.result(timeout=60)  # every request answered, none hangs
        assert answers[-12:] == [503] * 12, answers[-12:]
        why = group.get(0, "/v2/health/ready").json()["error"]
        assert "process 1 went away" in why and "restart" in why, why
        assert group.get(0, "/v2/models/mlp/ready").status_code == 503
        group.procs[0].send_signal(signal.SIGTERM)
        assert group.wait(0, 30) == 0, group.output(0)
        # Restarted, on the same ports: it serves again.
        group.start()
        _check(group.infer(x), x)
    finally:
        group.stop()


def test_serve_stalled_follower(artifacts):
    group = Group(artifacts["mlp"], "--step-timeout-s", "1")
    try:
        x = np.ones((2, 32), np.float32)
        _check(group.infer(x), x)
        group.procs[1].send_signal(signal.SIGSTOP)
        t0 = time.time()
        r = group.infer(x)
        assert r.status_code in (500, 503), r.text
        assert "did not answer batch" in r.json()["error"], r.text
        assert time.time() - t0 < 10
        assert not group.ready(0)
    finally:
        group.stop()


def test_serve_killed_leader_stops_its_followers(artifacts):
    group = Group(artifacts["mlp"])
    try:
        x = np.ones((2, 32), np.float32)
        _check(group.infer(x), x)
        # A leader that dies: its followers stop at once, saying why (exit 3), unless
        # jax's own watchdog, which notices the same instant, aborts the process first.
        group.procs[0].kill()
        code = group.wait(1, 30)
        said = group.output(1)
        if code == 3:
            assert "the leader went away after batch" in said, said
        else:
            assert code == -signal.SIGABRT, said
            assert "JAX distributed service detected fatal errors" in said, said
    finally:
        group.stop()


def test_serve_leader_stops_its_followers(artifacts):
    group = Group(artifacts["mlp"])
    try:
        x = np.ones((3, 32), np.float32)
        _check(group.infer(x), x)
        t0 = time.time()
        group.procs[0].send_signal(signal.SIGTERM)
        assert group.wait(0, 30) == 0, group.output(0)
        assert group.wait(1, 30) == 0, group.output(1)
        assert time.time() - t0 < 8, "a clean stop waited on something"
        assert "the leader stopped the group" in group.output(1)
    finally:
        group.stop()


def test_serve_group_stopped_whole_drains_and_every_process_exits_0(artifacts):
    # SIGTERM to every process at once (an orchestrator stopping the group), the
    # follower's first: it follows the batches the leader drains, and leaves when the
    # leader stops the group. Every request is answered, 200 or (drained) 503, and
    # every process exits 0.
    group = Group(artifacts["mlp"])
    answers: list[int] = []
    stop = threading.Event()

    def caller(seed: int) -> None:
        local = np.random.default_rng(seed)
        while not stop.is_set():
            xi = local.standard_normal((int(local.integers(1, 9)), 32)).astype(np.float32)
            try:
                r = group.infer(xi)
            except httpx.ConnectError:  # the leader closed its port: drained
                return
            answers.append(r.status_code)
            if r.status_code != 200:
                assert r.status_code == 503 and "draining" in r.json()["error"], r.text
                return
            _check(r, xi)

    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            calls = [pool.submit(caller, s) for s in range(4)]
            deadline = time.time() + 60
            while answers.count(200) < 20:
                assert time.time() < deadline and not any(c.done() for c in calls), [
                    c.exception() for c in calls if c.done()
                ]
                time.sleep(0.01)
            for proc in reversed(group.procs):
                proc.send_signal(signal.SIGTERM)
            codes = [group.wait(pid, 60) for pid in range(len(group.procs))]
            stop.set()
            for call in calls:
                call.result(timeout=60)  # no request failed: none met a broken group
        assert codes == [0, 0], f"exit codes {codes}:\n{group.output(0)}\n{group.output(1)}"
        assert "the leader stopped the group" in group.output(1), group.output(1)
    finally:
        stop.set()
        group.stop()


# --------------------------------------------------------------------------- protocol


def _fake_leader(why: str | None = None, secret: str = SECRET):
    """A listening socket playing the leader (holding ``secret``; ``why``: it refuses
    the follower): (cfg for a follower, accept())."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    cfg = Distributed("127.0.0.1:1", 2, 1, control_port=port, connect_timeout_s=10,
                      secret=SECRET)  # fmt: skip
    leader = Distributed("127.0.0.1:1", 2, 0, control_port=port, secret=secret)

    def accept():
        sock, _ = server.accept()
        server.close()
        hello = multihost.greet_follower(sock, dataclasses.replace(leader, secret=SECRET))
        multihost.welcome(sock, leader, hello, why)
        return sock

    return cfg, accept


def _follower(cfg):
    return multihost.Follower(cfg, "m", [], "fp", 0.0)


def test_follower_refuses_a_step_out_of_sequence():
    cfg, accept = _fake_leader()
    follower = _follower(cfg)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        leader = pool.submit(accept)
        following = pool.submit(follower.follow)
        sock = leader.result(timeout=10)
        sock.sendall(HEADER.pack(b"PXST", 2, 0, 0))  # batch 1 is due
        with pytest.raises(LeaderGone, match="batch 2 .* when batch 1 was due: the group diverged"):
            following.result(timeout=10)
        sock.close()
    assert follower.state == "leader gone"


def test_a_follower_told_to_stop_follows_until_its_leader_stops_or_its_grace_ends():
    class One:
        payload_bytes = 8

        def run(self, body):
            return [bytes(body)]

    for leader_stops in (True, False):
        cfg, accept = _fake_leader()
        follower = multihost.Follower(cfg, "m", [One()], "fp", 0.0)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            leader = pool.submit(accept)
            following = pool.submit(follower.follow)
            sock = leader.result(timeout=10)
            follower.stop(grace_s=60 if leader_stops else 0.2)
            # Told to stop, it still runs the leader's batches (a draining leader's).
            sock.sendall(HEADER.pack(b"PXST", 1, 0, 8) + b"12345678")
            reply = multihost._recv_exact(sock, REPLY.size)
            assert REPLY.unpack(reply)[1:3] == (1, 0)
            assert multihost._recv_exact(sock, 8) == b"12345678"
            if leader_stops:
                sock.sendall(HEADER.pack(b"PXST", 2, multihost.STOP, 0))
            following.result(timeout=30)  # no LeaderGone: a requested stop
            # Past its grace it hung up: the leader reads the end of the connection.
            assert leader_stops or sock.recv(1) == b""
            sock.close()
        assert follower.steps == 1
        assert follower.state == ("stopped" if leader_stops else "left")


@pytest.mark.parametrize(
    "header, why",
    [
        (HEADER.pack(b"PXST", 1, 3, 0), "names program 3 with 0 bytes; this process has 1"),
        (HEADER.pack(b"PXST", 1, 0, 99), "names program 0 with 99 bytes"),
        (HEADER.pack(b"XXXX", 1, 0, 0), "magic b'XXXX'"),
    ],
)
def test_follower_refuses_a_step_it_cannot_run(header, why):
    cfg, accept = _fake_leader()

    class One:
        payload_bytes = 8

        def run(self, body):
            raise AssertionError("not run")

    follower = multihost.Follower(cfg, "m", [One()], "fp", 0.0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        leader = pool.submit(accept)
        following = pool.submit(follower.follow)
        sock = leader.result(timeout=10)
        sock.sendall(header)
        with pytest.raises(LeaderGone, match=re.escape(why)):
            following.result(timeout=10)
        sock.close()


def test_follower_refused_by_its_leader_says_why():
    cfg, accept = _fake_leader("process 1 loaded a different artifact")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(accept)
        with pytest.raises(LeaderGone, match="refused this process: process 1 loaded a different"):
            _follower(cfg).follow()


def test_a_follower_does_not_follow_a_leader_without_the_secret():
    """A peer on the leader's port that answers the follower's hello without the group's
    secret (one that got there first, a wrong --group-secret-file) is not followed."""
    cfg, accept = _fake_leader(secret="another-secret-0123456789abcdef")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(accept)
        follower = _follower(cfg)
        with pytest.raises(LeaderGone, match="does not hold the group's secret"):
            follower.follow()
    assert follower.state == "leader gone"


def _leader_group(fake, step_timeout_s=5):
    """A leader's Group with one fake follower (``fake(sock)`` plays it)."""
    port = free_ports(1)[0]
    cfg = Distributed("127.0.0.1:1", 2, 0, control_port=port, connect_timeout_s=10,
                      step_timeout_s=step_timeout_s, secret=SECRET)  # fmt: skip
    group = multihost.Group(cfg)

    def follower():
        sock = socket.create_connection(("127.0.0.1", port))
        multihost.join_leader(sock, dataclasses.replace(cfg, process_id=1), "fp")
        fake(sock)

    t = threading.Thread(target=follower, daemon=True)
    t.start()
    group.accept("fp")
    return group, t


def test_group_breaks_on_an_answer_out_of_sequence():
    def fake(sock):
        multihost._recv_exact(sock, HEADER.size)
        sock.sendall(REPLY.pack(b"PXRE", 7, 0, 0))

    group, _ = _leader_group(fake)
    step = group.send(0, [[]])
    with pytest.raises(
        GroupBroken, match="answered batch 7 .* when batch 1 was due: the group diverged"
    ):
        group.wait(step)
    with pytest.raises(GroupBroken):  # and for good
        group.send(0, [[]])
    group.close()


def test_group_breaks_when_a_follower_goes_away_or_fails():
    def gone(sock):
        multihost._recv_exact(sock, HEADER.size)
        sock.close()

    group, _ = _leader_group(gone)
    seen = []
    group.on_broken(seen.append)
    with pytest.raises(GroupBroken, match="process 1 went away"):
        group.wait(group.send(0, [[]]))
    deadline = time.time() + 10  # the callbacks run after the waiters are woken
    while not seen:
        assert time.time() < deadline
        time.sleep(0.01)
    assert "restart every process of the group" in seen[0]
    group.close()

    def failing(sock):
        multihost._recv_exact(sock, HEADER.size)
        message = b"RuntimeError('device lost')"
        sock.sendall(REPLY.pack(b"PXRE", 1, 1, len(message)) + message)

    group, _ = _leader_group(failing)
    with pytest.raises(
        GroupBroken, match="process 1 failed batch 1: RuntimeError\\('device lost'\\)"
    ):
        group.wait(group.send(0, [[]]))
    group.close()


def test_group_breaks_on_a_follower_that_stops_reading():
    """A stalled follower whose socket's buffers are full: the leader's send gives up
    after step_timeout_s instead of blocking (under the group's lock) for ever."""
    stop = threading.Event()
    group, _ = _leader_group(lambda sock: stop.wait(30), step_timeout_s=1)
    big = np.zeros(64 << 20, np.uint8)  # more than loopback buffers hold
    t0 = time.time()
    with pytest.raises(GroupBroken, match="process 1 did not take batch 1 within 1 s"):
        group.send(0, [[big]])
    assert time.time() - t0 < 10
    stop.set()
    group.close()


def test_group_refuses_a_follower_with_another_artifact():
    port = free_ports(1)[0]
    cfg = Distributed("127.0.0.1:1", 2, 0, control_port=port, connect_timeout_s=10,
                      secret=SECRET)  # fmt: skip
    group = multihost.Group(cfg)
    answers = []

    def follower():
        sock = socket.create_connection(("127.0.0.1", port))
        try:
            multihost.join_leader(sock, dataclasses.replace(cfg, process_id=1), "other")
        except LeaderGone as exc:
            answers.append(str(exc))

    t = threading.Thread(target=follower)
    t.start()
    with pytest.raises(GroupBroken, match="process 1 loaded a different artifact"):
        group.accept("fp")
    t.join(10)
    assert "refused this process: process 1 loaded a different artifact" in answers[0]
    group.close()


def test_the_group_port_lets_in_only_members_and_nobody_holds_it_up(caplog):
    """The leader's port: a silent connection does not hold up the others (each hello is
    heard on its own thread), one that forges a hello without the secret (the artifact's
    fingerprint is no secret) is told so, logged and ignored, and the real follower
    still joins; the group is whole."""
    port = free_ports(1)[0]
    cfg = Distributed("127.0.0.1:1", 2, 0, control_port=port, connect_timeout_s=20,
                      secret=SECRET)  # fmt: skip
    group = multihost.Group(cfg)
    silent = socket.create_connection(("127.0.0.1", port))
    forged = []

    def forger():
        sock = socket.create_connection(("127.0.0.1", port))
        wrong = dataclasses.replace(cfg, process_id=1, secret="guessed-secret-0123456789")
        try:
            multihost.join_leader(sock, wrong, "fp")
        except LeaderGone as exc:
            forged.append(str(exc))
        sock.close()

    member = []

    def follower():
        time.sleep(0.5)  # after the other two
        sock = socket.create_connection(("127.0.0.1", port))
        member.append(sock)
        multihost.join_leader(sock, dataclasses.replace(cfg, process_id=1), "fp")
        multihost._recv_exact(sock, HEADER.size)
        sock.sendall(REPLY.pack(b"PXRE", 1, 0, 0))

    threads = [threading.Thread(target=forger), threading.Thread(target=follower)]
    for t in threads:
        t.start()
    with caplog.at_level("WARNING", logger="pxrt"):
        group.accept("fp")
    group.wait(group.send(0, [[]]))  # the real follower answers its batch
    for t in threads:
        t.join(10)
    assert forged and "refused this process: it does not hold the group's secret" in forged[0]
    assert "ignored 1 connection(s) to the group's port" in caplog.text
    assert group.broken is None and [p.process for p in group.peers] == [1]
    silent.close()
    member[0].close()  # (a follower hangs up once told to stop: the fake, at once)
    group.close(timeout_s=1)


def test_distributed_options_are_checked():
    with pytest.raises(ValueError, match="coordinator must be host:port"):
        Distributed("nohost", 2, 0)
    with pytest.raises(ValueError, match="process_id must be in"):
        Distributed("h:1", 2, 2)
    with pytest.raises(ValueError, match="step_timeout_s must be > 0"):
        Distributed("h:1", 2, 0, step_timeout_s=0)
    assert Distributed("[::1]:8470", 2, 1, secret=SECRET).control_address == ("::1", 8471)
    with pytest.raises(ValueError, match="needs a shared secret of at least 16 characters"):
        Distributed("h:1", 2, 0, secret="short")
    assert Distributed("h:1", 1, 0).secret is None  # one process: no lockstep, no secret


def test_serve_multihost_flags_are_checked(tmp_path, monkeypatch):
    from serving.config import add_arguments, distributed_config
    from serving.options import OptionError

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def config(*argv, models=1):
        return distributed_config(parser.parse_args(list(argv)), models)

    monkeypatch.delenv("PXRT_GROUP_SECRET", raising=False)
    assert config() is None
    with pytest.raises(OptionError, match="needs --coordinator, --num-processes and --process-id"):
        config("--coordinator", "h:1")
    group = ("--coordinator", "h:1", "--num-processes", "2", "--process-id", "1")
    with pytest.raises(OptionError, match="needs a shared secret"):
        config(*group)
    (tmp_path / "secret").write_text(SECRET + "\n")
    with pytest.raises(OptionError, match="--group-secret-file is for a multi-host group"):
        config("--group-secret-file", str(tmp_path / "secret"))
    with pytest.raises(OptionError, match="--group-secret-file: .*No such file"):
        config(*group, "--group-secret-file", str(tmp_path / "nope"))
    assert config(*group, "--group-secret-file", str(tmp_path / "secret")).secret == SECRET
    monkeypatch.setenv("PXRT_GROUP_SECRET", SECRET)
    assert config(*group).process_id == 1
    with pytest.raises(OptionError, match="--workers does not go with a multi-host group"):
        config(*group, "--workers", "2")
    with pytest.raises(OptionError, match="--placement does not go with a multi-host group"):
        config(*group, "--placement", "auto")
    from serving.serve import main

    assert main(parser.parse_args(["--ray", *group])) == 2  # (before Ray is imported)
    with pytest.raises(OptionError, match="serves one model; 2 given"):
        config(*group, models=2)
    with pytest.raises(OptionError, match="process_id must be in"):
        config("--coordinator", "h:1", "--num-processes", "2", "--process-id", "2")


# --------------------------------------------------------------------------- a process's part


def _part(artifacts, size=8):
    """A LocalPart of the mlp's cell of ``size`` rows in this one process (process 0,
    every local device), its example rows, and plain JAX's outputs for them."""
    from pxrt import _xla, artifact, compiling

    art = artifact.read(artifacts["mlp"])
    settings = compiling.Settings(art, None, True, False, 1, 1, False)
    inst = compiling.Instance(settings, jax.devices())
    compiled, _ = inst.compile_cell(size, ())
    layout = multihost.Layout.of(inst.rows, size, 0)
    example = compiling.staged_example(art.inputs, size, {})
    want = reference("mlp", {"x": example[0]})["y"]
    return (compiled, inst.params_dev, layout, inst.rows, False, example), want, _xla


def _whole(part, example):
    return np.concatenate(part.rows(part.launch(example))[0])


def test_local_part_takes_the_raw_path_when_it_gives_the_same_bits(artifacts):
    args, want, _ = _part(artifacts)
    part = multihost.LocalPart(*args)
    assert part.path == "raw"
    assert_matches({"y": _whole(part, args[-1])}, {"y": want})


def test_local_part_falls_back_to_the_public_path(artifacts, monkeypatch, caplog):
    args, want, _xla = _part(artifacts)
    real = _xla.RawProgram.fetch

    def off_by_one_bit(self, results):
        out = real(self, results)
        out[0][0] = out[0][0].copy()
        out[0][0].view(np.uint32)[0] ^= 1
        return out

    monkeypatch.setattr(_xla.RawProgram, "fetch", off_by_one_bit)
    part = multihost.LocalPart(*args)
    assert part.path == "public" and part.raw is None
    assert "the raw path differs" in caplog.text
    assert_matches({"y": _whole(part, args[-1])}, {"y": want})
    monkeypatch.setattr(_xla, "RAW_PATH_AVAILABLE", False)
    assert multihost.LocalPart(*args).path == "public"
