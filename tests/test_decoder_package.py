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
