"""The pxrt command, run as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _pxrt(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "serving.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )


def test_inspect_prints_manifest_and_buckets(artifacts):
    result = _pxrt("inspect", str(artifacts["two_io"]))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "two_io version 1" in out
    assert "tokens" in out and "int32" in out and "features" in out and "float16" in out
    assert "GFLOP" in out and ("raw" in out or "call" in out)


def test_inspect_json(artifacts):
    result = _pxrt("inspect", "--json", str(artifacts["mlp"]))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["manifest"]["name"] == "mlp"
    assert all(b["flops"] > 0 and "memory" in b for b in info["buckets"])


def test_inspect_a_broken_artifact_is_a_clean_error(tmp_path):
    result = _pxrt("inspect", str(tmp_path))
    assert result.returncode == 2
    assert "not a pxrt artifact" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_demo_runs(tmp_path):
    result = _pxrt("demo", "--keep", str(tmp_path / "demo"), "--rounds", "1", "--calls", "3")
    assert result.returncode == 0, result.stderr
    assert "max |pxrt - jax.jit|" in result.stdout and "compiles after load: 0" in result.stdout
    assert (tmp_path / "demo" / "manifest.json").is_file()


def test_bench_writes_its_report(tmp_path, artifacts):
    out = tmp_path / "bench"
    result = _pxrt(
        "bench",
        str(artifacts["mlp"]),
        "--duration",
        "0.3",
        "--concurrency",
        "1,8",
        "--naive-concurrency",
        "2",
        "--max-batch-size",
        "8",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for words in (
        "ceiling: bucket 8",
        "naive",
        "pxrt: 8 concurrent callers",
        "plain asyncio batcher: 8 callers",
        "pxrt / plain at 8 callers",
        "Poisson",
        "saturated throughput / ceiling",
        "event-loop lag p99",
    ):
        assert words in result.stdout, words
    report = json.loads((out / "bench.json").read_text())
    modes = [r["mode"] for r in report["results"]]
    assert modes == [
        "ceiling",
        "pxrt-closed",
        "plain",
        "pxrt-closed",
        "plain",
        "pxrt-open",
        "naive",
    ]
    assert all(r["rows_per_s"] > 0 for r in report["results"])
    summary = report["summary"]
    assert summary["saturated_vs_ceiling"] > 0
    assert summary["pxrt_vs_plain_at_1"] > 0 and summary["pxrt_vs_plain_at_8"] > 0
    assert (out / "bench.png").stat().st_size > 10_000


def test_export_then_inspect(tmp_path):
    out = tmp_path / "mlp"
    result = _pxrt("export", "pxrt.demo:spec", str(out), "--buckets", "4,8")
    assert result.returncode == 0, result.stderr
    assert "exported mlp" in result.stdout and "buckets [4, 8]" in result.stdout
    again = _pxrt("export", "pxrt.demo:spec", str(out))
    assert again.returncode == 2 and "--overwrite" in again.stderr
    info = _pxrt("inspect", "--json", str(out))
    assert [b["bucket"] for b in json.loads(info.stdout)["buckets"]] == [4, 8]


@pytest.mark.parametrize(
    "args,words",
    [
        (["--max-body-mb", "-1"], "--max-body-mb: '-1' is not a number > 0"),
        (["--default-timeout-s", "0"], "--default-timeout-s: '0' is not a number > 0"),
        (["--max-queue", "1.5"], "--max-queue: '1.5' is not an integer >= 1"),
        (["--max-inflight", "0"], "--max-inflight: '0' is not an integer >= 1"),
        (["--max-delay-us", "nan"], "--max-delay-us: 'nan' is not a number >= 0"),
    ],
)
def test_serve_refuses_bad_flags_at_start_up(args, words):
    result = _pxrt("serve", *args, timeout=60)
    assert result.returncode == 2 and words in result.stderr, result.stderr


@pytest.mark.parametrize(
    "toml,words",
    [
        ("[defaults]\nmax_queue = -3\n", "max_queue in [defaults]: -3 is not an integer >= 1"),
        ("[models.m]\npath = 'x'\nmax_delay_us = true\n", "max_delay_us in [models.m]: True"),
        ("[defaults]\nmax_batch = 8\n", "unknown option(s) ['max_batch']"),
        (
            "[defaults]\ninstance_group = [{count = 2, kind = 'KIND_GPU'}]\n",
            "instance_group in [defaults]: instance_group count 2: pxrt runs one instance",
        ),
        (
            "[models.m]\npath = 'x'\ninstance_group = [{kind = 'KIND_TPU'}]\n",
            "instance_group kind 'KIND_TPU' is not one of",
        ),
        ("[defaults]\ninstances = 0\n", "instances in [defaults]: 0 is not an integer >= 1"),
    ],
)
def test_serve_refuses_bad_config_at_start_up(tmp_path, toml, words):
    conf = tmp_path / "serve.toml"
    conf.write_text(toml)
    result = _pxrt("serve", "--config", str(conf), timeout=60)
    assert result.returncode != 0 and words in result.stderr, result.stderr


def test_inspect_shows_the_grid(var_artifacts):
    result = _pxrt("inspect", str(var_artifacts["encoder"]))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "tokens           int32     [n, seq]  pad 0" in out
    assert "grid: batch [1, 4] x seq [8, 16, 32] =" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("bucket"))
    assert header.split()[:2] == ["bucket", "seq"] and "exec" in header


def test_serve_refuses_an_unknown_placement():
    result = _pxrt("serve", "--placement", "spread", timeout=60)
    assert result.returncode == 2 and "'spread' is not one of sharded, replicated, auto" in (
        result.stderr
    )


def test_serve_refuses_an_unknown_cell_policy():
    result = _pxrt("serve", "--cell-policy", "fifo", timeout=60)
    assert result.returncode == 2 and "'fifo' is not one of cost, oldest" in result.stderr


def test_bench_on_variable_lengths(tmp_path, var_artifacts):
    out = tmp_path / "bench"
    args = ["bench", str(var_artifacts["encoder"]), "--duration", "0.3", "--quick"]
    result = _pxrt(*args, "--lengths", "uniform:1:32", "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    modes = {r["mode"] for r in report["results"]}
    assert {"grid", "oldest", "padded", "grid-open", "oldest-open", "jit"} <= modes
    assert all(r["requests_per_s"] > 0 for r in report["results"] if r["mode"] != "jit")
    assert report["summary"]["grid_vs_padded_throughput"] > 0
    assert "grid vs padded throughput" in result.stdout
    bad = _pxrt("bench", str(var_artifacts["encoder"]), "--lengths", "zipf:1", timeout=120)
    assert bad.returncode == 2 and "expected pareto:LOW:HIGH" in bad.stderr


def test_serving_works_without_ray_and_says_how_to_get_it():
    # Ray is an optional extra: without it (blocked here), serving and its HTTP app
    # import; serving.ray and pxrt serve --ray say which extra to install.
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import serving, serving.http.app, serving.engine.server\n"
        "try:\n    import serving.ray\nexcept ImportError as e:\n    print(e)\n"
        "from serving.cli import main\n"
        "sys.exit(main(['serve', '--ray']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "pip install 'pxrt[ray]'" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 2 and "--ray needs the ray extra" in proc.stderr, proc.stderr


def test_inspect_shows_a_decoder(tmp_path, capsys):
    from pxrt import demo

    path = demo.export_lm(
        str(tmp_path / "lm"), max_length=64, prefill_lengths=(8, 16), prefill_batches=(1,),
        dim=16, heads=2, layers=1,
    )  # fmt: skip
    result = _pxrt("inspect", path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "decoder: vocabulary 258, stop ids [257]" in out
    assert "donated through every step and insert" in out
    assert out.count("prefill_insert") == 2 and "step " in out
    assert out.count("extend_insert") == 2 and "prompts up to 63 tokens" in out
    assert "prefix cache: 16 blocks of 16 tokens" in out, out
    assert "load: read " in out and " programs " in out and " warm-up " in out, out
    # (the JSON in this process: the command's path is the same, without a second start)
    from serving import cli

    assert cli.main(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    kinds = [p["program"] for p in info["programs"]]
    assert info["kind"] == "decoder" and len(kinds) == 4 + kinds.count("step")
    assert kinds.count("step") >= 2  # over all the slots, and over fewer
    assert set(info["load_phases"]) == {"read", "programs", "warm-up"}
