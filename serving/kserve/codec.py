"""KServe v2 / Open Inference Protocol tensors: decoding requests, encoding responses.

HTTP: binary tensors (the binary tensor data extension) decode with ``np.frombuffer`` on
the request body and encode as the output arrays' own memory: no per-element Python
work; JSON ``data`` is accepted flat or nested. gRPC: ``raw_input_contents`` decode as
views of the message's bytes, typed ``contents`` are checked against their datatype's
range. Nothing is cast silently: a JSON float for an integer tensor, or an integer out
of its type's range, is an error (``ProtocolError``, naming the input).

What a request asks beyond its tensors (its id, outputs, timeout) is read here too; the
request core (``serving.kserve.core``) puts it together.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
import orjson

from pxrt._ext import twin

if TYPE_CHECKING:
    from .shm import Regions

tensors = twin("serving.kserve._tensors", "serving.kserve._tensors_py")

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


def parse_json(header: memoryview | bytes) -> dict:
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
    doc: dict,
    binary: memoryview,
    specs: Mapping[str, Any] | None = None,
    regions: Regions | None = None,
) -> dict[str, np.ndarray]:
    """The request's ``inputs`` as arrays; binary ones are views of ``binary``, those in
    shared memory views of their region (of ``regions``: ``serving.kserve.shm``).

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
        dtype = tensor_dtype(name, datatype)
        shape = tensor_shape(name, spec.get("shape"))
        count = math.prod(shape)
        params = _parameters(spec, f"input {name!r}")
        size = params.get("binary_data_size")
        if "shared_memory_region" in params:
            if "data" in spec or size is not None:
                raise ProtocolError(
                    f"input {name!r} names a shared memory region and also has data; give one"
                )
            out[name] = _shared(regions).tensor(params, dtype, shape, f"input {name!r}")
        elif size is not None:
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


@dataclasses.dataclass(frozen=True, slots=True)
class BinaryPlan:
    """What a request header whose every tensor comes as binary data decoded to, for a
    model: the same header with a binary tail of ``size`` bytes decodes to the same
    arrays (``views``, of the new tail), outputs, id and deadline, with nothing to check
    again (the header's checks passed; the values are the model's to validate)."""

    inputs: tuple[tuple[str, np.dtype, int, int, tuple[int, ...]], ...]  # name, dtype,
    # count, offset, shape
    size: int
    outputs: list[tuple[str, bool]]
    id: str | None
    timeout_s: float | None
    priority: int

    @classmethod
    def of(
        cls,
        doc: dict,
        inputs: Mapping[str, np.ndarray],
        outputs: list[tuple[str, bool]],
        rid: str | None,
        timeout_s: float | None,
        priority: int,
    ) -> BinaryPlan | None:
        """The plan of a decoded request (``decode_inputs`` laid the binary inputs out
        in order, end to end), or None when any tensor came otherwise (as JSON data, in
        shared memory) or an output goes to shared memory."""
        if not all(
            "binary_data_size" in (spec.get("parameters") or ())
            and "data" not in spec
            and "shared_memory_region" not in spec["parameters"]
            for spec in doc["inputs"]
        ) or not inline(outputs):
            return None
        entries = []
        offset = 0
        for name, arr in inputs.items():
            entries.append((name, arr.dtype, arr.size, offset, arr.shape))
            offset += arr.nbytes
        return cls(tuple(entries), offset, outputs, rid, timeout_s, priority)

    def views(self, binary: memoryview) -> dict[str, np.ndarray]:
        return _views(binary, self.inputs)


def _views(data: Any, inputs: tuple) -> dict[str, np.ndarray]:
    """A plan's arrays: ``(name, dtype, count, offset, shape)`` each, views of ``data``."""
    return {
        name: np.frombuffer(data, dtype, count, offset).reshape(shape)
        for name, dtype, count, offset, shape in inputs
    }


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


