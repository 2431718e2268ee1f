"""Shared fixtures: a private shm directory, worker pools per world size, leak checks.

Every test runs with TPCOMM_SHM_DIR pointing at a directory of the suite's
own (ranks started as separate interpreters keep it: tests/_helpers.py), so
"no segment left behind" is checked exactly after every test, on the suite's
own segments only: another tpcomm job on the host neither fails the suite nor
has its files swept by it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tpcomm.launch import LocalGroup
from tpcomm.shm.segment import PREFIX

# a wait that outlives this is a hang: the suite must fail, not stall
COMM_TIMEOUT = 30.0
RUN_TIMEOUT = 240.0


def _tpcomm_files(directory: str) -> set[str]:
    try:
        return {n for n in os.listdir(directory) if n.startswith(PREFIX)}
    except FileNotFoundError:
        return set()


@pytest.fixture(scope="session", autouse=True)
def shm_dir():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="tpc-tests-", dir=base)
    os.chmod(d, 0o1777)  # as /dev/shm: a rank run as another user can look in
    old = os.environ.get("TPCOMM_SHM_DIR")
    os.environ["TPCOMM_SHM_DIR"] = d
    yield d
    if old is None:
        os.environ.pop("TPCOMM_SHM_DIR", None)
    else:
        os.environ["TPCOMM_SHM_DIR"] = old
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaks(shm_dir):
    """Every test must leave no segment behind in the suite's directory."""
    yield
    left = _tpcomm_files(shm_dir)
    assert not left, f"segments left behind in {shm_dir}: {sorted(left)}"


class Pools:
    """One LocalGroup per world size, started on first use, rebuilt after a failure."""

    def __init__(self):
        self._groups: dict[int, LocalGroup] = {}

    def run(self, world: int, fn, *args, timeout: float = RUN_TIMEOUT) -> list:
        g = self._groups.get(world)
        if g is None or not g._procs:
            g = self._groups[world] = LocalGroup(world, timeout=COMM_TIMEOUT)
        return g.run(fn, *args, timeout=timeout)

    def close(self):
        for g in self._groups.values():
            g.close()
        self._groups.clear()


@pytest.fixture(scope="session")
def pools(shm_dir):
    p = Pools()
    yield p
    p.close()
