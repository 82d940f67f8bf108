"""Export a JAX function and its params to an artifact directory, and read one back.

An artifact directory holds:

- ``model.jaxexport``: the function as ``jax.export`` serialized StableHLO, with a
  symbolic batch dimension ``b`` and the params as arguments (never closed over: that
  would bake a copy of the weights into every bucket's executable);
- ``params.npz``: the param leaves as plain arrays (read with ``allow_pickle=False``;
  loading a directory never runs code from it);
- ``manifest.json``: format version, name/version, inputs and outputs (name, dtype,
  per-example shape, pad value), batch buckets, buckets per named dimension, mesh
  layout, x64 flag, jax versions and the sha256 of every file above.

A per-example shape may name a dimension (``("seq",)``, ``("seq", 64)``): it is
symbolic in the program, like the batch, and every input that names it has the same
length in one request. Outputs may carry it too (they come back cut to each request's
length). ``dim_buckets`` gives the lengths each named dimension is compiled at.

The manifest is bound to its program: the exported function is named after a hash of
the manifest's signature (inputs and outputs in order, params, x64, mesh), and
``read`` refuses a manifest whose signature is not the one its program was exported
with, or that does not match the program's own argument and result types. Nothing in
the directory is native code: compiled executables are cached outside it (see
``pxrt.load``).

This module writes and reads the directory; what a tensor spec is lives in
``pxrt.specs``, the manifest's format and checks in ``pxrt.manifest``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jaxlib
import numpy as np
from jax import export as jax_export

from . import _xla
from . import shapes as _shapes
from .manifest import (
    CONCRETE_FORMAT_VERSION,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MAX_FORMAT_VERSION,
    PARAMS_FILE,
    PROGRAM_FILE,
    ArtifactError,
    check_jax_version,
    check_manifest,
    check_program,
    is_concrete,
    program_name,
)
from .specs import (
    BATCH_DIM,
    DTYPES,
    MAX_BUCKET,
    Dim,
    TensorSpec,
    as_dtype,
    check_lengths,
)

BATCH_AXIS = "data"
DEFAULT_OUTPUT = "output"
SYMBOLIC, CONCRETE = "symbolic", "concrete"  # how an artifact's programs were traced

log = logging.getLogger("pxrt")


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A verified artifact directory, read into memory."""

    path: str
    manifest: dict
    exported: jax_export.Exported
    #: The program's params argument, numpy leaves: the list of leaves (the user's pytree
    #: is rebuilt inside the program; ``params_by_path`` names them), or the pytree
    #: itself in artifacts exported before that.
    params: Any
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    #: A concrete-shape artifact's programs by cell (batch, lengths...); None: the one
    #: symbolic ``exported`` runs every cell.
    programs: dict[tuple[int, ...], jax_export.Exported] | None = None

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        return tuple(self.manifest["batch_buckets"])

    @property
    def x64(self) -> bool:
        return bool(self.manifest["x64"])

    @property
    def params_by_path(self) -> dict[str, np.ndarray]:
        """Each param array by its path in the exported pytree (``"['w']"``)."""
        return dict(zip((p["path"] for p in self.manifest["params"]), jax.tree.leaves(self.params)))

    @property
    def bounds(self) -> dict[str, int]:
        """Named dimension -> the bound its program was exported with (``dim <= n``);
        absent: unbounded."""
        return dict(self.manifest.get("bounds", {}))

    @property
    def dim_buckets(self) -> dict[str, tuple[int, ...]]:
        """Named dimension -> the lengths it is compiled at (empty: fixed shapes), in
        the order the inputs first name them."""
        if self.manifest["format_version"] < 3:
            return {}
        given = self.manifest["dim_buckets"]
        named = dict.fromkeys(d for spec in self.inputs.values() for d in spec.dims)
        return {d: tuple(given[d]) for d in named}


# --------------------------------------------------------------------------- export


