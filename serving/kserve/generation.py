"""TokenStream over HTTP: KServe's (Triton's) generate extension and an OpenAI-compatible
completions API, for the decoders a ``Server`` serves (``Server.add_decoder``).

- ``POST /v2/models/{m}[/versions/{v}]/generate``: one JSON answer;
  ``.../generate_stream``: server-sent events, one per token, then a final one with the
  finish reason and the token counts. The prompt is ``text_input`` (text, through the
  artifact's tokenizer) or ``input_ids`` (token ids); options at the top level or under
  ``parameters``: ``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``,
  ``stop`` (strings), ``stop_ids``, ``prefix_cache`` (false: this prompt neither uses
  nor fills the prefix cache), the sampling controls (``presence_penalty``,
  ``frequency_penalty``, ``repetition_penalty``, ``min_tokens``, ``logit_bias``),
  ``logprobs`` (0-20: each token's log-probability and that many alternatives, in
  ``logprobs`` beside ``output_ids``), ``timeout`` (the generation's deadline in
  microseconds from arrival, as for inference: when it passes, the generation is
  cancelled and answered as a 504 / a last error event, the tokens before it sent),
  ``priority`` (its level among the prompts waiting for a slot, as for inference: the
  decoder's ``priority_levels``). Any other field or parameter is refused by name.
- ``POST /v1/completions`` and ``/v1/chat/completions`` (``messages`` rendered by the
  artifact's chat template; ``stream`` for server-sent events ending in ``data:
  [DONE]``) and ``GET /v1/models``, as OpenAI's client expects them: ``n`` choices,
  ``logprobs`` (completions: a count; chat: ``logprobs`` and ``top_logprobs``), ``echo``
  (completions), the penalties, ``logit_bias``, ``max_completion_tokens`` (chat),
  ``response_format`` (``json_object``, ``json_schema``), and vLLM's
  ``repetition_penalty``, ``min_tokens``, ``priority``, ``structured_outputs`` and
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (the last
  two kinds on the generate extension too).

A bad request is a 400 JSON error naming what is wrong; a full queue a 429 with
Retry-After; once a stream has started, an error is its last event. A client that hangs
up cancels its generation: its slot is free for the next step.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pxrt.decoder.grammar import StructuredOutput
from pxrt.decoder.params import SamplingParams
from pxrt.finish import DEADLINE, STOP

from ..errors import DeadlineExceeded, ExecutionFailed, ServerClosed, ServingError
from . import codec, core
from . import tools as tools_

_clock = time.perf_counter

if TYPE_CHECKING:
    from ..options import GenerationLimits
    from .backend import Backend, ServedDecoder, TokenStream

OPTIONS = (
    "max_tokens", "temperature", "top_k", "top_p", "seed", "stop_ids", "prefix_cache",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "priority",
)  # fmt: skip
# The JSON protocols' options besides (gRPC's one-element tensors carry neither).
JSON_OPTIONS = (*OPTIONS, "logprobs", "logit_bias")
SSE = "text/event-stream"
# OpenAI's defaults where pxrt's differ (its temperature is 1).
_OPENAI_DEFAULTS = {"max_tokens": 16, "temperature": 1.0}


class Prompt:
    """A parsed generation request: the token ids, its ``SamplingParams`` (checked),
    stop strings."""

    def __init__(
        self,
        ids: list[int],
        params: SamplingParams,
        stop: list[str],
        text: bool,
        timeout_s: float | None = None,
    ) -> None:
        self.ids = ids
        self.params = params
        self.stop = stop
        self.text = text  # answer with text (the prompt was text or a tokenizer exists)
        self.echo: str | None = None  # (completions' echo) the prompt's text to answer
        self.timeout_s = timeout_s  # its deadline, from arrival (None: none)
        self.timer: Any = None  # the deadline's timer once started
        self.trace: Any = None  # (sampled for tracing) its serving.tracing.GenerationTrace

    @property
    def logprobs(self) -> bool:
        """Whether its tokens come with their log-probabilities."""
        return self.params.logprobs is not None

    def choice(self, i: int) -> Prompt:
        """The ``i``-th of ``n`` choices: the same request with its own seed (the
        next, given one: seeded choices are reproducible, and differ)."""
        params = self.params
        if i and params.seed is not None:
            params = params.with_seed((params.seed + i) % 2**32)
        choice = Prompt(self.ids, params, self.stop, self.text, self.timeout_s)
        choice.echo = self.echo
        return choice


def invalid(message: str) -> core.InvalidRequest:
    return core.InvalidRequest(message)


_COUNTED = {"stop": ("strings", "--max-stop-strings"), "stop_ids": ("ids", "--max-stop-ids")}


def check_limit(field: str, count: int, most: int) -> None:
    """A request's ``count`` stop strings or ids (``field``) within ``most``."""
    if count > most:
        unit, flag = _COUNTED[field]
        raise invalid(f"{field}: {count} {unit}; at most {most} (pxrt serve {flag})")


def _stop_strings(value: Any, limits: GenerationLimits) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise invalid(f"stop must be a string or a list of strings, got {value!r:.80}")
    check_limit("stop", len(stops), limits.max_stop_strings)
    for s in stops:
        size = len(s.encode("utf-8", "surrogatepass"))
        if size > limits.max_stop_bytes:
            raise invalid(
                f"stop: a string of {size} bytes; at most {limits.max_stop_bytes} each "
                "(pxrt serve --max-stop-bytes)"
            )
    return stops


