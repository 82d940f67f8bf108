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

from pxrt._ext import twin

tensors = twin("serving._tensors", "serving._tensors_py")

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
    if not (header_length.isascii() and header_length.isdigit() and len(header_length) <= 19):
        raise ProtocolError(
            "Inference-Header-Content-Length must be a decimal byte count, got "
            f"{_short(header_length)}"
        )
    n = int(header_length)
    if not n <= len(view):
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


def protocol_dims(shape: tuple) -> list[int]:
    """A per-example shape as the protocol writes it: -1 for a named (variable)
    dimension."""
    return [-1 if isinstance(d, str) else d for d in shape]


def request_id(doc: dict) -> str | None:
    """The request's ``id``, echoed in the response: a string, as the protocol says."""
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError(f"'id' must be a string, got {type(rid).__name__}")
    return rid


def decode_inputs(
    doc: dict, binary: memoryview, specs: Mapping[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """The request's ``inputs`` as arrays; binary ones are views of ``binary``.

    Nothing is cast: JSON elements must be exactly of their datatype's JSON type and in
    its range. The work is bounded before it starts: with the model's input ``specs``,
    an input the model does not have is refused before any data is read, and every
    tensor's element count is bounded by the bytes that carry it.
    """
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError("the request needs a non-empty 'inputs' list")
    if specs is not None and len(inputs) > len(specs):
        raise ProtocolError(
            f"the request has {len(inputs)} inputs; the model takes {len(specs)}: {_names(specs)}"
        )
    out: dict[str, np.ndarray] = {}
    offset = 0
    for i, spec in enumerate(inputs):
        if not isinstance(spec, dict):
            raise ProtocolError(f"inputs[{i}] must be an object")
        name = spec.get("name")
        if not isinstance(name, str):
            raise ProtocolError(f"inputs[{i}] needs a string 'name'")
        if specs is not None and name not in specs:
            raise ProtocolError(f"unexpected input {_short(name)}; the model takes {_names(specs)}")
        if name in out:
            raise ProtocolError(f"input {name!r} is given twice")
        datatype = spec.get("datatype")
        dtype = _dtype(name, datatype)
        shape = _shape(name, spec.get("shape"))
        count = math.prod(shape)
        params = _parameters(spec, f"input {name!r}")
        size = params.get("binary_data_size")
        if size is not None:
            if "data" in spec:
                raise ProtocolError(
                    f"input {name!r} has both 'data' and binary_data_size; give one of them"
                )
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ProtocolError(f"input {name!r}: binary_data_size must be a non-negative int")
            if size != count * dtype.itemsize:
                raise ProtocolError(
                    f"input {name!r}: shape {list(shape)} of {datatype} needs "
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
            out[name] = _from_json(name, spec["data"], dtype, shape, datatype)
    if offset != len(binary):
        raise ProtocolError(
            f"the body has {len(binary) - offset} bytes of binary data that no input claims"
        )
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _names(specs: Mapping[str, Any], limit: int = 8) -> str:
    names = [repr(n) for n in specs]
    return ", ".join(names[:limit] + (["..."] if len(names) > limit else []))


def _parameters(obj: dict, where: str) -> dict:
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ProtocolError(f"{where}: 'parameters' must be an object, got {_short(params)}")
    return params


def _dtype(name: str, datatype: Any) -> np.dtype:
    try:
        return DATATYPES[datatype]
    except (KeyError, TypeError):
        raise ProtocolError(
            f"input {name!r}: unsupported datatype {_short(datatype)}; supported: "
            f"{', '.join(DATATYPES)}"
        ) from None


MAX_RANK = 32


def _shape(name: str, shape: Any) -> tuple[int, ...]:
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ProtocolError(
            f"input {name!r}: 'shape' must be a list of at most {MAX_RANK} non-negative ints, "
            f"got {_short(shape)}"
        )
    count = 1
    for d in shape:
        count *= d
        if count > MAX_ELEMENTS or d > MAX_ELEMENTS:  # before anything is allocated for it
            raise ProtocolError(
                f"input {name!r}: shape {_short(shape)} has more than {MAX_ELEMENTS} elements"
            )
    return tuple(shape)


# The most elements one tensor may have: every one is at least a byte of the body, and
# bodies are bounded far below this by the server's body limit.
MAX_ELEMENTS = 1 << 40


# JSON elements by datatype: how they are checked, and the range of the narrower types.
def _limits(dtype: np.dtype) -> tuple[int, tuple]:
    """How a datatype's JSON elements are checked: the kind, and the range they must be
    in (for floats, the magnitude from which they would round to infinity)."""
    if dtype.kind == "b":
        return tensors.BOOL, ()
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return (tensors.INT if dtype.kind == "i" else tensors.UINT), (int(info.min), int(info.max))
    if dtype == np.float64:
        return tensors.FLOAT, (0, 0, math.inf)  # JSON numbers are doubles already
    info = ml_dtypes.finfo(dtype)
    top = float(info.max)
    ulp = float(info.eps) * 2.0 ** math.floor(math.log2(top))  # the spacing at the top
    # From max + half an ulp on, a value rounds to infinity (ties to even, the bound too).
    return tensors.FLOAT, (0, 0, top + ulp / 2)


_LIMITS = {dtype: _limits(dtype) for dtype in DATATYPES.values()}


def _from_json(name: str, data: Any, dtype: np.dtype, shape: tuple, datatype: str) -> np.ndarray:
    kind, bounds = _LIMITS[dtype]
    try:
        raw = tensors.decode(data, shape, kind, *bounds)
    except tensors.TensorDataError as exc:
        raise ProtocolError(f"input {name!r}: {datatype} data: {exc}") from None
    if kind == tensors.BOOL:
        return raw.view(np.bool_).reshape(shape)
    return raw.astype(dtype).reshape(shape)  # in range: nothing overflows or wraps


def requested_outputs(doc: dict, names: list[str]) -> list[tuple[str, bool]]:
    """(output name, as binary) for each output to return, in the request's order."""
    default_binary = _flag(_parameters(doc, "the request"), "binary_data_output", "the request")
    wanted = doc.get("outputs")
    if wanted is None:
        return [(n, default_binary) for n in names]
    if not isinstance(wanted, list):
        raise ProtocolError(f"'outputs' must be a list, got {_short(wanted)}")
    if len(wanted) > len(names):
        raise ProtocolError(f"'outputs' asks for {len(wanted)} outputs; the model has {len(names)}")
    out = []
    for i, spec in enumerate(wanted):
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str) or name not in names:
            raise ProtocolError(
                f"outputs[{i}]: unknown output {_short(name)}; the model has {', '.join(names)}"
            )
        params = _parameters(spec, f"outputs[{i}]")
        out.append((name, _flag(params, "binary_data", f"outputs[{i}]", default_binary)))
    return out


def _flag(params: dict, key: str, where: str, default: bool = False) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise ProtocolError(f"{where}: parameters.{key} must be true or false, got {_short(value)}")
    return value


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


# --------------------------------------------------------------------------- documents
# What the metadata, config and statistics endpoints answer, as plain dicts: the HTTP
# app sends them as JSON, the gRPC service as the protocol's messages.


def server_metadata() -> dict:
    import pxrt

    return {
        "name": "pxrt",
        "version": pxrt.__version__,
        "extensions": ["binary_tensor_data", "model_configuration", "statistics"],
    }


def model_metadata(name: str, model: Any, versions: list[str] | None = None) -> dict:
    def tensors(specs: dict) -> list[dict]:
        return [
            {"name": k, "datatype": datatype_of(s.dtype), "shape": [-1, *protocol_dims(s.shape)]}
            for k, s in specs.items()
        ]

    return {
        "name": name,
        "versions": versions or [model.version],
        "platform": "pxrt_jax",
        "inputs": tensors(model.inputs),
        "outputs": tensors(model.outputs),
    }


def model_config(name: str, model: Any, batcher: Any) -> dict:
    """The model's configuration in Triton's shape (what Triton's tools read)."""

    def tensors(specs: dict) -> list[dict]:
        return [
            {
                "name": k,
                "data_type": "TYPE_" + datatype_of(s.dtype),
                "dims": protocol_dims(s.shape),
            }
            for k, s in specs.items()
        ]

    return {
        "name": name,
        "platform": "pxrt_jax",
        "backend": "pxrt",
        "version_policy": {"specific": {"versions": [model.version]}},
        "max_batch_size": batcher.max_batch_size,
        "input": tensors(model.inputs),
        "output": tensors(model.outputs),
        # pxrt's own: the lengths each named (-1) dimension is compiled at.
        "parameters": {
            f"dim_buckets.{d}": {"string_value": ",".join(map(str, v))}
            for d, v in model.dim_buckets.items()
        },
        "dynamic_batching": {
            "preferred_batch_size": [b for b in model.buckets if b <= batcher.max_batch_size],
            "max_queue_delay_microseconds": int(batcher.max_delay * 1e6),
            "default_queue_policy": {"max_queue_size": batcher.max_queue},
        },
        "instance_group": [
            {
                "count": 1,
                "kind": "KIND_CPU" if model.devices[0].platform == "cpu" else "KIND_GPU",
            }
        ],
    }


def model_stats(name: str, model: Any, snap: dict) -> dict:
    """One model's statistics, in Triton's shape, from its metrics snapshot."""

    def duration(key: str) -> dict:
        h = snap[key]
        return {"count": h["count"], "ns": int(h["mean"] * h["count"] * 1e3)}

    req = snap["requests"]
    fail_count = sum(req[k] for k in ("invalid", "rejected", "expired", "failed"))
    return {
        "name": name,
        "version": model.version,
        "inference_count": int(snap["batch_rows"]["mean"] * snap["batch_rows"]["count"]),
        "execution_count": snap["batches"],
        "inference_stats": {
            "success": duration("request_us"),
            "fail": {"count": fail_count, "ns": 0},
            "queue": duration("queue_us"),
            "compute_input": duration("compute_input_us"),
            "compute_infer": duration("compute_infer_us"),
            "compute_output": duration("compute_output_us"),
        },
        "batch_stats": [],
    }
