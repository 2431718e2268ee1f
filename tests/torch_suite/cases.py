"""The test case class of ``run.py``: PyTorch's ``DistributedTest._DistTestBase``
with process groups meant for gloo made on ``cpu:tpcomm``
(``TPCOMM_SUITE_BACKEND=tpcomm``, the default), on gloo itself (``gloo``), or
with ``BACKEND=tpcomm`` (``named``: the cases that check the backend's name).

A module of its own: torch's harness starts every rank with ``spawn``, and
each child imports this module (the environment it reads is inherited), so
the redirection holds in every rank.
"""

from __future__ import annotations

import os
import tempfile

# the gloo cases: their gloo-only checks (timeouts, monitored_barrier) are on;
# "named": the cases run with BACKEND=tpcomm (those that check the backend's name)
_MODE = os.environ.setdefault("TPCOMM_SUITE_BACKEND", "tpcomm")
os.environ["BACKEND"] = "tpcomm" if _MODE == "named" else "gloo"
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="tpc-torch-suite-"))
for _sub in ("barrier", "test_dir"):
    os.makedirs(os.path.join(os.environ["TEMP_DIR"], _sub), exist_ok=True)

import torch.distributed as dist  # noqa: E402

import tpcomm  # noqa: E402,F401  (registers the backend)


def _redirect() -> None:
    """Process groups meant for gloo (or the default) are made on cpu:tpcomm."""
    real_init, real_new = dist.init_process_group, dist.new_group

    def init_process_group(*args, backend=None, **kwargs):
        if backend in (None, "gloo"):
            backend = "cpu:tpcomm"
        return real_init(*args, backend=backend, **kwargs)

    def new_group(*args, backend=None, **kwargs):
        if backend == "gloo":
            backend = "cpu:tpcomm"
        return real_new(*args, backend=backend, **kwargs)

    dist.init_process_group = init_process_group
    dist.new_group = new_group


# A rank that hands a call to a private gloo group (tpcomm's torch.distributed
# path, or the group's own gloo for tags, monitored_barrier, ...) leaves this
# file: run.py tells the cases tpcomm serves itself from those gloo serves.
GLOO_USED = os.path.join(os.environ["TEMP_DIR"], "gloo-used")


def _mark_gloo() -> None:
    from tpcomm.dist_backend import ProcessGroupTpcomm
    from tpcomm.dist_path import DistPath

    real_group, real_private = DistPath.group.fget, ProcessGroupTpcomm._private_gloo

    def group(self):
        open(GLOO_USED, "w").close()
        return real_group(self)

    def private_gloo(self):
        open(GLOO_USED, "w").close()
        return real_private(self)

    DistPath.group = property(group)
    ProcessGroupTpcomm._private_gloo = private_gloo


if _MODE == "tpcomm":
    _redirect()
    _mark_gloo()

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class Cases(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _spawn_processes(self) -> None:
        # fork, not torch's spawn: a spawned rank imports torch and this suite
        # again (4-5 s a case here); a forked one starts in milliseconds.  The
        # parent has made no process group and started no threads of its own.
        import torch.multiprocessing as mp

        self._start_processes(mp.get_context("fork").Process)