def tensor_dtype(name: str, datatype: Any) -> np.dtype:
    """The dtype of input ``name``'s protocol ``datatype``."""
    try:
        return DATATYPES[datatype]
    except (KeyError, TypeError):
        raise ProtocolError(
            f"input {name!r}: unsupported datatype {_short(datatype)}; supported: "
            f"{', '.join(DATATYPES)}"
        ) from None


MAX_RANK = 32


def tensor_shape(name: str, shape: Any) -> tuple[int, ...]:
    """Input ``name``'s ``shape``, checked: a list of non-negative ints, bounded."""
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
        ints = np.iinfo(dtype)
        return (tensors.INT if dtype.kind == "i" else tensors.UINT), (int(ints.min), int(ints.max))
    if dtype == np.float64:
        return tensors.FLOAT, (0, 0, math.inf)  # JSON numbers are doubles already
    info = ml_dtypes.finfo(dtype)
    top = float(info.max)
    ulp = float(info.eps) * 2.0 ** math.floor(math.log2(top))  # the spacing at the top
    # From max + half an ulp on, a value rounds to infinity (ties to even, the bound too).
    return tensors.FLOAT, (0, 0, top + ulp / 2)


_LIMITS = {dtype: _limits(dtype) for dtype in DATATYPES.values()}


def _from_json(name: str, data: Any, dtype: np.dtype, shape: tuple, datatype: Any) -> np.ndarray:
    kind, bounds = _LIMITS[dtype]
    try:
        raw = tensors.decode(data, shape, kind, *bounds)
    except tensors.TensorDataError as exc:
        raise ProtocolError(f"input {name!r}: {datatype} data: {exc}") from None
    if kind == tensors.BOOL:
        return raw.view(np.bool_).reshape(shape)
    return raw.astype(dtype).reshape(shape)  # in range: nothing overflows or wraps


def requested_outputs(
    doc: dict, names: list[str], regions: Regions | None = None
) -> list[tuple[str, Any]]:
    """(output name, as binary) for each output to return, in the request's order; an
    output asked for in shared memory has where it goes instead (``shm.Placed``)."""
    default_binary = _flag(_parameters(doc, "the request"), "binary_data_output", "the request")
    wanted = doc.get("outputs")
    if wanted is None:
        return [(n, default_binary) for n in names]
    if not isinstance(wanted, list):
        raise ProtocolError(f"'outputs' must be a list, got {_short(wanted)}")
    if len(wanted) > len(names):
        raise ProtocolError(f"'outputs' asks for {len(wanted)} outputs; the model has {len(names)}")
    out: list[tuple[str, Any]] = []
    for i, spec in enumerate(wanted):
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str) or name not in names:
            raise ProtocolError(
                f"outputs[{i}]: unknown output {_short(name)}; the model has {', '.join(names)}"
            )
        params = _parameters(spec, f"outputs[{i}]")
        if "shared_memory_region" in params:
            out.append((name, _shared(regions).placed(params, f"output {name!r}")))
            continue
        out.append((name, _flag(params, "binary_data", f"outputs[{i}]", default_binary)))
    return out


def inline(outputs: list[tuple[str, Any]]) -> bool:
    """Whether every output is answered in the reply (none goes to shared memory)."""
    for _, where in outputs:  # (a loop: all() over a generator costs ~0.3 us an answer)
        if where.__class__ is not bool:
            return False
    return True


def _shared(regions: Regions | None) -> Regions:
    if regions is None:
        raise ProtocolError("this endpoint does not serve system shared memory")
    return regions


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
    header, blobs = response_parts(model, version, request_id, outputs, selected)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def response_parts(
    model: str,
    version: str,
    request_id: Any,
    outputs: Mapping[str, np.ndarray],
    selected: list[tuple[str, bool]],
) -> tuple[bytes, list[memoryview]]:
    """The response's JSON header and the binary data that follows it (views of the
    outputs, in order): a body written as a list of buffers, never joined."""
    entries = []
    blobs: list[Any] = []
    for name, binary in selected:
        arr = np.ascontiguousarray(outputs[name])
        entry: dict[str, Any] = {
            "name": name,
            "datatype": datatype_of(arr.dtype),
            "shape": list(arr.shape),
        }
        if binary.__class__ is not bool:  # written to shared memory: no data here
            binary.write(name, arr)
        elif binary:
            entry["parameters"] = {"binary_data_size": arr.nbytes}
            blobs.append(memoryview(arr.reshape(-1).view(np.uint8).data))
        elif arr.dtype == DATATYPES["BF16"]:
            entry["data"] = arr.astype(np.float32).ravel()
        else:
            entry["data"] = arr.ravel()
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if request_id is not None:
        doc["id"] = request_id
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), blobs


