"""Export a JAX function and its params to an artifact directory, and read one back.

An artifact directory holds:

- ``model.jaxexport``: the function as ``jax.export`` serialized StableHLO, with a
  symbolic batch dimension ``b`` and the params as arguments (never closed over: that
  would bake a copy of the weights into every bucket's executable);
- ``params.npz``: the param leaves as plain arrays (read with ``allow_pickle=False``;
  loading a directory never runs code from it);
- ``manifest.json``: format version, name/version, inputs and outputs (name, dtype,
  per-example shape), batch buckets, mesh layout, x64 flag, jax versions and the
  sha256 of every file above.

The manifest is bound to its program: the exported function is named after a hash of
the manifest's signature (inputs and outputs in order, params, x64, mesh), and
``read`` refuses a manifest whose signature is not the one its program was exported
with, or that does not match the program's own argument and result types. Nothing in
the directory is native code: compiled executables are cached outside it (see
``pxrt.load``).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jaxlib
import ml_dtypes
import numpy as np
from jax import export as jax_export

from . import _xla

FORMAT = "pxrt-artifact"
# 2: the program's name binds the manifest's signature (1 still loads, unbound).
FORMAT_VERSION = 2
SIGNATURE_KEYS = ("inputs", "outputs", "params", "x64", "mesh")
# A bucket's rows, at most: far beyond any batch one device runs, small enough that a
# typo (1e9) is refused before anything is allocated for it.
MAX_BUCKET = 1 << 20
MANIFEST = "manifest.json"
PROGRAM_FILE = "model.jaxexport"
PARAMS_FILE = "params.npz"
BATCH_AXIS = "data"
DEFAULT_OUTPUT = "output"

# dtype name -> numpy dtype; names are what manifests and error messages use.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
}
DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)


class ArtifactError(ValueError):
    """An artifact directory cannot be written or loaded; the message says what to do."""


def as_dtype(dtype: Any) -> np.dtype:
    """A supported numpy dtype from a name, a numpy/ml_dtypes dtype or a scalar type."""
    try:
        dt = DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    except (KeyError, TypeError) as exc:
        raise TypeError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}") from exc
    if dt.name not in DTYPES or dt != DTYPES[dt.name]:
        raise TypeError(f"unsupported dtype {dt}; supported: {', '.join(DTYPES)}")
    return DTYPES[dt.name]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One named input or output: its per-example ``shape`` (the leading batch
    dimension is implicit) and its exact ``dtype``."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def __init__(self, shape: Sequence[int], dtype: Any):
        if isinstance(shape, int):
            shape = (shape,)
        dims = tuple(shape)
        if not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims
        ):
            raise ValueError(f"shape must be a tuple of non-negative ints, got {shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in dims))
        object.__setattr__(self, "dtype", as_dtype(dtype))

    @property
    def nbytes_per_row(self) -> int:
        """Bytes of one example (one row of a batch)."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def describe(self) -> str:
        return (
            f"{self.dtype.name}[n, {', '.join(map(str, self.shape))}]"
            if self.shape
            else f"{self.dtype.name}[n]"
        )

    def to_json(self, name: str) -> dict:
        return {"name": name, "dtype": self.dtype.name, "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A verified artifact directory, read into memory."""

    path: str
    manifest: dict
    exported: jax_export.Exported
    params: Any  # the params pytree, numpy leaves
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        return tuple(self.manifest["batch_buckets"])

    @property
    def x64(self) -> bool:
        return bool(self.manifest["x64"])


# --------------------------------------------------------------------------- export


def export(
    fn: Callable,
    params: Any,
    path: str | os.PathLike,
    *,
    inputs: Mapping[str, TensorSpec],
    batch_buckets: Sequence[int] = (1, 8, 64),
    name: str | None = None,
    version: str = "1",
    num_devices: int | None = None,
    x64: bool | None = None,
    overwrite: bool = False,
) -> str:
    """Export ``fn(params, **inputs)`` and ``params`` to the artifact directory ``path``.

    Args:
      fn: ``fn(params, **inputs)`` returning an array (named ``"output"``) or a dict of
        named arrays. Every input and output has a leading batch dimension, and
        example ``i`` of the outputs may depend only on example ``i`` of the inputs.
      params: a pytree of arrays, stored as plain arrays and passed as arguments.
      inputs: name -> ``TensorSpec`` with the per-example shape and exact dtype.
      batch_buckets: the batch sizes to compile at load time.
      name, version: identify the model (name defaults to the directory name).
      num_devices: if given, check that every bucket splits evenly over that many
        devices (``pxrt.load`` rounds buckets up to a multiple of its device count).
      x64: trace with 64-bit types; defaults to whether any input or param is 64-bit.
        Only pxrt's own tracing sees it: the caller's jax config is not changed.
      overwrite: replace an existing artifact at ``path``.

    Returns the artifact path.
    """
    path = os.fspath(path)
    if not isinstance(inputs, Mapping) or not inputs:
        raise ValueError("inputs must be a non-empty mapping of name -> pxrt.TensorSpec")
    for key, spec in inputs.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"input names must be non-empty strings, got {key!r}")
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"input {key!r}: expected a pxrt.TensorSpec, got {type(spec).__name__}")
    buckets = _check_buckets(batch_buckets, num_devices)
    names = list(inputs)

    leaves, treedef = jax.tree.flatten(params)
    leaves = [np.asarray(leaf) for leaf in leaves]
    for (keypath, _), leaf in zip(jax.tree_util.tree_flatten_with_path(params)[0], leaves):
        try:
            as_dtype(leaf.dtype)
        except TypeError as exc:
            raise TypeError(f"param {jax.tree_util.keystr(keypath)}: {exc}") from None
    params_np = jax.tree.unflatten(treedef, leaves)
    if x64 is None:
        x64 = any(
            np.dtype(d).itemsize == 8
            for d in [s.dtype for s in inputs.values()] + [leaf.dtype for leaf in leaves]
        )

    with _xla.x64_scope(x64):
        param_specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params_np)
        out_shapes = jax.eval_shape(
            fn,
            param_specs,
            **{
                k: jax.ShapeDtypeStruct((buckets[0],) + s.shape, s.dtype) for k, s in inputs.items()
            },
        )
        out_names = _output_names(out_shapes)
        outputs = {}
        for out_name in out_names:
            shaped = out_shapes[out_name] if isinstance(out_shapes, Mapping) else out_shapes
            if not shaped.shape or shaped.shape[0] != buckets[0]:
                raise ValueError(
                    f"output {out_name!r} has shape {shaped.shape} for {buckets[0]} rows: every "
                    "output needs the batch dimension of the inputs as its leading dimension"
                )
            outputs[out_name] = TensorSpec(shaped.shape[1:], shaped.dtype)

        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "name": name or os.path.basename(os.path.normpath(path)),
            "version": str(version),
            "inputs": [spec.to_json(k) for k, spec in inputs.items()],
            "outputs": [spec.to_json(k) for k, spec in outputs.items()],
            "batch_buckets": list(buckets),
            "sequence_buckets": None,
            "mesh": {
                "axes": [BATCH_AXIS],
                "inputs": [BATCH_AXIS],
                "outputs": [BATCH_AXIS],
                "params": "replicated",
            },
            "x64": bool(x64),
            "params": [
                {
                    "key": f"p{i:04d}",
                    "path": jax.tree_util.keystr(kp),
                    "dtype": leaf.dtype.name,
                    "shape": list(leaf.shape),
                }
                for i, ((kp, _), leaf) in enumerate(
                    zip(jax.tree_util.tree_flatten_with_path(params)[0], leaves)
                )
            ],
        }

        def flat_fn(params, *xs):
            out = fn(params, **dict(zip(names, xs)))
            return tuple(out[k] for k in out_names) if isinstance(out, Mapping) else (out,)

        flat_fn.__name__ = program_name(manifest)  # binds this manifest to the program
        (b,) = jax_export.symbolic_shape("b")
        x_specs = [jax.ShapeDtypeStruct((b,) + s.shape, s.dtype) for s in inputs.values()]
        exported = jax_export.export(jax.jit(flat_fn))(param_specs, *x_specs)

    for out_name, aval in zip(out_names, exported.out_avals):
        if not aval.shape or aval.shape[0] is not b and str(aval.shape[0]) != "b":
            raise ValueError(
                f"output {out_name!r} has shape {aval.shape}: every output needs the "
                "batch dimension of the inputs as its leading dimension"
            )
        if tuple(aval.shape[1:]) != outputs[out_name].shape:
            raise ValueError(
                f"output {out_name!r} has shape {aval.shape}: only the batch dimension may "
                "be symbolic"
            )

    manifest |= {
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "calling_convention_version": exported.calling_convention_version,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "files": {},
    }
    _write_directory(path, manifest, bytes(exported.serialize()), leaves, overwrite)
    return path


