"""Generation over gRPC: ``ModelStreamInfer`` in Triton's decoupled mode, for both gRPC
servers (pxrt's HTTP/2 and grpcio's).

A request to a decoder is a ``ModelInferRequest`` whose inputs are ``text_input``
(BYTES, through the artifact's tokenizer) or ``input_ids`` (INT32/INT64); the options
(``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``,
``stop_ids``) come as inputs of those names or as request parameters. It gets many
responses: one per token (``output_ids``, and ``text_output`` with a tokenizer), each
with the parameter ``triton_final_response`` false, then an empty one with it true and
the finish reason and token counts as parameters, as Triton sends with
``enable_empty_final_response``. A request that fails before its first token gets one
response: its ``error_message``.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from . import core, generation

if TYPE_CHECKING:
    from .server import Server

_LEN = struct.Struct("<I")
FINAL = "triton_final_response"
_DTYPES = {
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT32": np.uint32,
    "FP32": np.float32,
    "FP64": np.float64,
}
_CONTENTS = {
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT32": "uint_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
    "BOOL": "bool_contents",
}


def _bytes_elements(raw: bytes) -> list[bytes]:
    out, at = [], 0
    while at + 4 <= len(raw):
        (n,) = _LEN.unpack_from(raw, at)
        out.append(raw[at + 4 : at + 4 + n])
        at += 4 + n
    if at != len(raw):
        raise generation.invalid("a BYTES input's raw contents are not length-prefixed elements")
    return out


def _values(message: Any, index: int) -> list:
    tensor = message.inputs[index]
    datatype = tensor.datatype
    if index < len(message.raw_input_contents):
        raw = message.raw_input_contents[index]
        if datatype == "BYTES":
            return _bytes_elements(raw)
        if datatype not in _DTYPES:
            raise generation.invalid(f"input {tensor.name!r}: unsupported datatype {datatype}")
        return np.frombuffer(raw, _DTYPES[datatype]).tolist()
    field = _CONTENTS.get(datatype)
    if field is None:
        raise generation.invalid(f"input {tensor.name!r}: unsupported datatype {datatype}")
    return list(getattr(tensor.contents, field))


def _param(value: Any) -> Any:
    kind = value.WhichOneof("parameter_choice")
    return None if kind is None else getattr(value, kind)


def parse(decoder: Any, message: Any) -> generation.Prompt:
    """A decoupled request's prompt and options, as the HTTP generate extension's."""
    fields: dict[str, Any] = {}
    for i, tensor in enumerate(message.inputs):
        values = _values(message, i)
        if tensor.name in ("text_input", "stop"):
            texts = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in values]
            fields[tensor.name] = texts[0] if tensor.name == "text_input" and texts else texts
        elif tensor.name in ("input_ids", "stop_ids"):
            fields[tensor.name] = [int(v) for v in values]
        elif values:
            fields[tensor.name] = values[0]
    for key, value in message.parameters.items():
        fields.setdefault(key, _param(value))
    return generation.parse_kserve(decoder, fields)


def _response(name: str, version: str, ident: str, piece: Any, text: bool) -> Any:
    ids = np.asarray(piece.ids, np.int32)
    outputs = [
        pb.ModelInferResponse.InferOutputTensor(
            name="output_ids", datatype="INT32", shape=[len(ids)]
        )
    ]
    raw = [ids.tobytes()]
    if text:
        data = piece.text.encode()
        outputs.append(
            pb.ModelInferResponse.InferOutputTensor(name="text_output", datatype="BYTES", shape=[1])
        )
        raw.append(_LEN.pack(len(data)) + data)
    response = pb.ModelInferResponse(
        model_name=name, model_version=version, id=ident, outputs=outputs, raw_output_contents=raw
    )
    response.parameters[FINAL].bool_param = False
    return pb.ModelStreamInferResponse(infer_response=response)


def _final(name: str, version: str, ident: str, gen: Any) -> Any:
    response = pb.ModelInferResponse(model_name=name, model_version=version, id=ident)
    response.parameters[FINAL].bool_param = True
    response.parameters["finish_reason"].string_param = gen.finish_reason or ""
    for key, value in generation.usage(gen).items():
        response.parameters[key].int64_param = value
    return pb.ModelStreamInferResponse(infer_response=response)


async def responses(server: Server, message: Any) -> AsyncIterator[Any]:
    """The responses of one decoupled request (``ModelStreamInferResponse``s). A bad
    request raises before the first (the caller answers it with its error)."""
    name = message.model_name
    decoder = core.resolve_decoder(server, name, message.model_version)
    prompt = parse(decoder, message)
    gen = await generation.start(server, name, prompt)
    async for piece in generation.pieces(decoder, gen, prompt):
        yield _response(name, decoder.version, message.id, piece, prompt.text)
    generation.raise_error(gen)
    yield _final(name, decoder.version, message.id, gen)