def _ids(value: Any, field: str) -> list[int]:
    if not (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        raise invalid(f"{field} must be a non-empty list of token ids, got {value!r:.80}")
    return value


def _encode(decoder: ServedDecoder, text: Any, field: str) -> list[int]:
    if not isinstance(text, str):
        raise invalid(f"{field} must be a string, got {type(text).__name__}")
    if decoder.tokenizer is None:
        raise invalid(
            f"model {decoder.name!r} has no tokenizer: send token ids (input_ids / a "
            "prompt of token ids) instead of text"
        )
    return decoder.tokenizer.encode(text)


def upload(server: Backend, budget: core.BodyBudget, length: str | bytes | None) -> core.Upload:
    """The ``core.Upload`` of a generation request's body (``length``: its
    Content-Length): within the server's ``GenerationLimits.max_request_kb`` (its JSON
    is parsed on the loop) and ``budget``."""
    return core.Upload(
        budget,
        server.generation_limits.max_request_kb << 10,
        length,
        "a generation request's body (pxrt serve --max-request-kb)",
    )


async def _body(request: Request, server: Backend) -> dict:
    """A generation request's body (Starlette's path), read within ``upload``'s limits."""
    body = upload(server, request.app.state.pxrt.budget, request.headers.get("content-length"))
    try:
        return body_of(await body.read(request.stream()))
    finally:
        body.release()


def _params(
    source: Mapping[str, Any], limits: GenerationLimits, defaults: Mapping[str, Any] = {}
) -> SamplingParams:
    """The request's ``SamplingParams`` (``JSON_OPTIONS`` of ``source`` over
    ``defaults``), checked here in the front end: a bad one is a 400 naming it."""
    options = {k: source[k] for k in JSON_OPTIONS if source.get(k) is not None}
    structured = structured_of(source)
    if structured is not None:
        options["structured"] = structured
    stop_ids = options.get("stop_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise invalid(f"stop_ids must be a list of token ids, got {stop_ids!r:.80}")
        check_limit("stop_ids", len(stop_ids), limits.max_stop_ids)
    try:
        return SamplingParams(**{**defaults, **options})
    except ValueError as exc:
        raise invalid(str(exc)) from None


# A structured output's fields: vLLM's ``structured_outputs`` (an object of
# ``pxrt.StructuredOutput``'s fields) and its older ``guided_*`` fields; OpenAI's
# ``response_format`` (chat and completions only).
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}  # fmt: skip
STRUCTURED = ("structured_outputs", *_GUIDED)


def structured_of(source: Mapping[str, Any]) -> StructuredOutput | None:
    """The request's structured output (None: free text), checked and compiled here:
    a schema or grammar the engine cannot take is a 400 naming it. At most one of
    ``response_format`` (``json_object``, ``json_schema``), ``structured_outputs`` and
    the ``guided_*`` fields."""
    given = [k for k in ("response_format", *STRUCTURED) if source.get(k) is not None]
    fmt = source.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise invalid(f"response_format must be an object with a type, got {fmt!r:.80}")
        if fmt["type"] == "text":
            given.remove("response_format")
    if len(given) > 1:
        raise invalid(f"give one structured output, got {', '.join(given)}")
    if not given:
        return None
    field = given[0]
    value = source[field]
    try:
        if field == "response_format":
            return _response_format(value)
        if field == "structured_outputs":
            if not isinstance(value, dict):
                raise ValueError(f"structured_outputs must be an object, got {value!r:.80}")
            return StructuredOutput(**value)
        return StructuredOutput(**{_GUIDED[field]: value})
    except (TypeError, ValueError) as exc:
        raise invalid(f"{field}: {exc}") from None


def _response_format(fmt: dict) -> StructuredOutput:
    kind = fmt["type"]
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"type must be text, json_object or json_schema, got {kind!r:.40}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ValueError("json_schema must be an object with the schema under 'schema'")
    # (OpenAI's ``strict``: the schema is always enforced here)
    return StructuredOutput(json=spec.get("schema") or {"type": "object"})


# The generate extension's fields: the prompt, the options at the top level or under
# ``parameters``. Any other is refused by name: a misspelt option (``max_token``) must
# not run the request with its default, unsaid.
# ``stream`` (Triton's own generate examples send ``"stream": false``) is taken as a bool
# and asks nothing more: the endpoint decides, ``generate`` whole, ``generate_stream`` as
# server-sent events.
_KSERVE_PARAMETERS = ("stop", "timeout", "stream", *JSON_OPTIONS, *STRUCTURED)
_KSERVE = ("text_input", "input_ids", "parameters", *_KSERVE_PARAMETERS)


def check_known(fields: Iterable[str], known: tuple[str, ...], kind: str) -> None:
    """Refuse the first of ``fields`` not in ``known``, naming it (a ``kind``: field,
    input, parameter) and listing what is accepted."""
    for field in fields:
        if field not in known:
            raise invalid(f"unknown {kind} {field!r:.60}; known: {', '.join(known)}")


def parse_kserve(decoder: ServedDecoder, body: dict, limits: GenerationLimits) -> Prompt:
    """The generate extension's request: ``text_input`` or ``input_ids``, options at the
    top level or under ``parameters`` (these win), within ``limits``; an unknown field
    or parameter is refused."""
    check_known(body, _KSERVE, "field")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise invalid("parameters must be an object")
    check_known(params, _KSERVE_PARAMETERS, "parameter")
    merged = {**body, **params}
    if not isinstance(merged.get("stream", False), bool):
        raise invalid(f"stream must be true or false, got {merged['stream']!r:.40}")
    if ("text_input" in body) == ("input_ids" in body):
        raise invalid("give the prompt as exactly one of text_input (text) or input_ids")
    if "text_input" in body:
        ids, text = _encode(decoder, body["text_input"], "text_input"), True
    else:
        ids, text = _ids(body["input_ids"], "input_ids"), decoder.tokenizer is not None
    stop = _stop_strings(merged.get("stop"), limits)
    params = _params(merged, limits)
    return Prompt(ids, params, stop, text, codec.timeout_s(merged.get("timeout"), "timeout"))


# OpenAI's request fields pxrt does not honour, each with the values that ask nothing of
# it (what clients send as defaults); any other value is a 400 naming the field, never
# silently ignored. Fields in neither table nor the ones parsed are refused as unknown.
_NOT_HONOURED: dict[str, tuple] = {
    "best_of": (1,),
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "store": (False,),
}
# Fields accepted and not acted on: they ask nothing of the model's answer.
_INFORMATIONAL = ("user", "metadata", "service_tier", "stream_options")
_COMPLETIONS = ("model", "prompt", "n", "stream", "stop", "timeout", "echo", "response_format",
                *JSON_OPTIONS, *STRUCTURED)  # fmt: skip
_CHAT = ("model", "messages", "n", "stream", "stop", "timeout", "max_completion_tokens",
         "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls",
         *JSON_OPTIONS, *STRUCTURED)  # fmt: skip


def _check_fields(body: dict, known: tuple[str, ...]) -> None:
    for field, value in body.items():
        if field in known or field in _INFORMATIONAL or value is None:
            continue
        noop = _NOT_HONOURED.get(field)
        if noop is None:
            raise invalid(f"unknown field {field!r:.60}")
        if not any(v == value and isinstance(v, bool) == isinstance(value, bool) for v in noop):
            raise invalid(f"{field} is not supported by this server, got {value!r:.80}")


def choices(body: dict, limits: GenerationLimits, prompts: int = 1) -> int:
    """An OpenAI request's ``n``: how many completions it asks for of each of its
    ``prompts``; ``n`` times the prompts at most ``max_choices``."""
    n = body.get("n", 1)
    if n is None:
        n = 1
    most = limits.max_choices // prompts
    if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= most):
        if prompts > limits.max_choices:
            raise invalid(
                f"prompt: {prompts} prompts, at most {limits.max_choices} in one request "
                "(pxrt serve --max-choices)"
            )
        per = f" for each of {prompts} prompts" if prompts > 1 else ""
        raise invalid(
            f"n must be an integer from 1 to {most}{per} (pxrt serve --max-choices "
            f"{limits.max_choices}), got {n!r:.40}"
        )
    return n


