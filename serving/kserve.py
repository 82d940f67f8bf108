"""KServe v2 / Open Inference Protocol tensors: decoding requests, encoding responses.

Binary tensors (the binary tensor data extension) decode with ``np.frombuffer`` on the
request body and encode as the output arrays' own memory: no per-element Python work.
JSON ``data`` is accepted flat or nested. Nothing is cast silently: a JSON float for an
integer tensor, or an integer out of its type's range, is an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import orjson

# v2 datatype <-> numpy dtype, and the Triton config type names.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
DATATYPE_OF = {dt: name for name, dt in DATATYPES.items()}


def datatype_of(dtype: np.dtype) -> str:
    return DATATYPE_OF[np.dtype(dtype)]


class ProtocolError(ValueError):
    """A request that does not follow the protocol (answered 400)."""


def split_body(body: bytes, header_length: str | None) -> tuple[memoryview, memoryview]:
    """The JSON header and the binary tail of a request body."""
    view = memoryview(body)
    if header_length is None:
        return view, view[len(view) :]
    try:
        n = int(header_length)
    except ValueError:
        raise ProtocolError(
            f"Inference-Header-Content-Length must be an integer, got {header_length!r}"
        ) from None
    if not 0 <= n <= len(view):
        raise ProtocolError(
            f"Inference-Header-Content-Length is {n} but the body has {len(view)} bytes"
        )
    return view[:n], view[n:]


def parse_json(header: memoryview) -> dict:
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"malformed JSON in the request: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError(f"the request must be a JSON object, got {type(doc).__name__}")
    return doc


def request_id(doc: dict) -> str | None:
    """The request's ``id``, echoed in the response: a string, as the protocol says."""
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError(f"'id' must be a string, got {type(rid).__name__}")
    return rid


def decode_inputs(doc: dict, binary: memoryview) -> dict[str, np.ndarray]:
    """The request's ``inputs`` as arrays; binary ones are views of ``binary``."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError("the request needs a non-empty 'inputs' list")
    out: dict[str, np.ndarray] = {}
    offset = 0
    for i, spec in enumerate(inputs):
        if not isinstance(spec, dict):
            raise ProtocolError(f"inputs[{i}] must be an object")
        name = spec.get("name")
        if not isinstance(name, str):
            raise ProtocolError(f"inputs[{i}] needs a string 'name'")
        if name in out:
            raise ProtocolError(f"input {name!r} is given twice")
        dtype = _dtype(name, spec.get("datatype"))
        shape = _shape(name, spec.get("shape"))
        count = math.prod(shape)
        params = spec.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is not None:
            if not isinstance(size, int) or size < 0:
                raise ProtocolError(f"input {name!r}: binary_data_size must be a non-negative int")
            if size != count * dtype.itemsize:
                raise ProtocolError(
                    f"input {name!r}: shape {shape} of {spec['datatype']} needs "
                    f"{count * dtype.itemsize} bytes, binary_data_size says {size}"
                )
            if offset + size > len(binary):
                raise ProtocolError(
                    f"input {name!r}: truncated binary data: needs bytes {offset}..{offset + size}"
                    f" after the JSON header, the body has {len(binary)}"
                )
            arr = np.frombuffer(binary, dtype=dtype, count=count, offset=offset)
            offset += size
            out[name] = arr.reshape(shape)
        else:
            if "data" not in spec:
                raise ProtocolError(f"input {name!r} has neither 'data' nor binary_data_size")
            out[name] = _from_json(name, spec["data"], dtype, shape, spec["datatype"])
    if offset != len(binary):
        raise ProtocolError(
            f"the body has {len(binary) - offset} bytes of binary data that no input claims"
        )
    return out


def _dtype(name: str, datatype: Any) -> np.dtype:
    try:
        return DATATYPES[datatype]
    except (KeyError, TypeError):
        raise ProtocolError(
            f"input {name!r}: unsupported datatype {datatype!r}; supported: {', '.join(DATATYPES)}"
        ) from None


def _shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ProtocolError(f"input {name!r}: 'shape' must be a list of non-negative ints")
    return tuple(shape)


def _from_json(name: str, data: Any, dtype: np.dtype, shape: tuple, datatype: str) -> np.ndarray:
    try:
        raw = np.asarray(data)
    except ValueError:
        raise ProtocolError(
            f"input {name!r}: 'data' is ragged; give a flat or a full nested list"
        ) from None
    if raw.dtype == object or raw.dtype.kind in "USV":
        raise ProtocolError(f"input {name!r}: 'data' must hold {datatype} numbers only")
    if raw.size != math.prod(shape):
        raise ProtocolError(
            f"input {name!r}: shape {list(shape)} needs {math.prod(shape)} values, "
            f"'data' has {raw.size}"
        )
    kind = dtype.kind
    if kind == "b":
        if raw.size and raw.dtype.kind != "b":
            raise ProtocolError(f"input {name!r}: BOOL data must be true/false")
    elif kind in "iu":
        try:
            # Python ints convert exactly or raise OverflowError; floats would truncate.
            exact = np.asarray(data, dtype=dtype)
        except OverflowError:
            raise ProtocolError(
                f"input {name!r}: a value is out of the range of {datatype}"
            ) from None
        # numpy infers float64 for floats, and for ints too big for int64 (uint64):
        # those convert back to the same float, a real fraction does not.
        if raw.size and (
            raw.dtype.kind not in "iuf"
            or (raw.dtype.kind == "f" and not np.array_equal(exact.astype(np.float64), raw))
        ):
            raise ProtocolError(f"input {name!r}: {datatype} data must be integers")
        return exact.reshape(shape)
    elif raw.size and raw.dtype.kind not in "iuf":
        raise ProtocolError(f"input {name!r}: {datatype} data must be numbers")
    return raw.astype(dtype).reshape(shape)


def requested_outputs(doc: dict, names: list[str]) -> list[tuple[str, bool]]:
    """(output name, as binary) for each output to return, in the request's order."""
    params = doc.get("parameters") or {}
    default_binary = (
        bool(params.get("binary_data_output", False)) if isinstance(params, dict) else False
    )
    wanted = doc.get("outputs")
    if wanted is None:
        return [(n, default_binary) for n in names]
    if not isinstance(wanted, list):
        raise ProtocolError("'outputs' must be a list")
    out = []
    for i, spec in enumerate(wanted):
        name = spec.get("name") if isinstance(spec, dict) else None
        if name not in names:
            raise ProtocolError(
                f"outputs[{i}]: unknown output {name!r}; the model has {', '.join(names)}"
            )
        p = spec.get("parameters") or {}
        out.append((name, bool(p.get("binary_data", default_binary))))
    return out


def encode_response(
    model: str,
    version: str,
    request_id: Any,
    outputs: Mapping[str, np.ndarray],
    selected: list[tuple[str, bool]],
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary data follows it."""
    entries = []
    blobs: list[Any] = []
    for name, binary in selected:
        arr = np.ascontiguousarray(outputs[name])
        entry: dict[str, Any] = {
            "name": name,
            "datatype": datatype_of(arr.dtype),
            "shape": list(arr.shape),
        }
        if binary:
            entry["parameters"] = {"binary_data_size": arr.nbytes}
            blobs.append(memoryview(arr.reshape(-1).view(np.uint8)))
        elif arr.dtype == DATATYPES["BF16"]:
            entry["data"] = arr.astype(np.float32).ravel()
        else:
            entry["data"] = arr.ravel()
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if request_id is not None:
        doc["id"] = request_id
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)
