"""The HTTP baseline: a plain FastAPI endpoint calling the jitted model once per request.

It speaks the same KServe v2 request format (through pxrt's own decoder, so the
difference measured is batching and the runtime, not parsing):

    PXRT_BASELINE_MODEL=models/mlp uvicorn --app-dir benchmarks baseline_fastapi:app
"""

from __future__ import annotations

import os

import jax
import numpy as np
from fastapi import FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

import pxrt
from serving.kserve import codec

artifact = pxrt.read_artifact(os.environ["PXRT_BASELINE_MODEL"])
names = list(artifact.inputs)
out_names = list(artifact.outputs)
jitted = jax.jit(artifact.exported.call)
params = jax.device_put(artifact.params)
app = FastAPI()


@app.get("/v2/models/{model}")
async def metadata(model: str) -> dict:
    return {
        "name": model,
        "inputs": [
            {"name": k, "datatype": codec.datatype_of(s.dtype), "shape": [-1, *s.shape]}
            for k, s in artifact.inputs.items()
        ],
    }


@app.post("/v2/models/{model}/infer")
async def infer(model: str, request: Request) -> Response:
    body = await request.body()
    header, binary = codec.split_body(body, request.headers.get("inference-header-content-length"))
    doc = codec.parse_json(header)
    inputs = codec.decode_inputs(doc, binary, artifact.inputs)

    def run() -> dict:
        outs = jitted(params, *[inputs[n] for n in names])
        return {k: np.asarray(o) for k, o in zip(out_names, outs)}

    outputs = await run_in_threadpool(run)
    body, header_length = codec.encode_response(
        model, "1", doc.get("id"), outputs, codec.requested_outputs(doc, out_names)
    )
    if header_length is None:
        return Response(body, media_type="application/json")
    return Response(
        body,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(header_length)},
    )