def echoed(body: dict) -> bool:
    """A completions request's ``echo``: answer with the prompt before the completion."""
    echo = body.get("echo", False)
    if echo is None:
        return False
    if not isinstance(echo, bool):
        raise invalid(f"echo must be true or false, got {echo!r:.40}")
    return echo


def parse_openai(
    decoder: ServedDecoder,
    body: dict,
    limits: GenerationLimits,
    known: tuple[str, ...] = _COMPLETIONS,
) -> tuple[Prompt, bool]:
    """``/v1/completions``: the prompt (text, or token ids), OpenAI's defaults
    (``max_tokens`` 16, ``temperature`` 1), and whether to stream. A field it does not
    honour is refused unless it asks nothing (``_NOT_HONOURED``)."""
    prompts, stream = parse_completions(decoder, body, limits, known)
    if len(prompts) != 1:
        raise invalid(f"give one prompt, got {len(prompts)}")
    return prompts[0], stream


def parse_completions(
    decoder: ServedDecoder,
    body: dict,
    limits: GenerationLimits,
    known: tuple[str, ...] = _COMPLETIONS,
) -> tuple[list[Prompt], bool]:
    """``/v1/completions``: its prompts (a string, token ids, or a list of either),
    each with the request's options, and whether to stream."""
    _check_fields(body, known)
    params = _params(body, limits, _OPENAI_DEFAULTS)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid(f"stream must be true or false, got {stream!r:.40}")
    stop = _stop_strings(body.get("stop"), limits)
    timeout_s = codec.timeout_s(body.get("timeout"), "timeout")
    echo = echoed(body)
    if echo and params.logprobs is not None:  # (the prompt's too: scored in chunks)
        params = msgspec.structs.replace(params, prompt_logprobs=params.logprobs)
    decode = getattr(decoder.tokenizer, "decode", None)
    parsed = []
    prompts, batched = _prompts_of(body.get("prompt"))
    for at, prompt in enumerate(prompts):
        name = f"prompt[{at}]" if batched else "prompt"
        if isinstance(prompt, str):
            ids = _encode(decoder, prompt, name)
        else:
            ids = _ids(prompt, name)
        one = Prompt(ids, params, stop, True, timeout_s)
        if echo:
            one.echo = prompt if isinstance(prompt, str) else decode(ids) if decode else None
        parsed.append(one)
    return parsed, stream


