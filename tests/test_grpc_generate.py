"""Generation over gRPC: ``ModelStreamInfer`` in Triton's decoupled mode, driven by the
unmodified ``tritonclient.grpc`` stream API against both gRPC servers. Every token is
held to the engine's in-process API for the same request and seed."""

from __future__ import annotations

import queue
import sys
import time

import pytest

if "kserve" in sys.modules:  # its protobufs claim the same names as tritonclient.grpc's
    pytest.skip("run the gRPC tests in their own pytest", allow_module_level=True)

import numpy as np
import tritonclient.grpc as grpcclient
from servers import ServeProcess, decoder_config

import pxrt
from pxrt import demo
from pxrt.tokenizer import ByteTokenizer, TextStream


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory):
    return demo.export_lm(
        str(tmp_path_factory.mktemp("lm") / "lm"),
        slots=4,
        max_length=512,
        prefill_lengths=(8, 32),
        prefill_batches=(1, 2),
        dim=32,
        heads=2,
        layers=1,
        extend=False,  # (the protocols are under test; test_generate.py chunks prompts)
    )


@pytest.fixture(scope="module")
def local(lm_path):
    dec = pxrt.load(lm_path, step_slots=(), step_lengths=())  # (both: test_generate.py)
    assert dec.wait_programs(120)
    yield dec
    dec.close()


@pytest.fixture(scope="module", params=["native", "grpcio", "workers"])
def served(request, lm_path, tmp_path_factory):
    extra = {"native": [], "grpcio": ["--no-native-grpc"], "workers": ["--workers", "2"]}[
        request.param
    ]
    # The decoder's load options from the TOML, as the local one's: no steps over fewer
    # slots (test_generate.py has those).
    conf = decoder_config(tmp_path_factory.mktemp("conf"), lm_path, step_slots=[], step_lengths=[])
    proc = ServeProcess(["--config", conf, *extra], grpc=True)
    yield proc
    rc = proc.stop()
    assert rc == 0, proc.last_output[-6000:]


def _text_input(text: str):
    inp = grpcclient.InferInput("text_input", [1], "BYTES")
    inp.set_data_from_numpy(np.array([text.encode()], dtype=object))
    return inp


