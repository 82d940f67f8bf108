"""The tree's layers, read from the source: the transports never import the engine at
run time (they are typed against ``serving.kserve.backend.Backend``, which the in-process
``Server`` and a worker's ``RemoteServer`` both satisfy), and no package's modules import
each other in a circle."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# What serves the models (the engine: serving.engine, and the supervisor of --workers,
# the device process's side) and what speaks the wire (the transports: serving.kserve,
# serving.http, serving.grpc, the worker processes' side of --workers, and the small
# pieces they share). Entry points (serve, cli, config, follower, ray) compose both.
ENGINE = ("serving.engine", "serving.workers.supervisor")
TRANSPORTS = (
    "serving.kserve", "serving.http", "serving.grpc", "serving.workers.worker",
    "serving.workers.remote", "serving.workers.ipc", "serving.accept", "serving.access",
    "serving.errors", "serving.logs", "serving.options",
)  # fmt: skip


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _modules(package: str) -> dict[str, pathlib.Path]:
    """The package's modules: Python's and the Cython extensions' (read from the .py
    alone: an extension's imports are its twin's)."""
    out = {}
    for path in [*(ROOT / package).rglob("*.py"), *(ROOT / package).rglob("*.pyx")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def runtime_imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The package's modules ``name`` imports when it runs (anywhere in it, functions
    included; not under ``TYPE_CHECKING``)."""
    if path.suffix != ".py":
        return set()
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
            found.update(subs if len(subs) == len(node.names) else [module, *subs])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in modules and m != name}


def test_the_transports_do_not_import_the_engine():
    modules = _modules("serving")
    transports = [m for m in modules if _within(m, TRANSPORTS)]
    assert len(transports) > 20  # (the names above are the tree's)
    bad = {}
    for name in transports:
        engine = {m for m in runtime_imports(name, modules[name], modules) if _within(m, ENGINE)}
        if engine:
            bad[name] = sorted(engine)
    assert not bad, f"transports importing the engine at run time: {bad}"


@pytest.mark.parametrize("package", ["serving", "pxrt"])
def test_no_import_circles(package):
    modules = _modules(package)
    graph = {m: runtime_imports(m, p, modules) for m, p in modules.items()}
    circles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def walk(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                circles.append(path[path.index(d) :] + [d])
            elif d not in state:
                walk(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)
