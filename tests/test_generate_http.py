"""Generation over HTTP, against `pxrt serve`: KServe's generate extension (JSON and
server-sent events) and the OpenAI-compatible API through OpenAI's own client. Every
answer is held to the tokens the engine's in-process API gives for the same request."""

from __future__ import annotations

import functools
import json
import time

import httpx
import numpy as np
import pytest
from servers import ServeProcess, decoder_config

import pxrt
from pxrt import demo
from pxrt.tokenizer import ByteTokenizer, TextStream

MAX_LENGTH = 2048  # long enough that a stream outlives the hang-up test
SIZES = {"dim": 32, "heads": 2, "layers": 2}
PROMPTS = ["Hello, world", "pxrt serves JAX", "é€ utf-8 ✓"]


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory):
    return demo.export_lm(
        str(tmp_path_factory.mktemp("lm") / "lm"),
        slots=4,
        max_length=MAX_LENGTH,
        prefill_lengths=(8, 64),
        prefill_batches=(1, 2),
        chunk_lengths=(64,),  # (echo with logprobs scores prompts in chunks)
        **SIZES,
    )


@pytest.fixture(scope="module")
def local(lm_path):
    dec = pxrt.load(lm_path, step_slots=(), step_lengths=())  # (both: test_generate.py)
    assert dec.wait_programs(120)
    yield dec
    dec.close()


ENCODER = {"vocab": 300, "dim": 32, "heads": 2, "layers": 1}


@pytest.fixture(scope="module")
def embedder_path(tmp_path_factory):
    """The demo encoder as an embedding model: byte tokens, its pooled output."""
    return pxrt.export(
        demo.encoder, demo.make_encoder_params(**ENCODER), tmp_path_factory.mktemp("e") / "emb",
        inputs=demo.encoder_inputs(), batch_buckets=(1, 4), dim_buckets={"seq": (8, 32)},
        tokenizer="bytes", embedding={"tokens": "tokens", "mask": "mask", "output": "pooled"},
    )  # fmt: skip


@pytest.fixture(scope="module", params=["one", "asgi", "workers"])
def served(request, lm_path, artifacts, embedder_path, tmp_path_factory):
    """`pxrt serve` of the decoder beside a one-shot model (streams on its native HTTP
    path); the same with every request through the ASGI app; and with two front-end
    workers, which stream generations running in the device process. The decoder loads
    as the local one (its TOML: no steps over fewer slots)."""
    extra = {"one": [], "asgi": ["--no-native-http"], "workers": ["--workers", "2"]}[request.param]
    conf = decoder_config(tmp_path_factory.mktemp("conf"), lm_path, step_slots=[], step_lengths=[])
    proc = ServeProcess(["--config", conf, str(artifacts["mlp"]), str(embedder_path), *extra])
    proc.mode = request.param
    yield proc
    proc.stop()


# The documented shapes: Triton's generate extension (plus pxrt's output_ids, finish
# reason and usage) and OpenAI's completions API.
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        k: {"type": "integer", "minimum": 0}
        for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}
GENERATE = {
    "type": "object",
    "required": ["model_name", "model_version", "output_ids"],
    "properties": {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "text_output": {"type": "string"},
        "output_ids": {"type": "array", "items": {"type": "integer"}},
        "finish_reason": {"enum": ["stop", "length", "cancelled"]},
        "usage": _USAGE,
    },
}
COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "text_completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["index", "text", "finish_reason"],
                "properties": {
                    "index": {"type": "integer"},
                    "text": {"type": "string"},
                    "finish_reason": {"enum": ["stop", "length", None]},
                },
            },
        },
        "usage": _USAGE,
    },
}
MODELS = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {"type": "object", "required": ["id", "object", "created", "owned_by"]},
        },
    },
}


def test_answers_have_the_documented_shapes(served):
    import jsonschema

    url = served.url
    jsonschema.validate(
        httpx.post(
            f"{url}/v2/models/lm/generate", json={"text_input": "hi", "max_tokens": 3}
        ).json(),
        GENERATE,
    )
    # (Triton's own generate examples say "stream": false: the endpoint decides)
    jsonschema.validate(
        httpx.post(
            f"{url}/v2/models/lm/generate",
            json={"text_input": "hi", "parameters": {"stream": False, "max_tokens": 3}},
        ).json(),
        GENERATE,
    )
    with httpx.stream(
        "POST", f"{url}/v2/models/lm/generate_stream", json={"text_input": "hi", "max_tokens": 3}
    ) as r:
        for event in sse(r):
            jsonschema.validate(event, GENERATE)
    body = {"model": "lm", "prompt": "hi", "max_tokens": 3}
    jsonschema.validate(httpx.post(f"{url}/v1/completions", json=body).json(), COMPLETION)
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
        *chunks, done = sse(r)
    assert done == "[DONE]"
    for chunk in chunks:
        jsonschema.validate(chunk, COMPLETION)
    jsonschema.validate(httpx.get(f"{url}/v1/models").json(), MODELS)
    error = httpx.post(f"{url}/v1/completions", json=body | {"max_tokens": 0}).json()
    jsonschema.validate(
        error,
        {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["message", "type"]}},
        },
    )


def expected(local, text, **options):
    """The in-process tokens and text for ``text``: what every protocol must give."""
    ids = ByteTokenizer().encode(text)
    out = local.generate(ids, **options)
    stream = TextStream(ByteTokenizer(), options.get("stop", ()))
    return out, "".join(stream.push(t) for t in out.tokens) + stream.flush()


