"""Generation over gRPC: ``ModelStreamInfer`` in Triton's decoupled mode, for both gRPC
servers (pxrt's HTTP/2 and grpcio's).

A request to a decoder is a ``ModelInferRequest`` whose inputs are ``text_input``
(BYTES, through the artifact's tokenizer) or ``input_ids`` (an integer datatype); the
options (``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``,
``stop_ids``, Triton's ``priority``...) and a structured output's (vLLM's ``guided_*``
fields and ``structured_outputs``, as text) come as inputs of those names or as request
parameters, never both; any other input or parameter is refused by name. It gets many
responses: one per token (``output_ids``, and ``text_output`` with a tokenizer), each
with the parameter ``triton_final_response`` false, then an empty one with it true and
the finish reason and token counts as parameters, as Triton sends with
``enable_empty_final_response``. A request that fails before its first token gets one
response: its ``error_message``.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from . import codec, core, generation

if TYPE_CHECKING:
    from ..options import GenerationLimits
    from .backend import Backend

_LEN = struct.Struct("<I")
FINAL = "triton_final_response"
ASK_FINAL = "triton_enable_empty_final_response"  # (tritonclient's, asking for FINAL)
# The protocol's tables (codec's), and BYTES: prompts and stop strings come as text.
_CONTENTS = {**codec.CONTENTS, "BYTES": "bytes_contents"}


def _bytes_elements(raw: bytes, count: int) -> list[bytes]:
    out: list[bytes] = []
    at = 0
    while at + 4 <= len(raw) and len(out) < count:
        (n,) = _LEN.unpack_from(raw, at)
        out.append(raw[at + 4 : at + 4 + n])
        at += 4 + n
    if at != len(raw) or len(out) != count:
        raise generation.invalid(
            f"a BYTES input's raw contents are not {count} length-prefixed elements"
        )
    return out


def _values(message: Any, index: int) -> list:
    """The elements of input ``index``: exactly as many as its shape says."""
    tensor = message.inputs[index]
    datatype = tensor.datatype
    count = math.prod(tensor.shape)
    if index < len(message.raw_input_contents):
        raw = message.raw_input_contents[index]
        if datatype == "BYTES":
            return _bytes_elements(raw, count)
        dtype = codec.DATATYPES.get(datatype)
        if dtype is None or dtype.kind not in "iuf":
            raise generation.invalid(f"input {tensor.name!r}: unsupported datatype {datatype}")
        values = np.frombuffer(raw, dtype) if len(raw) % dtype.itemsize == 0 else None
        if values is None or len(values) != count:
            raise generation.invalid(
                f"input {tensor.name!r}: {len(raw)} bytes of raw contents for shape "
                f"{list(tensor.shape)} of {datatype}"
            )
        return values.tolist()
    field = _CONTENTS.get(datatype)
    if field is None:
        raise generation.invalid(f"input {tensor.name!r}: unsupported datatype {datatype}")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise generation.invalid(
            f"input {tensor.name!r}: {len(values)} elements for shape {list(tensor.shape)}"
        )
    return list(values)


def _param(value: Any) -> Any:
    kind = value.WhichOneof("parameter_choice")
    return None if kind is None else getattr(value, kind)


# The inputs a decoupled request may give: lists of elements, and one-element options.
# A structured output's: JSON text (``guided_json``, ``structured_outputs``: a schema,
# an object of ``pxrt.StructuredOutput``'s fields), a regex or grammar's text, and the
# choices (a BYTES input of one element each, or a parameter of JSON text: a list).
_JSON_TEXT = ("guided_json", "structured_outputs")
_TEXTS = ("text_input", "stop", "guided_regex", "guided_grammar", "guided_choice", *_JSON_TEXT)
_LISTS = ("input_ids", "stop", "stop_ids", "guided_choice")
_ONE = (
    "text_input", "timeout", *(o for o in generation.OPTIONS if o not in _LISTS),
    *(o for o in generation.STRUCTURED if o not in _LISTS),
)  # fmt: skip
_KNOWN = (*_LISTS[:3], *_ONE, *_LISTS[3:])  # as inputs or parameters; any other is refused
# Token ids come as integers: another datatype's values are never cast (72.5 is no id).
_IDS = ("input_ids", "stop_ids")
_INTEGERS = ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")


def parse(decoder: Any, message: Any, limits: GenerationLimits) -> generation.Prompt:
    """A decoupled request's prompt and options, as the HTTP generate extension's: an
    input it does not know, one given twice, or one whose elements are not as many as
    its shape says (one for an option) is refused; stop strings and ids are counted
    against ``limits`` before they are read."""
    fields: dict[str, Any] = {}
    most = {"stop": limits.max_stop_strings, "stop_ids": limits.max_stop_ids}
    for i, tensor in enumerate(message.inputs):
        name = tensor.name
        generation.check_known((name,), _KNOWN, "input")
        if name in fields:
            raise generation.invalid(f"input {name!r} is given twice")
        count = math.prod(tensor.shape)
        if name in _ONE and count != 1:
            raise generation.invalid(
                f"input {name!r} takes one element, got shape {list(tensor.shape)}"
            )
        if name in most and count > most[name]:
            generation.check_limit(name, count, most[name])
        if name in _IDS and tensor.datatype not in _INTEGERS:
            raise generation.invalid(
                f"input {name!r} takes token ids, an integer datatype ({', '.join(_INTEGERS)}), "
                f"got {tensor.datatype:.20}"
            )
        if name in _TEXTS and name not in ("text_input", "stop") and tensor.datatype != "BYTES":
            raise generation.invalid(
                f"input {name!r} takes text (BYTES), got {tensor.datatype:.20}"
            )
        values = _values(message, i)
        if name in _TEXTS:
            texts = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in values]
            fields[name] = texts if name in _LISTS else texts[0]
        elif name in _IDS:
            fields[name] = values  # (integers: the datatype is one)
        else:
            fields[name] = values[0]
    for key, value in message.parameters.items():
        if key in ("logprobs", "logit_bias"):
            raise generation.invalid(
                f"{key} is not given over gRPC (its responses carry the tokens and their "
                "text): ask over HTTP (the generate extension or /v1)"
            )
        if key == ASK_FINAL:
            continue  # (the empty final response is always sent)
        generation.check_known((key,), _KNOWN, "parameter")
        if key in fields:
            raise generation.invalid(f"{key!r} is given as an input and as a parameter")
        fields[key] = _param(value)
        if key == "guided_choice":  # (a list, in a parameter's one string)
            fields[key] = _json_text(key, fields[key], list)
    for key in _JSON_TEXT:
        if key in fields:
            fields[key] = _json_text(key, fields[key], dict)
    return generation.parse_kserve(decoder, fields, limits)


def _json_text(name: str, value: Any, kind: type) -> Any:
    """``value``, JSON text of a ``kind`` (an object, a list), read: a 400 naming
    ``name`` when it is not."""
    try:
        got = json.loads(value) if isinstance(value, str) else None
    except ValueError as exc:
        raise generation.invalid(f"{name} is not JSON text: {exc}") from None
    if not isinstance(got, kind):
        want = "an object" if kind is dict else "a list"
        raise generation.invalid(f"{name} takes JSON text of {want}, got {value!r:.80}")
    return got


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


async def responses(server: Backend, message: Any, headers: Any = ()) -> AsyncIterator[Any]:
    """The responses of one decoupled request (``ModelStreamInferResponse``s). A bad
    request raises before the first (the caller answers it with its error). ``headers``:
    the call's metadata pairs, read only if it is traced."""
    name = message.model_name
    decoder = core.resolve_decoder(server, name, message.model_version)
    prompt = parse(decoder, message, server.generation_limits)
    gen = await generation.start(server, name, prompt, headers)
    async for piece in generation.pieces(decoder, gen, prompt):
        yield _response(name, decoder.version, message.id, piece, prompt.text)
    generation.raise_error(gen)
    yield _final(name, decoder.version, message.id, gen)