def _prompts_of(prompt: Any) -> tuple[list, bool]:
    """A completions request's prompts (a string, a list of token ids, or a list of
    strings or of token-id lists: OpenAI's batch), and whether they came as a batch."""
    if isinstance(prompt, str):
        return [prompt], False
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, (str, list)) for p in prompt):
            return prompt, True
        if not any(isinstance(p, (str, list)) for p in prompt):
            return [prompt], False  # (token ids: checked by _ids)
    raise invalid(
        "prompt must be a string, a list of token ids, or a non-empty list of strings or of "
        f"token-id lists, got {prompt!r:.60}"
    )


async def start(server: Backend, name: str, prompt: Prompt, headers: Any = ()) -> TokenStream:
    """Submit (``open_generation``: a worker's waits for the device process to accept
    it), with the prompt's deadline armed; a bad option is a 400 naming it. ``headers``:
    the request's (name, value) pairs, read only if it is traced (its span continues
    their W3C ``traceparent``)."""
    tracing = server.tracing
    trace = tracing.begin_generation(name, headers) if tracing is not None else None
    try:
        gen = await server.open_generation(name, prompt.ids, prompt.params)
    except BaseException as exc:
        if trace is not None:
            trace.failed(exc)
        if isinstance(exc, (TypeError, ValueError)) and not isinstance(exc, ServingError):
            raise invalid(str(exc)) from None
        raise
    if trace is not None:
        trace.version = server.decoder(name).version
    prompt.trace = trace
    if prompt.timeout_s is not None:
        loop = asyncio.get_running_loop()
        prompt.timer = loop.call_later(prompt.timeout_s, gen.cancel, DEADLINE)
    return gen


class Piece:
    """One step of a generation as the protocols see it: its token ids, their text,
    and (asked for) their log-probabilities (``pxrt.Generation.token_logprobs``)."""

    __slots__ = ("ids", "text", "logprobs")

    def __init__(self, ids: list[int], text: str, logprobs: list | None = None) -> None:
        self.ids = ids
        self.text = text
        self.logprobs = logprobs


class Pieces:
    """A generation's tokens as pieces with their text (``TextStream``: whole UTF-8
    characters, cut at a stop string, which ends the generation with reason ``stop``),
    one token at a time, whoever reads them (``pieces``, or a callback)."""

    __slots__ = ("gen", "prompt", "text", "stopped", "count")

    def __init__(self, decoder: ServedDecoder, gen: TokenStream, prompt: Prompt) -> None:
        from pxrt.tokenizer import TextStream

        self.gen = gen
        self.prompt = prompt
        self.text = (
            TextStream(decoder.tokenizer, prompt.stop) if decoder.tokenizer is not None else None
        )
        self.stopped = False  # a stop string came: take no more tokens
        self.count = 0  # tokens made into pieces

    def piece(self, token: int) -> Piece:
        text = self.text
        i = self.count = self.count + 1
        scores = self.gen.token_logprobs(i - 1, i) if self.prompt.logprobs else None
        if text is None:
            return Piece([token], "", scores)
        trace = self.prompt.trace
        if trace is None:
            piece = Piece([token], text.push(token), scores)
        else:
            t0 = _clock()
            piece = Piece([token], text.push(token), scores)
            trace.detokenize_s += _clock() - t0
        if text.stopped:
            self.stopped = True
            self.gen.cancel(STOP)  # (the piece holds the token that completed it)
        return piece

    def rest(self) -> Piece | None:
        """What the text held back, once the generation has ended."""
        rest = self.text.flush() if self.text is not None and not self.stopped else ""
        return Piece([], rest) if rest else None

    def close(self) -> None:
        """The reader is done: the deadline is disarmed, the generation ended."""
        self.close_of(self.prompt, self.gen)

    @staticmethod
    def close_of(prompt: Prompt, gen: TokenStream) -> None:
        if prompt.timer is not None:
            prompt.timer.cancel()
        gen.cancel()
        trace, prompt.trace = prompt.trace, None
        if trace is not None:
            trace.end(gen)


async def pieces(decoder: ServedDecoder, gen: TokenStream, prompt: Prompt) -> AsyncIterator[Piece]:
    """The generation's pieces (``Pieces``) as they come. Leaving early cancels the
    generation."""
    maker = Pieces(decoder, gen, prompt)
    try:
        async for token in gen:
            yield maker.piece(token)
            if maker.stopped:
                return
        rest = maker.rest()
        if rest is not None:
            yield rest
    finally:
        maker.close()


def usage(gen: TokenStream) -> dict:
    n = gen.delivered  # (a stop string may end it before tokens generated after it)
    return {
        "prompt_tokens": len(gen.prompt),
        "completion_tokens": n,
        "total_tokens": len(gen.prompt) + n,
    }


def kserve_logprobs(ids: list[int], scores: list) -> list[dict]:
    """The generate extension's ``logprobs``: per token, its id, log-probability and
    alternatives."""
    return [
        {"id": t, "logprob": lp, "top_logprobs": [{"id": i, "logprob": v} for i, v in top]}
        for t, (lp, top) in zip(ids, scores)
    ]


def token_text(decoder: ServedDecoder, token: int) -> str:
    """A token's own text, for OpenAI's logprobs: ``token_id:N`` (as vLLM writes it)
    without a tokenizer, or for a token that is not text on its own (a part of a
    UTF-8 character): distinct tokens have distinct keys in ``top_logprobs``."""
    decode = getattr(decoder.tokenizer, "decode", None)
    text = decode([token]) if decode is not None else "\ufffd"
    return f"token_id:{token}" if "\ufffd" in text else text


