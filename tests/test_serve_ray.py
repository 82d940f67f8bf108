"""`pxrt serve --ray`: the command line on a local Ray it starts itself (its own, one per
test): replicas behind Ray's proxy over HTTPS until SIGTERM drains them, what the proxy
cannot enforce refused at start-up, a bad artifact reported before Ray starts, SIGTERM
while deploying. (Ray Serve through the library, on a cluster the tests start: test_ray.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

import httpx
import numpy as np
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("ray", reason="the ray extra is not installed")

import tritonclient.http as httpclient  # noqa: E402
from models import MODELS, assert_matches, random_request, reference  # noqa: E402
from servers import ServeProcess, free_ports, make_certs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _sigterm_under_traffic(proc: ServeProcess) -> str:
    """SIGTERM ``proc`` while 4 clients send requests: it drains (exit 0, every request
    answered, 200 until each client gets 503 + Connection: close) without replacing its
    replicas (an in-place update). Returns its output."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32], "data": [0.5] * 32}]}
    statuses: list = []
    lost: list = []
    done = threading.Event()

    def traffic():
        # Every request in flight when the drain begins is answered; from then on the
        # replicas answer 503 + Connection: close, and a client told so stops.
        verify = proc.ssl_context() if proc.tls else True
        with httpx.Client(timeout=60, verify=verify) as http:
            while not done.is_set():
                try:
                    r = http.post(proc.url + "/v2/models/mlp/infer", json=body)
                except httpx.HTTPError as exc:
                    lost.append(repr(exc))
                    return
                statuses.append(r.status_code)
                if r.status_code == 503:
                    assert "draining" in r.json()["error"]
                    assert r.headers["connection"] == "close"
                    return

    threads = [threading.Thread(target=traffic) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        while len(statuses) < 50 and not lost:
            time.sleep(0.05)
        proc.proc.send_signal(signal.SIGTERM)
        proc.proc.wait(120)
        output = proc.output()
    finally:
        done.set()
        rc = proc.stop()
    for t in threads:
        t.join(60)
    assert rc == 0, output[-6000:]
    if lost:  # (pytest.fail: its message is shown whole, an assertion's is cut short)
        pytest.fail(
            f"{len(lost)} requests lost, e.g. {lost[:2]}; {statuses.count(200)} answered 200, "
            f"{statuses.count(503)} 503; the server's output ends:\n{output[-6000:]}"
        )
    assert set(statuses) == {200, 503} and statuses.count(503) == len(threads), statuses[-8:]
    assert "pxrt serve: draining" in output
    # Reconfigured, not replaced (Ray Serve says "Stopping N replicas ... with outdated
    # versions" when the code version changes).
    assert "with outdated versions" not in output, output[-6000:]
    return output


def test_pxrt_serve_ray_over_https_runs_replicas_until_sigterm_and_drains(artifacts, tmp_path):
    # Ray's proxy serves TLS (the unmodified Triton client over HTTPS), and drains on
    # SIGTERM.
    certs = make_certs(tmp_path)
    proc = ServeProcess([str(artifacts["mlp"]), "--ray", "--replicas", "2",
                         "--replica-cpus", "0.5", "--max-delay-us", "500"], tls=certs)  # fmt: skip
    try:
        client = httpclient.InferenceServerClient(
            f"localhost:{proc.port}", ssl=True, ssl_options={"ca_certs": certs["ca"]}
        )
        request = random_request(MODELS["mlp"]["inputs"], 3, np.random.default_rng(5))
        inp = httpclient.InferInput("x", [3, 32], "FP32")
        inp.set_data_from_numpy(request["x"])
        assert_matches({"y": client.infer("mlp", [inp]).as_numpy("y")}, reference("mlp", request))
        client.close()
    except BaseException:
        proc.stop()
        raise
    # (The proxy answers before ``serve.run`` returns: a SIGTERM then drains too.)
    _sigterm_under_traffic(proc)


def test_pxrt_serve_ray_drains_replicas_serving_before_serve_run_returns(artifacts, monkeypatch):
    # Two replicas of every CPU Ray has: one runs and serves through the proxy, the other
    # cannot be placed, so ``serve.run`` does not return. A SIGTERM then drains the one
    # that serves, as on any stop.
    monkeypatch.setenv("RAY_USE_MULTIPROCESSING_CPU_COUNT", "1")  # Ray's CPUs: os.cpu_count()
    proc = ServeProcess([str(artifacts["mlp"]), "--ray", "--replicas", "2",
                         "--replica-cpus", str(os.cpu_count())])  # fmt: skip
    assert "pxrt serve: ready on" not in proc.output()
    output = _sigterm_under_traffic(proc)
    assert "stopped while deploying" not in output and "ready on" not in output


def test_pxrt_serve_ray_gives_its_replicas_a_stable_code_version(artifacts):
    # Ray Serve replaces the replicas of a deployment whose code version changes, and
    # gives each serve.run a new one unless the deployment sets it: the draining app must
    # keep it (reconfigured in place), another artifact or options must not.
    from serving.ray import pxrt_app

    def version(path, **kw):
        return pxrt_app(str(path), **kw)._bound_deployment.version

    first = version(artifacts["mlp"], num_replicas=2)
    assert first and first == version(artifacts["mlp"], num_replicas=2, draining=True)
    assert first == version(artifacts["mlp"], num_replicas=3)  # Ray's own: in place too
    assert first != version(artifacts["mlp"], max_batch_size=8)
    assert first != version(artifacts["mlp"], load_options={"buckets": [8]})
    assert first != version(artifacts["two_io"])


def test_pxrt_serve_ray_refuses_what_rays_proxy_cannot_enforce(artifacts, tmp_path):
    import subprocess
    import sys

    for extra in (["--restricted-api", "model-repository:k=v"], ["--tls-ca", str(tmp_path)]):
        done = subprocess.run(
            [sys.executable, "-m", "serving.cli", "serve", str(artifacts["mlp"]), "--ray", *extra],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2 and "Ray's HTTP proxy" in done.stderr, done.stderr


def test_pxrt_serve_ray_reports_a_bad_artifact_before_starting_ray(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "serving.cli", "serve", str(tmp_path), "--ray"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "is not a pxrt artifact: manifest.json is missing" in proc.stderr, proc.stderr
    assert "Started a local Ray" not in proc.stdout + proc.stderr


def test_pxrt_serve_ray_stops_when_signalled_while_deploying(artifacts, tmp_path):
    # SIGTERM while replicas are still loading: Serve and Ray shut down and the process
    # exits 0 ("stopped while deploying", unless the deployment won the race), no hang.
    import subprocess
    import sys

    (port,) = free_ports(1)
    log = tmp_path / "log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "serving.cli", "serve", str(artifacts["mlp"]), "--ray",
             "--replicas", "2", "--replica-cpus", "0.5", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.time() + 60
        while "Deploying new version" not in log.read_text() and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("pxrt serve --ray did not stop on SIGTERM while deploying")
    text = log.read_text()
    assert rc == 0, text[-2000:]
    said = ("stopped while deploying", "ready on", "draining")  # (replicas serving: drained)
    assert any(s in text for s in said), text[-2000:]
