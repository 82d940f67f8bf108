"""`pxrt bench`'s measuring machinery: arrival schedules, the open-loop runner and its
records, the stability rule, the goodput search, paired ratios with intervals, the CSV
in perf_analyzer's columns; and the command over HTTP as a user runs it."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from serving.bench import loadgen, method, report, schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- schedules


def _gaps(spec: str, duration: float = 200.0) -> np.ndarray:
    return np.diff(schedule.parse(spec).times(duration, seed=1))


def test_constant_and_poisson_arrivals_have_their_rate():
    assert np.allclose(_gaps("constant:50"), 1 / 50)
    times = schedule.parse("poisson:100").times(200.0, seed=2)
    assert abs(len(times) / 200.0 / 100 - 1) < 0.03
    gaps = np.diff(times)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential: CV 1
    assert times.max() < 200.0 and np.all(gaps >= 0)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_keep_the_rate_and_set_the_burstiness(burstiness):
    gaps = _gaps(f"gamma:100:{burstiness}")
    assert abs(gaps.mean() * 100 - 1) < 0.05
    assert abs(gaps.std() / gaps.mean() - 1 / math.sqrt(burstiness)) < 0.08


def test_a_ramp_rises_from_its_first_rate_to_its_last():
    times = schedule.parse("ramp:50:250").times(100.0, seed=3)
    early = np.sum(times < 10) / 10  # mean rate over the first tenth: 60 req/s
    late = np.sum(times >= 90) / 10  # and the last: 240 req/s
    assert abs(early / 60 - 1) < 0.2 and abs(late / 240 - 1) < 0.1
    assert abs(len(times) / (150 * 100) - 1) < 0.05  # the mean rate over the run


def test_traces_replay_their_times_and_sizes(tmp_path):
    jsonl = tmp_path / "trace.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps({"timestamp": t, "rows": r}) for t, r in [(0, 1), (5, 3), (20, 2)])
    )
    plan = schedule.parse(f"trace:{jsonl}")
    assert plan.times(10.0).tolist() == [0.0, 0.005, 0.02] and plan.rows == (1, 3, 2)
    assert plan.times(0.01).tolist() == [0.0, 0.005]  # cut at the run's length
    assert np.allclose(plan.at(plan.rate * 2).times(10.0), [0.0, 0.0025, 0.01])
    intervals = tmp_path / "intervals.txt"  # perf_analyzer's: gaps in microseconds
    intervals.write_text("1000\n2000\n500\n")
    assert np.allclose(schedule.parse(f"trace:{intervals}").times(1.0), [0.001, 0.003, 0.0035])


@pytest.mark.parametrize(
    "spec, words",
    [
        ("zipf:3", "expected one of constant"),
        ("gamma:100", "expected gamma:200:0.5"),
        ("poisson:-5", "must be > 0"),
        ("poisson:fast", "not numbers"),
        ("trace:", "needs a file"),
        ("trace:/nonexistent/file", "No such file"),
    ],
)
def test_bad_schedules_are_named(spec, words):
    with pytest.raises(ValueError, match=words):
        schedule.parse(spec)


def test_bad_trace_lines_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 5}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="line 2: times must be >= 0 and not decrease"):
        schedule.parse(f"trace:{bad}")
    bad.write_text('{"time": 5}\n')
    with pytest.raises(ValueError, match="line 1: expected a JSON object with timestamp"):
        schedule.parse(f"trace:{bad}")


def test_the_runs_of_arrival_and_request_rate():
    assert [p.rate for p in schedule.plans("poisson", None, 40.0)] == [40.0]
    assert [p.rate for p in schedule.plans("poisson:25", None, 40.0)] == [25.0]
    runs = schedule.plans("gamma::0.5", [10.0, 20.0], 40.0)
    assert [(p.kind, p.rate, p.burstiness) for p in runs] == [
        ("gamma", 10.0, 0.5),
        ("gamma", 20.0, 0.5),
    ]
    (ramp,) = schedule.plans("ramp:10:30", None, 40.0)
    assert (ramp.rate, ramp.end_rate) == (10.0, 30.0)


# --------------------------------------------------------------------------- the runner


def test_the_open_loop_runner_times_from_the_schedule_and_records_each_request(run):
    """A fake server answering in 5 ms: latencies are 5 ms from each scheduled send,
    nothing is sent late at 200 req/s, and a failure is recorded, not lost."""

    async def main():
        loop = asyncio.get_running_loop()
        calls = 0

        def submit(_request):
            nonlocal calls
            calls += 1
            fut = loop.create_future()
            if calls == 7:
                loop.call_later(0.005, fut.set_exception, RuntimeError("HTTP 500"))
            else:
                loop.call_later(0.005, fut.set_result, None)
            return fut

        times = schedule.parse("constant:200").times(0.5)
        return await loadgen.scheduled_run(submit, None, times), times

    (records, elapsed), times = run(main)
    lat = np.asarray(records.latencies())
    assert len(times) == 100 and times[0] == 0 and len(lat) == 99  # one failed
    assert np.median(lat) == pytest.approx(0.005, abs=0.003)
    assert records.late_share() < 0.25  # (a busy machine delays a few)
    rows = records.rows_of()
    assert rows[6]["error"] == "RuntimeError: HTTP 500" and "latency_ms" not in rows[6]
    assert rows[0]["scheduled_s"] == 0.0 and rows[1]["scheduled_s"] == 0.005
    assert elapsed >= times[-1]


def test_a_generator_that_falls_behind_says_so(run):
    """Requests whose sending blocks the loop for 3 ms, scheduled every 1 ms: most are
    sent late, and their latency includes the lateness."""
    import time

    async def main():
        loop = asyncio.get_running_loop()

        def submit(_request):
            time.sleep(0.003)
            fut = loop.create_future()
            fut.set_result(None)
            return fut

        return await loadgen.scheduled_run(submit, None, np.arange(50) * 0.001)

    records, _ = run(main)
    assert records.late_share() > 0.5
    assert max(records.latencies()) > 0.05


def test_the_raw_client_reuses_connections_within_its_limit(run):
    """A server that closes every third connection after answering, 2 connections
    allowed, 12 requests at once: every answer arrives, never over 2 connections open."""
    from serving.bench.wire import RawClient, request_bytes

    async def main():
        open_now = peak = answered = 0

        async def handle(reader, writer):
            nonlocal open_now, peak, answered
            open_now += 1
            peak = max(peak, open_now)
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                    await reader.readexactly(length)
                    answered += 1
                    close = answered % 3 == 0
                    status = b"200 OK" if answered != 5 else b"503 Service Unavailable"
                    writer.write(
                        b"HTTP/1.1 " + status + b"\r\nContent-Length: 2\r\n"
                        + (b"Connection: close\r\n" if close else b"") + b"\r\nok"
                    )  # fmt: skip
                    await writer.drain()
                    if close:
                        break
            except asyncio.IncompleteReadError:
                pass
            finally:
                open_now -= 1
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RawClient("127.0.0.1", port, 2)
        data = request_bytes(f"http://127.0.0.1:{port}/v2/models/m/infer", b"{}", {})
        statuses = await asyncio.gather(*(client.send(data) for _ in range(12)))
        await client.close()
        for _ in range(200):  # the handlers see their connections close
            if not open_now:
                break
            await asyncio.sleep(0.005)
        server.close()
        await server.wait_closed()
        return statuses, peak

    statuses, peak = run(main)
    assert sorted(statuses) == [200] * 11 + [503] and peak <= 2


# --------------------------------------------------------------------------- method


def test_stability_waits_for_three_agreeing_windows():
    values = iter([100, 150, 90, 100, 104, 98, 300])
    windows, ok = method.stable(
        lambda: {"requests_per_s": next(values), "mean_ms": 1.0}, threshold=0.1
    )
    assert ok and [w["requests_per_s"] for w in windows] == [100, 104, 98]
    noisy = iter([100, 200] * 10)
    windows, ok = method.stable(
        lambda: {"requests_per_s": next(noisy), "mean_ms": 1.0}, max_windows=6
    )
    assert not ok and len(windows) == 3


def test_the_goodput_search_finds_the_rate_at_the_objective():
    """An M/M/1 server (service rate 1000/s): p99 = ln(100) / (mu - lambda), so a
    10 ms objective is met up to 1000 - 460.5 = 539.5 req/s."""
    mu = 1000.0

    def p99_ms(rate: float) -> float:
        return math.log(100) / (mu - rate) * 1e3 if rate < mu else float("inf")

    best, probed = method.goodput(p99_ms, 10.0, 10.0, 2000.0, rel_tol=0.01, max_probes=30)
    assert best == pytest.approx(539.5, rel=0.015) and p99_ms(best) <= 10.0
    assert method.goodput(p99_ms, 0.001, 10.0, 2000.0)[0] == 0.0  # even the lowest misses
    assert method.goodput(p99_ms, 1e9, 10.0, 900.0)[0] == 900.0


def test_paired_ratios_have_intervals_that_cover_the_difference():
    rng = np.random.default_rng(0)
    drift = rng.normal(0, 0.2, 5)  # the machine's drift hits both of a pair
    a = list(100 * np.exp(drift + rng.normal(0, 0.01, 5)))
    b = list(120 * np.exp(drift + rng.normal(0, 0.01, 5)))
    out = method.ratio_interval(a, b)
    assert out["low"] < 1.2 < out["high"] and out["high"] / out["low"] < 1.05
    assert out["n"] == 5
    one = method.ratio_interval([2.0], [3.0])
    assert one["ratio"] == pytest.approx(1.5) and math.isnan(one["low"])
    with pytest.raises(ValueError):
        method.ratio_interval([1.0], [1.0, 2.0])


# --------------------------------------------------------------------------- files


def test_csv_has_perf_analyzers_columns_in_microseconds(tmp_path):
    closed = loadgen.run_result("http-closed", "x", [0.001, 0.002, 0.003], 1, 1.0, concurrency=4)
    closed["stages_us"] = {
        "queue": 100.0,
        "compute_input": 10.0,
        "compute_infer": 500.0,
        "compute_output": 20.0,
    }
    path = tmp_path / "out.csv"
    report.write_csv(str(path), [closed])
    header, row = list(csv.reader(path.open()))
    assert header[:3] == ["Concurrency", "Inferences/Second", "Client Send"]
    assert "p99 latency" in header and "Server Compute Infer" in header
    values = dict(zip(header, row))
    assert values["Concurrency"] == "4" and float(values["Inferences/Second"]) == 3.0
    assert values["p50 latency"] == "2000" and values["Server Compute Infer"] == "500"
    assert values["Network+Server Send/Recv"] == str(2000 - 630)
    opened = loadgen.run_result("http-open", "y", [0.001], 1, 1.0, offered_per_s=50.0)
    report.write_csv(str(path), [opened])
    header, row = list(csv.reader(path.open()))
    assert header[0] == "Request Rate" and row[0] == "50.0" and row[3] == ""


# --------------------------------------------------------------------------- the command


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "serving.cli", "bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bench_url_with_schedules_stability_goodput_and_files(served, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "\n".join(json.dumps({"timestamp": 10 * i, "rows": 1 + i % 3}) for i in range(30))
    )
    out = tmp_path / "bench"
    result = _bench(
        "--url", served.url, "--model", "mlp", "--duration", "0.4", "--concurrency", "2",
        "--request-rate", "40,80", "--arrival", "gamma::0.5", "--stability",
        "--max-windows", "4", "--goodput-p99-ms", "1000", "--csv", str(tmp_path / "r.csv"),
        "--records", str(tmp_path / "r.jsonl"), "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gamma arrivals (burstiness 0.5) at 40 req/s" in result.stdout
    doc = json.loads((out / "bench.json").read_text())
    closed, *opened = doc["results"]
    assert closed["windows"] >= 3 and isinstance(closed["stable"], bool)
    assert [r["mode"] for r in opened] == ["http-open", "http-open"]
    assert all(r["errors"] == 0 and r["requests_per_s"] > 0 for r in opened)
    # a generous objective: met at the highest rate probed
    assert doc["goodput"]["goodput_per_s"] > 0 and "goodput:" in result.stdout
    records = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(records) > 20 and all("latency_ms" in r for r in records)
    assert {r["run"] for r in records} == {r["label"] for r in opened}
    header = next(csv.reader((tmp_path / "r.csv").open()))
    assert header[0] == "Concurrency"
    # a trace replays its own times and sizes
    replay = _bench(
        "--url", served.url, "--model", "mlp", "--duration", "5", "--concurrency", "",
        "--arrival", f"trace:{trace}", "--records", str(tmp_path / "t.jsonl"),
        "--client-procs", "2", "--out", str(out),
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr[-3000:]
    # (sent by two processes, every other request each, merged in the trace's order)
    rows = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["rows"] for r in rows] == [1 + i % 3 for i in range(30)]
    assert [r["scheduled_s"] for r in rows] == pytest.approx([0.01 * i for i in range(30)])
    assert all("latency_ms" in r for r in rows)
    doc = json.loads((out / "bench.json").read_text())
    assert doc["results"][0]["client_procs"] == 2 and doc["results"][0]["client_cpu_us"] > 0


def test_bench_compare_alternates_two_servers(served, tmp_path):
    result = _bench(
        "--url", served.url, "--compare", served.url, "--model", "mlp", "--duration", "0.3",
        "--concurrency", "2", "--repeats", "2", "--client-procs", "2", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "B / A, 2 alternated repeats" in result.stdout
    (row,) = json.loads((tmp_path / "compare.json").read_text())["compare"]
    for key in ("requests_per_s", "p50_ms", "p99_ms"):
        assert len(row[key]["a"]) == len(row[key]["b"]) == 2
        assert row[key]["low"] <= row[key]["ratio"] <= row[key]["high"]
    bad = _bench("--compare", served.url)
    assert bad.returncode == 2 and "--compare URL_B needs --url URL_A" in bad.stderr
    bad = _bench("--url", served.url, "--arrival", "zipf:2")
    assert bad.returncode == 2 and "expected one of constant" in bad.stderr


def test_bench_over_grpc(served, tmp_path):
    """`--url grpc://HOST:PORT`: the same runs over KServe's gRPC, with the server's
    breakdown from ModelStatistics."""
    result = _bench(
        "--url", f"grpc://{served.grpc_url}", "--model", "mlp", "--duration", "0.4",
        "--concurrency", "1,4", "--request-rate", "50", "--csv", str(tmp_path / "g.csv"),
        "--out", str(tmp_path),
    )  # fmt: skip
    procs = _bench(
        "--url", f"grpc://{served.grpc_url}", "--model", "mlp", "--duration", "0.4",
        "--concurrency", "4", "--request-rate", "50", "--client-procs", "2",
        "--out", str(tmp_path / "procs"),
    )  # fmt: skip
    assert procs.returncode == 0, procs.stderr[-3000:]
    runs = json.loads((tmp_path / "procs" / "bench.json").read_text())["results"]
    assert all(r["client_procs"] == 2 and r["errors"] == 0 for r in runs)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gRPC: 4 clients" in result.stdout
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [r["mode"] for r in doc["results"]] == ["grpc-closed", "grpc-closed", "grpc-open"]
    assert all(r["errors"] == 0 and r["requests_per_s"] > 0 for r in doc["results"])
    assert doc["results"][1]["stages_us"]["compute_infer"] > 0
    rows = list(csv.reader((tmp_path / "g.csv").open()))
    assert [r[0] for r in rows[1:]] == ["1", "4"]
    bad = _bench("--url", f"grpc://{served.grpc_url}", "--model", "nope", "--duration", "0.2")
    assert bad.returncode != 0 and "no model 'nope'" in bad.stderr


# --------------------------------------------------------------------------- inputs

MLP_META = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 32]}]}


def test_input_data_files_in_perf_analyzers_format(tmp_path):
    import base64

    from serving.bench.inputs import parse_shapes, read_input_data

    row = np.arange(32, dtype=np.float32)
    path = tmp_path / "data.json"
    path.write_text(
        json.dumps(
            {
                "data": [
                    {"x": row.tolist()},  # one row, flat
                    {"x": {"content": np.ones(64).tolist(), "shape": [2, 32]}},  # a batch
                    {"x": {"b64": base64.b64encode(row.tobytes()).decode(), "shape": [32]}},
                ]
            }
        )
    )
    a, b, c = read_input_data(str(path), MLP_META, rows=3)
    assert a["x"].shape == (3, 32) and np.array_equal(a["x"][2], row)  # repeated to --rows
    assert b["x"].shape == (2, 32) and b["x"].dtype == np.float32
    assert np.array_equal(c["x"], np.repeat(row[None], 3, 0))
    for doc, words in [
        ({"data": [{}]}, "step 0: missing inputs ['x']"),
        ({"data": [{"x": row.tolist(), "y": [1]}]}, "the model has no inputs ['y']"),
        ({"data": [{"x": {"content": [1, 2, 3], "shape": [2, 32]}}]}, "3 values do not make"),
        ({"rows": []}, 'expected {"data"'),
    ]:
        path.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            read_input_data(str(path), MLP_META, rows=1)
    assert parse_shapes(["tokens:16", "mask:2,8"]) == {"tokens": [16], "mask": [2, 8]}
    with pytest.raises(ValueError, match="expected NAME:D1"):
        parse_shapes(["tokens"])


def test_bench_sends_input_data_and_named_shapes(served, tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"data": [{"x": [0.5] * 32}, {"x": [1.5] * 32}]}))
    for url in (served.url, f"grpc://{served.grpc_url}"):
        result = _bench(
            "--url", url, "--model", "mlp", "--duration", "0.3", "--concurrency", "2",
            "--request-rate", "20", "--input-data", str(path), "--out", str(tmp_path),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        doc = json.loads((tmp_path / "bench.json").read_text())
        assert all(r["errors"] == 0 and r["requests_per_s"] > 0 for r in doc["results"])
    # an input with named dimensions needs its shape; then it is measured
    bad = _bench("--url", served.url, "--model", "encoder", "--duration", "0.2")
    assert bad.returncode == 2 and "--shape tokens:" in bad.stderr
    good = _bench(
        "--url", served.url, "--model", "encoder", "--duration", "0.3", "--concurrency", "2",
        "--request-rate", "20", "--shape", "tokens:12", "--shape", "mask:12",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert good.returncode == 0, good.stderr[-3000:]
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert all(r["errors"] == 0 for r in doc["results"])


def test_bench_compares_two_artifacts_in_process(artifacts, tmp_path):
    """In process, --compare B takes a second artifact: both on fresh servers,
    alternated, as ratios with intervals (the same model twice: near 1)."""
    result = _bench(
        str(artifacts["mlp"]), "--compare", str(artifacts["mlp"]), "--concurrency", "4",
        "--duration", "0.3", "--repeats", "3", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads((tmp_path / "compare.json").read_text())["compare"]
    ratio = row["requests_per_s"]
    assert len(ratio["a"]) == 3 and ratio["low"] <= ratio["ratio"] <= ratio["high"]
    assert 0.5 < ratio["ratio"] < 2.0
    bad = _bench(str(artifacts["mlp"]), "--compare", str(tmp_path / "nowhere"))
    assert bad.returncode == 2 and "not a directory" in bad.stderr


def test_bench_in_process_has_stability_and_goodput(artifacts, tmp_path):
    result = _bench(
        str(artifacts["mlp"]), "--concurrency", "2", "--naive-concurrency", "",
        "--duration", "0.2", "--stability", "--max-windows", "3",
        "--goodput-p99-ms", "10000", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads((tmp_path / "bench.json").read_text())
    (closed,) = [r for r in doc["results"] if r["mode"] == "pxrt-closed"]
    assert closed["windows"] == 3 and isinstance(closed["stable"], bool)
    assert doc["goodput"]["at_least"] and "goodput: at least" in result.stdout


def test_bench_measures_a_decoder_in_process(tmp_path):
    from pxrt import demo

    path = demo.export_lm(
        str(tmp_path / "lm"), slots=2, max_length=64, prefill_lengths=(8,),
        prefill_batches=(1,), dim=16, heads=2, layers=1, extend=False,
    )  # fmt: skip
    result = _bench(
        path, "--concurrency", "2", "--duration", "0.3", "--request-rate", "5",
        "--prompt-tokens", "fixed:4", "--output-tokens", "fixed:6", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "in process: 2 streams" in result.stdout
    closed, opened = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert closed["errors"] == 0 and closed["output_tokens_per_s"] > 0
    assert opened["offered_per_s"] > 0 and opened["ttft_p50_ms"] > 0
