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
from pxrt.manifest import MAX_FORMAT_VERSION


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
        {"name": "tokens", "dtype": "int32", "shape": [5], "pad": 0},
        {"name": "features", "dtype": "float16", "shape": [8], "pad": 0.0},
    ]
    # Outputs come in name order (jax flattens dicts by sorted key).
    assert m["outputs"] == [
        {"name": "argmax", "dtype": "int32", "shape": []},
        {"name": "scores", "dtype": "float32", "shape": [3]},
    ]
    assert m["batch_buckets"] == [4, 8] and m["dim_buckets"] == {}
    assert m["jax_version"] == jax.__version__ and m["x64"] is False
    assert set(m["files"]) == {"model.jaxexport", "params.npz"}
    assert [p["path"] for p in m["params"]] == ["['emb']", "['head']", "['proj']"]


def test_params_are_plain_arrays_without_pickle(artifacts):
    with zipfile.ZipFile(artifacts["bf16"] / "params.npz") as z:
        for name in z.namelist():
            header = z.read(name)[:128]
            assert b"'descr': '|O'" not in header and b"'descr': '<V" not in header
    art = pxrt.read_artifact(artifacts["bf16"])
    np.testing.assert_array_equal(art.params_by_path["['w']"], MODELS["bf16"]["params"]()["w"])
    assert art.params_by_path["['w']"].dtype.name == "bfloat16"


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
    _edit_manifest(path, format_version=MAX_FORMAT_VERSION + 1)
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


# --------------------------------------------------------------------------- trust


def _sub(x, y):
    return {"d": x - y}


def _export_sub(path):
    return pxrt.export(
        lambda p, x, y: _sub(x, y),
        {},
        path,
        inputs={"x": pxrt.TensorSpec((2,), "float32"), "y": pxrt.TensorSpec((2,), "float32")},
        batch_buckets=(2,),
    )


def _manifest(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def test_a_manifest_edited_after_export_is_refused(tmp_path):
    """Swapping two inputs of the same type, renaming an output, or flipping x64 would
    silently change what the model computes or says: the program's name binds them."""
    path = _export_sub(tmp_path / "sub")
    x, y = np.ones((1, 2), np.float32), np.full((1, 2), 3.0, np.float32)
    np.testing.assert_array_equal(pxrt.load(path).run({"x": x, "y": y})["d"], x - y)
    original = _manifest(path)
    edits = {
        "inputs reversed": dict(inputs=original["inputs"][::-1]),
        "output renamed": dict(outputs=[dict(original["outputs"][0], name="e")]),
        "x64 flipped": dict(x64=True),
    }
    for label, change in edits.items():
        _edit_manifest(path, **original)
        _edit_manifest(path, **change)
        with pytest.raises(pxrt.ArtifactError, match="does not match the program"):
            pxrt.load(path)
            pytest.fail(f"{label}: loaded")
    _edit_manifest(path, **original)
    pxrt.load(path)  # and the original still loads


def test_a_manifest_that_contradicts_its_program_is_refused(tmp_path):
    """Also without the name binding (format 1 artifacts): dtypes and shapes in order."""
    path = _export_mlp(tmp_path / "m")
    original = _manifest(path)
    _edit_manifest(path, format_version=1)
    pxrt.load(path)  # a format 1 artifact still loads
    for change in (
        dict(inputs=[{"name": "x", "dtype": "float16", "shape": [32]}]),
        dict(inputs=[{"name": "x", "dtype": "float32", "shape": [31]}]),
        dict(outputs=[{"name": "y", "dtype": "int32", "shape": [32]}]),
        dict(
            outputs=[
                {"name": "y", "dtype": "float32", "shape": [32]},
                {"name": "z", "dtype": "float32", "shape": [32]},
            ]
        ),
    ):
        _edit_manifest(path, **(original | {"format_version": 1}))
        _edit_manifest(path, **change)
        with pytest.raises(pxrt.ArtifactError, match="does not match the program"):
            pxrt.load(path)


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(inputs=None), "'inputs' must be a non-empty list"),
        (dict(inputs=[{"name": "x", "dtype": "float32"}]), r"inputs\[0\].shape"),
        (dict(inputs=[{"name": "x", "dtype": "quad", "shape": [32]}]), r"inputs\[0\].dtype"),
        (dict(outputs=[{"dtype": "float32", "shape": [32]}]), r"outputs\[0\].name"),
        (
            dict(inputs=[{"name": "x", "dtype": "float32", "shape": [32]}] * 2),
            "names a tensor twice",
        ),
        (dict(batch_buckets=[1e9]), "'batch_buckets' must be"),
        (dict(batch_buckets=[10**9]), "over 1048576 rows"),
        (dict(params="none"), "'params' must be a list"),
        (dict(params=[{"key": "p0"}]), r"params\[0\] needs"),
        (dict(files=[]), "'files' must map"),
        (dict(x64="no"), "'x64' must be true or false"),
        (dict(name=""), "'name' must be a non-empty string"),
        (dict(format_version="2"), "bad format_version"),
    ],
)
def test_a_malformed_manifest_is_an_artifact_error(tmp_path, change, words):
    path = _export_mlp(tmp_path / "m")
    _edit_manifest(path, **change)
    with pytest.raises(pxrt.ArtifactError, match=words):
        pxrt.read_artifact(path)


