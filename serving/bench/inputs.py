"""What ``pxrt bench --url`` sends: real inputs from a file in perf_analyzer's JSON
input format (``--input-data FILE``), or random ones with the shapes of named (-1)
dimensions given (``--shape NAME:D1,D2``, as perf_analyzer's ``--shape``).

The file holds ``{"data": [STEP, ...]}``; each step is one request, input name ->
its value: a list of values (flat, in the model's shape, or nested), ``{"content":
[...], "shape": [...]}``, or ``{"b64": "...", "shape": [...]}`` (the raw bytes). A value
without the batch dimension is one row, repeated ``--rows`` times; one with it is sent
as it is. Requests go round robin through the steps.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from ..kserve import codec


def parse_shapes(specs: list[str]) -> dict[str, list[int]]:
    """``["tokens:128", "mask:128"]`` -> name -> dims (without the batch)."""
    out = {}
    for spec in specs:
        name, _, dims = spec.partition(":")
        try:
            shape = [int(d) for d in dims.split(",")]
        except ValueError:
            shape = []
        if not name or not shape or min(shape) < 0:
            raise ValueError(f"--shape {spec!r}: expected NAME:D1[,D2...] (dims >= 0)")
        out[name] = shape
    return out


def row_shape(spec: dict, shapes: dict[str, list[int]]) -> list[int]:
    """An input's dims without the batch: from ``--shape``, else the metadata's (named
    dimensions, -1, must then be given)."""
    name = spec["name"]
    if name in shapes:
        return shapes[name]
    dims = [int(d) for d in spec["shape"][1:]]
    if any(d < 0 for d in dims):
        raise ValueError(
            f"input {name!r} has dimensions the model leaves open ({spec['shape']}): give "
            f"them with --shape {name}:{','.join('128' if d < 0 else str(d) for d in dims)}"
        )
    return dims


def random_inputs(meta: dict, rows: int, shapes: dict[str, list[int]], seed: int) -> dict:
    """Input name -> random values of ``rows`` rows (what the bench sends by default)."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in meta["inputs"]:
        dtype = codec.DATATYPES[spec["datatype"]]
        shape = [rows, *row_shape(spec, shapes)]
        if dtype.kind == "f" or spec["datatype"] == "BF16":
            out[spec["name"]] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            out[spec["name"]] = rng.random(shape) < 0.5
        else:
            out[spec["name"]] = rng.integers(0, 10, shape).astype(dtype)
    return out


def read_input_data(path: str, meta: dict, rows: int) -> list[dict[str, np.ndarray]]:
    """The requests of a perf_analyzer input-data file (see the module); ValueError
    naming the step and input that is wrong."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--input-data {path}: {exc}") from None
    steps = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(steps, list) or not steps:
        raise ValueError(f'--input-data {path}: expected {{"data": [{{input: value}}, ...]}}')
    specs = {s["name"]: s for s in meta["inputs"]}
    requests = []
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            raise ValueError(f"--input-data {path}: step {i} is not an object of inputs")
        missing = sorted(set(specs) - set(step))
        unknown = sorted(set(step) - set(specs))
        if missing or unknown:
            raise ValueError(
                f"--input-data {path}: step {i}: "
                + "; ".join(
                    x
                    for x in (
                        f"missing inputs {missing}" if missing else "",
                        f"the model has no inputs {unknown}" if unknown else "",
                    )
                    if x
                )
            )
        requests.append(
            {
                name: _value(step[name], specs[name], rows, f"step {i} input {name!r}")
                for name in specs
            }
        )
    return requests


def _value(value: Any, spec: dict, rows: int, where: str) -> np.ndarray:
    dtype = codec.DATATYPES[spec["datatype"]]
    rank = len(spec["shape"])  # with the batch
    shape = None
    if isinstance(value, dict):
        shape = value.get("shape")
        if "b64" in value:
            arr = np.frombuffer(base64.b64decode(value["b64"]), dtype)
        elif "content" in value:
            arr = np.asarray(value["content"], dtype)
        else:
            raise ValueError(f"{where}: expected content or b64 (and shape)")
    else:
        arr = np.asarray(value, dtype)
    if shape is not None:
        try:
            arr = arr.reshape([int(d) for d in shape])
        except ValueError as exc:
            raise ValueError(
                f"{where}: {arr.size} values do not make shape {shape} ({exc})"
            ) from None
    elif arr.ndim == 1 and rank - 1 > 1:  # flat: the model's row shape
        dims = [int(d) for d in spec["shape"][1:]]
        if any(d < 0 for d in dims):
            raise ValueError(
                f"{where}: flat values for open dimensions {spec['shape']}: give a shape"
            )
        arr = arr.reshape(dims)
    if arr.ndim == rank - 1:
        return np.repeat(arr[None], rows, axis=0)
    if arr.ndim == rank:
        return arr
    raise ValueError(
        f"{where}: got {arr.ndim} dimensions ({list(arr.shape)}); the model's input has "
        f"{rank} with the batch ({spec['shape']})"
    )


__all__ = ["parse_shapes", "random_inputs", "read_input_data", "row_shape"]