class CompletionLogprobs:
    """``/v1/completions``' ``logprobs`` of a choice, piece by piece (``text_offset``
    runs on from ``offset``, the characters before the completion)."""

    def __init__(self, decoder: ServedDecoder, offset: int = 0) -> None:
        self.decoder = decoder
        self.offset = offset

    def of(self, ids: list[int], scores: list, before: dict | None = None) -> dict:
        """The entries of ``ids`` (a score None: a prompt's first token, with none),
        after those of ``before`` (the prompt's, with ``echo``)."""
        doc: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}  # fmt: skip
        for token, score in zip(ids, scores):
            text = token_text(self.decoder, token)
            doc["tokens"].append(text)
            doc["token_logprobs"].append(None if score is None else score[0])
            doc["top_logprobs"].append(
                None if score is None else {token_text(self.decoder, i): v for i, v in score[1]}
            )
            doc["text_offset"].append(self.offset)
            self.offset += len(text)
        return doc if before is None else {k: before[k] + doc[k] for k in doc}


def chat_logprobs(decoder: ServedDecoder, ids: list[int], scores: list) -> dict:
    """``/v1/chat/completions``' ``logprobs`` of the tokens ``ids``."""

    def entry(token: int, logprob: float) -> dict:
        text = token_text(decoder, token)
        raw = None if text.startswith("token_id:") else list(text.encode("utf-8"))
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {
        "content": [
            entry(t, lp) | {"top_logprobs": [entry(i, v) for i, v in top]}
            for t, (lp, top) in zip(ids, scores)
        ]
    }


async def merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of ``streams`` as they come (one stream: itself). Each is read by a
    task of its own; leaving early cancels them, and a stream's error is raised once
    every other one has ended."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        finally:
            queue.put_nowait(end)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is end:
                left -= 1
            else:
                yield item
        for task in tasks:
            task.result()
    finally:
        for task in tasks:
            task.cancel()


async def open_choices(
    server: Backend, name: str, prompt: Prompt, n: int, headers: Any = ()
) -> list[tuple[Prompt, TokenStream]]:
    """``n`` generations of ``prompt`` (``Prompt.choice``), submitted one after the
    other: the first caches the prompt's start, which the others then share. A refusal
    cancels those already started."""
    opened: list[tuple[Prompt, TokenStream]] = []
    try:
        for i in range(n):
            choice = prompt.choice(i)
            opened.append((choice, await start(server, name, choice, headers)))
    except BaseException:
        for choice, gen in opened:
            Pieces.close_of(choice, gen)
        raise
    return opened


async def collected(
    decoder: ServedDecoder, gen: TokenStream, prompt: Prompt
) -> tuple[str, list[int], list]:
    """A whole generation's (text, token ids, their log-probabilities if asked)."""
    text: list[str] = []
    ids: list[int] = []
    scores: list = []
    async for piece in pieces(decoder, gen, prompt):
        text.append(piece.text)
        ids += piece.ids
        scores += piece.logprobs or ()
    return "".join(text), ids, scores


async def each_choice(
    opened: list[tuple[Prompt, TokenStream]],
    answer: Callable[[int, Prompt, TokenStream], Awaitable[dict]],
) -> list[dict]:
    """``answer(i, prompt, generation)`` of every choice, at once; all of them ended
    (their deadlines disarmed) whatever happens."""
    try:
        return list(await asyncio.gather(*(answer(i, *pair) for i, pair in enumerate(opened))))
    finally:
        for pair in opened:
            Pieces.close_of(*pair)


def usage_of(gens: list[TokenStream], prompts: int = 1) -> dict:
    """``usage`` of one request's choices (``prompts`` prompts' choices in turn, as
    many each): every prompt once, every choice's tokens."""
    n = sum(gen.delivered for gen in gens)
    each = len(gens) // prompts
    prompt = sum(len(gens[i * each].prompt) for i in range(prompts))
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}


def _event(doc: Any) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _error_event(exc: BaseException) -> bytes:
    return _event({"error": core.status_of(exc).message})


# --------------------------------------------------------------------------- KServe


