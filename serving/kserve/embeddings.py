"""``POST /v1/embeddings``: OpenAI's embeddings API over a one-shot model exported as an
embedding model (``pxrt.export(..., tokenizer=..., embedding={"tokens", "mask",
"output"})``), as Hugging Face's text-embeddings-inference serves one.

``input``: a string, a list of strings, a list of token ids, or a list of those lists.
Each becomes one request row (its token ids, and a mask of ones) batched with every
other by the model's batcher, at the smallest sequence length compiled that holds it;
the answer is OpenAI's list of ``embedding`` objects in the inputs' order
(``encoding_format`` ``float``, or ``base64``: the little-endian float32 bytes),
``usage`` counting the tokens. A bad input is a 400 naming it; the others batched with
it are not touched.
"""

from __future__ import annotations

import asyncio
import base64
import functools
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .generation import _body, invalid, openai_error

_FIELDS = ("model", "input", "encoding_format", "user", "dimensions")


@functools.lru_cache(maxsize=64)
def _tokenizer(config: str, path: str) -> Any:
    import json

    from pxrt import tokenizer

    return tokenizer.load(json.loads(config), path)


def _model(server: Any, name: Any) -> tuple[Any, dict, Any]:
    """The embedding model ``name`` (its newest version), its manifest's ``embedding``
    entry and its tokenizer; a 404 for an unknown model, a 400 for one that is not an
    embedding model."""
    import json

    if not isinstance(name, str):
        raise invalid("model must be the name of an embedding model served")
    model = server.model(name)
    manifest = getattr(getattr(model, "artifact", None), "manifest", {})
    spec = manifest.get("embedding")
    if spec is None:
        raise invalid(
            f"model {name!r} is not an embedding model (export it with pxrt.export(..., "
            "tokenizer=..., embedding=...))"
        )
    config = json.dumps(manifest["tokenizer"], sort_keys=True)
    return model, spec, _tokenizer(config, model.artifact.path)


def _inputs(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [value]
        if all(isinstance(v, (str, list)) for v in value):
            return value
    raise invalid(
        "input must be a string, a list of strings, a list of token ids or a list of "
        f"token-id lists, got {value!r:.60}"
    )


def _ids(item: Any, at: int, tokenizer: Any, longest: int) -> list[int]:
    where = f"input[{at}]"
    if isinstance(item, str):
        if not item:
            raise invalid(f"{where} is empty")
        ids = tokenizer.encode(item)
    elif item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        ids = item
        vocab = tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"{where}: token id {bad} is not in the vocabulary (0 to {vocab - 1})")
    else:
        raise invalid(f"{where} must be a non-empty string or list of token ids")
    if len(ids) > longest:
        raise invalid(
            f"{where}: {len(ids)} tokens, more than the model's longest sequence ({longest})"
        )
    return list(ids)


async def openai_embeddings(request: Request, server: Any) -> Response:
    try:
        body = await _body(request, server)
        for field in body:
            if field not in _FIELDS:
                raise invalid(f"unknown field {field!r:.60}")
        if body.get("dimensions") is not None:
            raise invalid("dimensions is not supported by this server: the model's are given")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise invalid(f"encoding_format must be float or base64, got {fmt!r:.40}")
        name = body.get("model")
        model, spec, tokenizer = _model(server, name)
        tokens_spec = model.inputs[spec["tokens"]]
        longest = max(model.dim_buckets[tokens_spec.shape[0]])
        rows = [_ids(v, i, tokenizer, longest) for i, v in enumerate(_inputs(body.get("input")))]
        mask = spec.get("mask")
        mask_dtype = model.inputs[mask].dtype if mask is not None else None

        def request_of(ids: list[int]) -> dict:
            req = {spec["tokens"]: np.asarray([ids], np.int32)}
            if mask is not None:
                req[mask] = np.ones((1, len(ids)), mask_dtype)
            return req

        got = await asyncio.gather(*(server.infer(name, request_of(ids)) for ids in rows))
        data = []
        for i, out in enumerate(got):
            vector = np.asarray(out[spec["output"]][0], np.float32)
            value: Any = (
                vector.tolist()
                if fmt == "float"
                else base64.b64encode(vector.astype("<f4").tobytes()).decode()
            )
            data.append({"object": "embedding", "index": i, "embedding": value})
        n = sum(len(ids) for ids in rows)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": name,
                "usage": {"prompt_tokens": n, "total_tokens": n},
            }  # fmt: skip
        )
    except Exception as exc:  # noqa: BLE001 - answered in OpenAI's shape when known
        answer = openai_error(exc)
        if answer is None:
            raise
        return answer
