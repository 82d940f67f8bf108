"""JSON Schemas for the REST API's response bodies, written from the Open Inference
Protocol's REST specification (kserve/open-inference-protocol, inference_rest.md and
open_inference_rest.yaml) and, for Triton's extensions (model configuration,
statistics), from the shapes tritonclient reads. Stricter than the spec where the spec
leaves room pxrt does not use: every object names its required fields, datatypes are
the protocol's, shapes are integers."""

from __future__ import annotations

DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BF16",
    "BYTES",
]

_string = {"type": "string"}
_bool = {"type": "boolean"}
_int = {"type": "integer"}
_ints = {"type": "array", "items": _int}
_strings = {"type": "array", "items": _string}


def _object(required: dict, optional: dict | None = None, extra: bool = False) -> dict:
    return {
        "type": "object",
        "required": list(required),
        "properties": {**required, **(optional or {})},
        "additionalProperties": extra,
    }


# $live_server_response, $ready_server_response, $ready_model_response
LIVE = _object({"live": _bool})
READY = _object({"ready": _bool}, {"error": _string})
MODEL_READY = _object({"name": _string, "ready": _bool}, {"error": _string})

# $metadata_server_error_response, $metadata_model_error_response,
# $inference_error_response: every failure of every endpoint.
ERROR = _object({"error": _string}, {"ready": _bool, "name": _string})

# $metadata_server_response
SERVER_METADATA = _object({"name": _string, "version": _string, "extensions": _strings})

# $metadata_tensor, $metadata_model_response
METADATA_TENSOR = _object(
    {"name": _string, "datatype": {"enum": DATATYPES}, "shape": _ints},
    {"parameters": {"type": "object"}},
)
MODEL_METADATA = _object(
    {
        "name": _string,
        "platform": _string,
        "inputs": {"type": "array", "items": METADATA_TENSOR},
        "outputs": {"type": "array", "items": METADATA_TENSOR},
    },
    {"versions": _strings, "parameters": {"type": "object"}},
)

# $tensor_data: flat or nested numbers (and booleans, strings for BYTES).
TENSOR_DATA = {
    "type": "array",
    "items": {"anyOf": [{"$ref": "#"}, {"type": ["number", "boolean", "string"]}]},
}

# $response_output: JSON data, or with the binary tensor extension no "data" and its
# byte count in parameters.binary_data_size.
RESPONSE_OUTPUT = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": _string,
        "shape": _ints,
        "datatype": {"enum": DATATYPES},
        "parameters": {"type": "object"},
        "data": TENSOR_DATA,
    },
    "additionalProperties": False,
    "oneOf": [
        {"required": ["data"]},
        {
            "required": ["parameters"],
            "properties": {
                "parameters": {
                    "type": "object",
                    "required": ["binary_data_size"],
                    "properties": {"binary_data_size": {"type": "integer", "minimum": 0}},
                }
            },
            "not": {"required": ["data"]},
        },
    ],
}

# $inference_response
INFERENCE_RESPONSE = _object(
    {"model_name": _string, "outputs": {"type": "array", "items": RESPONSE_OUTPUT}},
    {"model_version": _string, "id": _string, "parameters": {"type": "object"}},
)

# Triton's model configuration extension (the fields tritonclient and perf tools read).
CONFIG_TENSOR = _object(
    {"name": _string, "data_type": {"type": "string", "pattern": "^TYPE_"}, "dims": _ints}
)
MODEL_CONFIG = {
    "type": "object",
    "required": ["name", "platform", "max_batch_size", "input", "output"],
    "properties": {
        "name": _string,
        "platform": _string,
        "backend": _string,
        "max_batch_size": _int,
        "input": {"type": "array", "items": CONFIG_TENSOR},
        "output": {"type": "array", "items": CONFIG_TENSOR},
        "version_policy": {"type": "object"},
        "dynamic_batching": {
            "type": "object",
            "properties": {
                "preferred_batch_size": _ints,
                "max_queue_delay_microseconds": _int,
            },
        },
        "instance_group": {"type": "array"},
    },
}

# Triton's statistics extension.
_DURATION = _object({"count": _int, "ns": _int})
MODEL_STATS = _object(
    {
        "model_stats": {
            "type": "array",
            "items": _object(
                {
                    "name": _string,
                    "version": _string,
                    "inference_count": _int,
                    "execution_count": _int,
                    "inference_stats": _object(
                        {
                            k: _DURATION
                            for k in (
                                "success",
                                "fail",
                                "queue",
                                "compute_input",
                                "compute_infer",
                                "compute_output",
                            )
                        },
                        # Triton's, for a model with the response cache
                        {"cache_hit": _DURATION, "cache_miss": _DURATION},
                    ),
                    "batch_stats": {"type": "array"},
                }
            ),
        }
    }
)