def timeout_s(value: Any, field: str = "parameters.timeout") -> float | None:
    """A request's deadline in seconds from ``value``, its ``timeout`` in microseconds
    (Triton's; None: none), on every protocol: anything but a positive number is a
    ``ProtocolError`` naming ``field``."""
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ProtocolError(f"{field} must be a positive number of microseconds, got {value!r:.40}")
    return value * 1e-6


def timeout_of(doc: dict) -> float | None:
    """A JSON request's deadline: ``parameters.timeout`` in microseconds (None: none)."""
    params = doc.get("parameters")
    return timeout_s(params.get("timeout")) if isinstance(params, dict) else None


# The largest priority a queue takes (its levels are C ``Py_ssize_t``s): beyond it the
# queue's call would fail converting it (OverflowError, a 500), not refuse it as no level.
MAX_PRIORITY = 2**63 - 1


def priority(value: Any) -> int:
    """A request's priority level (Triton's ``priority`` parameter: 1 the highest, up to
    the model's levels; 0 or none: its default), on every protocol; whether the model has
    that level is its queue's check."""
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_PRIORITY:
        raise ProtocolError(
            f"parameters.priority must be an integer from 0 to {MAX_PRIORITY} (1 the "
            f"highest level, 0 the model's default), got {value!r:.40}"
        )
    return value


def priority_of(doc: dict) -> int:
    """A JSON request's ``parameters.priority`` (0: none)."""
    params = doc.get("parameters")
    return priority(params.get("priority")) if isinstance(params, dict) else 0


# --------------------------------------------------------------------------- gRPC
# ModelInferRequest messages are read by their fields only: this module does not import
# the protobuf classes (they come with the grpc extra).

