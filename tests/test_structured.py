"""Structured outputs and tool calls, without a model: what a request may ask
(``pxrt.StructuredOutput``, OpenAI's and vLLM's fields), checked where it is parsed;
the masks a decoder's grammar engine makes; the tool calls found in a text."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

import pxrt
from pxrt.decoder.grammar import Grammars
from pxrt.tokenizer import ByteTokenizer
from serving.kserve import core
from serving.kserve import tools as tools_
from serving.kserve.generation import structured_of

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_structured_output_is_one_constraint_checked_when_made():
    for kind, value in [("json", SCHEMA), ("json", json.dumps(SCHEMA)), ("json_object", True),
                        ("regex", "[a-z]+"), ("choice", ["x", "y"]),
                        ("grammar", 'start: "a" | "b"'),
                        ("grammar", 'root ::= "a" | "b"')]:  # fmt: skip
        so = pxrt.StructuredOutput(**{kind: value})
        assert so.kind == kind and so.compiled()
    assert pxrt.StructuredOutput(json=json.dumps(SCHEMA)).json == SCHEMA  # (text: parsed)
    for options, message in [
        ({}, "give exactly one of json, json_object, regex, choice, grammar"),
        ({"regex": "a", "choice": ["a"]}, r"exactly one .*\(got regex, choice\)"),
        ({"json": "{"}, "json: not JSON"),
        ({"json": [1]}, "json must be a JSON schema"),
        ({"json": {"type": "nope"}}, "structured output: json: .*nope"),
        ({"regex": "(a"}, "structured output: regex: .*unclosed group"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"grammar": "start: nope"}, "structured output: grammar:"),
        ({"json_object": 1}, "json_object must be true"),
    ]:
        with pytest.raises(ValueError, match=message):
            pxrt.StructuredOutput(**options)


def test_sampling_params_carry_one_across_processes():
    params = pxrt.SamplingParams(max_tokens=5, structured={"regex": "[0-9]+"})
    assert isinstance(params.structured, pxrt.StructuredOutput) and params.has_controls
    assert not params.has_penalties
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=pxrt.SamplingParams)
    assert back == params and back.structured.compiled() == params.structured.compiled()
    with pytest.raises(ValueError, match="structured must be a pxrt.StructuredOutput, got int"):
        pxrt.SamplingParams(structured=3)


def test_openai_and_vllm_fields_become_one_structured_output():
    cases = [
        ({"response_format": {"type": "json_object"}}, pxrt.StructuredOutput(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                     "schema": SCHEMA}}},
         pxrt.StructuredOutput(json=SCHEMA)),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": SCHEMA}, pxrt.StructuredOutput(json=SCHEMA)),
        ({"guided_regex": "a+"}, pxrt.StructuredOutput(regex="a+")),
        ({"guided_choice": ["a", "b"]}, pxrt.StructuredOutput(choice=("a", "b"))),
        ({"guided_grammar": 'start: "a"'}, pxrt.StructuredOutput(grammar='start: "a"')),
        ({"structured_outputs": {"choice": ["a"]}}, pxrt.StructuredOutput(choice=("a",))),
        ({}, None),
    ]  # fmt: skip
    for body, want in cases:
        assert structured_of(body) == want, body
    for body, message in [
        ({"response_format": {"type": "xml"}}, "response_format: type must be text, json_object"),
        ({"response_format": "json"}, "response_format must be an object with a type"),
        ({"guided_regex": "a", "guided_json": SCHEMA}, "one structured output, got guided_json"),
        ({"structured_outputs": {"regex": "a", "json_object": True}}, "exactly one"),
        ({"structured_outputs": {"jsonn": SCHEMA}}, "structured_outputs: .*jsonn"),
        ({"guided_json": {"type": "integer", "minimum": "x"}}, "guided_json: .*minimum"),
    ]:
        with pytest.raises(core.InvalidRequest, match=message):
            structured_of(body)


def _bits(row, vocab):
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def test_masks_allow_what_the_grammar_allows_and_only_the_rows_asked():
    """Byte tokens: the first mask of a choice allows its first bytes only; a step's
    masks fill the rows of the matchers given and leave every other row all allowed;
    ids past the tokenizer's (specials) never, the end token once the text is whole.
    A refused token leaves its matcher in its error state, the others go on."""
    grammars = Grammars(ByteTokenizer(), 260, [257], "")
    so = pxrt.StructuredOutput(choice=["yes", "no"])
    m, mask = grammars.matcher(so)
    first = _bits(mask[0], 260)
    assert set(np.flatnonzero(first)) == {ord("y"), ord("n")}
    other, _ = grammars.matcher(so)
    grammars.consume([(m, ord("n")), (other, ord("x"))])  # (refused: an error state)
    assert other.is_error() and not m.is_error()
    grammars.consume([(m, ord("o"))])
    other, _ = grammars.matcher(so)
    masks = grammars.masks([(m, 2), (other, 0)], 4)
    assert set(np.flatnonzero(_bits(masks[2], 260))) == {257}  # (whole: the end token)
    assert set(np.flatnonzero(_bits(masks[0], 260))) == {ord("y"), ord("n")}
    assert _bits(masks[1], 260).all() and _bits(masks[3], 260).all()
    with pytest.raises(ValueError, match="no stop ids"):
        Grammars(ByteTokenizer(), 260, [], "")


def test_tool_calls_in_text_and_the_schemas_they_are_held_to():
    weather = {"type": "function", "function": {"name": "w", "parameters": SCHEMA}}
    other = {"type": "function", "function": {"name": "t"}}
    auto = tools_.parse({"tools": [weather, other]})
    assert auto.mode == "auto" and auto.structured() is None
    for text, want in [
        ('{"name": "w", "arguments": {"a": 1}}', [("w", {"a": 1})]),
        ('[{"name": "w", "arguments": {"a": 1}}, {"name": "t", "parameters": {}}]',
         [("w", {"a": 1}), ("t", {})]),
        ('Sure. <tool_call>\n{"name": "w", "arguments": "{\\"a\\": 2}"}\n</tool_call>',
         [("w", {"a": 2})]),
        ("It is sunny.", None),
        ('{"name": "nope", "arguments": {}}', None),
        ('{"a": 1}', None),
    ]:  # fmt: skip
        calls = auto.calls(text)
        got = calls and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                         for c in calls]  # fmt: skip
        assert got == want, text
    named = tools_.parse(
        {"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "w"}}}
    )
    assert named.structured() == {"json": SCHEMA}
    assert named.calls('{"a": 3}')[0]["function"]["name"] == "w"
    required = tools_.parse({"tools": [weather, other], "tool_choice": "required",
                             "parallel_tool_calls": False})  # fmt: skip
    schema = required.structured()["json"]
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    pxrt.StructuredOutput(**required.structured())  # (the engine takes it)
    assert tools_.parse({"tools": [weather], "tool_choice": "none"}) is None
    for body, message in [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function"}]}, r"tools\[0\] must be"),
        ({"tools": [weather], "tool_choice": "sometimes"}, "tool_choice must be none, auto"),
        ({"tools": [weather], "parallel_tool_calls": "yes"}, "parallel_tool_calls must be"),
    ]:
        with pytest.raises(core.InvalidRequest, match=message):
            tools_.parse(body)
