"""The artifact manifest (``manifest.json``): its format, the name its program is exported
under (bound to the manifest's signature), and the checks ``pxrt.artifact.read`` runs on a
manifest and against the program and the jax it came with. Every failure is an
``ArtifactError`` that names the field and says what to do."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import export as jax_export

from .specs import DTYPES, MAX_BUCKET, check_pad, is_dim_name

FORMAT = "pxrt-artifact"
# 2: the program's name binds the manifest's signature (1 still loads, unbound).
# 3: named dimensions in shapes, their buckets (``dim_buckets``) and per-input pad
#    values (2 and 1 still load: they have neither).
FORMAT_VERSION = 3
# 4: decoders (``"kind": "decoder"``, see ``pxrt.decoder``). One-shot artifacts are still
#    written as 3, so a pxrt that predates decoders loads them.
DECODER_FORMAT_VERSION = 4
# 5: programs traced at concrete shapes, one per cell (``"shapes": "concrete"`` and their
#    ``programs``); symbolic artifacts are still written as 3 and 4.
CONCRETE_FORMAT_VERSION = 5
MAX_FORMAT_VERSION = 5  # the newest this pxrt reads
SIGNATURE_KEYS = ("inputs", "outputs", "params", "x64", "mesh")
MANIFEST = "manifest.json"
PROGRAM_FILE = "model.jaxexport"
PARAMS_FILE = "params.npz"


class ArtifactError(ValueError):
    """An artifact directory cannot be written or loaded; the message says what to do."""


def program_name(manifest: Mapping[str, Any]) -> str:
    """The name an artifact's program is exported under: a hash of the manifest's
    signature (what feeds the program, what its outputs are called)."""
    signature = {k: manifest[k] for k in SIGNATURE_KEYS}
    text = json.dumps(signature, sort_keys=True, separators=(",", ":"))
    return "pxrt_" + hashlib.sha256(text.encode()).hexdigest()[:40]


def version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def needs(where: str) -> Callable[[bool, str, str], None]:
    """``need(ok, field, what)``: an ArtifactError naming ``field`` unless ``ok``."""

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ArtifactError(f"{where}: {field} {what}; re-export the model")

    return need


def is_int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def check_common(m: dict[str, Any], where: str) -> None:
    """The fields every kind of manifest has: name, version, x64, files (the params are
    ``check_params``)."""
    need = needs(where)
    need(isinstance(m.get("name"), str) and bool(m["name"]), "'name'", "must be a non-empty string")
    need(isinstance(m.get("version"), str), "'version'", "must be a string")
    need(isinstance(m.get("x64"), bool), "'x64'", "must be true or false")
    files: Any = m.get("files")
    need(
        isinstance(files, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()),
        "'files'",
        "must map file names to sha256 strings",
    )


def check_bounds(m: dict[str, Any], where: str, dims: Collection[str]) -> None:
    """The optional ``bounds`` (dimension -> the bound its programs were exported with,
    ``dim <= n``; see ``pxrt.shapes``) and ``constraints`` (more of jax's symbolic
    constraints, as given to export)."""
    need = needs(where)
    bounds: Any = m.get("bounds", {})
    need(
        isinstance(bounds, dict)
        and all(k in dims and is_int(v, 1) and v <= MAX_BUCKET for k, v in bounds.items()),
        "'bounds'",
        f"must map the dimensions {sorted(dims)} to ints from 1 to {MAX_BUCKET}",
    )
    constraints: Any = m.get("constraints", [])
    need(
        isinstance(constraints, list) and all(isinstance(c, str) for c in constraints),
        "'constraints'",
        "must be a list of strings",
    )


def check_manifest(m: dict[str, Any], where: str) -> None:
    """The manifest's structure, field by field: a malformed one is an ArtifactError that
    names the field, never a KeyError or an allocation sized by a typo. (Its values are
    untrusted JSON, ``Any`` until checked.)"""
    need = needs(where)
    check_common(m, where)
    need(isinstance(m.get("mesh"), dict), "'mesh'", "must be an object")
    v3 = m["format_version"] >= 3
    dim_buckets: Any = m.get("dim_buckets") if v3 else {}
    need(
        isinstance(dim_buckets, dict)
        and all(
            is_dim_name(k)
            and isinstance(v, list)
            and bool(v)
            and all(is_int(x, 1) and x <= MAX_BUCKET for x in v)
            for k, v in dim_buckets.items()
        ),
        "'dim_buckets'",
        f"must map dimension names to non-empty lists of lengths from 1 to {MAX_BUCKET}",
    )
    for kind in ("inputs", "outputs"):
        tensors: Any = m.get(kind)
        need(isinstance(tensors, list) and bool(tensors), f"'{kind}'", "must be a non-empty list")
        for i, t in enumerate(tensors):
            field = f"{kind}[{i}]"
            need(isinstance(t, dict), field, "must be an object")
            need(
                isinstance(t.get("name"), str) and bool(t["name"]),
                f"{field}.name",
                "must be a non-empty string",
            )
            need(
                isinstance(t.get("dtype"), str) and t["dtype"] in DTYPES,
                f"{field}.dtype",
                f"must be one of {', '.join(DTYPES)}",
            )
            shape = t.get("shape")
            need(
                isinstance(shape, list)
                and all(
                    is_int(d) or (v3 and isinstance(d, str) and d in dim_buckets) for d in shape
                ),
                f"{field}.shape",
                "must be a list of non-negative ints"
                + (" and names from 'dim_buckets'" if v3 else ""),
            )
            if kind == "inputs" and "pad" in t:
                try:
                    check_pad(t["pad"], DTYPES[t["dtype"]])
                except ValueError as exc:
                    need(False, f"{field}.pad", str(exc))
        names = [t["name"] for t in tensors]
        need(len(set(names)) == len(names), f"'{kind}'", "names a tensor twice")
    named = {d for t in m["inputs"] for d in t["shape"] if isinstance(d, str)}
    need(
        set(dim_buckets) == named,
        "'dim_buckets'",
        f"must give lengths for exactly the inputs' named dimensions {sorted(named)}",
    )
    buckets: Any = m.get("batch_buckets")
    need(
        isinstance(buckets, list) and bool(buckets) and all(is_int(b, 1) for b in buckets),
        "'batch_buckets'",
        "must be a non-empty list of positive ints",
    )
    need(max(buckets) <= MAX_BUCKET, "'batch_buckets'", f"has a bucket over {MAX_BUCKET} rows")
    check_bounds(m, where, dim_buckets)
    if is_concrete(m):
        check_programs(m, where, [buckets, *dim_buckets.values()])
    check_params(m, where)


def is_concrete(m: Mapping[str, Any]) -> bool:
    """Whether an artifact's programs were traced per cell (``shapes="concrete"``)."""
    return m.get("format_version", 0) >= CONCRETE_FORMAT_VERSION and m.get("shapes") == "concrete"