def program_name(manifest: Mapping[str, Any]) -> str:
    """The name an artifact's program is exported under: a hash of the manifest's
    signature (what feeds the program, what its outputs are called)."""
    signature = {k: manifest[k] for k in SIGNATURE_KEYS}
    text = json.dumps(signature, sort_keys=True, separators=(",", ":"))
    return "pxrt_" + hashlib.sha256(text.encode()).hexdigest()[:40]


def _check_buckets(batch_buckets: Sequence[int], num_devices: int | None) -> tuple[int, ...]:
    try:
        buckets = tuple(sorted(set(int(b) for b in batch_buckets)))
    except (TypeError, ValueError):
        raise ValueError(f"batch_buckets must be positive ints, got {batch_buckets!r}") from None
    if not buckets or buckets[0] < 1:
        raise ValueError(f"batch_buckets must be positive ints, got {batch_buckets!r}")
    if buckets[-1] > MAX_BUCKET:
        raise ValueError(f"batch bucket {buckets[-1]} is over the limit of {MAX_BUCKET} rows")
    if num_devices is not None:
        uneven = [b for b in buckets if b % num_devices]
        if uneven:
            raise ValueError(
                f"batch buckets {uneven} do not split evenly over {num_devices} "
                f"devices; use multiples of {num_devices}"
            )
    return buckets