class KServeCall:
    """One generate-extension request, validated and submitted (``open``): ``json``
    answers it whole, ``events`` streams it (server-sent events)."""

    def __init__(self, name: str, decoder: ServedDecoder, prompt: Prompt, gen: TokenStream) -> None:
        self.decoder = decoder
        self.prompt = prompt
        self.gen = gen
        self.head = {"model_name": name, "model_version": decoder.version}

    @classmethod
    async def open(
        cls, server: Backend, params: Mapping[str, Any], body: dict, headers: Any = ()
    ) -> KServeCall:
        name = params["model"]
        decoder = core.resolve_decoder(server, name, params.get("version"))
        prompt = parse_kserve(decoder, body, server.generation_limits)
        return cls(name, decoder, prompt, await start(server, name, prompt, headers))

    async def json(self) -> dict:
        text, ids, scores = await collected(self.decoder, self.gen, self.prompt)
        gen = self.gen
        raise_error(gen)
        doc: dict[str, Any] = self.head | {
            "output_ids": ids,
            "finish_reason": gen.finish_reason,
            "usage": usage(gen),
        }
        if self.prompt.text:
            doc["text_output"] = text
        if self.prompt.logprobs:
            doc["logprobs"] = kserve_logprobs(ids, scores)
        return doc

    def event(self, piece: Piece) -> bytes:
        """A token's event (server-sent)."""
        doc: dict[str, Any] = self.head | {"output_ids": piece.ids}
        if self.prompt.text:
            doc["text_output"] = piece.text
        if self.prompt.logprobs:
            doc["logprobs"] = kserve_logprobs(piece.ids, piece.logprobs or [])
        return _event(doc)

    def last_event(self) -> bytes:
        """The final event once the generation has ended: its finish reason and usage,
        or its error."""
        gen = self.gen
        try:
            raise_error(gen)
        except Exception as exc:  # noqa: BLE001 - once streaming, an error is an event
            return _error_event(exc)
        final: dict[str, Any] = self.head | {"output_ids": [], "finish_reason": gen.finish_reason}
        if self.prompt.text:
            final["text_output"] = ""
        return _event(final | {"usage": usage(gen)})

    async def events(self) -> AsyncIterator[bytes]:
        """An event per token, then the final one (an error is the last event)."""
        try:
            async for piece in pieces(self.decoder, self.gen, self.prompt):
                yield self.event(piece)
        except Exception as exc:  # noqa: BLE001 - once streaming, an error is an event
            if exc is not self.gen.error:  # (its own is answered as last_event does)
                yield _error_event(exc)
                return
        yield self.last_event()


async def kserve_generate(
    request: Request, server: Backend, on_disconnect: Callable | None = None
) -> Response:
    """``POST .../generate``: one JSON answer. ``on_disconnect`` (``pxrt serve``'s scope
    extension) takes a callback for a client that hangs up: its generation is cancelled."""
    call = await KServeCall.open(
        server, request.path_params, await _body(request, server), request.scope["headers"]
    )
    if on_disconnect is not None:
        on_disconnect(call.gen.cancel)
    return JSONResponse(await call.json())


async def kserve_stream(request: Request, server: Backend) -> Response:
    """``POST .../generate_stream``: server-sent events (Starlette cancels the stream,
    and with it the generation, when the client hangs up)."""
    call = await KServeCall.open(
        server, request.path_params, await _body(request, server), request.scope["headers"]
    )
    return StreamingResponse(call.events(), media_type=SSE, headers={"Cache-Control": "no-cache"})


def body_of(raw: bytes) -> dict:
    """A request body as a JSON object (``ProtocolError`` otherwise)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise core.ProtocolError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise core.ProtocolError("the request body must be a JSON object")
    return body


def raise_error(gen: TokenStream) -> None:
    """The generation's failure as the front ends answer it: a deadline that passed,
    the decoder closed under it, its step failed."""
    if gen.finish_reason == DEADLINE:
        raise DeadlineExceeded(
            f"the generation did not end before its deadline ({gen.delivered} tokens were sent)"
        )
    if isinstance(gen.error, ServingError):  # (a worker's: raised as it came)
        raise gen.error
    if gen.error is not None:
        from pxrt.generate import DecoderClosed

        if isinstance(gen.error, DecoderClosed):
            raise ServerClosed(str(gen.error))
        raise ExecutionFailed(str(gen.error))


# --------------------------------------------------------------------------- OpenAI


def openai_error(exc: BaseException) -> Response | None:
    """A known error as OpenAI's clients read one (``{"error": {"message", "type",
    "code"}}``, with the status it has everywhere); None for an unexpected one."""
    if not core.is_known(exc):
        return None
    status = core.status_of(exc)
    kind = "invalid_request_error" if status.http < 500 else "server_error"
    doc = {"error": {"message": status.message, "type": kind, "param": None, "code": None}}
    return JSONResponse(doc, status.http, status.headers)


def openai_endpoint(
    handler: Callable[[Backend, str, ServedDecoder, dict, Any], Awaitable[Response]],
) -> Callable[[Request, Backend], Awaitable[Response]]:
    """An OpenAI endpoint: the body read, its ``model`` looked up among the decoders,
    and known errors answered in OpenAI's shape."""

    @functools.wraps(handler)
    async def endpoint(request: Request, server: Backend) -> Response:
        try:
            body = await _body(request, server)
            name = body.get("model")
            if not isinstance(name, str):
                raise invalid("model must be the name of a model served (GET /v1/models)")
            decoder = server.decoder(name)
            return await handler(server, name, decoder, body, request.scope["headers"])
        except Exception as exc:  # noqa: BLE001 - answered in OpenAI's shape when known
            answer = openai_error(exc)
            if answer is None:
                raise
            return answer

    return endpoint


