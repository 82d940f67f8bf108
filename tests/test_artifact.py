"""Artifact directories: contents, verification on load, and export-time checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile

import jax
import numpy as np
import pytest
from models import MODELS, mlp, mlp_params

import pxrt
from pxrt import artifact


def _export_mlp(path, **kw):
    return pxrt.export(
        mlp,
        mlp_params(),
        path,
        inputs={"x": pxrt.TensorSpec((32,), "float32")},
        batch_buckets=kw.pop("batch_buckets", (1, 4)),
        **kw,
    )


def _edit_manifest(path, **changes):
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        manifest = json.load(f)
    manifest.update(changes)
    with open(mpath, "w") as f:
        json.dump(manifest, f)


def test_manifest_describes_the_model(artifacts):
    with open(artifacts["two_io"] / "manifest.json") as f:
        m = json.load(f)
    assert m["format"] == "pxrt-artifact" and m["format_version"] == artifact.FORMAT_VERSION
    assert m["inputs"] == [
        {"name": "tokens", "dtype": "int32", "shape": [5]},
        {"name": "features", "dtype": "float16", "shape": [8]},
    ]
    # Outputs come in name order (jax flattens dicts by sorted key).
    assert m["outputs"] == [
        {"name": "argmax", "dtype": "int32", "shape": []},
        {"name": "scores", "dtype": "float32", "shape": [3]},
    ]
    assert m["batch_buckets"] == [4, 8]
    assert m["jax_version"] == jax.__version__ and m["x64"] is False
    assert set(m["files"]) == {"model.jaxexport", "params.npz"}
    assert [p["path"] for p in m["params"]] == ["['emb']", "['head']", "['proj']"]


def test_params_are_plain_arrays_without_pickle(artifacts):
    with zipfile.ZipFile(artifacts["bf16"] / "params.npz") as z:
        for name in z.namelist():
            header = z.read(name)[:128]
            assert b"'descr': '|O'" not in header and b"'descr': '<V" not in header
    art = pxrt.read_artifact(artifacts["bf16"])
    np.testing.assert_array_equal(art.params["w"], MODELS["bf16"]["params"]()["w"])
    assert art.params["w"].dtype.name == "bfloat16"


def test_object_params_are_refused(tmp_path):
    with pytest.raises(TypeError, match=r"param \['bad'\].*unsupported dtype"):
        pxrt.export(
            lambda p, x: x,
            {"bad": np.array([object()])},
            tmp_path / "m",
            inputs={"x": pxrt.TensorSpec((1,), "float32")},
        )


def test_x64_is_recorded_for_int64_models(artifacts):
    assert pxrt.read_artifact(artifacts["all_dtypes"]).x64 is True
    assert pxrt.read_artifact(artifacts["mlp"]).x64 is False


def test_tampered_file_is_refused(tmp_path):
    path = _export_mlp(tmp_path / "m")
    with open(os.path.join(path, "params.npz"), "r+b") as f:
        f.seek(-20, os.SEEK_END)
        f.write(b"\x00" * 8)
    with pytest.raises(pxrt.ArtifactError, match="params.npz does not match its sha256"):
        pxrt.load(path)


def test_missing_file_is_refused(tmp_path):
    path = _export_mlp(tmp_path / "m")
    os.remove(os.path.join(path, "model.jaxexport"))
    with pytest.raises(pxrt.ArtifactError, match="model.jaxexport .*missing"):
        pxrt.load(path)


def test_newer_format_version_is_refused(tmp_path):
    path = _export_mlp(tmp_path / "m")
    _edit_manifest(path, format_version=artifact.FORMAT_VERSION + 1)
    with pytest.raises(pxrt.ArtifactError, match="upgrade pxrt"):
        pxrt.load(path)


def test_jax_outside_the_compatibility_window_is_refused(tmp_path):
    path = _export_mlp(tmp_path / "m")
    _edit_manifest(path, jax_version="99.0.0")
    with pytest.raises(pxrt.ArtifactError, match="newer than this process's jax"):
        pxrt.load(path)
    _edit_manifest(path, jax_version=jax.__version__, calling_convention_version=1)
    with pytest.raises(pxrt.ArtifactError, match="calling convention"):
        pxrt.load(path)


def test_not_an_artifact(tmp_path):
    with pytest.raises(pxrt.ArtifactError, match="not a pxrt artifact"):
        pxrt.load(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(pxrt.ArtifactError, match="not valid JSON"):
        pxrt.load(tmp_path)


def test_export_refuses_to_overwrite(tmp_path):
    path = _export_mlp(tmp_path / "m")
    with pytest.raises(pxrt.ArtifactError, match="already exists"):
        _export_mlp(path)
    _export_mlp(path, overwrite=True, batch_buckets=(2,))
    assert pxrt.read_artifact(path).batch_buckets == (2,)


def test_export_checks_buckets_against_devices(tmp_path):
    with pytest.raises(ValueError, match=r"batch buckets \[1, 6\] do not split evenly over 4"):
        _export_mlp(tmp_path / "m", batch_buckets=(1, 6, 8), num_devices=4)
    with pytest.raises(ValueError, match="positive ints"):
        _export_mlp(tmp_path / "m", batch_buckets=(0, 4))


def test_export_needs_batched_outputs(tmp_path):
    with pytest.raises(ValueError, match="output 'total'.*leading dimension"):
        pxrt.export(
            lambda p, x: {"total": x.sum()},
            {},
            tmp_path / "m",
            inputs={"x": pxrt.TensorSpec((3,), "float32")},
        )


def test_export_checks_inputs(tmp_path):
    with pytest.raises(ValueError, match="non-empty mapping"):
        pxrt.export(mlp, mlp_params(), tmp_path / "m", inputs={})
    with pytest.raises(TypeError, match="TensorSpec"):
        pxrt.export(mlp, mlp_params(), tmp_path / "m", inputs={"x": (32,)})
    with pytest.raises(TypeError, match="unsupported dtype"):
        pxrt.TensorSpec((2,), "complex64")


def test_import_and_use_leave_the_callers_jax_alone(artifacts):
    """int64 through pxrt, with the caller's x64 off before, during and after."""
    code = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        before = {{k: getattr(jax.config, k) for k in
                  ("jax_enable_x64", "jax_compilation_cache_dir", "jax_default_matmul_precision")}}
        import pxrt
        model = pxrt.load({str(artifacts["all_dtypes"])!r})
        req = pxrt.example_inputs(model.inputs, 2)
        req["i64"] = np.full((2, 2), 2**40, np.int64)
        out = model.run(req)
        assert out["i64"].dtype == np.int64 and (out["i64"] == 2**40 + 2**31 + 5).all()
        after = {{k: getattr(jax.config, k) for k in before}}
        assert before == after, (before, after)
        assert jnp.asarray(np.int64(5)).dtype == jnp.int32   # x64 still off for the caller
        print("ok")
    """)
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