def test_no_native_code_is_read_from_the_artifact(tmp_path, monkeypatch):
    """A compilation cache planted in (or symlinked from) the artifact is never used:
    pxrt's cache lives in a directory only this user writes."""
    path = _export_mlp(tmp_path / "m")
    planted = tmp_path / "m" / "xla_cache"
    planted.mkdir()
    (planted / "jit_flat_fn-bogus").write_bytes(b"\x7fELF not really")
    cache = tmp_path / "cache"
    monkeypatch.setenv("PXRT_CACHE_DIR", str(cache))
    model = pxrt.load(path)
    x = np.ones((1, 32), np.float32)
    np.testing.assert_allclose(
        model.run({"x": x})["y"], pxrt.load(path, compilation_cache=False).run({"x": x})["y"]
    )
    assert sorted(os.listdir(planted)) == ["jit_flat_fn-bogus"]  # untouched, unused
    assert any(cache.iterdir()) and (cache.stat().st_mode & 0o077) == 0


def test_a_cache_directory_others_can_write_is_not_used(tmp_path):
    path = _export_mlp(tmp_path / "m")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.warns(RuntimeWarning, match="others can write to it"):
        pxrt.load(path, compilation_cache=shared)
    assert not any(shared.iterdir())


def test_buckets_too_large_to_stage_are_refused_before_allocating(tmp_path):
    path = pxrt.export(
        lambda p, x: x * 2,
        {},
        tmp_path / "wide",
        inputs={"x": pxrt.TensorSpec((1 << 20,), "float32")},  # 4 MiB a row
        batch_buckets=(1, 8192),
    )
    with pytest.raises(ValueError, match="GiB of staging"):
        pxrt.load(path)
    assert pxrt.load(path, buckets=(1,)).buckets == (jax.device_count(),)  # rounded up


def test_a_64_bit_leaf_is_named_at_export(tmp_path, caplog):
    """One float64 leaf (numpy 2 promotes ``float32 / np.sqrt(1)``) turns on 64-bit
    tracing when x64 is inferred: the export says which leaf, a trace that then fails
    says it too, and ``x64=False`` with such a leaf is refused by name at export (the
    load found it before, as a dtype mismatch)."""
    from pxrt import demo

    params = {"w": np.ones((4, 4), np.float32), "b": np.ones(4, np.float32) / np.sqrt(1)}
    assert params["b"].dtype == np.float64
    spec = {"x": pxrt.TensorSpec((4,), "float32")}

    def affine(params, x):
        return x @ params["w"] + params["b"]

    with caplog.at_level("WARNING", logger="pxrt"):
        pxrt.export(affine, params, tmp_path / "a", inputs=spec, batch_buckets=(1,))
    assert "since param ['b'] (float64) is 64-bit" in caplog.text
    assert pxrt.read_artifact(tmp_path / "a").x64 is True

    def indexed(params, x):  # int64 indices under x64 meet an int32 one
        i = jax.numpy.argmax(params["b"])
        return jax.lax.dynamic_slice(x, (jax.numpy.int32(0), i), (x.shape[0], 1))

    with pytest.raises(TypeError, match="dynamic_slice") as info:
        pxrt.export(indexed, params, tmp_path / "b", inputs=spec, batch_buckets=(1,))
    assert "because param ['b'] (float64) is 64-bit" in "".join(info.value.__notes__)

    caplog.clear()
    with caplog.at_level("WARNING", logger="pxrt"):  # said to be meant: nothing to say
        pxrt.export(affine, params, tmp_path / "c", inputs=spec, batch_buckets=(1,), x64=True)
    assert "64-bit" not in caplog.text
    with pytest.raises(TypeError, match=r"x64=False, but param \['b'\] \(float64\) is 64-bit"):
        pxrt.export(affine, params, tmp_path / "d", inputs=spec, batch_buckets=(1,), x64=False)
    lm = demo.make_lm_params()
    lm["embed"] = lm["embed"].astype(np.float64)
    with pytest.raises(TypeError, match=r"export_decoder: x64=False, but param \['embed'\]"):
        pxrt.export_decoder(
            demo.lm_prefill, demo.lm_decode, lm, tmp_path / "lm", cache=demo.lm_cache_spec(),
            max_length=256, x64=False,
        )  # fmt: skip


def test_an_embedding_model_names_its_inputs_and_vector_at_export(tmp_path):
    """embedding= is checked at export: it needs a tokenizer, an int32 token input of a
    named dimension, a mask of its shape, and one vector per example as its output."""
    from pxrt import demo

    def export(**options):
        return pxrt.export(
            demo.encoder, demo.make_encoder_params(vocab=300, dim=16, heads=2, layers=1),
            tmp_path / "emb", inputs=demo.encoder_inputs(), batch_buckets=(1,),
            dim_buckets={"seq": (8,)}, overwrite=True, **options,
        )  # fmt: skip

    spec = {"tokens": "tokens", "mask": "mask", "output": "pooled"}
    for options, message in [
        ({"embedding": spec}, "give tokenizer="),
        ({"tokenizer": "bytes", "embedding": spec | {"tokens": "mask"}}, "must be an int32"),
        ({"tokenizer": "bytes", "embedding": spec | {"mask": "nope"}}, "mask 'nope' must be"),
        ({"tokenizer": "bytes", "embedding": spec | {"output": "hidden"}}, "one vector per"),
        ({"tokenizer": "bytes", "embedding": {"tokens": "tokens", "pool": 1}}, "must be {"),
    ]:
        with pytest.raises(ValueError, match=message):
            export(**options)
    manifest = pxrt.read_artifact(export(tokenizer="bytes", embedding=spec)).manifest
    assert manifest["embedding"] == spec and manifest["tokenizer"] == {"kind": "bytes"}