# Typed contents: the field each datatype's elements travel in. FP16 and BF16 have none
# (the protocol sends them as raw bytes only).
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def decode_proto_inputs(
    message: Any, specs: Mapping[str, Any], regions: Regions | None = None
) -> dict[str, np.ndarray]:
    """A ModelInferRequest's inputs as arrays (raw ones are views of the message's
    bytes, those in shared memory views of their region). Nothing is cast: typed
    contents must fit their datatype's range exactly."""
    raw = message.raw_input_contents
    if not message.inputs:
        raise ProtocolError("the request has no inputs")
    if len(message.inputs) > len(specs):
        raise ProtocolError(
            f"the request has {len(message.inputs)} inputs; the model takes {len(specs)}"
        )
    shared = [i for i, t in enumerate(message.inputs) if SHM_REGION in t.parameters]
    carried = len(message.inputs) - len(shared)  # inputs whose data the message has
    if raw and len(raw) != carried:
        raise ProtocolError(
            f"{len(raw)} raw_input_contents for {carried} inputs: give every input's data "
            "raw (but those in shared memory), or every input's as contents"
        )
    out: dict[str, np.ndarray] = {}
    index = 0  # of the next raw contents
    for tensor in message.inputs:
        name = tensor.name
        if name not in specs:
            raise ProtocolError(
                f"unexpected input {name[:60]!r}; the model takes {', '.join(map(repr, specs))}"
            )
        if name in out:
            raise ProtocolError(f"input {name!r} is given twice")
        dtype = tensor_dtype(name, tensor.datatype)
        shape = tensor_shape(name, list(tensor.shape))
        count = math.prod(shape)
        if SHM_REGION in tensor.parameters:
            if tensor.HasField("contents"):
                raise ProtocolError(
                    f"input {name!r} names a shared memory region and also has contents; give one"
                )
            where = f"input {name!r}"
            params = proto_parameters(tensor.parameters)
            out[name] = _shared(regions).tensor(params, dtype, shape, where)
            continue
        if raw:
            if tensor.HasField("contents"):
                raise ProtocolError(
                    f"input {name!r} has both contents and raw_input_contents; give one"
                )
            data = raw[index]
            index += 1
            if len(data) != count * dtype.itemsize:
                raise ProtocolError(
                    f"input {name!r}: shape {list(shape)} of {tensor.datatype} needs "
                    f"{count * dtype.itemsize} bytes, raw_input_contents has {len(data)}"
                )
            out[name] = np.frombuffer(data, dtype).reshape(shape)
            continue
        field = CONTENTS.get(tensor.datatype)
        if field is None:
            raise ProtocolError(
                f"input {name!r}: {tensor.datatype} has no typed contents; send it as "
                "raw_input_contents"
            )
        values = getattr(tensor.contents, field)
        if len(values) != count:
            raise ProtocolError(
                f"input {name!r}: shape {list(shape)} needs {count} elements, contents.{field} "
                f"has {len(values)}"
            )
        wide = np.array(values, dtype=np.float64 if dtype.kind == "f" else None)
        if dtype.kind in "iu" and count:
            info = np.iinfo(dtype)
            if wide.min() < info.min or wide.max() > info.max:
                raise ProtocolError(f"input {name!r}: contents out of range for {tensor.datatype}")
        out[name] = wide.astype(dtype).reshape(shape)
    return out


def requested_proto_outputs(
    message: Any, names: list[str], regions: Regions | None = None
) -> list[tuple[str, Any]]:
    """(output name, as raw bytes: always) for each output a ModelInferRequest asks for
    (all of them when it names none), in its order; one asked for in shared memory has
    where it goes instead (``shm.Placed``)."""
    if not message.outputs:
        return [(name, True) for name in names]
    out: list[tuple[str, Any]] = []
    for wanted in message.outputs:
        name = wanted.name
        if name not in names:
            raise ProtocolError(f"unknown output {name[:60]!r}; the model has {', '.join(names)}")
        if SHM_REGION in wanted.parameters:
            params = proto_parameters(wanted.parameters)
            out.append((name, _shared(regions).placed(params, f"output {name!r}")))
        else:
            out.append((name, True))
    return out


SHM_REGION = "shared_memory_region"


def proto_parameters(params: Any) -> dict[str, Any]:
    """A protobuf ``map<string, InferParameter>`` as a dict of plain values."""
    out = {}
    for key, value in params.items():
        kind = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, kind) if kind else None
    return out


RAW_INPUT_TAG = 0x3A  # ModelInferRequest.raw_input_contents: field 7, length-delimited


