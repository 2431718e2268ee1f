"""The package has no import circle: every module's imports, module-level and
inside functions alike, form a graph without cycles (a submodule importing its
own package's ``__init__`` aside).  Once there was one: cuda/path.py ->
paths.py -> shm/engine.py -> routing.py -> cuda/path.py."""

from __future__ import annotations

import ast
import os

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _modules() -> dict:
    mods = {}
    for d, _, files in os.walk(os.path.join(SRC, "tpcomm")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    return mods


def _graph(mods: dict) -> dict:
    graph = {}
    for mod, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                parts = mod.split(".")
                if not path.endswith("__init__.py"):
                    parts = parts[:-1]
                if node.level:
                    parts = parts[: len(parts) - (node.level - 1)]
                    target = ".".join(parts + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                deps.update(t for t in [target] if t in mods)
                deps.update(
                    f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods
                )
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
        # a module importing a package it lives in (its __init__) is no circle
        graph[mod] = {d for d in deps if d != mod and not mod.startswith(d + ".")}
    return graph


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, count = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = count[0]
        count[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    graph = _graph(_modules())
    assert "tpcomm.routing" in graph and "tpcomm.cuda.path" in graph
    assert "tpcomm.routing" in graph["tpcomm.cuda.path"]  # edges are seen
    assert _cycles(graph) == []


def _imports_native(path: str) -> bool:
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if (node.module or "").endswith("_native") or any(
                a.name == "_native" for a in node.names
            ):
                return True
        elif isinstance(node, ast.Import) and any(a.name.endswith("._native") for a in node.names):
            return True
    return False


def test_one_module_calls_the_core():
    """The C core (tpcomm._native) has one Python caller: shm/engine.py."""
    callers = sorted(m for m, p in _modules().items() if _imports_native(p))
    assert callers == ["tpcomm.shm.engine"]


def test_the_communicator_calls_only_path_methods():
    """What communicator.py asks of a path (the path of its one-call entries,
    ``self._fast``, and the one ``self._path(...)`` routes to) is a method of
    ``paths.Path``: no path's own extras, no engine."""
    from tpcomm.paths import Path

    with open(os.path.join(SRC, "tpcomm", "communicator.py")) as f:
        tree = ast.parse(f.read())
    asked = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        of_fast = isinstance(v, ast.Attribute) and v.attr == "_fast"
        routed = isinstance(v, ast.Call) and getattr(v.func, "attr", "") == "_path"
        if of_fast or routed:
            asked.add(node.attr)
    assert {"fast_broadcast", "scatter", "recv_any", "close"} <= asked  # the walk sees them
    assert sorted(a for a in asked if not hasattr(Path, a)) == []
