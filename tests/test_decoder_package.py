"""The generation engine's package (``pxrt/decoder/``): its old import paths still work,
and what a front-end worker imports of it leaves jax out."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_artifact_names_are_the_packages_too():
    from pxrt import decoder
    from pxrt.decoder import LENGTH_DIM, export

    assert LENGTH_DIM == export.LENGTH_DIM == "length"
    assert decoder.export_decoder is export.export_decoder
    assert decoder.read is export.read


def test_the_request_side_and_the_scheduler_do_not_import_jax():
    code = (
        "import sys, pxrt.decoder, pxrt.decoder.params, pxrt.decoder.request, "
        "pxrt.decoder.prefix, pxrt.decoder.scheduler, pxrt.decoder.speculative, "
        "pxrt.generation, pxrt.prefix\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_sampling_params_are_checked_when_made_and_cross_processes_as_they_are():
    """A request's parameters are checked where they are made (a front end), each bad
    one named with what was expected and what came; numpy scalars and JSON's string
    keys become plain ints and floats; the struct crosses a process boundary whole."""
    import msgspec
    import numpy as np
    import pytest

    from pxrt.decoder.params import SamplingParams

    p = SamplingParams(
        max_tokens=np.int64(5), temperature=np.float32(0.5), stop_ids=[3, np.int32(4)],
        logit_bias={"7": 2, 9: -1.5}, logprobs=2,
    )  # fmt: skip
    assert (p.max_tokens, p.temperature, p.stop_ids) == (5, 0.5, (3, 4))
    assert type(p.max_tokens) is int and type(p.temperature) is float
    assert p.logit_bias == {7: 2.0, 9: -1.5} and p.has_controls
    assert not SamplingParams().has_controls and SamplingParams().seed is None
    wire = msgspec.msgpack.encode(p)
    assert msgspec.msgpack.decode(wire, type=SamplingParams) == p
    assert p.with_seed(3).seed == 3 and p.seed is None  # (frozen: a copy)
    bad = [
        ({"max_tokens": 0}, "max_tokens must be an int >= 1, got 0"),
        ({"max_tokens": 2.0}, "max_tokens must be an int >= 1, got 2.0"),
        ({"temperature": -0.1}, "temperature must be a number from 0 to 100, got -0.1"),
        ({"temperature": float("nan")}, "temperature must be a number from 0 to 100"),
        ({"temperature": True}, "temperature must be a number >= 0, got True"),
        ({"top_k": -1}, "top_k must be an int >= 0, got -1"),
        ({"top_p": 0}, "top_p must be a number in (0, 1], got 0"),
        ({"seed": 2**32}, "seed must be an int from 0 to 4294967295"),
        ({"stop_ids": "ab"}, "stop_ids must be a list of token ids, got 'ab'"),
        ({"stop_ids": [-1]}, "stop_ids must be an int >= 0, got -1"),
        ({"prefix_cache": 1}, "prefix_cache must be true or false, got 1"),
        ({"logprobs": 21}, "logprobs must be an int from 0 to 20, got 21"),
        ({"presence_penalty": 3}, "presence_penalty must be a number from -2 to 2, got 3"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a number above 0 and at most 2"),
        ({"logit_bias": [1]}, "logit_bias must map token ids to numbers, got [1]"),
        ({"logit_bias": {"x": 1}}, "logit_bias: a token id must be an int >= 0, got 'x'"),
        ({"logit_bias": {5: 101}}, "logit_bias[5] must be a number from -100 to 100, got 101"),
        ({"logit_bias": dict.fromkeys(range(301), 1.0)}, "logit_bias: 301 entries; at most 300"),
        ({"min_tokens": -1}, "min_tokens must be an int >= 0, got -1"),
        ({"priority": "1"}, "priority must be an int >= 0, got '1'"),
    ]
    for options, words in bad:
        with pytest.raises(ValueError) as info:
            SamplingParams(**options)
        assert words in str(info.value), (options, str(info.value))
        # decoded from another process's bytes: refused too (msgspec's own type
        # check, or the same one), naming the field
        field = next(iter(options))
        with pytest.raises(msgspec.ValidationError, match=field):
            msgspec.msgpack.decode(msgspec.msgpack.encode(options), type=SamplingParams)
    with pytest.raises(ValueError, match="unknown sampling option 'max_token'; known: max_tokens"):
        SamplingParams.of({"max_token": 3})


def test_prompt_lookup_drafts_what_followed_the_last_tokens_before():
    """Speculation's drafts need no device: what followed the text's last 3 tokens
    (else 2) where they occurred before, the prompt and the tokens generated so far."""
    import numpy as np

    from pxrt.decoder.speculative import PromptLookup

    lookup = PromptLookup(np.array([1, 2, 3, 4, 1, 2]))
    assert lookup.draft([], 2) == [3, 4]  # (1, 2) came before 3, 4
    assert lookup.draft([3], 2) == [4, 1]  # (1, 2, 3) before 4, 1
    assert lookup.draft([3, 9], 2) == []  # (3, 9) and (2, 3, 9): never before


def _lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines, its signature included and its docstring left out."""
    n = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            n -= first.end_lineno - first.lineno + 1
    return n


def test_no_function_of_the_package_is_over_80_lines():
    """The engine stays in pieces one can read whole: no function or method of
    ``pxrt/decoder/`` over 80 lines (its docstring aside)."""
    long = []
    for path in sorted((ROOT / "pxrt" / "decoder").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _lines(node) > 80:
                long.append(f"{path.name}:{node.lineno} {node.name} ({_lines(node)} lines)")
    assert not long, long