def _output_names(out_shapes: Any) -> list[str]:
    if isinstance(out_shapes, Mapping):
        bad = [k for k in out_shapes if not isinstance(k, str)]
        if bad or not out_shapes:
            raise ValueError("fn must return an array or a non-empty dict of str -> array")
        nested = [k for k, v in out_shapes.items() if not hasattr(v, "shape")]
        if nested:
            raise ValueError(f"outputs {nested} are not arrays; return a flat dict of arrays")
        return list(out_shapes)
    if hasattr(out_shapes, "shape"):
        return [DEFAULT_OUTPUT]
    raise ValueError(
        f"fn must return an array or a dict of arrays, got {type(out_shapes).__name__}"
    )


def _storable(leaf: np.ndarray) -> np.ndarray:
    # npy has no bfloat16; store its bits and keep the real dtype in the manifest.
    if leaf.dtype == DTYPES["bfloat16"]:
        return leaf.view(np.uint16)
    return leaf


def _write_directory(
    path: str, manifest: dict, program: bytes, leaves: list[np.ndarray], overwrite: bool
) -> None:
    if os.path.exists(path) and not overwrite and (not os.path.isdir(path) or os.listdir(path)):
        raise ArtifactError(
            f"{path} already exists; pass overwrite=True (pxrt export --overwrite) to replace it"
        )
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    # Write beside the target and rename, so a crash never leaves half an artifact.
    tmp = tempfile.mkdtemp(prefix=".pxrt-export-", dir=parent)
    try:
        with open(os.path.join(tmp, PROGRAM_FILE), "wb") as f:
            f.write(program)
        with open(os.path.join(tmp, PARAMS_FILE), "wb") as f:
            np.savez(f, **{f"p{i:04d}": _storable(leaf) for i, leaf in enumerate(leaves)})
        manifest["files"] = {
            fname: _sha256(os.path.join(tmp, fname)) for fname in (PROGRAM_FILE, PARAMS_FILE)
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- read


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def read(path: str | os.PathLike) -> Artifact:
    """Read and verify an artifact directory (hashes, format and jax versions)."""
    path = os.fspath(path)
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise ArtifactError(
            f"{path} is not a pxrt artifact: {MANIFEST} is missing (create one with pxrt.export)"
        )
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"{manifest_path} is not valid JSON ({exc}); re-export the model"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{manifest_path} is not a pxrt manifest (format is not {FORMAT!r})")
    fv = manifest.get("format_version")
    if not isinstance(fv, int) or isinstance(fv, bool) or fv < 1:
        raise ArtifactError(f"{manifest_path}: bad format_version {fv!r}; re-export the model")
    if fv > FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has artifact format version {fv}, but this pxrt reads "
            f"versions up to {FORMAT_VERSION}: upgrade pxrt, or re-export the "
            "model with this one"
        )
    _check_manifest(manifest, manifest_path)

    files = manifest.get("files") or {}
    for fname in (PROGRAM_FILE, PARAMS_FILE):
        if fname not in files:
            raise ArtifactError(f"{manifest_path} lists no sha256 for {fname}; re-export the model")
    for fname, want in files.items():
        fpath = os.path.join(path, fname)
        if os.path.basename(fname) != fname or not os.path.isfile(fpath):
            raise ArtifactError(f"{path}: {fname} named in the manifest is missing; re-export")
        got = _sha256(fpath)
        if got != want:
            raise ArtifactError(
                f"{fpath} does not match its sha256 in {MANIFEST} (expected "
                f"{want[:12]}…, got {got[:12]}…): the artifact was modified or "
                "corrupted; re-export it"
            )

    _check_jax_version(path, manifest)
    with open(os.path.join(path, PROGRAM_FILE), "rb") as f:
        blob = f.read()
    try:
        exported = jax_export.deserialize(bytearray(blob))
    except Exception as exc:  # noqa: BLE001 - any failure here means the same thing
        raise ArtifactError(
            f"{path}: jax {jax.__version__} cannot read {PROGRAM_FILE} "
            f"({exc}); re-export the model with this jax"
        ) from exc

    inputs = {d["name"]: TensorSpec(d["shape"], d["dtype"]) for d in manifest["inputs"]}
    outputs = {d["name"]: TensorSpec(d["shape"], d["dtype"]) for d in manifest["outputs"]}
    param_meta = manifest["params"]
    _check_program(exported, manifest, inputs, outputs, path)

    params = _read_params(path, exported, param_meta)
    return Artifact(
        path=path,
        manifest=manifest,
        exported=exported,
        params=params,
        inputs=inputs,
        outputs=outputs,
    )