def _varint(data: Any, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("a truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def raw_layout(data: Any) -> tuple[int, list[tuple[int, int]]] | None:
    """Where a serialized ModelInferRequest's raw input contents lie: the length of
    everything before them (the request's description) and each one's (offset, size);
    None unless they all come last, as protobuf's serializers write fields (in number
    order: raw_input_contents is the last field)."""
    pos, end = 0, len(data)
    try:
        while pos < end:
            start = pos
            tag, pos = _varint(data, pos)
            if tag == RAW_INPUT_TAG:
                pos = start
                break
            wire = tag & 7
            if wire == 2:
                length, pos = _varint(data, pos)
                pos += length
            elif wire == 0:
                _, pos = _varint(data, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                return None
        prefix = pos
        raws = []
        while pos < end:
            tag, pos = _varint(data, pos)
            if tag != RAW_INPUT_TAG:
                return None
            length, pos = _varint(data, pos)
            raws.append((pos, length))
            pos += length
    except ValueError:
        return None
    return (prefix, raws) if pos == end and raws else None


def proto_model(data: Any) -> tuple[str, str] | None:
    """A serialized ModelInferRequest's model name and version read off its first fields
    (where serializers put them), or None when they are not there."""
    try:
        if not data or data[0] != 0x0A:  # model_name: field 1, length-delimited
            return None
        length, pos = _varint(data, 1)
        if pos + length > len(data):
            return None
        name = str(data[pos : pos + length], "utf-8")
        pos += length
        version = ""
        if pos < len(data) and data[pos] == 0x12:  # model_version: field 2
            length, pos = _varint(data, pos + 1)
            if pos + length > len(data):
                return None
            version = str(data[pos : pos + length], "utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    return name, version


@dataclasses.dataclass(frozen=True, slots=True)
class ProtoPlan:
    """What a ModelInferRequest whose inputs all come as raw contents decoded to, for a
    model, keyed by its bytes' layout: a message of the same ``size`` whose bytes are
    the same except inside the raw contents (the same description, the same contents'
    tags and lengths at the same places) decodes to the same arrays (``views`` of the
    new message's bytes), outputs, id and deadline, with nothing to parse or check
    again. Protobuf's serializers write the raw contents last, so the description is
    one prefix of the message."""

    prefix: bytes  # the message up to its first raw contents
    heads: tuple[tuple[int, bytes], ...]  # each raw contents' (offset, tag and length)
    inputs: tuple[tuple[str, np.dtype, int, int, tuple[int, ...]], ...]  # name, dtype,
    # count, offset, shape
    size: int
    outputs: list[tuple[str, bool]]
    id: str | None
    timeout_s: float | None
    priority: int

    @classmethod
    def of(
        cls,
        data: Any,
        inputs: Mapping[str, np.ndarray],
        outputs: list[tuple[str, bool]],
        rid: str | None,
        timeout_s: float | None,
        priority: int,
    ) -> ProtoPlan | None:
        """The plan of a decoded message (``inputs`` in the message's order, each a view
        of its raw contents), or None when its inputs are not all raw and last."""
        layout = raw_layout(data)
        if layout is None or len(layout[1]) != len(inputs):
            return None
        prefix, raws = layout
        heads, entries = [], []
        for (name, arr), (offset, length) in zip(inputs.items(), raws):
            if arr.nbytes != length:
                return None
            head = bytes([RAW_INPUT_TAG]) + encode_varint(length)
            if data[offset - len(head) : offset] != head:
                return None  # (a length written in more bytes than it needs)
            heads.append((offset - len(head), head))
            entries.append((name, arr.dtype, arr.size, offset, arr.shape))
        return cls(
            bytes(data[:prefix]), tuple(heads), tuple(entries), len(data), outputs, rid,
            timeout_s, priority,
        )  # fmt: skip

    def matches(self, data: Any) -> bool:
        """Whether ``data`` (of ``size`` bytes) has this plan's layout."""
        if data[: len(self.prefix)] != self.prefix:
            return False
        for offset, head in self.heads:
            if data[offset : offset + len(head)] != head:
                return False
        return True

    def views(self, data: Any) -> dict[str, np.ndarray]:
        return _views(data, self.inputs)


def encode_varint(n: int) -> bytes:
    """``n`` as a protobuf varint."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def proto_priority(message: Any) -> int:
    """A ModelInferRequest's ``priority`` parameter (0: none)."""
    if "priority" not in message.parameters:
        return 0
    param = message.parameters["priority"]
    kind = param.WhichOneof("parameter_choice")
    return priority(getattr(param, kind) if kind is not None else "no value")


def proto_timeout(message: Any) -> float | None:
    """A ModelInferRequest's ``timeout`` parameter (microseconds, as Triton's), in
    seconds; None when it has none."""
    if "timeout" not in message.parameters:
        return None
    param = message.parameters["timeout"]
    return timeout_s(param.int64_param if param.WhichOneof("parameter_choice") else 0)