@openai_endpoint
async def openai_completions(
    server: Backend, name: str, decoder: ServedDecoder, body: dict, headers: Any = ()
) -> Response:
    prompts, stream = parse_completions(decoder, body, server.generation_limits)
    n = choices(body, server.generation_limits, len(prompts))
    opened: list[tuple[Prompt, TokenStream]] = []
    try:  # (OpenAI's order: the n choices of the first prompt, then the next's)
        for prompt in prompts:
            opened += await open_choices(server, name, prompt, n, headers)
    except BaseException:
        for pair in opened:
            Pieces.close_of(*pair)
        raise
    gens = [gen for _, gen in opened]
    ident = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    head = {"id": ident, "object": "text_completion", "created": created, "model": name}

    # Without a tokenizer there is no text to give: the choices carry the token ids
    # (vLLM's ``token_ids`` and ``prompt_token_ids``) and their text is null. ``echo``:
    # the prompt comes first (its text, or its ids before the completion's).
    ids_only = decoder.tokenizer is None
    echo = body.get("echo") is True

    def choice(
        i: int, text: str, finish: str | None, ids: list[int], first: bool, scores: Any
    ) -> dict:
        doc: dict[str, Any] = {"index": i, "text": None if ids_only else text}
        doc |= {"logprobs": scores, "finish_reason": finish}
        if ids_only:
            prompt = opened[i][0]
            doc["token_ids"] = (list(prompt.ids) if echo and first else []) + ids
            if first:
                doc["prompt_token_ids"] = list(prompt.ids)
        return doc

    def logprobs_of(choice_prompt: Prompt) -> CompletionLogprobs | None:
        if not choice_prompt.logprobs:
            return None
        return CompletionLogprobs(decoder, len(choice_prompt.echo or "") if echo else 0)

    def prompt_logprobs(choice_prompt: Prompt, gen: TokenStream) -> dict | None:
        """With echo and logprobs: the prompt's entries (text offsets from 0)."""
        scores = gen.prompt_token_logprobs() if echo and choice_prompt.logprobs else None
        if scores is None:
            return None
        return CompletionLogprobs(decoder).of(list(choice_prompt.ids), scores)

    async def whole(i: int, choice_prompt: Prompt, gen: TokenStream) -> dict:
        text, ids, scores = await collected(decoder, gen, choice_prompt)
        raise_error(gen)
        marks = logprobs_of(choice_prompt)
        before = prompt_logprobs(choice_prompt, gen)
        got = None if marks is None else marks.of(ids, scores, before)
        text = (choice_prompt.echo or "") + text if echo else text
        return choice(i, text, gen.finish_reason, ids, True, got)

    if not stream:
        answers = await each_choice(opened, whole)
        return JSONResponse(head | {"choices": answers, "usage": usage_of(gens, len(prompts))})

    async def chunks(i: int, choice_prompt: Prompt, gen: TokenStream) -> AsyncIterator[dict]:
        marks = logprobs_of(choice_prompt)
        first = True
        # (the prompt's scores come with its first token: the echo waits for it)
        echoing = echo and bool(choice_prompt.echo or ids_only)
        if echoing and marks is None:
            yield choice(i, choice_prompt.echo or "", None, [], True, None)
            first, echoing = False, False
        held: list = []  # (a token whose text is held back: its scores go with the next)
        async for piece in pieces(decoder, gen, choice_prompt):
            if echoing:
                got = prompt_logprobs(choice_prompt, gen)
                yield choice(i, choice_prompt.echo or "", None, [], True, got)
                first, echoing = False, False
            held += zip(piece.ids, piece.logprobs or [None] * len(piece.ids))
            if piece.text or (ids_only and piece.ids):
                ids = [t for t, _ in held]
                got = None if marks is None else marks.of(ids, [lp for _, lp in held])
                yield choice(i, piece.text, None, piece.ids, first, got)
                first, held = False, []
        raise_error(gen)
        yield choice(i, "", gen.finish_reason, [], first, None)

    async def events() -> AsyncIterator[bytes]:
        try:
            last: dict = {}
            async for doc in merged([chunks(i, *pair) for i, pair in enumerate(opened)]):
                if len(opened) == 1 and doc["finish_reason"] is not None:
                    last = doc  # (answered with the usage, as before)
                    continue
                yield _event(head | {"choices": [doc]})
            usage = usage_of(gens, len(prompts))
            yield _event(head | {"choices": [last] if last else [], "usage": usage})
            yield b"data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - once streaming, an error is an event
            yield _error_event(exc)
        finally:
            for pair in opened:
                Pieces.close_of(*pair)

    return StreamingResponse(events(), media_type=SSE, headers={"Cache-Control": "no-cache"})


def parse_chat(
    decoder: ServedDecoder, body: dict, limits: GenerationLimits
) -> tuple[Prompt, bool, tools_.Tools | None]:
    """``/v1/chat/completions``: ``messages`` (and ``tools``) rendered by the
    artifact's chat template, then the options as for ``/v1/completions``
    (``max_completion_tokens`` is ``max_tokens``); the request's tools, if any
    (``serving.kserve.tools``)."""
    from pxrt.tokenizer import render_chat

    _check_fields(body, _CHAT)
    if body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise invalid("give max_tokens or max_completion_tokens, not both")
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    if decoder.chat_template is None or decoder.tokenizer is None:
        raise invalid(f"model {decoder.name!r} has no chat template: use /v1/completions")
    messages = body.get("messages")
    if not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and (
                isinstance(m.get("content"), str)
                or m.get("content") is None
                and isinstance(m.get("tool_calls"), list)
            )
            for m in messages
        )
    ):
        raise invalid(
            "messages must be a non-empty list of {role, content} objects with text content "
            "(an assistant's tool calls: content null and tool_calls)"
        )
    tools = tools_.parse(body)
    extra = {"tools": tools.tools} if tools is not None else {}
    try:
        text = render_chat(decoder.chat_template, messages, **extra)
    except Exception as exc:  # noqa: BLE001 - a template that fails on these messages
        raise invalid(f"the chat template failed on these messages: {exc}") from None
    drop = ("messages", "max_completion_tokens", "top_logprobs", "logprobs", "tools",
            "tool_choice", "parallel_tool_calls")  # fmt: skip
    fields = {k: v for k, v in body.items() if k not in drop}
    held = tools.structured() if tools is not None else None
    if tools is not None and held is not None:
        other = [k for k in ("response_format", *STRUCTURED) if body.get(k) is not None]
        if other and body.get("response_format") != {"type": "text"}:
            raise invalid(f"tool_choice {tools.mode} holds the output to the tools' "
                          f"schemas: it cannot be combined with {other[0]}")  # fmt: skip
        fields["structured_outputs"] = held
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise invalid(f"logprobs must be true or false, got {wanted!r:.40}")
    if top is not None and not wanted:
        raise invalid("top_logprobs needs logprobs: true")
    if wanted:
        fields["logprobs"] = 0 if top is None else top
        if isinstance(top, bool) or not isinstance(top, int):
            raise invalid(f"top_logprobs must be an integer from 0 to 20, got {top!r:.40}")
    return (*parse_openai(decoder, {**fields, "prompt": text}, limits), tools)