def _stream(served, requests):
    """Send ``requests`` (kwargs of async_stream_infer) on one stream; collect every
    response per request id until each has its final one."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(served.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i, kwargs in enumerate(requests):
            client.async_stream_infer(
                "lm", request_id=str(i), enable_empty_final_response=True, **kwargs
            )
        got: dict = {str(i): [] for i in range(len(requests))}
        finals: dict = {}
        errors: dict = {}
        while len(finals) + len(errors) < len(requests):
            result, error = results.get(timeout=60)
            if error is not None:
                errors[len(errors)] = str(error)
                continue
            response = result.get_response()
            params = response.parameters
            if params["triton_final_response"].bool_param:
                finals[response.id] = {k: v for k, v in params.items()}
            else:
                got[response.id].append(result)
        return got, finals, errors
    finally:
        client.stop_stream()
        client.close()


def test_decoupled_streams_give_the_engines_tokens(served, local):
    texts = ["Hello, world", "é€ ✓", "pxrt"]
    options = [
        dict(max_tokens=9, seed=1),
        dict(max_tokens=14, temperature=3.0, top_k=40, seed=2),
        dict(max_tokens=5),
        dict(max_tokens=8, repetition_penalty=1.8, presence_penalty=0.5, min_tokens=3),
    ]
    texts.append("controls")
    requests = [{"inputs": [_text_input(t)], "parameters": o} for t, o in zip(texts, options)]
    got, finals, errors = _stream(served, requests)
    assert not errors
    for i, (text, o) in enumerate(zip(texts, options)):
        want = local.generate(ByteTokenizer().encode(text), **o)
        responses = got[str(i)]
        ids = [int(t) for r in responses for t in r.as_numpy("output_ids")]
        assert ids == want.tokens
        stream = TextStream(ByteTokenizer())
        want_text = "".join(stream.push(t) for t in want.tokens) + stream.flush()
        text_out = b"".join(r.as_numpy("text_output")[0] for r in responses).decode()
        assert text_out == want_text
        final = finals[str(i)]
        assert final["finish_reason"].string_param == want.finish_reason
        assert final["completion_tokens"].int64_param == len(want.tokens)


def test_a_bad_request_fails_alone_on_its_stream(served, local):
    ids = grpcclient.InferInput("input_ids", [2], "INT32")
    ids.set_data_from_numpy(np.array([72, 999], np.int32))
    good = {"inputs": [_text_input("ok")], "parameters": {"max_tokens": 4, "seed": 3}}
    got, finals, errors = _stream(served, [{"inputs": [ids]}, good])
    assert len(errors) == 1
    assert "token id 999 is outside the vocabulary" in errors[0]
    want = local.generate(ByteTokenizer().encode("ok"), max_tokens=4, seed=3)
    assert [int(t) for r in got["1"] for t in r.as_numpy("output_ids")] == want.tokens
    assert "1" in finals


def _bytes_input(name: str, values: list[bytes]):
    inp = grpcclient.InferInput(name, [len(values)], "BYTES")
    inp.set_data_from_numpy(np.array(values, dtype=object))
    return inp


def test_unknown_inputs_extra_elements_and_too_many_stops_are_refused(served, local):
    """Each bad request fails alone, naming what is wrong (an unknown input or parameter
    with what is known); the good one after them is answered. Stop strings and ids are
    counted against the limits before they are read."""
    temps = grpcclient.InferInput("temperature", [2], "FP32")
    temps.set_data_from_numpy(np.array([0.5, 0.7], np.float32))
    hot = grpcclient.InferInput("temperature", [1], "FP64")
    hot.set_data_from_numpy(np.array([1e300]))
    stop_ids = grpcclient.InferInput("stop_ids", [65], "INT32")
    stop_ids.set_data_from_numpy(np.ones(65, np.int32))
    prompt = _text_input("ok")
    bad = [
        ([prompt, _bytes_input("text_inputs", [b"x"])], "unknown input 'text_inputs'"),
        ([_bytes_input("text_input", [b"a", b"b"])], "'text_input' takes one element"),
        ([prompt, temps], "'temperature' takes one element"),
        ([prompt, hot], "temperature must be a number from 0 to 100"),
        ([prompt, _bytes_input("stop", [b"x"] * 17)], "stop: 17 strings; at most 16"),
        ([prompt, _bytes_input("stop", [b"x" * 300])], "stop: a string of 300 bytes"),
        ([prompt, stop_ids], "stop_ids: 65 ids; at most 64"),
        ([prompt, prompt], "input 'text_input' is given twice"),
    ]
    bad = [({"inputs": inputs}, words) for inputs, words in bad]
    known = "known: input_ids, stop, stop_ids, text_input, timeout, max_tokens, temperature"
    bad += [
        ({"inputs": [prompt], "parameters": {"logprobs": 2}}, "logprobs is not given over gRPC"),
        # Unknown parameters are refused by name, never ignored.
        ({"inputs": [prompt], "parameters": {"max_token": 4}}, f"'max_token'; {known}"),
        ({"inputs": [prompt], "parameters": {"temprature": 0.5}}, "parameter 'temprature'"),
        # Triton's priority (uint64) that is no level of the decoder.
        ({"inputs": [prompt], "priority": 2**63}, "priority must be an int from 0 to 1, got 9"),
        ({"inputs": [prompt], "priority": 2**64 - 1}, "priority must be an int from 0 to 1, got 1"),
    ]
    good = {"inputs": [_text_input("ok")], "parameters": {"max_tokens": 4, "seed": 3},
            "priority": 1}  # fmt: skip
    got, finals, errors = _stream(served, [request for request, _ in bad] + [good])
    messages = sorted(errors.values())
    assert len(messages) == len(bad)
    for _, words in bad:
        assert any(words in m for m in messages), (words, messages)
    want = local.generate(ByteTokenizer().encode("ok"), max_tokens=4, seed=3)
    assert [int(t) for r in got[str(len(bad))] for t in r.as_numpy("output_ids")] == want.tokens


def test_structured_outputs_over_grpc_are_the_engines(served, local):
    """vLLM's guided fields as string parameters (a schema, a list of choices: JSON
    text) or BYTES inputs: the tokens are the engine's for the same structured output
    and seed; a schema the engine refuses fails alone, naming the field."""
    import json

    n = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {"type": "object", "properties": {"n": n}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    prompt = _text_input("json:")
    cases = [
        ({"guided_json": json.dumps(schema)}, [], pxrt.StructuredOutput(json=schema)),
        ({"guided_choice": '["yes", "no"]'}, [], pxrt.StructuredOutput(choice=["yes", "no"])),
        ({}, [_bytes_input("guided_regex", [b"[a-c]{3}"])],
         pxrt.StructuredOutput(regex="[a-c]{3}")),
        ({}, [_bytes_input("guided_choice", [b"up", b"down"])],
         pxrt.StructuredOutput(choice=["up", "down"])),
    ]  # fmt: skip
    bad = [
        ({"inputs": [prompt], "parameters": {"guided_json": "{not"}}, "guided_json is not JSON"),
        ({"inputs": [prompt], "parameters": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"inputs": [prompt, _tensor("guided_regex", "INT32", [1])]}, "takes text (BYTES)"),
    ]  # fmt: skip
    requests = [
        {"inputs": [prompt, *inputs], "parameters": {**params, "max_tokens": 24, "seed": 7,
                                                     "temperature": 1.0}}
        for params, inputs, _ in cases
    ] + [request for request, _ in bad]  # fmt: skip
    got, finals, errors = _stream(served, requests)
    messages = sorted(errors.values())
    assert len(messages) == len(bad), messages
    for _, words in bad:
        assert any(words in m for m in messages), (words, messages)
    for i, (_, _, so) in enumerate(cases):
        want = local.generate(
            ByteTokenizer().encode("json:"), max_tokens=24, seed=7, temperature=1.0, structured=so
        )
        assert [int(t) for r in got[str(i)] for t in r.as_numpy("output_ids")] == want.tokens, i
        text = ByteTokenizer().decode(want.tokens)
        assert finals[str(i)]["finish_reason"].string_param == want.finish_reason == "stop", text


def _tensor(name: str, datatype: str, values: list):
    dtypes = {"FP32": np.float32, "FP64": np.float64, "BYTES": object, "INT32": np.int32,
              "INT64": np.int64, "UINT16": np.uint16}  # fmt: skip
    inp = grpcclient.InferInput(name, [len(values)], datatype)
    inp.set_data_from_numpy(np.array(values, dtypes[datatype]))
    return inp


def test_token_ids_are_integer_tensors_never_cast(served, local):
    """``input_ids`` and ``stop_ids`` of a datatype other than an integer one are
    INVALID_ARGUMENT naming them: FP32 72.5 was cast to 72, -0.5 to 0, and NaN was an
    internal error. Ids of any integer datatype are the same ids."""
    bad_ids = [("FP32", [72.5, 3.0]), ("FP32", [-0.5]), ("FP32", [float("nan")]),
               ("FP64", [72.0]), ("BYTES", [b"72"])]  # fmt: skip
    bad = [{"inputs": [_tensor("input_ids", *ids)]} for ids in bad_ids]
    prompt = _tensor("input_ids", "INT32", [72, 105])
    bad.append({"inputs": [prompt, _tensor("stop_ids", "FP32", [1.5])]})
    options = {"max_tokens": 4, "seed": 3}
    good = [{"inputs": [_tensor("input_ids", datatype, [72, 105])], "parameters": options}
            for datatype in ("INT64", "UINT16")]  # fmt: skip
    got, finals, errors = _stream(served, bad + good)
    messages = list(errors.values())
    assert len(messages) == len(bad), messages
    takes = "takes token ids, an integer datatype"
    assert sum(f"input 'input_ids' {takes}" in m for m in messages) == len(bad_ids), messages
    assert sum(f"input 'stop_ids' {takes}" in m for m in messages) == 1, messages
    want = local.generate([72, 105], **options)
    for i in range(len(bad), len(bad) + len(good)):
        assert [int(t) for r in got[str(i)] for t in r.as_numpy("output_ids")] == want.tokens


def test_a_deadline_ends_a_stream_with_an_error_after_its_tokens(served):
    ids = grpcclient.InferInput("input_ids", [2], "INT32")
    ids.set_data_from_numpy(np.array([1, 2], np.int32))
    no_stops = grpcclient.InferInput("stop_ids", [0], "INT32")
    no_stops.set_data_from_numpy(np.zeros(0, np.int32))
    # A deadline a quarter of the time the same generation took just before (its first
    # token comes after one step of 510: long before): it passes mid-stream.
    request = {"inputs": [ids, no_stops], "parameters": {"max_tokens": 510}}
    t0 = time.perf_counter()
    _, finals, _ = _stream(served, [request])
    took_us = (time.perf_counter() - t0) * 1e6
    assert finals["0"]["completion_tokens"].int64_param == 510
    got, finals, errors = _stream(served, [{**request, "timeout": int(took_us / 4)}])
    assert len(errors) == 1 and "deadline" in errors[0], errors
    assert got["0"] and not finals


def test_a_decoder_has_readiness_metadata_and_config(served):
    assert "steps over [4] slots" in served.output()  # (the TOML's load options)
    client = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        assert client.is_model_ready("lm") and not client.is_model_ready("lm", "7")
        meta = client.get_model_metadata("lm")
        assert meta.platform == "pxrt_jax_decoder" and list(meta.versions) == ["1"]
        assert [t.name for t in meta.outputs] == ["output_ids", "text_output"]
        config = client.get_model_config("lm").config
        assert config.model_transaction_policy.decoupled
        assert config.parameters["max_length"].string_value == "512"
    finally:
        client.close()


def test_pxrt_bench_measures_generation_over_grpc(served, tmp_path):
    """`pxrt bench --url grpc://...` knows the decoder and times its decoupled streams."""
    import json
    import subprocess
    import sys

    if "--no-native-grpc" in served.proc.args or "--workers" in served.proc.args:
        pytest.skip("one server is enough")
    result = subprocess.run(
        [sys.executable, "-m", "serving.cli", "bench", "--url", f"grpc://{served.grpc_url}",
         "--model", "lm", "--concurrency", "2", "--duration", "0.5", "--request-rate", "10",
         "--prompt-tokens", "fixed:8", "--output-tokens", "fixed:10", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    closed, opened = json.loads((tmp_path / "bench.json").read_text())["results"]
    for r in (closed, opened):
        assert r["errors"] == 0 and r["output_tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0