def sse(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_generate_json_equals_the_engine(served, local):
    for text in PROMPTS:
        want, want_text = expected(local, text, max_tokens=12, seed=3)
        r = httpx.post(
            f"{served.url}/v2/models/lm/generate",
            json={"text_input": text, "parameters": {"max_tokens": 12, "seed": 3}},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["output_ids"] == want.tokens
        assert doc["text_output"] == want_text
        assert doc["finish_reason"] == want.finish_reason
        assert doc["model_name"] == "lm" and doc["model_version"] == "1"
        assert doc["usage"] == {
            "prompt_tokens": len(text.encode()),
            "completion_tokens": len(want.tokens),
            "total_tokens": len(text.encode()) + len(want.tokens),
        }


def test_generate_stream_sends_each_token_then_the_end(served, local):
    options = {"max_tokens": 20, "temperature": 4.0, "top_k": 50, "seed": 11}
    want, want_text = expected(local, PROMPTS[0], **options)
    with httpx.stream(
        "POST",
        f"{served.url}/v2/models/lm/versions/1/generate_stream",
        json={"text_input": PROMPTS[0], **options},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    *tokens, final = events
    assert [t for e in tokens for t in e["output_ids"]] == want.tokens
    assert "".join(e["text_output"] for e in events) == want_text
    assert final["finish_reason"] == want.finish_reason and final["output_ids"] == []
    assert final["usage"]["completion_tokens"] == len(want.tokens)


def test_token_ids_in_and_out(served, local):
    ids = [72, 105, 33]
    want = local.generate(ids, max_tokens=7, seed=1)
    r = httpx.post(
        f"{served.url}/v2/models/lm/generate",
        json={"input_ids": ids, "max_tokens": 7, "seed": 1},
        timeout=30,
    )
    assert r.json()["output_ids"] == want.tokens


def _count(served, reason: str) -> float:
    prefix = f'pxrt_generations_total{{model="lm",reason="{reason}",version="1"}} '
    text = httpx.get(f"{served.url}/metrics").text
    return float(next(x for x in text.splitlines() if x.startswith(prefix))[len(prefix) :])


def test_stop_strings_cut_the_text_and_end_the_generation(served, local):
    stops, cancels = _count(served, "stop"), _count(served, "cancelled")
    want, full = expected(local, PROMPTS[1], max_tokens=30, seed=5)
    stop = full[3:5]
    assert stop and stop in full
    r = httpx.post(
        f"{served.url}/v2/models/lm/generate",
        json={"text_input": PROMPTS[1], "max_tokens": 30, "seed": 5, "stop": [stop]},
        timeout=30,
    )
    doc = r.json()
    assert doc["text_output"] == full[: full.index(stop)]
    assert doc["finish_reason"] == "stop"
    assert doc["output_ids"] == want.tokens[: len(doc["output_ids"])]
    assert doc["usage"]["completion_tokens"] == len(doc["output_ids"])
    # counted as a stop, not a cancellation
    assert (_count(served, "stop"), _count(served, "cancelled")) == (stops + 1, cancels)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be an int >= 1"),
        ({"text_input": "hi", "temperature": -1}, "temperature"),
        ({"text_input": "x" * MAX_LENGTH}, "leave no room in a cache of 2048 positions"),
        ({"text_input": "x" * MAX_LENGTH}, "leave no room in a cache"),
        ({"input_ids": [1, 999]}, "token id 999 is outside the vocabulary"),
        ({}, "exactly one of text_input"),
        ({"text_input": "hi", "stop": 3}, "stop must be a string"),
        ({"text_input": "hi", "temperature": 1e300}, "temperature must be a number from 0 to"),
        ({"text_input": "hi", "stop": ["a"] * 17}, "stop: 17 strings; at most 16"),
        ({"text_input": "hi", "stop": ["é" * 200]}, "stop: a string of 400 bytes; at most 256"),
        ({"text_input": "hi", "parameters": {"stop_ids": [1] * 65}}, "stop_ids: 65 ids"),
        ({"text_input": "hi", "stop": ["x"] * 100_000}, "stop: 100000 strings"),
        ({"text_input": "hi", "prefix_cache": "no"}, "prefix_cache must be true or false"),
        # Unknown fields and parameters are refused by name, never ignored.
        (
            {"text_input": "hi", "max_token": 4},
            "unknown field 'max_token'; known: text_input, input_ids, parameters, stop, timeout, "
            "stream, max_tokens, temperature",
        ),
        (
            {"text_input": "hi", "parameters": {"temprature": 0.5}},
            "unknown parameter 'temprature'; known: stop, timeout, stream, max_tokens, temperature",
        ),
        ({"text_input": "hi", "parameters": {"text_input": "x"}}, "unknown parameter 'text_input'"),
        ({"text_input": "hi", "parameters": {"stream": "no"}}, "stream must be true or false"),
        # A priority that is no level of the decoder (2**64: a float once parsed).
        ({"text_input": "hi", "priority": 2}, "priority must be an int from 0 to 1, got 2"),
        ({"text_input": "hi", "priority": 2**63}, "priority must be an int from 0 to 1, got 9"),
        ({"text_input": "hi", "parameters": {"priority": 2**64}}, "priority must be an int"),
        ({"text_input": "hi", "parameters": {"priority": "1"}}, "priority must be an int"),
        # Token ids are integers, never cast.
        ({"input_ids": [72.5, 3.0], "max_tokens": 2}, "input_ids must be a non-empty list of"),
        ({"input_ids": [72], "stop_ids": [1.5]}, "stop_ids must be an int >= 0, got 1.5"),
        ({"input_ids": [72], "stop_ids": [9999]}, "stop_ids must be an int from 0 to"),
    ],
)
def test_bad_requests_are_400s_naming_the_problem(served, body, words):
    r = httpx.post(f"{served.url}/v2/models/lm/generate", json=body, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"], r.text


def test_a_generation_body_over_its_limit_is_a_413_before_it_is_parsed(served):
    """A generation request's JSON is parsed on the event loop: its body is bounded
    (--max-request-kb, 1 MiB by default), on every path (the native stream, Starlette's
    generate and OpenAI's), said length or not."""
    big = json.dumps({"text_input": "hi", "stop": ["x"] * 300_000}).encode()  # 1.5 MB
    for path in ("/v2/models/lm/generate", "/v2/models/lm/generate_stream"):
        r = httpx.post(served.url + path, content=big, timeout=30)
        assert r.status_code == 413 and "--max-request-kb" in r.json()["error"], (path, r.text)

        def chunks():
            yield big  # (no Content-Length: chunked)

        r = httpx.post(served.url + path, content=chunks(), timeout=30)
        assert r.status_code == 413, (path, r.text)
    r = httpx.post(f"{served.url}/v1/completions", content=big, timeout=30)
    assert r.status_code == 413 and "--max-request-kb" in r.json()["error"]["message"]
    ok = httpx.post(f"{served.url}/v2/models/lm/generate",
                    json={"text_input": "hi", "max_tokens": 2}, timeout=30)  # fmt: skip
    assert ok.status_code == 200


def test_a_client_hanging_up_before_its_body_is_in_is_one_line_not_an_error(local, caplog):
    """On the Starlette path (generate, OpenAI's): one INFO line, not an internal error."""
    import asyncio

    from serving import Server
    from serving.http.app import create_app

    async def hang_up(app, path):
        sent = []

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": [(b"content-length", b"100")],
            "root_path": "",
            "scheme": "http",
            "server": ("x", 80),
            "http_version": "1.1",
        }
        await app(scope, receive, send)  # fmt: skip
        return sent

    async def main():
        server = Server()
        server.add_decoder("lm", local)
        app = create_app(server)
        with caplog.at_level("INFO", logger="pxrt"):
            for path in ("/v2/models/lm/generate", "/v1/completions"):
                await hang_up(app, path)

    asyncio.run(main())
    lines = [r for r in caplog.records if r.name.startswith("pxrt")]
    assert [r.levelname for r in lines] == ["INFO", "INFO"], caplog.text
    assert all("the client hung up" in r.getMessage() for r in lines)


def test_unknown_models_and_one_shot_models_are_404s(served):
    r = httpx.post(f"{served.url}/v2/models/nope/generate", json={"text_input": "a"})
    assert r.status_code == 404 and "no model named 'nope'" in r.json()["error"]
    r = httpx.post(f"{served.url}/v2/models/mlp/generate", json={"text_input": "a"})
    assert r.status_code == 404
    # The one-shot model is served beside the decoder.
    assert httpx.get(f"{served.url}/v2/models/mlp/ready").status_code == 200


def _busy(served) -> float:
    text = httpx.get(f"{served.url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("pxrt_slots_busy{"))
    return float(line.rsplit(" ", 1)[1])


def test_a_client_that_hangs_up_frees_its_slot(served):
    long = {"input_ids": [1, 2], "max_tokens": 10_000, "stop_ids": []}
    with httpx.stream(
        "POST", f"{served.url}/v2/models/lm/generate_stream", json=long, timeout=30
    ) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert _busy(served) == 1
    deadline = time.monotonic() + 10
    while _busy(served) != 0:
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.01)


def test_a_client_that_hangs_up_on_a_whole_answer_frees_its_slot(served):
    long = {"input_ids": [1, 2], "max_tokens": MAX_LENGTH - 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v2/models/lm/generate", json=long, timeout=0.3)
    deadline = time.monotonic() + 1.0  # its generation would run for seconds
    while _busy(served) != 0:
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.01)


def test_a_deadline_ends_a_generation_with_a_504_and_frees_its_slot(served):
    """``parameters.timeout`` (microseconds, as for inference) bounds a generation: the
    whole answer is a 504 naming the deadline; a stream sends its tokens, then the error
    as its last event; either way the slot is free at once and the end is counted as a
    deadline."""
    before = _count(served, "deadline")
    long = {"input_ids": [1, 2], "max_tokens": MAX_LENGTH - 2, "stop_ids": []}
    r = httpx.post(
        f"{served.url}/v2/models/lm/generate",
        json=long | {"parameters": {"timeout": 200_000}},
        timeout=30,
    )
    assert r.status_code == 504 and "deadline" in r.json()["error"], r.text
    assert _busy(served) == 0
    with httpx.stream(
        "POST",
        f"{served.url}/v2/models/lm/generate_stream",
        json=long | {"timeout": 200_000},
        timeout=30,
    ) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    assert all("output_ids" in e for e in events[:-1]) and len(events) > 1
    assert "deadline" in events[-1]["error"], events[-1]
    assert _busy(served) == 0
    assert _count(served, "deadline") == before + 2
    bad = httpx.post(
        f"{served.url}/v2/models/lm/generate", json={"input_ids": [1], "timeout": -5}, timeout=30
    )
    assert bad.status_code == 400 and "timeout must be a positive number" in bad.text


# --------------------------------------------------------------------------- OpenAI


def test_openai_client_completions(served, local):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    # (the decoders, then the embedding models; not the other one-shot models)
    assert [m.id for m in client.models.list().data] == ["lm", "emb"]
    assert client.models.retrieve("emb").id == "emb"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("mlp")
    want, want_text = expected(local, PROMPTS[2], max_tokens=10, temperature=0.0)
    out = client.completions.create(model="lm", prompt=PROMPTS[2], max_tokens=10, temperature=0)
    assert out.choices[0].text == want_text
    assert out.choices[0].finish_reason == want.finish_reason
    assert out.usage.completion_tokens == len(want.tokens)
    assert out.usage.prompt_tokens == len(PROMPTS[2].encode())

    want, want_text = expected(local, PROMPTS[0], max_tokens=16, temperature=1.0, seed=9)
    chunks = list(
        client.completions.create(
            model="lm", prompt=PROMPTS[0], max_tokens=16, temperature=1.0, seed=9, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == want_text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="lm", prompt="x", temperature=-2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_openai_fields_are_honoured_or_refused_never_ignored(served):
    """A field pxrt does not honour is a 400 in OpenAI's shape naming it, unless its
    value asks nothing (what clients send as defaults); max_completion_tokens is
    max_tokens; /v1/models/{id} is served and a 404 under /v1 has OpenAI's shape too."""
    url = f"{served.url}/v1"
    base = {"model": "lm", "prompt": [72, 105], "max_tokens": 3, "temperature": 0}
    defaults = {"echo": False, "logprobs": None, "n": 1, "best_of": 1, "presence_penalty": 0.0,
                "frequency_penalty": 0, "logit_bias": {}, "suffix": None, "user": "u1"}  # fmt: skip
    r = httpx.post(f"{url}/completions", json=base | defaults | {"priority": 1}, timeout=30)
    assert r.status_code == 200, r.text
    for field, value in [("best_of", 3), ("suffix", "x"),
                         ("response_format", {"type": "xml"}), ("guided_regex", "(a"),
                         ("guided_json", {"type": "nope"}), ("guided_choice", []),
                         ("tools", [{"type": "function"}]), ("stop_sequences", ["x"]), ("n", 0),
                         ("n", 9), ("echo", "yes"), ("logprobs", 21), ("logprobs", True),
                         ("presence_penalty", 3), ("frequency_penalty", "x"),
                         ("repetition_penalty", 0), ("min_tokens", -1),
                         ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}),
                         ("logit_bias", [5]), ("priority", 2**63), ("priority", 1.5)]:  # fmt: skip
        r = httpx.post(f"{url}/completions", json=base | {field: value}, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and error["type"] == "invalid_request_error", (field, r.text)
        assert field in error["message"], (field, error)
    chat = {"model": "lm", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    r = httpx.post(f"{url}/chat/completions", json=chat | {"max_completion_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text
    r = httpx.post(f"{url}/chat/completions", json=chat | {"top_logprobs": 2}, timeout=30)
    assert r.status_code == 400 and "needs logprobs: true" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/chat/completions", json=chat | {"echo": True}, timeout=30)
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/models/lm", timeout=10).json()["id"] == "lm"
    for path in ("/models/nope", "/nope"):
        r = httpx.get(url + path, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def _id(text):
    """A token's id from its text in OpenAI's logprobs (one byte, or ``token_id:N``)."""
    return int(text[len("token_id:") :]) if text.startswith("token_id:") else ord(text)


def _close(got, want):
    """Log-probabilities the server sent (JSON floats) against the engine's."""
    assert len(got) == len(want)
    for (lp, top), (wlp, wtop) in zip(got, want):
        assert abs(lp - wlp) <= 1e-4 and [t for t, _ in top] == [t for t, _ in wtop]
        assert all(abs(v - w) <= 1e-4 for (_, v), (_, w) in zip(top, wtop))


def test_logprobs_choices_echo_and_controls_over_each_protocol(served, local):
    """``n`` choices (seeded: seed, seed + 1), ``logprobs`` in OpenAI's completions and
    chat shapes and the generate extension's, ``echo``, the penalties and logit_bias:
    each equal to what the engine's own API gives for the same request."""
    url = served.url
    ids = ByteTokenizer().encode(PROMPTS[0])
    sampled = {"temperature": 1.0, "seed": 7, "max_tokens": 8}
    wants = [local.generate(ids, **(sampled | {"seed": 7 + i}), logprobs=3) for i in range(2)]
    body = {"model": "lm", "prompt": PROMPTS[0], "n": 2, "logprobs": 3, **sampled}
    doc = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert doc["usage"]["completion_tokens"] == sum(len(w.tokens) for w in wants)
    for i, (choice, want) in enumerate(zip(doc["choices"], wants)):
        assert choice["index"] == i
        marks = choice["logprobs"]
        assert [_id(t) for t in marks["tokens"]] == want.tokens
        tops = [[(_id(k), v) for k, v in top.items()] for top in marks["top_logprobs"]]
        _close(list(zip(marks["token_logprobs"], tops)), want.logprobs)
        lengths = [len(t) for t in marks["tokens"]]
        assert marks["text_offset"] == [sum(lengths[:k]) for k in range(len(lengths))]
    # Streamed: each choice's chunks, in any interleaving, add up to the same.
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
        *chunks, done = sse(r)
    assert done == "[DONE]"
    for i, want in enumerate(wants):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert [_id(t) for t in tokens] == want.tokens
    # echo: the prompt, then the completion.
    body = {"model": "lm", "prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0, "echo": True}
    text = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert text == PROMPTS[1] + expected(local, PROMPTS[1], max_tokens=5)[1]
    # echo with logprobs: the prompt's tokens' too (the first has none), then the
    # completion's, as the engine's prompt_logprobs; streamed, with the echo chunk.
    prompt_ids = ByteTokenizer().encode(PROMPTS[1])
    want = local.generate(prompt_ids, max_tokens=5, temperature=0.0, logprobs=2,
                          prompt_logprobs=2)  # fmt: skip
    body |= {"logprobs": 2}
    for stream in (False, True):
        if stream:
            with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
                *chunks, _ = sse(r)
            parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
            marks = {k: [v for p in parts if p for v in p[k]] for k in parts[0]}
        else:
            doc = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            marks = doc["choices"][0]["logprobs"]
        assert [_id(t) for t in marks["tokens"]] == prompt_ids + want.tokens
        assert marks["token_logprobs"][0] is None and marks["top_logprobs"][0] is None
        tops = [[(_id(k), v) for k, v in top.items()] for top in marks["top_logprobs"][1:]]
        _close(list(zip(marks["token_logprobs"][1:], tops)),
               want.prompt_logprobs[1:] + want.logprobs)  # fmt: skip
    # Chat: logprobs true, top_logprobs 2.
    messages = [{"role": "user", "content": "Hi"}]
    from pxrt.tokenizer import render_chat

    chat_ids = ByteTokenizer().encode(render_chat(demo.LM_CHAT_TEMPLATE, messages))
    want = local.generate(chat_ids, max_tokens=6, temperature=0.0, logprobs=2)
    body = {"model": "lm", "messages": messages, "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    content = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    content = content["choices"][0]["logprobs"]["content"]
    assert [e["bytes"] for e in content] == [[t] if t < 128 else None for t in want.tokens]
    got = [(e["logprob"], [(_id(a["token"]), a["logprob"]) for a in e["top_logprobs"]])
           for e in content]  # fmt: skip
    _close(got, want.logprobs)
    # The generate extension: the controls and logprobs.
    controls = {"repetition_penalty": 1.7, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                "min_tokens": 4, "logit_bias": {"101": 3.0}, "logprobs": 1}  # fmt: skip
    want = local.generate(ids, max_tokens=10, temperature=0.0, **controls)
    doc = httpx.post(
        f"{url}/v2/models/lm/generate",
        json={"input_ids": ids, "max_tokens": 10, "temperature": 0, "parameters": controls},
        timeout=60,
    ).json()
    assert doc["output_ids"] == want.tokens
    got = [(e["logprob"], [(a["id"], a["logprob"]) for a in e["top_logprobs"]])
           for e in doc["logprobs"]]  # fmt: skip
    _close(got, want.logprobs)
    assert want.tokens != local.generate(ids, max_tokens=10, temperature=0.0).tokens


def test_openai_stream_ends_with_done(served):
    with httpx.stream(
        "POST",
        f"{served.url}/v1/completions",
        json={"model": "lm", "prompt": [72, 105], "max_tokens": 5, "stream": True},
        timeout=30,
    ) as r:
        events = sse(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert events[-2]["usage"]["prompt_tokens"] == 2
    assert all(e["object"] == "text_completion" for e in events[:-1])


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one", "workers"])
def test_sigterm_finishes_open_streams(lm_path, workers):
    import signal

    proc = ServeProcess([lm_path, *workers])
    try:
        body = {"input_ids": [1, 2], "max_tokens": 400}
        with httpx.stream(
            "POST", f"{proc.url}/v2/models/lm/generate_stream", json=body, timeout=60
        ) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            try:  # a new request: the listener is closed, or the answer is a 503
                refused = httpx.post(
                    f"{proc.url}/v2/models/lm/generate", json={"input_ids": [1]}, timeout=10
                ).status_code
            except httpx.TransportError:  # (ReadError: a worker that took the connection
                refused = 503  # as it shut down closes it unread, as uvicorn does)
            events = [json.loads(first[6:])] + [
                json.loads(line[6:]) for line in lines if line.startswith("data: ")
            ]
        assert refused == 503
        assert events[-1]["finish_reason"] == "length"
        assert sum(len(e["output_ids"]) for e in events) == 400
    finally:
        assert proc.stop() == 0


def test_openai_client_chat_completions(served, local):
    openai = pytest.importorskip("openai")
    from pxrt.tokenizer import render_chat

    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ✓"},
    ]
    prompt = render_chat(demo.LM_CHAT_TEMPLATE, messages)
    assert prompt == "<|system|>Be brief.\n<|user|>Hi ✓\n<|assistant|>"
    want, want_text = expected(local, prompt, max_tokens=12, temperature=0.0)
    out = client.chat.completions.create(
        model="lm", messages=messages, max_tokens=12, temperature=0
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want_text
    assert out.choices[0].finish_reason == want.finish_reason
    assert out.usage.prompt_tokens == len(prompt.encode())

    want, want_text = expected(local, prompt, max_tokens=15, temperature=1.0, seed=4)
    chunks = list(
        client.chat.completions.create(
            model="lm", messages=messages, max_tokens=15, temperature=1.0, seed=4, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    with pytest.raises(openai.BadRequestError, match="messages must be"):
        client.chat.completions.create(model="lm", messages=[])


def test_openai_batched_prompts_equal_one_prompt_at_a_time(served, local):
    """A list of prompts (strings and token-id lists) with n: OpenAI's choices indexed
    across them (prompt k's n choices at k*n..), each equal to the prompt asked alone
    (greedy: to the engine's tokens), streamed or not; usage counts every prompt."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    batch = [PROMPTS[0], [72, 105, 33], PROMPTS[2]]
    greedy = client.completions.create(model="lm", prompt=batch, n=2, max_tokens=8, temperature=0)
    assert [c.index for c in greedy.choices] == list(range(6))
    for k, prompt in enumerate(batch):
        text = prompt if isinstance(prompt, str) else bytes(prompt).decode()
        want = expected(local, text, max_tokens=8, temperature=0.0)[1]
        assert [c.text for c in greedy.choices[2 * k : 2 * k + 2]] == [want, want]
    assert greedy.usage.prompt_tokens == sum(len(p.encode()) for p in PROMPTS[::2]) + 3
    seeded = {"max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 2}
    alone = [client.completions.create(model="lm", prompt=p, **seeded) for p in batch]
    chunks = client.completions.create(model="lm", prompt=batch, stream=True, **seeded)
    texts = [""] * 6
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for a in alone for c in a.choices]
    r = httpx.post(f"{served.url}/v1/completions", timeout=30, json={
        "model": "lm", "prompt": ["a"] * 5, "n": 2, "max_tokens": 1})  # fmt: skip
    assert r.status_code == 400 and "n must be an integer from 1 to 1 for each of 5" in r.text
    r = httpx.post(f"{served.url}/v1/completions", timeout=30, json={
        "model": "lm", "prompt": ["a", 5], "max_tokens": 1})  # fmt: skip
    assert r.status_code == 400 and "prompt must be" in r.text


def _schema(rng, depth=0):
    """A random JSON schema the demo's random weights can finish: objects (required
    fields, no others), arrays, enums, bounded integers and strings, booleans."""
    kinds = ["integer", "string", "enum", "boolean"] + (["array", "object"] if depth < 2 else [])
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "integer":
        low = int(rng.integers(-50, 50))
        return {"type": "integer", "minimum": low, "maximum": low + int(rng.integers(0, 500))}
    if kind == "string":
        return {"type": "string", "maxLength": int(rng.integers(1, 5))}
    if kind == "enum":
        return {"enum": [f"v{int(i)}" for i in rng.choice(50, int(rng.integers(1, 4)), False)]}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": _schema(rng, depth + 1), "maxItems": 2}
    return _object(rng, depth + 1)


def _object(rng, depth=0):
    names = [f"k{int(i)}" for i in rng.choice(20, int(rng.integers(1, 4)), False)]
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": {n: _schema(rng, depth) for n in names},
            "required": required, "additionalProperties": False}  # fmt: skip


def test_openai_structured_outputs_validate_against_their_schemas(served):
    """100 random JSON schemas through OpenAI's client (response_format json_schema on
    chat; vLLM's guided_json on completions), streamed and not, at temperature 0 and 1:
    every answer's text validates against its schema (jsonschema). Regexes and choices
    always match. A schema the engine cannot take is a 400 naming it."""
    import concurrent.futures
    import re

    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    rng = np.random.default_rng(52)
    # (every mode runs a few; one runs the hundred)
    schemas = [_object(rng) for _ in range(100 if served.mode == "workers" else 6)]
    messages = [{"role": "user", "content": "Answer in JSON."}]

    def ask(i, schema):
        options = {"max_tokens": 1000, "temperature": float(i % 4 < 2), "seed": i}
        stream = i % 2 == 1
        if i % 3 == 2:  # (completions: vLLM's field)
            extra = {"guided_json": schema}
            out = client.completions.create(
                model="lm", prompt="JSON: ", stream=stream, extra_body=extra, **options
            )
            parts = [c.choices[0] for c in out] if stream else [out.choices[0]]
            text = "".join(p.text for p in parts)
        else:
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
            out = client.chat.completions.create(model="lm", messages=messages, stream=stream,
                                                 response_format=fmt, **options)  # fmt: skip
            if stream:
                parts = [c.choices[0] for c in out if c.choices]
                text = "".join(p.delta.content or "" for p in parts)
            else:
                parts = [out.choices[0]]
                text = parts[0].message.content
        return text, parts[-1].finish_reason

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        try:
            answers = list(pool.map(ask, range(len(schemas)), schemas))
        except openai.InternalServerError:  # (what the server said, in the test's report)
            print(served.output()[-8000:])
            raise
    for schema, (text, reason) in zip(schemas, answers):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    for i in range(4):
        out = client.completions.create(
            model="lm", prompt=f"Code {i}: ", max_tokens=30, temperature=1.0, seed=i,
            extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"},
        )  # fmt: skip
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out.choices[0].text), out
        out = client.chat.completions.create(
            model="lm", messages=messages, max_tokens=30, temperature=1.0, seed=i,
            extra_body={"guided_choice": ["red", "green", "blue"]},
        )  # fmt: skip
        assert out.choices[0].message.content in ("red", "green", "blue"), out
    with pytest.raises(openai.BadRequestError, match=r"response_format: .*json.*minimum"):
        client.chat.completions.create(
            model="lm", messages=messages,
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "integer", "minimum": "x"}}},
        )  # fmt: skip


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False,
        },
    },
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"], "additionalProperties": False}}}  # fmt: skip


def test_openai_tool_calls_with_arguments_valid_for_their_function(served):
    """tool_choice a named function and "required": OpenAI's client parses tool_calls
    whose arguments validate against the function's parameters, streamed (as deltas)
    and not, finish_reason tool_calls; a named function not among the tools is a 400."""
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Paris?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed, choice in enumerate([named, "required", named, "required"]):
        options = {"max_tokens": 200, "temperature": 1.0, "seed": seed, "tools": [WEATHER, TIME],
                   "tool_choice": choice, "parallel_tool_calls": seed < 2}  # fmt: skip
        out = client.chat.completions.create(model="lm", messages=messages, **options)
        got = out.choices[0]
        assert got.finish_reason == "tool_calls" and got.message.content is None, got
        calls = got.message.tool_calls
        if choice is named or seed >= 2:
            assert len(calls) == 1
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if choice is named:
            assert calls[0].function.name == "get_weather"
        stream = client.chat.completions.create(
            model="lm", messages=messages, stream=True, **options
        )
        deltas = [c.choices[0] for c in stream if c.choices]
        streamed = [t for d in deltas for t in d.delta.tool_calls or ()]
        assert [t.function.arguments for t in streamed] == [c.function.arguments for c in calls]
        assert deltas[-1].finish_reason == "tool_calls"
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "Sun"},
    ]
    out = client.chat.completions.create(
        model="lm", messages=follow, max_tokens=5, tools=[WEATHER], tool_choice="none"
    )
    assert out.choices[0].message.tool_calls is None
    bad = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(openai.BadRequestError, match="tool_choice names 'nope'"):
        client.chat.completions.create(model="lm", messages=messages, tools=[WEATHER],
                                       tool_choice=bad)  # fmt: skip


@functools.cache
def _pooled(ids: tuple[int, ...]) -> np.ndarray:
    """The demo encoder's pooled output for ``ids`` in plain JAX (once per module: every
    front end is held to the same)."""
    import jax.numpy as jnp

    tokens = jnp.asarray([ids], jnp.int32)
    out = demo.encoder(demo.make_encoder_params(**ENCODER), tokens, jnp.ones(tokens.shape, bool))
    return np.asarray(out["pooled"][0])


def test_openai_embeddings_equal_the_pooled_output_in_plain_jax(served):
    """/v1/embeddings through OpenAI's client: strings and token ids, one and a list,
    float and base64, each equal to the model's pooled output in plain JAX (1e-5); a
    bad input is a 400 naming it while requests beside it are answered; a model that
    is not an embedding model is refused by name."""
    import base64
    import concurrent.futures

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    texts = ["Hello, world", "pxrt embeds ✓", "a" * 30]

    def want(ids):
        return _pooled(tuple(ids))

    out = client.embeddings.create(model="emb", input=texts)
    assert [d.index for d in out.data] == [0, 1, 2]
    assert out.usage.prompt_tokens == sum(len(t.encode()) for t in texts)
    for text, d in zip(texts, out.data):
        np.testing.assert_allclose(d.embedding, want(list(text.encode())), atol=1e-5)
    ids = [[72, 105], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    raw = client.embeddings.create(model="emb", input=ids, encoding_format="base64")
    for row, d in zip(ids, raw.data):
        got = d.embedding
        got = np.frombuffer(base64.b64decode(got), "<f4") if isinstance(got, str) else got
        np.testing.assert_allclose(got, want(row), atol=1e-5)
    one = client.embeddings.create(model="emb", input="Hi").data[0].embedding
    np.testing.assert_allclose(one, want([72, 105]), atol=1e-5)

    def bad():
        with pytest.raises(openai.BadRequestError, match=r"input\[1\]: 40 tokens, more than"):
            client.embeddings.create(model="emb", input=["ok", "x" * 40])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(bad)] + [
            pool.submit(client.embeddings.create, model="emb", input=t) for t in texts
        ]
        for f, text in zip(futures[1:], texts):
            np.testing.assert_allclose(f.result().data[0].embedding, want(list(text.encode())),
                                       atol=1e-5)  # fmt: skip
        futures[0].result()
    with pytest.raises(openai.BadRequestError, match="'mlp' is not an embedding model"):
        client.embeddings.create(model="mlp", input="x")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")


def test_workers_stream_without_jax(served, local):
    """Through `--workers`, a worker tokenizes, streams and detokenizes itself (the
    generation runs in the device process) without importing jax."""
    from servers import children

    if "--workers" not in served.proc.args:
        pytest.skip("one process")
    want, want_text = expected(local, PROMPTS[0], max_tokens=6, temperature=0.0)
    r = httpx.post(
        f"{served.url}/v2/models/lm/generate",
        json={"text_input": PROMPTS[0], "max_tokens": 6, "temperature": 0.0},
        timeout=30,
    )
    assert r.json()["output_ids"] == want.tokens and r.json()["text_output"] == want_text
    workers = []
    for pid in children(served.proc.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"serving.workers.worker" in f.read():
                workers.append(pid)
    assert len(workers) == 2
    for pid in workers:
        with open(f"/proc/{pid}/maps") as f:
            assert "jaxlib" not in f.read()


def test_a_decoder_has_readiness_metadata_and_config(served):
    """KServe's model endpoints know the decoder: ready, its generate tensors, a
    decoupled config with its sizes; a version it does not serve is a 404, and its
    statistics point to /metrics."""
    import tritonclient.http as th

    client = th.InferenceServerClient(served.url[len("http://") :])
    try:
        assert client.is_model_ready("lm") and client.is_model_ready("lm", "1")
        assert not client.is_model_ready("lm", "7")
        meta = client.get_model_metadata("lm")
        assert meta["platform"] == "pxrt_jax_decoder" and meta["versions"] == ["1"]
        names = [t["name"] for t in meta["inputs"]]
        assert names[:2] == ["text_input", "input_ids"] and "max_tokens" in names
        assert [t["name"] for t in meta["outputs"]] == ["output_ids", "text_output"]
        config = client.get_model_config("lm")
        assert config["model_transaction_policy"] == {"decoupled": True}
        assert config["parameters"]["slots"]["string_value"] == "4"
        assert config["parameters"]["max_length"]["string_value"] == str(MAX_LENGTH)
    finally:
        client.close()
    r = httpx.get(f"{served.url}/v2/models/lm/versions/7", timeout=10)
    assert r.status_code == 404 and "serving version 1" in r.json()["error"]
    r = httpx.get(f"{served.url}/v2/models/lm/stats", timeout=10)
    assert r.status_code == 404 and "its statistics are in /metrics" in r.json()["error"]


def test_pxrt_bench_measures_generation(served, tmp_path):
    """`pxrt bench --url` knows a decoder by its metadata and measures its streams: time
    to first token, inter-token latency, time per output token, output tokens/s, a
    goodput search on TTFT, and a record per request."""
    import subprocess
    import sys

    if "--workers" in served.proc.args or "--no-native-http" in served.proc.args:
        pytest.skip("the native path is enough")
    result = subprocess.run(
        [sys.executable, "-m", "serving.cli", "bench", "--url", served.url, "--model", "lm",
         "--concurrency", "2", "--duration", "0.5", "--request-rate", "10",
         "--prompt-tokens", "fixed:8", "--output-tokens", "fixed:12",
         "--goodput-p99-ms", "10000", "--records", str(tmp_path / "g.jsonl"),
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "generate: 2 streams" in result.stdout and "TTFT p50" in result.stdout
    doc = json.loads((tmp_path / "bench.json").read_text())
    closed, opened = doc["results"]
    for r in (closed, opened):
        assert r["errors"] == 0 and r["output_tokens_per_s"] > 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        # (a block of steps delivers its tokens together: on a quiet machine most gaps
        # can be 0, so the median may be; the tail never is)
        assert 0 <= r["itl_p50_ms"] <= r["itl_p99_ms"] and 0 < r["itl_p99_ms"]
    # A generous objective: the search finds a rate that meets it (how high depends on
    # the machine's load: the top of the search is 1.5x the throughput just measured).
    assert doc["goodput"]["goodput_per_s"] > 0 and doc["goodput"]["probes"]
    records = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    # (greedy, no stop token: each stream gives the 12 tokens it asked for, or stops at
    # the end-of-sequence token)
    assert records and all(1 <= r["tokens"] <= 12 and r["ttft_ms"] > 0 for r in records)


def test_generations_are_traced_with_their_stages(local):
    """A sampled generation request gets a ``pxrt.generate`` span under the caller's
    trace, with its queue, prefill, decode and detokenize events from the engine's own
    clocks, on the generate extension and OpenAI's endpoint; a refused one, an error span."""
    import asyncio

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from serving import Server, Tracing
    from serving.http.app import create_app

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

    async def main():
        server = Server(tracing=Tracing(1, provider))  # (not closed: it would close `local`)
        server.add_decoder("lm", local)
        transport = httpx.ASGITransport(app=create_app(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://pxrt") as http:
            one = await http.post(
                "/v2/models/lm/generate",
                json={"text_input": PROMPTS[0], "parameters": {"max_tokens": 6}},
                headers={"traceparent": f"00-{trace_id}-{parent}-01"},
            )
            two = await http.post(
                "/v1/completions",
                json={"model": "lm", "prompt": PROMPTS[1], "max_tokens": 4, "stream": True},
            )
            # (a refusal the model makes: a stop id outside its vocabulary; a bad
            # parameter alone is refused by the front end, before anything is traced)
            bad = await http.post(
                "/v2/models/lm/generate",
                json={"text_input": "x", "parameters": {"stop_ids": [10**6]}},
            )
        return one, two, bad

    one, two, bad = asyncio.run(main())
    assert one.status_code == 200 and two.status_code == 200 and bad.status_code == 400
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["pxrt.generate"] * 3
    first, second, refused = spans
    assert format(first.context.trace_id, "032x") == trace_id
    assert format(first.parent.span_id, "016x") == parent
    assert first.attributes["pxrt.output_tokens"] == 6
    assert first.attributes["pxrt.prompt_tokens"] == len(PROMPTS[0].encode())
    assert first.attributes["pxrt.model_version"] == local.version
    names = [e.name for e in first.events]
    assert names == ["queue", "prefill", "decode", "detokenize"], names
    decode = first.events[2].attributes
    assert decode["pxrt.tokens"] == 5 and decode["pxrt.inter_token_us"] > 0
    stamps = [e.timestamp for e in first.events]
    assert first.start_time <= stamps[0] <= stamps[1] <= stamps[2] <= first.end_time
    assert second.parent is None and second.attributes["pxrt.output_tokens"] == 4
    assert not refused.status.is_ok and "stop_ids" in refused.status.description