def _check_manifest(m: dict, where: str) -> None:
    """The manifest's structure, field by field: a malformed one is an ArtifactError that
    names the field, never a KeyError or an allocation sized by a typo."""

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ArtifactError(f"{where}: {field} {what}; re-export the model")

    def is_int(v: Any, low: int = 0) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    need(isinstance(m.get("name"), str) and bool(m["name"]), "'name'", "must be a non-empty string")
    need(isinstance(m.get("version"), str), "'version'", "must be a string")
    need(isinstance(m.get("x64"), bool), "'x64'", "must be true or false")
    need(isinstance(m.get("mesh"), dict), "'mesh'", "must be an object")
    files = m.get("files")
    need(
        isinstance(files, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()),
        "'files'",
        "must map file names to sha256 strings",
    )
    for kind in ("inputs", "outputs"):
        tensors = m.get(kind)
        need(isinstance(tensors, list) and bool(tensors), f"'{kind}'", "must be a non-empty list")
        for i, t in enumerate(tensors):
            field = f"{kind}[{i}]"
            need(isinstance(t, dict), field, "must be an object")
            need(
                isinstance(t.get("name"), str) and bool(t["name"]),
                f"{field}.name",
                "must be a non-empty string",
            )
            need(t.get("dtype") in DTYPES, f"{field}.dtype", f"must be one of {', '.join(DTYPES)}")
            shape = t.get("shape")
            need(
                isinstance(shape, list) and all(is_int(d) for d in shape),
                f"{field}.shape",
                "must be a list of non-negative ints",
            )
        names = [t["name"] for t in tensors]
        need(len(set(names)) == len(names), f"'{kind}'", "names a tensor twice")
    buckets = m.get("batch_buckets")
    need(
        isinstance(buckets, list) and bool(buckets) and all(is_int(b, 1) for b in buckets),
        "'batch_buckets'",
        "must be a non-empty list of positive ints",
    )
    need(max(buckets) <= MAX_BUCKET, "'batch_buckets'", f"has a bucket over {MAX_BUCKET} rows")
    params = m.get("params")
    need(isinstance(params, list), "'params'", "must be a list")
    for i, p in enumerate(params):
        field = f"params[{i}]"
        need(isinstance(p, dict), field, "must be an object")
        need(
            isinstance(p.get("key"), str) and isinstance(p.get("path"), str),
            field,
            "needs string 'key' and 'path'",
        )
        need(p.get("dtype") in DTYPES, f"{field}.dtype", f"must be one of {', '.join(DTYPES)}")
        need(
            isinstance(p.get("shape"), list) and all(is_int(d) for d in p["shape"]),
            f"{field}.shape",
            "must be a list of non-negative ints",
        )


