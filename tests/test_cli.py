"""The pxrt command, run as a user would run it."""

from __future__ import annotations

import json
import os
import re
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
        ("[defaults]\nmax_queue = -3\n", "[defaults] max_queue: -3 is not an integer >= 1"),
        ("[models.m]\npath = 'x'\nmax_delay_us = true\n", "[models.m] max_delay_us: True"),
        ("[defaults]\nmax_batch = 8\n", "unknown option(s) ['max_batch']"),
        (
            "[defaults]\ninstance_group = [{count = 2, kind = 'KIND_GPU'}]\n",
            "[defaults] instance_group: instance_group count 2: pxrt runs one instance",
        ),
        (
            "[models.m]\npath = 'x'\ninstance_group = [{kind = 'KIND_TPU'}]\n",
            "instance_group kind 'KIND_TPU' is not one of",
        ),
        ("[defaults]\ninstances = 0\n", "[defaults] instances: 0 is not an integer >= 1"),
    ],
)
def test_serve_refuses_bad_config_at_start_up(tmp_path, toml, words):
    conf = tmp_path / "serve.toml"
    conf.write_text(toml)
    result = _pxrt("serve", "--config", str(conf), timeout=60)
    assert result.returncode != 0 and words in result.stderr, result.stderr


def _model_specs(tmp_path, toml, *flags):
    import argparse

    from serving.config import add_arguments, model_specs, repository_config

    conf = tmp_path / "serve.toml"
    conf.write_text(toml)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--config", str(conf), *flags])
    return repository_config(args) if flags else model_specs(args, str(tmp_path))


@pytest.mark.parametrize(
    "toml, words",
    [
        ("[models.lm]\npath = 'x'\nslots = '8'\n", "[models.lm] slots: '8' is a string, not an "
         "integer >= 1 (or none): write the number without quotes"),
        ('[defaults]\nmax_delay_us = "100"\n', "[defaults] max_delay_us: '100' is a string, not a"),
        ("[defaults]\nmax_queue = 8.0\n", "[defaults] max_queue: 8.0 is not an integer >= 1"),
        ("[defaults]\nmax_queue = true\n", "[defaults] max_queue: True is not an integer"),
        ("[defaults]\ndefault_timeout_s = false\n", "[defaults] default_timeout_s: False is not"),
        ("[defaults]\ninstances = '2'\n", "[defaults] instances: '2' is a string, not an"),
        ("[models.lm]\npath = 'x'\ndynamic_batching = {priority_levels = '2'}\n",
         "[models.lm] dynamic_batching: '2' is a string, not an integer"),
        ("[defaults]\ninstance_group = [{count = '1'}]\n",
         "[defaults] instance_group: '1' is a string, not an integer"),
        ("[defaults]\npriority_levels = 2\ndefault_priority_level = 3\n",
         "[defaults]: option default_priority_level: 3 is not a level of priority_levels 2"),
        ("[defaults\nmax_queue = 3\n", "not valid TOML: Expected ']' at the end of a table "
         "declaration (at line 1, column 10)"),
        ("[model.lm]\npath = 'x'\n", "unknown table(s) or key(s) ['model'] at the top"),
        ("defaults = 3\n", "[defaults] must be a table of options, got 3"),
        ("[models]\nlm = 'x'\n", "[models.lm] must be a table of options, got 'x'"),
        ("[models.lm]\npath = 3\n", "[models.lm] path: 3 is not a string"),
        ("[models.lm]\nslots = 8\n", "[models.lm] needs a path"),
        ("[models.lm]\npath = 'x'\nversion_policy = 'all'\n",
         "[models.lm] version_policy: for models of the --model-repository"),
        ("[defaults]\nmax_batch = 8\n", "unknown option(s) ['max_batch'] in [defaults]"),
    ],
)  # fmt: skip
def test_serve_config_errors_name_the_file_the_section_and_the_key(tmp_path, toml, words):
    """TOML's values are typed: an integer option takes an integer (not "8", not 8.0,
    not true), a number option an integer or a float; and every error, a TOML syntax
    error too, names the file, then the section and the key."""
    with pytest.raises(SystemExit) as err:
        _model_specs(tmp_path, toml)
    message = str(err.value)
    assert message.startswith(f"pxrt serve: {tmp_path / 'serve.toml'}: ") and words in message


def test_serve_config_takes_typed_values_and_checks_the_repositorys(tmp_path):
    [(name, path, options, place)] = _model_specs(
        tmp_path, "[models.lm]\npath = 'x'\nslots = 8\nmax_delay_us = 100\nmax_queue = 16\n"
    )
    assert (name, path, options.max_delay_us, options.max_queue) == ("lm", "x", 100.0, 16)
    assert isinstance(options.max_delay_us, float) and place.decoder.slots == 8
    conf = tmp_path / "serve.toml"
    for toml, words in [
        ("[models.r]\nversion_policy = 2\n", "[models.r] version_policy: 2 is not a string"),
        ("[models.r]\nallow_signature_change = 1\n",
         "[models.r] allow_signature_change: 1 is not true or false"),
        ("[models.r]\nmax_queue = '3'\n", "[models.r] max_queue: '3' is a string, not an integer"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit, match=re.escape(f"pxrt serve: {conf}: {words}")):
            _model_specs(tmp_path, toml, "--model-repository", str(tmp_path))
    with pytest.raises(SystemExit, match=re.escape(f"--config {tmp_path / 'none.toml'}: No such")):
        import argparse

        from serving.config import add_arguments, model_specs

        p = argparse.ArgumentParser()
        add_arguments(p)
        model_specs(p.parse_args(["--config", str(tmp_path / "none.toml")]), str(tmp_path))


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
    # (on CPU devices each prefill cell is two programs: its rows beside the steps)
    rows = kinds.count("prefill_rows")
    forwards = kinds.count("forward")  # (the step with the controls', by cache window)
    assert info["kind"] == "decoder" and len(kinds) == 4 + kinds.count("step") + rows + forwards
    assert rows == kinds.count("prefill_insert") == 2 and forwards >= 1
    assert kinds.count("step") >= 2  # over all the slots, and over fewer
    assert set(info["load_phases"]) == {"read", "programs", "warm-up", "measure"}
    assert "scheduler: prompts are prefilled on a thread of their own beside" in out, out
    assert info["scheduler"]["overlap_prefill"] is True
    assert "decode steps in blocks of up to 4 (multi_step)" in out, out
    assert info["scheduler"]["step_launch_ms"] >= 0 and info["scheduler"]["multi_step"] == 4
    # --length-tiers reaches the load (refused there before compiling) and the tiers are
    # printed among the scheduler's choices
    with pytest.raises(ValueError, match="slots x positions per tier"):
        cli.main(["inspect", path, "--length-tiers", "4 by 32"])
    cli._print_scheduler(info["scheduler"] | {"length_tiers": [[4, 32], [4, 64]]})
    out = capsys.readouterr().out
    assert "length tiers (slots x positions): 4 x 32 + 4 x 64; each prompt in the" in out, out
    cli._print_scheduler(info["scheduler"] | {"auto_tiers": True, "relayout": "compiling"})
    out = capsys.readouterr().out
    assert "length tiers from the traffic (length_tiers auto): compiling; suggested" in out, out
    cli._print_scheduler(info["scheduler"] | {"need_shares": {"32": 0.3, "64": 0.025}})
    out = capsys.readouterr().out
    assert "the busy slots need (prompt and max_tokens): 30.0% over 32, 2.5% over 64" in out