@openai_endpoint
async def openai_chat(
    server: Backend, name: str, decoder: ServedDecoder, body: dict, headers: Any = ()
) -> Response:
    prompt, stream, tools = parse_chat(decoder, body, server.generation_limits)
    n = choices(body, server.generation_limits)
    opened = await open_choices(server, name, prompt, n, headers)
    gens = [gen for _, gen in opened]
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}

    def scores_of(ids: list[int], scores: Any) -> dict | None:
        return chat_logprobs(decoder, ids, scores) if prompt.logprobs else None

    def answer(text: str, finish: str | None) -> tuple[dict, str | None]:
        """(the message, the finish reason): the tool calls in ``text``, or ``text``."""
        calls = tools.calls(text) if tools is not None and finish == STOP else None
        if calls is None:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

    async def whole(i: int, choice_prompt: Prompt, gen: TokenStream) -> dict:
        text, ids, scores = await collected(decoder, gen, choice_prompt)
        raise_error(gen)
        message, finish = answer(text, gen.finish_reason)
        return {"index": i, "message": message, "logprobs": scores_of(ids, scores),
                "finish_reason": finish}  # fmt: skip

    if not stream:
        answers = await each_choice(opened, whole)
        return JSONResponse(
            head | {"object": "chat.completion", "choices": answers, "usage": usage_of(gens)}
        )

    def chunk(i: int, delta: dict, finish: str | None, scores: Any = None) -> bytes:
        choice = {"index": i, "delta": delta, "logprobs": scores, "finish_reason": finish}
        return _event(head | {"object": "chat.completion.chunk", "choices": [choice]})

    async def chunks(i: int, choice_prompt: Prompt, gen: TokenStream) -> AsyncIterator[bytes]:
        if tools is not None:  # (a call is known once its text is whole: sent then)
            text, ids, scores = await collected(decoder, gen, choice_prompt)
            raise_error(gen)
            message, finish = answer(text, gen.finish_reason)
            calls = [c | {"index": j} for j, c in enumerate(message.get("tool_calls", ()))]
            delta = {"role": "assistant"} | ({"tool_calls": calls} if calls else message)
            yield chunk(i, delta, None, scores_of(ids, scores))
            yield chunk(i, {}, finish)
            return
        yield chunk(i, {"role": "assistant", "content": ""}, None)
        held: list = []  # (a token whose text is held back: its scores go with the next)
        async for piece in pieces(decoder, gen, choice_prompt):
            held += zip(piece.ids, piece.logprobs or [None] * len(piece.ids))
            if piece.text:
                got = scores_of([t for t, _ in held], [lp for _, lp in held])
                yield chunk(i, {"content": piece.text}, None, got)
                held = []
        raise_error(gen)
        yield chunk(i, {}, gen.finish_reason)

    async def events() -> AsyncIterator[bytes]:
        try:
            async for data in merged([chunks(i, *pair) for i, pair in enumerate(opened)]):
                yield data
            yield b"data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - once streaming, an error is an event
            yield _error_event(exc)
        finally:
            for pair in opened:
                Pieces.close_of(*pair)

    return StreamingResponse(events(), media_type=SSE, headers={"Cache-Control": "no-cache"})


def _model_doc(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "pxrt"}


def _openai_names(server: Backend) -> list[str]:
    """The models OpenAI's endpoints serve: the decoders, then the embedding models."""
    models = server.models
    return [*server.decoders, *(n for n in models if core.is_embedding(server.model(n)))]


async def openai_models(request: Request, server: Backend) -> Response:
    """``GET /v1/models``: the decoders and the embedding models."""
    docs = [_model_doc(n) for n in _openai_names(server)]
    return JSONResponse({"object": "list", "data": docs})


async def openai_model(request: Request, server: Backend) -> Response:
    """``GET /v1/models/{model}``: one of ``openai_models``' (404 in OpenAI's shape)."""
    name = request.path_params["model"]
    if name not in _openai_names(server):
        return openai_not_found(f"The model {name!r:.100} does not exist", "model_not_found")
    return JSONResponse(_model_doc(name))


def openai_not_found(message: str, code: str | None = None) -> Response:
    """A 404 as OpenAI's clients read one."""
    doc = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                     "code": code}}  # fmt: skip
    return JSONResponse(doc, 404)