def _check_program(exported: Any, manifest: dict, inputs: dict, outputs: dict, path: str) -> None:
    """The manifest against the program it came with: every input and output's dtype and
    per-example shape in order, and (format 2) the signature the program was named after."""
    n_params = len(manifest["params"])
    in_avals, out_avals = exported.in_avals, exported.out_avals

    def mismatch(kind: str, specs: dict, avals: Any) -> str | None:
        if len(avals) != len(specs):
            return f"the program has {len(avals)} {kind}, the manifest lists {len(specs)}"
        for (name, spec), aval in zip(specs.items(), avals):
            if (
                not aval.shape
                or isinstance(aval.shape[0], int)
                or np.dtype(aval.dtype) != spec.dtype
                or tuple(aval.shape[1:]) != spec.shape
            ):
                return (
                    f"{kind[:-1]} {name!r} is {spec.describe()} in the manifest but "
                    f"{np.dtype(aval.dtype).name}{list(aval.shape)} in the program"
                )
        return None

    why = mismatch("inputs", inputs, in_avals[n_params:]) or mismatch("outputs", outputs, out_avals)
    if why is None and manifest["format_version"] >= 2:
        if exported.fun_name != program_name(manifest):
            why = (
                "its inputs, outputs, params, x64 flag or mesh are not the ones the program "
                "was exported with (they were edited)"
            )
    if why is not None:
        raise ArtifactError(
            f"{path}: the manifest does not match the program: {why}; re-export the model"
        )


def _check_jax_version(path: str, manifest: dict) -> None:
    ccv = manifest.get("calling_convention_version")
    lo = jax_export.minimum_supported_calling_convention_version
    hi = jax_export.maximum_supported_calling_convention_version
    exported_with = str(manifest.get("jax_version", "?"))
    if not isinstance(ccv, int) or not lo <= ccv <= hi:
        raise ArtifactError(
            f"{path} was exported with jax {exported_with} (calling convention {ccv}); jax "
            f"{jax.__version__} runs calling conventions {lo}..{hi}. Re-export the model with "
            f"jax {jax.__version__}, or load it with jax {exported_with}"
        )
    if _version_tuple(exported_with) > _version_tuple(jax.__version__):
        raise ArtifactError(
            f"{path} was exported with jax {exported_with}, newer than this process's jax "
            f"{jax.__version__} (jax.export reads artifacts at most a few weeks newer than "
            f"itself). Install jax=={exported_with}, or re-export with jax {jax.__version__}"
        )


def _read_params(path: str, exported: jax_export.Exported, meta: list[dict]) -> Any:
    args_tree = exported.in_tree.children()[0]
    params_tree = args_tree.children()[0]
    if params_tree.num_leaves != len(meta):
        raise ArtifactError(
            f"{path}: the program takes {params_tree.num_leaves} param arrays "
            f"but the manifest lists {len(meta)}; re-export the model"
        )
    leaves = []
    with np.load(os.path.join(path, PARAMS_FILE), allow_pickle=False) as npz:
        for m, aval in zip(meta, exported.in_avals):
            leaf = npz[m["key"]]
            dtype = as_dtype(m["dtype"])
            if leaf.dtype != dtype:
                leaf = leaf.view(dtype)
            if (
                list(leaf.shape) != m["shape"]
                or tuple(aval.shape) != leaf.shape
                or np.dtype(aval.dtype) != dtype
            ):
                raise ArtifactError(
                    f"{path}: param {m['path']} is {leaf.dtype}{list(leaf.shape)}, "
                    f"the program expects {aval.dtype}{list(aval.shape)}"
                )
            leaves.append(leaf)
    return jax.tree.unflatten(params_tree, leaves)
