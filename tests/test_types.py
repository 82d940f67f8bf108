"""The Cython modules' stubs (``pxrt/*.pyi``, ``serving/kserve/_tensors.pyi``) are the one
statement of their Python API: ``make lint`` checks them against the built modules
(mypy's stubtest) and the code that uses them (mypy); here, each pure-Python twin is
held to the same stub, name by name and parameter by parameter."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


TWINS = {
    "pxrt/_batch.pyi": "pxrt._batch_py",
    "pxrt/_handlers.pyi": "pxrt._handlers_py",
    "pxrt/_keys.pyi": "pxrt._keys_py",
    "pxrt/_slots.pyi": "pxrt._slots_py",
    "serving/kserve/_tensors.pyi": "serving.kserve._tensors_py",
    "serving/grpc/_hpack.pyi": "serving.grpc._hpack_py",
}


def _stub_functions(tree: ast.Module):
    """(dotted name, ast function) of every function and method a stub declares, and
    the dotted names of everything else it declares (classes, constants)."""
    functions, names = [], []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            names.append(node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    functions.append((f"{node.name}.{item.name}", item))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.append(f"{node.name}.{item.target.id}")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return functions, names


def _stub_parameters(fn: ast.FunctionDef) -> list[tuple[str, str, bool]]:
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append((arg.arg, kind, i >= first_default))
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", False))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, "KEYWORD_ONLY", default is not None))
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", False))
    return out


def _resolve(module, dotted: str):
    obj = module
    for part in dotted.split("."):
        obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
    return obj


def _is_instance_attribute(cls, attr: str) -> bool:
    """A plain attribute the twin's instances carry (a slot, or set on self)."""
    assigned = re.search(rf"self\.{attr}\b[^=\n]*=", inspect.getsource(cls))
    return attr in getattr(cls, "__slots__", ()) or assigned is not None


@pytest.mark.parametrize("stub", sorted(TWINS))
def test_each_twin_has_its_stubs_api(stub):
    twin = importlib.import_module(TWINS[stub])
    functions, names = _stub_functions(ast.parse((ROOT / stub).read_text()))
    assert functions, stub
    for name in names:
        cls, _, attr = name.rpartition(".")
        if cls:
            holder = _resolve(twin, cls)
            assert hasattr(holder, attr) or _is_instance_attribute(holder, attr), (
                f"{TWINS[stub]}.{name} is missing"
            )
        else:
            assert hasattr(twin, name), f"{TWINS[stub]}.{name} is missing"
    for name, fn in functions:
        decorators = {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}
        cls, _, attr = name.rpartition(".")
        if "property" in decorators:  # read-only in the Cython class
            holder = _resolve(twin, cls)
            got = inspect.getattr_static(holder, attr, None)
            assert isinstance(got, property) or _is_instance_attribute(holder, attr), (
                f"{TWINS[stub]}.{name} is missing"
            )
            continue
        got = _resolve(twin, name)
        if isinstance(got, staticmethod):
            got = got.__func__
        assert callable(got), f"{TWINS[stub]}.{name} is not callable"
        params = [
            (p.name, p.kind.name, p.default is not inspect.Parameter.empty)
            for p in inspect.signature(got).parameters.values()
        ]
        want = _stub_parameters(fn)
        if attr.startswith("__"):  # called by syntax: positional-only or not is moot
            params = [(n, "POSITIONAL", d) for n, _, d in params]
            want = [(n, "POSITIONAL", d) for n, _, d in want]
        # Names, kinds and which have defaults agree (stubtest holds the Cython module
        # to the same stub).
        assert params == want, f"{TWINS[stub]}.{name}: {params}"


@pytest.mark.parametrize("module", ["pxrt._slots_py", "pxrt._slots"])
def test_the_slot_tables_finish_reasons_are_the_engines(module):
    """The engine's finish reasons (``pxrt.finish``, which front ends without jax
    compare against) are the strings the slot table sets, in both builds."""
    from pxrt import finish

    slots = (
        pytest.importorskip(module) if module == "pxrt._slots" else importlib.import_module(module)
    )
    for name in ("STOP", "LENGTH", "CANCELLED", "ERROR"):
        assert getattr(slots, name) == getattr(finish, name)
