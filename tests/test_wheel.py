"""The package as pip builds it for a user: the wheel holds every module and
every file the package opens at run time (a file found next to a module
through ``__file__``), so that what works from the source tree works
installed (``tpcomm perf --compare vllm`` once died installed:
``FileNotFoundError: .../tpcomm/perf/vllm_peer.cpp``, not in the wheel)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "src", "tpcomm")


def _files_opened_beside_modules():
    """(module, file) for every string literal naming a file that lies next to
    a module of the package, in a module that uses ``__file__``."""
    found = []
    for dirpath, _, names in os.walk(PKG):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                src = f.read()
            if "__file__" not in src:
                continue
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    cand = os.path.join(dirpath, node.value)
                    rel = node.value and "\n" not in node.value and not os.path.isabs(node.value)
                    if rel and os.path.isfile(cand):
                        found.append((os.path.relpath(path, ROOT), os.path.relpath(cand, PKG)))
    return found


def test_wheel_holds_what_the_package_opens(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check",
         "--no-build-isolation", "--no-deps", "-w", str(tmp_path), ROOT],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    names = set(zipfile.ZipFile(tmp_path / wheel).namelist())
    opened = _files_opened_beside_modules()
    assert ("src/tpcomm/perf/peers.py", "perf/vllm_peer.cpp") in opened  # the finder finds
    for module, rel in opened:
        assert f"tpcomm/{rel}" in names, f"{module} opens tpcomm/{rel}, which the wheel lacks"
    for dirpath, _, files in os.walk(PKG):
        for name in files:
            if name.endswith((".py", ".pyi")) or name == "py.typed":
                rel = os.path.relpath(os.path.join(dirpath, name), os.path.dirname(PKG))
                assert rel in names, f"the wheel lacks {rel}"
    assert any(n.startswith("tpcomm/_native") and n.endswith(".so") for n in names)
    # the vLLM plugin's entry point is in the wheel's metadata
    (ep,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(tmp_path / wheel).read(ep).decode()
    assert "[vllm.general_plugins]" in text and "tpcomm = tpcomm.vllm_plugin:register" in text