def export(
    fn: Callable,
    params: Any,
    path: str | os.PathLike,
    *,
    inputs: Mapping[str, TensorSpec],
    batch_buckets: Sequence[int] = (1, 8, 64),
    dim_buckets: Mapping[str, Sequence[int]] | None = None,
    name: str | None = None,
    version: str = "1",
    num_devices: int | None = None,
    x64: bool | None = None,
    bounds: Mapping[str, int | None] | None = None,
    constraints: Sequence[str] = (),
    shapes: str = "symbolic",
    overwrite: bool = False,
    tokenizer: str | os.PathLike | None = None,
    embedding: Mapping[str, str | None] | None = None,
) -> str:
    """Export ``fn(params, **inputs)`` and ``params`` to the artifact directory ``path``.

    Args:
      fn: ``fn(params, **inputs)`` returning an array (named ``"output"``) or a dict of
        named arrays. Every input and output has a leading batch dimension, and
        example ``i`` of the outputs may depend only on example ``i`` of the inputs.
      params: a pytree of arrays, stored as plain arrays and passed as arguments.
      inputs: name -> ``TensorSpec`` with the per-example shape and exact dtype. A
        dimension given by name (``TensorSpec(("seq",), "int32")``) varies per request;
        inputs that name the same dimension have the same length in a request.
      batch_buckets: the batch sizes to compile at load time.
      dim_buckets: named dimension -> the lengths to compile it at (every named
        dimension needs some). A request of length ``L`` runs at the smallest length
        ``>= L``, its inputs padded with their ``pad`` value; ``fn`` must give the
        same outputs at the valid positions whatever the padding (mask it).
      name, version: identify the model (name defaults to the directory name).
      num_devices: if given, check that every bucket splits evenly over that many
        devices (``pxrt.load`` rounds buckets up to a multiple of its device count).
      x64: trace with 64-bit types; defaults to whether any input or param is 64-bit.
        Only pxrt's own tracing sees it: the caller's jax config is not changed.
      bounds: named dimension -> the largest length its program will ever run at
        (None: unbounded). Default: its largest ``dim_buckets`` length. The program
        knows ``seq <= bound``, which is what code slicing a fixed table (a position
        embedding) needs; load refuses lengths beyond it (see ``pxrt.shapes``).
      constraints: more of jax's symbolic constraints over the dimensions (``"seq <=
        2 * b"``), passed to ``jax.export.symbolic_shape``.
      shapes: ``"symbolic"`` (one program for every cell) or ``"concrete"``: one program
        per cell of the grid, each traced at its own sizes, for code that needs Python
        ints (``len(x)``, ``range(x.shape[1])``). Loads and serves the same, but only
        the cells exported (batch sizes must split evenly over the devices it loads
        on); an output's dimension is the named one when it equals that dimension's
        length in every cell.
      overwrite: replace an existing artifact at ``path``.
      tokenizer: as ``export_decoder``'s (``"bytes"``, a ``tokenizer.json``, a
        SentencePiece ``.model``), carried in the artifact for text inputs.
      embedding: the model embeds text (``/v1/embeddings``): ``{"tokens": input,
        "mask": input or None, "output": output}``: an int32 input of token ids
        ``[seq]`` (a named dimension), optionally a mask input of the same shape (true,
        or 1, where a token is), and an output of one vector ``[dim]`` per example.
        Needs ``tokenizer``.

    The same function, params and options give the same bytes from any caller.
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
    dims = _check_dim_buckets(dim_buckets, inputs)
    bound = _shapes.bounds_for(dims, bounds)
    if shapes not in (SYMBOLIC, CONCRETE):
        raise ValueError(f"shapes must be {SYMBOLIC!r} or {CONCRETE!r}, got {shapes!r}")
    if shapes == CONCRETE and (bounds or constraints):
        raise ValueError("bounds and constraints are for symbolic shapes, not shapes='concrete'")

    leaves, param_meta = param_entries(params)
    fn = on_leaves(fn, jax.tree.structure(params))
    x64, why = x64_of(x64, param_meta, inputs, "pxrt.export")
    files, tok_config = _text_files(tokenizer, embedding, inputs)

    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": name or os.path.basename(os.path.normpath(path)),
        "version": str(version),
        "inputs": [spec.to_json(k, pad=True) for k, spec in inputs.items()],
        "outputs": [],
        "batch_buckets": list(buckets),
        "dim_buckets": {k: list(v) for k, v in dims.items()},
        "mesh": {
            "axes": [BATCH_AXIS],
            "inputs": [BATCH_AXIS],
            "outputs": [BATCH_AXIS],
            "params": "replicated",
        },
        "x64": bool(x64),
        "params": param_meta,
        "bounds": bound,
        "constraints": _shapes.check_constraints(constraints, ([BATCH_DIM, *dims],)),
    }
    with _xla.export_scope(x64), x64_noted(why):
        param_specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves]
        trace = _trace_symbolic if shapes == SYMBOLIC else _trace_concrete
        programs, ccv = trace(fn, param_specs, inputs, buckets, dims, manifest)

    if tok_config is not None:
        manifest["tokenizer"] = tok_config
    if embedding is not None:
        manifest["embedding"] = _embedding_output(dict(embedding), manifest)
    manifest |= {
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "calling_convention_version": ccv,
        "files": {},
    }
    write_directory(path, manifest, programs | files, leaves, overwrite)
    return path


def _text_files(
    tokenizer: str | os.PathLike | None,
    embedding: Mapping[str, str | None] | None,
    inputs: Mapping[str, TensorSpec],
) -> tuple[dict[str, bytes], dict | None]:
    """A one-shot model's tokenizer files and config, and its ``embedding`` inputs
    checked (a ValueError naming what does not fit)."""
    from .tokenizer import artifact_files

    files, config, _ = artifact_files(tokenizer)
    if embedding is None:
        return files, config
    if tokenizer is None:
        raise ValueError("embedding: an embedding model turns text into vectors: give tokenizer=")
    known = {"tokens", "mask", "output"}
    if not isinstance(embedding, Mapping) or set(embedding) - known or "tokens" not in embedding:
        raise ValueError(
            "embedding must be {'tokens': input, 'mask': input or None, 'output': output}, "
            f"got {embedding!r:.100}"
        )
    tokens = inputs.get(str(embedding["tokens"]))
    if tokens is None or tokens.dtype != np.dtype("int32") or len(tokens.shape) != 1:
        raise ValueError(
            f"embedding: tokens {embedding['tokens']!r} must be an int32 input of one "
            f"named dimension ([seq]), got {tokens}"
        )
    if not isinstance(tokens.shape[0], str):
        raise ValueError(f"embedding: tokens {embedding['tokens']!r} needs a named dimension")
    mask = embedding.get("mask")
    if mask is not None and (mask not in inputs or inputs[mask].shape != tokens.shape):
        raise ValueError(f"embedding: mask {mask!r} must be an input of the tokens' shape")
    return files, config


def _embedding_output(embedding: dict, manifest: dict) -> dict:
    """The embedding entry of the manifest: its output checked (one vector per
    example) and named (the only output when not given)."""
    outputs = {o["name"]: o for o in manifest["outputs"]}
    name = embedding.get("output") or (next(iter(outputs)) if len(outputs) == 1 else None)
    if name not in outputs:
        raise ValueError(
            f"embedding: output {embedding.get('output')!r} is not among the outputs "
            f"({', '.join(outputs)})"
        )
    shape = outputs[name]["shape"]
    if len(shape) != 1 or not isinstance(shape[0], int):
        raise ValueError(f"embedding: output {name!r} must be one vector per example, got {shape}")
    return {"tokens": embedding["tokens"], "mask": embedding.get("mask"), "output": name}


def on_leaves(fn: Callable, treedef: Any) -> Callable:
    """``fn`` taking its params (the first argument) as their list of leaves, which is
    what the exported program takes: jax.export serializes only the pytree node types
    it knows, and a params pytree may be of any (flax NNX's ``State``, a dataclass).
    ``fn`` sees its own pytree again."""

    def with_leaves(leaves: list, *args: Any, **kwargs: Any) -> Any:
        return fn(jax.tree.unflatten(treedef, leaves), *args, **kwargs)

    return with_leaves


def _flat(fn: Callable, names: list[str], out_names: list[str], manifest: dict) -> Callable:
    """``fn`` over positional inputs, returning its outputs as a tuple, named after the
    manifest's signature (which binds the manifest to the program)."""

    def flat_fn(params, *xs):
        out = fn(params, **dict(zip(names, xs)))
        return tuple(out[k] for k in out_names) if isinstance(out, Mapping) else (out,)

    flat_fn.__name__ = program_name(manifest)
    return flat_fn


def _outputs(manifest: dict, out_names: list[str], specs: dict[str, TensorSpec]) -> None:
    manifest["outputs"] = [specs[k].to_json(k) for k in out_names]


def _trace_symbolic(
    fn: Callable,
    param_specs: Any,
    inputs: Mapping[str, TensorSpec],
    buckets: tuple[int, ...],
    dims: dict[str, tuple[int, ...]],
    manifest: dict,
) -> tuple[dict[str, bytes], int]:
    """One program for every cell: the batch and the named dimensions symbolic (in one
    scope, with the manifest's bounds and constraints)."""
    bound, names = manifest["bounds"], list(inputs)
    symbolic = {BATCH_DIM: None} | {d: bound.get(d) for d in dims}
    symbols = _shapes.symbols([BATCH_DIM, *dims], bound, manifest["constraints"])
    x_specs = [
        jax.ShapeDtypeStruct((symbols[BATCH_DIM],) + s.at(symbols), s.dtype)
        for s in inputs.values()
    ]
    with _shapes.explained(f"{manifest['name']!r}: fn", symbolic):
        out_shapes = jax.eval_shape(fn, param_specs, **dict(zip(names, x_specs)))
    out_names = _output_names(out_shapes)
    outputs = {}
    for out_name in out_names:
        shaped = out_shapes[out_name] if isinstance(out_shapes, Mapping) else out_shapes
        outputs[out_name] = TensorSpec(_output_dims(out_name, shaped.shape, dims), shaped.dtype)
    _outputs(manifest, out_names, outputs)
    flat_fn = _flat(fn, names, out_names, manifest)
    with _shapes.explained(f"{manifest['name']!r}: fn", symbolic):
        exported = jax_export.export(jax.jit(flat_fn))(param_specs, *x_specs)
    for out_name, aval in zip(out_names, exported.out_avals):
        if _output_dims(out_name, aval.shape, dims) != outputs[out_name].shape:
            raise ValueError(f"output {out_name!r} has shape {aval.shape} in the exported program")
    return {PROGRAM_FILE: bytes(exported.serialize())}, exported.calling_convention_version


def cell_file(cell: Sequence[int], dim_names: Sequence[str]) -> str:
    """The file of a concrete-shape artifact's program for ``cell`` (batch, lengths...)."""
    return (
        "model.b"
        + ".".join([str(cell[0])] + [f"{d}{n}" for d, n in zip(dim_names, cell[1:])])
        + ".jaxexport"
    )


def _trace_concrete(
    fn: Callable,
    param_specs: Any,
    inputs: Mapping[str, TensorSpec],
    buckets: tuple[int, ...],
    dims: dict[str, tuple[int, ...]],
    manifest: dict,
) -> tuple[dict[str, bytes], int]:
    """One program per cell, each traced at its own sizes (``shapes="concrete"``)."""
    names = list(inputs)
    cells = [(b, *ls) for b in buckets for ls in itertools.product(*dims.values())]
    traced = []
    for cell in cells:
        at = dict(zip(dims, cell[1:]))
        x_specs = [jax.ShapeDtypeStruct((cell[0],) + s.at(at), s.dtype) for s in inputs.values()]
        try:
            out_shapes = jax.eval_shape(fn, param_specs, **dict(zip(names, x_specs)))
        except Exception as exc:
            exc.add_note(f"pxrt: tracing {manifest['name']!r} at batch {cell[0]}"
                         + "".join(f", {d}={n}" for d, n in at.items()))  # fmt: skip
            raise
        traced.append((cell, x_specs, out_shapes))
    out_names = _output_names(traced[0][2])
    outputs = {}
    for out_name in out_names:
        got = [
            (cell, out[out_name] if isinstance(out, Mapping) else out) for cell, _, out in traced
        ]
        outputs[out_name] = TensorSpec(_concrete_dims(out_name, got, list(dims)), got[0][1].dtype)
    _outputs(manifest, out_names, outputs)
    manifest["format_version"] = CONCRETE_FORMAT_VERSION
    manifest["shapes"] = CONCRETE
    manifest["bounds"] = {}  # every size is a cell's own
    manifest["programs"] = [{"cell": list(c), "file": cell_file(c, list(dims))} for c in cells]
    flat_fn = _flat(fn, names, out_names, manifest)
    programs, ccv = {}, 0
    for cell, x_specs, _ in traced:
        exported = jax_export.export(jax.jit(flat_fn))(param_specs, *x_specs)
        programs[cell_file(cell, list(dims))] = bytes(exported.serialize())
        ccv = exported.calling_convention_version
    return programs, ccv


def _concrete_dims(
    name: str, got: list[tuple[tuple, Any]], dim_names: list[str]
) -> tuple[Dim, ...]:
    """An output's per-example shape from its shapes at every cell: the batch first; a
    dimension that equals a named dimension's length in every cell is that dimension."""
    ranks = {len(shaped.shape) for _, shaped in got}
    if len(ranks) > 1 or any(
        not shaped.shape or shaped.shape[0] != cell[0] for cell, shaped in got
    ):
        raise ValueError(
            f"output {name!r} has shapes {[tuple(s.shape) for _, s in got]} at the cells "
            f"{[c for c, _ in got]}: every output needs the batch as its leading dimension "
            "and the same rank in every cell"
        )
    out: list[Dim] = []
    for axis in range(1, ranks.pop()):
        sizes = [int(shaped.shape[axis]) for _, shaped in got]
        named = [
            d
            for i, d in enumerate(dim_names)
            if all(n == c[1 + i] for n, (c, _) in zip(sizes, got))
        ]
        if named:
            out.append(named[0])
        elif len(set(sizes)) == 1:
            out.append(sizes[0])
        else:
            raise ValueError(
                f"output {name!r}: dimension {axis} is {sizes} at the cells "
                f"{[c for c, _ in got]}, neither one size nor a named dimension's length"
            )
    return tuple(out)


def _check_dim_buckets(
    dim_buckets: Mapping[str, Sequence[int]] | None, inputs: Mapping[str, TensorSpec]
) -> dict[str, tuple[int, ...]]:
    """Named dimension -> its sorted lengths, in the order the inputs first name them."""
    named = list(dict.fromkeys(d for spec in inputs.values() for d in spec.dims))
    given = dict(dim_buckets or {})
    unknown = [k for k in given if k not in named]
    if unknown:
        raise ValueError(
            f"dim_buckets names {unknown}, which no input has; the inputs name "
            f"{named or 'no dimensions'}"
        )
    missing = [d for d in named if d not in given]
    if missing:
        raise ValueError(
            f"dimension{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
            "varies per request but has no buckets: give the lengths to compile, e.g. "
            f"dim_buckets={{{missing[0]!r}: (32, 64, 128)}}"
        )
    return {d: check_lengths(d, given[d]) for d in named}


def _output_dims(name: str, shape: Sequence[Any], dims: Mapping[str, Any]) -> tuple[Dim, ...]:
    """An output's per-example shape: sizes and named dimensions; the batch first."""
    if not shape or str(shape[0]) != BATCH_DIM:
        raise ValueError(
            f"output {name!r} has shape {tuple(shape)}: every output needs the batch "
            "dimension of the inputs as its leading dimension"
        )
    out: list[Dim] = []
    for d in shape[1:]:
        if isinstance(d, (int, np.integer)):
            out.append(int(d))
        elif str(d) in dims:
            out.append(str(d))
        else:
            raise ValueError(
                f"output {name!r} has shape {tuple(shape)}: after the batch, an output's "
                f"dimensions are sizes or the inputs' named dimensions ({', '.join(dims)}) "
                f"as they are, not {d}"
            )
    return tuple(out)


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


def param_entries(params: Any) -> tuple[list[np.ndarray], list[dict]]:
    """A params pytree's leaves as numpy arrays, and the manifest's ``params`` entries."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    leaves = [np.asarray(leaf) for _, leaf in flat]
    for (keypath, _), leaf in zip(flat, leaves):
        try:
            as_dtype(leaf.dtype)
        except TypeError as exc:
            raise TypeError(f"param {jax.tree_util.keystr(keypath)}: {exc}") from None
    entries = [
        {
            "key": f"p{i:04d}",
            "path": jax.tree_util.keystr(kp),
            "dtype": leaf.dtype.name,
            "shape": list(leaf.shape),
        }
        for i, ((kp, _), leaf) in enumerate(zip(flat, leaves))
    ]
    return leaves, entries


def x64_of(
    x64: bool | None, params: list[dict], inputs: Mapping[str, Any] | None, who: str
) -> tuple[bool, str | None]:
    """Whether an export traces with 64-bit types, and the 64-bit input or param that
    made it so (None: ``x64`` was given, or nothing is 64-bit). Inferred (``x64`` None):
    any 64-bit input or param turns it on, and says so by name, since one stray float64
    leaf (numpy promotes ``float32 / np.sqrt(1)``) changes every integer in the trace.
    ``x64=False`` with a 64-bit param is refused by name: the program would take 32 bits
    where the artifact stores 64 (found only at load, before)."""
    wide = [f"input {k!r} ({np.dtype(s.dtype).name})" for k, s in (inputs or {}).items()
            if np.dtype(s.dtype).itemsize == 8]  # fmt: skip
    wide += [f"param {e['path']} ({e['dtype']})" for e in params
             if np.dtype(e["dtype"]).itemsize == 8]  # fmt: skip
    if x64 is None:
        if not wide:
            return False, None
        log.warning(
            "%s: tracing with 64-bit types (x64), since %s is 64-bit%s; if that is not "
            "meant, cast it to 32 bits and pass x64=False (x64=True says it is meant)",
            who, wide[0], f" (and {len(wide) - 1} more)" if len(wide) > 1 else "",
        )  # fmt: skip
        return True, wide[0]
    if not x64:
        params64 = [w for w in wide if w.startswith("param")]
        if params64:
            raise TypeError(
                f"{who}: x64=False, but {params64[0]} is 64-bit: the programs would take it "
                "as 32 bits; cast it (e.g. .astype(np.float32)) or pass x64=True"
            )
    return bool(x64), None


@contextlib.contextmanager
def x64_noted(why: str | None) -> Any:
    """An error of the trace inside says, when x64 was inferred, what turned it on."""
    try:
        yield
    except Exception as exc:
        if why is not None:
            exc.add_note(
                f"pxrt: this export traced with 64-bit types (x64) because {why} is 64-bit; "
                "if that is not meant, cast it to 32 bits and pass x64=False"
            )
        raise


def write_directory(
    path: str,
    manifest: dict,
    programs: Mapping[str, bytes],
    leaves: list[np.ndarray],
    overwrite: bool,
) -> None:
    """Write an artifact directory: ``programs`` (file name -> serialized program), the
    params and the manifest with every file's sha256, beside ``path`` then renamed."""
    if os.path.exists(path) and not overwrite and (not os.path.isdir(path) or os.listdir(path)):
        raise ArtifactError(
            f"{path} already exists; pass overwrite=True (pxrt export --overwrite) to replace it"
        )
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    # Write beside the target and rename, so a crash never leaves half an artifact.
    tmp = tempfile.mkdtemp(prefix=".pxrt-export-", dir=parent)
    try:
        for fname, blob in programs.items():
            with open(os.path.join(tmp, fname), "wb") as f:
                f.write(blob)
        _write_params(os.path.join(tmp, PARAMS_FILE), leaves)
        manifest["files"] = {
            fname: _sha256(os.path.join(tmp, fname)) for fname in (*programs, PARAMS_FILE)
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


def _write_params(path: str, leaves: list[np.ndarray]) -> None:
    """The params as an ``.npz`` (``np.load`` reads it) whose bytes depend on the arrays
    only: ``np.savez`` stamps each member with the time it was written."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for i, leaf in enumerate(leaves):
            info = zipfile.ZipInfo(f"p{i:04d}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with zf.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, _storable(leaf), allow_pickle=False)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- read


def read_manifest(path: str) -> dict:
    """An artifact directory's manifest, with its format and version checked (not yet
    its fields)."""
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
    if fv > MAX_FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has artifact format version {fv}, but this pxrt reads "
            f"versions up to {MAX_FORMAT_VERSION}: upgrade pxrt, or re-export the "
            "model with this one"
        )
    return manifest


def kind(manifest: Mapping[str, Any]) -> str:
    """``"oneshot"`` (a program run once per request) or ``"decoder"`` (generation)."""
    return "decoder" if manifest.get("kind") == "decoder" else "oneshot"


def verify_files(path: str, manifest: Mapping[str, Any], required: Sequence[str]) -> None:
    """Every file the manifest lists is there and matches its sha256; ``required`` are."""
    manifest_path = os.path.join(path, MANIFEST)
    files = manifest.get("files") or {}
    for fname in required:
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


def deserialize(path: str, fname: str) -> jax_export.Exported:
    """One of an artifact's serialized programs (the jax version already checked)."""
    with open(os.path.join(path, fname), "rb") as f:
        blob = f.read()
    try:
        return jax_export.deserialize(bytearray(blob))
    except Exception as exc:  # noqa: BLE001 - any failure here means the same thing
        raise ArtifactError(
            f"{path}: jax {jax.__version__} cannot read {fname} ({exc}); re-export the "
            f"model with this jax"
        ) from exc


def read(path: str | os.PathLike) -> Artifact:
    """Read and verify an artifact directory (hashes, format and jax versions)."""
    path = os.fspath(path)
    manifest = read_manifest(path)
    if kind(manifest) != "oneshot":
        raise ArtifactError(
            f"{path} is a {kind(manifest)} artifact: load it with pxrt.load (or read it "
            "with pxrt.decoder.read)"
        )
    manifest_path = os.path.join(path, MANIFEST)
    check_manifest(manifest, manifest_path)
    concrete = is_concrete(manifest)
    verify_files(path, manifest, (PARAMS_FILE,) if concrete else (PROGRAM_FILE, PARAMS_FILE))
    check_jax_version(path, manifest)
    programs = None
    if concrete:
        programs = {tuple(p["cell"]): deserialize(path, p["file"]) for p in manifest["programs"]}
        exported = next(iter(programs.values()))
    else:
        exported = deserialize(path, PROGRAM_FILE)

    inputs = {
        d["name"]: TensorSpec(d["shape"], d["dtype"], d.get("pad", 0)) for d in manifest["inputs"]
    }
    outputs = {d["name"]: TensorSpec(d["shape"], d["dtype"]) for d in manifest["outputs"]}
    param_meta = manifest["params"]
    pairs: list[tuple[Any, jax_export.Exported]] = (
        list(programs.items()) if programs else [(None, exported)]
    )
    for cell, program in pairs:
        check_program(program, manifest, inputs, outputs, path, cell)

    params = read_params(path, exported, param_meta)
    return Artifact(
        path=path,
        manifest=manifest,
        exported=exported,
        params=params,
        inputs=inputs,
        outputs=outputs,
        programs=programs,
    )


def read_params(path: str, exported: jax_export.Exported, meta: list[dict]) -> Any:
    """The params pytree (numpy leaves) of ``exported``'s first argument, from the
    artifact's params file, each leaf checked against the manifest and the program."""
    args_tree = jax.tree_util.treedef_children(exported.in_tree)[0]
    params_tree: Any = jax.tree_util.treedef_children(args_tree)[0]  # jaxlib: untyped
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


__all__ = [
    "BATCH_AXIS",
    "FORMAT_VERSION",
    "Artifact",
    "ArtifactError",
    "TensorSpec",
    "check_lengths",
    "export",
    "program_name",
    "read",
]
