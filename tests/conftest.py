"""Shared fixtures. Run the suite with one device, or with several virtual CPU devices:
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set before jax is imported;
the Makefile does both)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys
import tempfile
import warnings

# The compilation cache of this test session: its own, not the user's (set before any
# load; the `pxrt serve` processes the tests start inherit it).
os.environ.setdefault("PXRT_CACHE_DIR", tempfile.mkdtemp(prefix="pxrt-test-cache-"))
# Loads that name no placement get one program over the devices, not ``auto``'s measured
# choice: what a test runs on must not depend on this machine's timing (test_placement.py
# tests ``auto``, and the default with this unset).
os.environ.setdefault("PXRT_PLACEMENT", "sharded")

import jax
import pytest
import uvloop

sys.path.insert(0, os.path.dirname(__file__))

from models import MODELS  # noqa: E402
from servers import ServeProcess  # noqa: E402

import pxrt  # noqa: E402


def pytest_report_header(config):
    return (
        f"pxrt: {jax.device_count()} {jax.default_backend()} device(s), "
        f"Cython extensions: {pxrt.using_extensions()}, jax {jax.__version__}"
    )


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    """name -> artifact directory, exported once per session."""
    root = tmp_path_factory.mktemp("artifacts")
    out = {}
    for name, spec in MODELS.items():
        out[name] = pathlib.Path(
            pxrt.export(
                spec["fn"],
                spec["params"](),
                root / name,
                inputs=spec["inputs"],
                batch_buckets=spec["buckets"],
                name=name,
            )
        )
    return out


@pytest.fixture(scope="session")
def var_artifacts(tmp_path_factory):
    """Artifacts with named dimensions: "encoder" (the demo encoder, small) and "ragged"."""
    from models import ENCODER, ENCODER_SIZES, RAGGED

    from pxrt import demo

    root = tmp_path_factory.mktemp("var_artifacts")
    return {
        "encoder": pathlib.Path(
            demo.export_encoder(
                str(root / "encoder"),
                batch_buckets=ENCODER["buckets"],
                seq_buckets=ENCODER["dim_buckets"]["seq"],
                **ENCODER_SIZES,
            )
        ),
        "ragged": pathlib.Path(
            pxrt.export(
                RAGGED["fn"],
                RAGGED["params"](),
                root / "ragged",
                inputs=RAGGED["inputs"],
                batch_buckets=RAGGED["buckets"],
                dim_buckets=RAGGED["dim_buckets"],
                name="ragged",
            )
        ),
    }


@pytest.fixture(scope="session")
def var_models(var_artifacts):
    """name -> loaded Model with named dimensions; loading must not warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return {name: pxrt.load(path) for name, path in var_artifacts.items()}


@pytest.fixture(scope="session")
def models(artifacts):
    """name -> loaded Model, loaded once per session; loading must not warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return {name: pxrt.load(path) for name, path in artifacts.items()}


LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=list(LOOPS))
def run(request):
    """Run a coroutine on a fresh loop of each kind; fail if the loop's exception
    handler fires (an exception nobody awaited, a callback that raised)."""

    def runner(coro_fn, *args):
        errors = []
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as r:
            r.get_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
            result = r.run(coro_fn(*args))
        assert not errors, errors
        return result

    return runner


# --------------------------------------------------------------------------- pxrt serve


def _serve(artifacts, var_artifacts, tmp_path_factory, *extra: str, grpc: bool = False):
    conf = tmp_path_factory.mktemp("serve") / "serve.toml"
    conf.write_text(
        "[defaults]\nmax_delay_us = 2000\n\n"
        f'[models.tiny_queue]\npath = "{artifacts["mlp"]}"\nmax_queue = 1\n\n'
        f'[models.cached]\npath = "{artifacts["mlp"]}"\nresponse_cache = {{enable = true}}\n'
    )
    paths = [str(artifacts[n]) for n in ("mlp", "two_io", "bf16", "all_dtypes")]
    paths.append(str(var_artifacts["encoder"]))
    args = [*paths, "--config", str(conf), "--max-body-mb", "1", "--allow-client-shm", *extra]
    return ServeProcess(args, grpc=grpc)


@pytest.fixture(scope="session")
def served(artifacts, var_artifacts, tmp_path_factory):
    """One `pxrt serve` process for the session: five models (one with a named
    dimension), a queue of one row, one with the response cache, a 1 MB body limit,
    system shared memory."""
    proc = _serve(artifacts, var_artifacts, tmp_path_factory, grpc=True)
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="session")
def served_grpcio(artifacts, var_artifacts, tmp_path_factory):
    """The same server as ``served`` with gRPC on grpcio's server (``--no-native-grpc``)."""
    proc = _serve(artifacts, var_artifacts, tmp_path_factory, "--no-native-grpc", grpc=True)
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="session")
def served_workers(artifacts, tmp_path_factory):
    """`pxrt serve --workers 2` (HTTP and gRPC): mlp, two_io and a queue of one row;
    statistics behind a key."""
    conf = tmp_path_factory.mktemp("workers") / "serve.toml"
    conf.write_text(f'[models.tiny_queue]\npath = "{artifacts["mlp"]}"\nmax_queue = 1\n')
    proc = ServeProcess(
        [str(artifacts["mlp"]), str(artifacts["two_io"]), "--workers", "2",
         "--config", str(conf), "--restricted-api", "statistics:admin-key=s3cret"],
        grpc=True,
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="session")
def served_asgi(artifacts, var_artifacts, tmp_path_factory):
    """The same server as ``served`` with every HTTP request through the Starlette app
    (``--no-native-http``): what the native path is held to."""
    proc = _serve(artifacts, var_artifacts, tmp_path_factory, "--no-native-http")
    yield proc
    assert proc.stop() == 0
