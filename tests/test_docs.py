"""The docs name what exists: every ``Class.method`` that docs/ENGINE.md and
docs/VLLM.md name in backticks is an attribute of a class of the package
(set on the class or in its ``__init__``).  ENGINE.md once named
``ShmPath.all_gather_fast`` and ``ShmPath.sendrecv_fast``, which never existed."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re

import tpcomm

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
NAMED = re.compile(r"`(?:[a-z_]+\.)*([A-Z][A-Za-z0-9]*)\.([a-z_][a-z_0-9]*)[`(]")


def _classes() -> dict:
    found = {}
    for info in pkgutil.walk_packages(tpcomm.__path__, "tpcomm."):
        if info.name in ("tpcomm.__main__", "tpcomm.perf.mpi_rank"):
            continue  # a program (runs at import), and one that needs mpi4py
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and obj.__module__ == info.name:
                found.setdefault(name, []).append(obj)
    return found


def _has(cls, attr: str) -> bool:
    if hasattr(cls, attr):
        return True
    init = getattr(cls, "__init__", None)
    try:
        return f"self.{attr} =" in inspect.getsource(init)
    except (OSError, TypeError):
        return False


def test_named_methods_exist():
    classes = _classes()
    missing, seen = [], 0
    for doc in ("ENGINE.md", "VLLM.md"):
        with open(os.path.join(DOCS, doc)) as f:
            text = f.read()
        for cls_name, attr in set(NAMED.findall(text)):
            if cls_name not in classes:
                continue  # not a class of the package (torch's, vLLM's)
            seen += 1
            if not any(_has(c, attr) for c in classes[cls_name]):
                missing.append(f"{doc}: {cls_name}.{attr}")
    assert seen >= 8  # the finder finds
    assert not missing, missing
