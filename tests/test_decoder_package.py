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


def test_the_request_side_does_not_import_jax():
    code = (
        "import sys, pxrt.decoder, pxrt.decoder.params, pxrt.decoder.request, "
        "pxrt.decoder.prefix, pxrt.generation, pxrt.prefix\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


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
