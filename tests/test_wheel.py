"""pxrt as a user installs it: the wheel ``python -m build`` makes from this tree, installed
into a fresh venv outside the tree, runs ``pxrt demo`` with its compiled extensions and
``pxrt serve`` answers a request on the demo model."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest
from servers import free_ports

from pxrt import demo

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What the sdist and wheel are built from: the package's own files, not the built ones.
SOURCES = ("pxrt", "serving", "setup.py", "pyproject.toml", "README.md")
BUILT = shutil.ignore_patterns("*.so", "*.c", "*.html", "__pycache__", "build", "*.egg-info")


def _run(args: list, cwd: pathlib.Path, timeout: float, env: dict | None = None) -> str:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{args}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _fresh_env(venv: pathlib.Path) -> dict:
    """The environment of a user's shell with ``venv`` active: nothing of this tree on
    the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PXRT_NO_EXTENSIONS", None)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> pathlib.Path:
    """A fresh venv holding the wheel built from a copy of this tree's sources (with
    its dependencies as the wheel declares them)."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=BUILT)
        else:
            shutil.copy2(path, src / name)
    dist = base / "dist"
    # --no-isolation: the build requirements are this venv's (no download); the build is
    # the sdist's, then the wheel's from the sdist, as `python -m build` does by default.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, src], base, 900)
    wheels = list(dist.glob("pxrt-*.whl"))
    assert len(wheels) == 1 and list(dist.glob("pxrt-*.tar.gz")), sorted(dist.iterdir())
    venv = base / "venv"
    uv = shutil.which("uv", path=str(pathlib.Path(sys.executable).parent))
    if uv:  # (uv's cache already holds what `make` installed: no download)
        _run([uv, "venv", "-q", "--python", sys.executable, venv], base, 300)
        python = venv / "bin" / "python"
        _run([uv, "pip", "install", "-q", "--python", python, wheels[0]], base, 900)
    else:
        _run([sys.executable, "-m", "venv", venv], base, 300)
        _run([venv / "bin" / "python", "-m", "pip", "install", "-q", wheels[0]], base, 900)
    return venv


def test_the_wheel_holds_the_compiled_extensions_and_the_stubs(installed):
    code = (
        "import pxrt, serving, pxrt._slots, serving.kserve._tensors\n"
        "print(pxrt.__file__); print(pxrt.using_extensions())\n"
        "print(pxrt._slots.__file__)\n"
    )
    where = installed.parent
    out = _run([installed / "bin" / "python", "-c", code], where, 120, _fresh_env(installed))
    module, using, slots = out.split()
    assert module.startswith(str(installed)) and not module.startswith(str(ROOT))
    assert using == "True" and slots.endswith(".so")
    site = pathlib.Path(module).parent
    for data in ("py.typed", "_slots.pyi", "_slots.pxd"):
        assert (site / data).is_file(), data


def test_pxrt_demo_and_serve_run_from_the_wheel(installed, tmp_path):
    env = _fresh_env(installed)
    pxrt = installed / "bin" / "pxrt"
    out = _run([pxrt, "demo", "--keep", tmp_path / "mlp", "--rounds", "2"], tmp_path, 300, env)
    assert "Cython handlers: True" in out and "compiles after load: 0" in out, out
    (port,) = free_ports(1)
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(
        [str(pxrt), "serve", str(tmp_path / "mlp"), "--port", str(port)],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (log.seek(0), log.read())[1]
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "pxrt serve did not become ready"
            time.sleep(0.2)
        meta = httpx.get(f"{url}/v2/models/mlp", timeout=10).json()
        (spec,) = meta["inputs"]
        width = spec["shape"][-1]
        x = np.random.default_rng(0).standard_normal((3, width)).astype(np.float32)
        body = {
            "inputs": [
                {"name": spec["name"], "shape": [3, width], "datatype": "FP32",
                 "data": x.ravel().tolist()}
            ]
        }  # fmt: skip
        r = httpx.post(f"{url}/v2/models/mlp/infer", json=body, timeout=60)
        assert r.status_code == 200, r.text
        (output,) = r.json()["outputs"]
        got = np.asarray(output["data"], np.float32).reshape(output["shape"])
        want = np.asarray(jax.jit(demo.mlp)(demo.make_params(), x)["y"])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
