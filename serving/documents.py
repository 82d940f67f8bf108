"""What the metadata, config and statistics endpoints answer, as plain dicts: the HTTP
app sends them as JSON, the gRPC service as the protocol's messages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .codec import datatype_of, protocol_dims
from .options import BatchingOptions

if TYPE_CHECKING:
    from pxrt import Model


def server_metadata() -> dict:
    import pxrt

    return {
        "name": "pxrt",
        "version": pxrt.__version__,
        "extensions": ["binary_tensor_data", "model_configuration", "statistics"],
    }


def _tensors(specs: dict, shape_key: str, type_of: Any, batch: list) -> list[dict]:
    return [
        {"name": k, **type_of(s.dtype), shape_key: [*batch, *protocol_dims(s.shape)]}
        for k, s in specs.items()
    ]


def model_metadata(name: str, model: Model, versions: list[str] | None = None) -> dict:
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
        },
        "instance_group": [
            {
                "count": 1,
                "kind": "KIND_CPU" if model.devices[0].platform == "cpu" else "KIND_GPU",
            }
        ],
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
        },
        "batch_stats": [],
    }