def check_programs(m: dict[str, Any], where: str, axes: list[Any]) -> None:
    """A concrete-shape manifest's ``programs``: each a cell (one size per axis, from the
    sizes that axis lists) and a file whose sha256 the manifest has."""
    need = needs(where)
    programs: Any = m.get("programs")
    files = m.get("files") or {}
    need(isinstance(programs, list) and bool(programs), "'programs'", "must be a non-empty list")
    for i, p in enumerate(programs):
        need(
            isinstance(p, dict)
            and isinstance(p.get("cell"), list)
            and len(p["cell"]) == len(axes)
            and all(is_int(n, 1) and n in axis for n, axis in zip(p["cell"], axes))
            and isinstance(p.get("file"), str)
            and p["file"] in files,
            f"programs[{i}]",
            "must be a cell of the grid (one of each axis's sizes) and a file among 'files'",
        )


def check_params(m: dict[str, Any], where: str) -> None:
    """The manifest's ``params`` entries (both kinds of artifact have them)."""
    need = needs(where)
    params: Any = m.get("params")
    need(isinstance(params, list), "'params'", "must be a list")
    for i, p in enumerate(params):
        field = f"params[{i}]"
        need(isinstance(p, dict), field, "must be an object")
        need(
            isinstance(p.get("key"), str) and isinstance(p.get("path"), str),
            field,
            "needs string 'key' and 'path'",
        )
        need(
            isinstance(p.get("dtype"), str) and p["dtype"] in DTYPES,
            f"{field}.dtype",
            f"must be one of {', '.join(DTYPES)}",
        )
        need(
            isinstance(p.get("shape"), list) and all(is_int(d) for d in p["shape"]),
            f"{field}.shape",
            "must be a list of non-negative ints",
        )


def check_program(
    exported: Any,
    manifest: dict,
    inputs: dict,
    outputs: dict,
    path: str,
    cell: Sequence[int] | None = None,
) -> None:
    """The manifest against the program it came with: every input and output's dtype and
    per-example shape in order, and (format 2) the signature the program was named after.
    ``cell``: a concrete-shape program's (batch, lengths...), which its shapes must be."""
    n_params = len(manifest["params"])
    in_avals, out_avals = exported.in_avals, exported.out_avals
    at = dict(zip(manifest.get("dim_buckets") or {}, cell[1:])) if cell is not None else None

    def mismatch(kind: str, specs: dict, avals: Any) -> str | None:
        if len(avals) != len(specs):
            return f"the program has {len(avals)} {kind}, the manifest lists {len(specs)}"
        for (name, spec), aval in zip(specs.items(), avals):
            dims = tuple(d if isinstance(d, int) else str(d) for d in aval.shape[1:])
            batch_ok = aval.shape and (
                not isinstance(aval.shape[0], int) if cell is None else aval.shape[0] == cell[0]
            )
            want = spec.shape if at is None else spec.at(at)
            if not batch_ok or np.dtype(aval.dtype) != spec.dtype or dims != want:
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


def check_jax_version(path: str, manifest: dict) -> None:
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
    if version_tuple(exported_with) > version_tuple(jax.__version__):
        raise ArtifactError(
            f"{path} was exported with jax {exported_with}, newer than this process's jax "
            f"{jax.__version__} (jax.export reads artifacts at most a few weeks newer than "
            f"itself). Install jax=={exported_with}, or re-export with jax {jax.__version__}"
        )
