"""What the metadata, config and statistics endpoints answer, as plain dicts: the HTTP
app sends them as JSON, the gRPC service as the protocol's messages."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..options import BatchingOptions
from .codec import datatype_of, protocol_dims

if TYPE_CHECKING:
    from pxrt import Model

    from .backend import ServedModel


def server_metadata() -> dict:
    import pxrt

    return {
        "name": "pxrt",
        "version": pxrt.__version__,
        "extensions": ["binary_tensor_data", "model_configuration", "statistics"],
    }


def _tensors(specs: Mapping[str, Any], shape_key: str, type_of: Any, batch: list) -> list[dict]:
    return [
        {"name": k, **type_of(s.dtype), shape_key: [*batch, *protocol_dims(s.shape)]}
        for k, s in specs.items()
    ]


def model_metadata(name: str, model: ServedModel, versions: list[str] | None = None) -> dict:
    """The model's KServe v2 metadata: its versions, inputs and outputs (-1 for the batch
    and for named dimensions)."""

    def datatype(dtype: Any) -> dict:
        return {"datatype": datatype_of(dtype)}

    return {
        "name": name,
        "versions": versions or [model.version],
        "platform": "pxrt_jax",
        "inputs": _tensors(model.inputs, "shape", datatype, [-1]),
        "outputs": _tensors(model.outputs, "shape", datatype, [-1]),
    }


def model_config(name: str, model: Model, options: BatchingOptions, max_batch_size: int) -> dict:
    """The model's configuration in Triton's shape (what Triton's tools read);
    ``max_batch_size`` is the option as capped by the model's largest bucket."""

    def data_type(dtype: Any) -> dict:
        return {"data_type": "TYPE_" + datatype_of(dtype)}

    return {
        "name": name,
        "platform": "pxrt_jax",
        "backend": "pxrt",
        "version_policy": {"specific": {"versions": [model.version]}},
        "max_batch_size": max_batch_size,
        "input": _tensors(model.inputs, "dims", data_type, []),
        "output": _tensors(model.outputs, "dims", data_type, []),
        # pxrt's own: the lengths each named (-1) dimension is compiled at.
        "parameters": {
            f"dim_buckets.{d}": {"string_value": ",".join(map(str, v))}
            for d, v in model.dim_buckets.items()
        },
        "dynamic_batching": {
            "preferred_batch_size": [b for b in model.buckets if b <= max_batch_size],
            "max_queue_delay_microseconds": round(options.max_delay_us),
            "default_queue_policy": {"max_queue_size": options.max_queue},
            "priority_levels": options.priority_levels,
            "default_priority_level": options.default_priority_level or options.priority_levels,
        },
        "response_cache": {"enable": options.response_cache},
        "instance_group": [
            {
                "count": 1,
                "kind": "KIND_CPU" if model.devices[0].platform == "cpu" else "KIND_GPU",
            }
        ],
    }


def _decoder_tensors(decoder: Any, shape_key: str, type_of: Any) -> tuple[list, list]:
    """A decoder's inputs and outputs as its generate requests carry them (the prompt,
    then the options, each optional but one prompt) and its responses."""
    text = decoder.tokenizer is not None
    inputs = [("input_ids", "INT32", [-1])]
    if text:
        inputs.insert(0, ("text_input", "BYTES", [1]))
    inputs += [("max_tokens", "INT32", [1]), ("temperature", "FP32", [1]),
               ("top_k", "INT32", [1]), ("top_p", "FP32", [1]), ("seed", "INT64", [1]),
               ("stop_ids", "INT32", [-1]), ("prefix_cache", "BOOL", [1]),
               ("presence_penalty", "FP32", [1]), ("frequency_penalty", "FP32", [1]),
               ("repetition_penalty", "FP32", [1]), ("min_tokens", "INT32", [1])]  # fmt: skip
    if text:  # (and a structured output's: JSON text, a regex, a grammar, the choices)
        inputs += [("stop", "BYTES", [-1]), ("guided_json", "BYTES", [1]),
                   ("structured_outputs", "BYTES", [1]), ("guided_regex", "BYTES", [1]),
                   ("guided_grammar", "BYTES", [1]), ("guided_choice", "BYTES", [-1])]  # fmt: skip
    outputs = [("output_ids", "INT32", [-1])]
    if text:
        outputs.append(("text_output", "BYTES", [1]))
    return (
        [{"name": n, **type_of(t), shape_key: shape} for n, t, shape in inputs],
        [{"name": n, **type_of(t), shape_key: shape} for n, t, shape in outputs],
    )


def decoder_metadata(name: str, decoder: Any) -> dict:
    """A decoder's KServe v2 metadata: the tensors of its generate requests (over gRPC:
    a decoupled ``ModelStreamInfer``; over HTTP: the generate extension)."""
    inputs, outputs = _decoder_tensors(decoder, "shape", lambda t: {"datatype": t})
    return {
        "name": name,
        "versions": [decoder.version],
        "platform": "pxrt_jax_decoder",
        "inputs": inputs,
        "outputs": outputs,
    }


def decoder_config(name: str, decoder: Any) -> dict:
    """A decoder's configuration in Triton's shape: decoupled (many responses per
    request), no batch dimension of its own (the decode slots batch it), and its sizes as
    parameters."""
    inputs, outputs = _decoder_tensors(
        decoder, "dims", lambda t: {"data_type": "TYPE_STRING" if t == "BYTES" else "TYPE_" + t}
    )  # (Triton's config names BYTES "STRING")
    for tensor in inputs:
        tensor["optional"] = True
    sizes = {
        "slots": decoder.slots,
        "max_length": decoder.max_length,
        "vocab": decoder.vocab,
        "prefill_lengths": ",".join(map(str, decoder.prefill_lengths)),
        "max_waiting": decoder.max_waiting,
    }
    return {
        "name": name,
        "platform": "pxrt_jax_decoder",
        "backend": "pxrt",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": 0,
        "input": inputs,
        "output": outputs,
        "model_transaction_policy": {"decoupled": True},
        "parameters": {k: {"string_value": str(v)} for k, v in sizes.items()},
        # (a decoder queues its waiting prompts by these: Decoder.set_priorities)
        "dynamic_batching": {
            "priority_levels": decoder.priority_levels,
            "default_priority_level": decoder.default_priority_level,
        },
    }


def _cache_stats(counts: dict | None) -> dict:
    """Triton's ``cache_hit`` and ``cache_miss`` (a model without the cache: none)."""
    if counts is None:
        return {}
    return {
        "cache_hit": {"count": counts["hits"], "ns": int(counts["hit_s"] * 1e9)},
        "cache_miss": {"count": counts["misses"], "ns": int(counts["miss_s"] * 1e9)},
    }


def model_stats(name: str, version: str, snap: dict) -> dict:
    """One model version's statistics, in Triton's shape, from its metrics snapshot."""

    def duration(key: str) -> dict:
        h = snap[key]
        return {"count": h["count"], "ns": int(h["mean"] * h["count"] * 1e3)}

    req = snap["requests"]
    fail_count = sum(req[k] for k in ("invalid", "rejected", "expired", "failed"))
    return {
        "name": name,
        "version": version,
        "inference_count": int(snap["batch_rows"]["mean"] * snap["batch_rows"]["count"]),
        "execution_count": snap["batches"],
        "inference_stats": {
            "success": duration("request_us"),
            "fail": {"count": fail_count, "ns": 0},
            "queue": duration("queue_us"),
            "compute_input": duration("compute_input_us"),
            "compute_infer": duration("compute_infer_us"),
            "compute_output": duration("compute_output_us"),
            **_cache_stats(snap.get("response_cache")),
        },
        "batch_stats": [],
    }
