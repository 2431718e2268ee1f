"""Set-up: what a communicator exposes while it forms, and forming again.

Guards: the launcher's set-up store listens on loopback only (torch's listens
on every interface, so anyone who reached the port could write set-up keys);
a rank that hosted the from_env store can close its communicator and make a
new one on the same MASTER_PORT in the same process (the next store used to
fail with EADDRINUSE while the peers timed out); the hosted store serves the
next from_env too, so peers still connected to it are not cut off.
"""

from __future__ import annotations

import os

import pytest

from ._helpers import free_port, script_ranks


def _listening(port: int) -> list:
    """(file, local address) of every socket listening on ``port``."""
    found = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hexport = fields[1].split(":")
            if int(hexport, 16) == port and fields[3] == "0A":  # LISTEN
                found.append((name, addr))
    return found


def _noop(comm):
    return comm.rank


def test_the_launch_store_listens_on_loopback_only():
    from tpcomm.launch import LocalGroup

    with LocalGroup(2) as g:
        assert g.run(_noop) == [0, 1]
        port = g._store.port
        assert _listening(port) == [("/proc/net/tcp", "0100007F")], _listening(port)


AGAIN = r"""
import os, torch, tpcomm
out = []
for round in range(3):
    with tpcomm.Communicator.from_env(timeout=30) as comm:
        x = torch.full((4,), float(comm.rank + round))
        comm.all_reduce(x)
        out.append(x[0].item())
print(out, flush=True)
"""


def _two_ranks(script: str, envs: list, timeout: float = 120, scripts: list = ()) -> list:
    """Run ``script`` (or each rank's of ``scripts``) as ranks 0 and 1 of a from_env
    job (``envs``: each rank's extra variables; the caller's TPCOMM_* are left
    out): (exit status, stdout)."""
    return script_ranks(list(scripts) or script, envs, timeout)


def test_from_env_again_in_the_same_process():
    assert _two_ranks(AGAIN, [{}, {}]) == [(0, "[1.0, 3.0, 5.0]")] * 2


def test_a_hosted_store_listens_on_its_address_only():
    """The store rank 0 of from_env hosts (bootstrap.master_store) listens on
    MASTER_ADDR alone, and its port is free again once it is dropped."""
    from tpcomm.bootstrap import master_store

    port = free_port()
    store = master_store("127.0.0.1", port, 2, 10.0)
    assert _listening(port) == [("/proc/net/tcp", "0100007F")], _listening(port)
    del store
    again = master_store("127.0.0.1", port, 2, 10.0)
    assert again.port == port


LATE = r"""
import os, time, torch, tpcomm
late = os.environ["RANK"] == "1"
if late:
    time.sleep(1.5)  # starts late: rank 0 waits in from_env's set-up
comm = tpcomm.Communicator.from_env(timeout=30)
if late:
    time.sleep(0.5)  # and again in dup()'s
sub = comm.dup()
x = torch.ones(4)
sub.all_reduce(x)
sub.close()
comm.close()
print(x.tolist(), flush=True)
"""


def test_a_late_peer_fills_no_log():
    """A rank that comes seconds after the others: the set-up waits print nothing.
    They waited in the store's own wait, 20 ms at a time, and torch logs two
    warning lines ("waitForInput ... likely a timeout") for every such wait that
    times out: 150 lines for this 1.5 s."""
    ranks = script_ranks(LATE, [{}, {}], 90, drop=("TPCOMM_", "TORCH_"), stderr=True)
    for code, out, err in ranks:
        assert code == 0 and out == "[2.0, 2.0, 2.0, 2.0]", (out, err)
        assert err.strip() == "", err[:2000]


DIFFER = r"""
import time, tpcomm
t0 = time.time()
try:
    tpcomm.Communicator.from_env(timeout=30).close()
    print("no error", flush=True)
except ValueError as e:
    print("ValueError", str(e), round(time.time() - t0, 1), flush=True)
time.sleep(3)  # rank 0 hosts the store: it stays up, so nobody fails by its exit
"""


def _two_ranks_with(envs: list) -> list:
    return [out for _, out in _two_ranks(DIFFER, envs, timeout=90)]


def test_switch_points_that_differ_between_ranks_are_refused():
    """Settings that change what a rank expects of its peers must agree: single-copy
    reads from 0 bytes on one rank and from 10 MiB on the other gave silently wrong
    data (one rank read the other's previous input); now the same ValueError on
    every rank names the setting and both values.  The all-reduce switch point too."""
    outs = _two_ranks_with([{"TPCOMM_CMA_MIN_BYTES": "0"}, {"TPCOMM_CMA_MIN_BYTES": "10485760"}])
    for out in outs:
        assert out.startswith("ValueError") and "TPCOMM_CMA_MIN_BYTES" in out, outs
        assert "from 0 bytes" in out and "from 10485760 bytes" in out, outs
    outs = _two_ranks_with([{"TPCOMM_ALLREDUCE_ALGO": "one_shot"}, {}])
    for out in outs:
        assert out.startswith("ValueError") and "TPCOMM_ALLREDUCE_ALGO" in out, outs
        assert "from never" in out and "from 262144 bytes" in out, outs
    assert _two_ranks_with([{"TPCOMM_CMA": "0"}, {}]) == ["no error"] * 2


UIDS = r"""
import os, time, tpcomm
t0 = time.time()
try:
    tpcomm.Communicator.from_env(timeout=30).close()
    print("no error", flush=True)
except tpcomm.CommError as e:
    print(type(e).__name__, round(time.time() - t0, 1), str(e).replace(chr(10), " "), flush=True)
time.sleep(2)
"""


# Rank 1 of the different-users test: started as root, it loads everything it
# will need and then becomes another user (who may not be able to read this
# interpreter's or this checkout's files, under /root).
AS_NOBODY = (
    r"""
import os
import torch.distributed
import tpcomm
from tpcomm import bootstrap, checks, communicator, construction, dist_path, errors, routing
from tpcomm.shm import engine, messages, path, segment, symmetric
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
"""
    + UIDS
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a rank as another user")
def test_ranks_of_different_users_fail_promptly_on_both():
    """Rank 1 runs as another user: it cannot open rank 0's segment (mode 0600).
    Both ranks get a prompt CommError saying the ranks must run as one user (rank
    0 used to wait the whole attach timeout, 20 s in the probe)."""
    outs = _two_ranks(UIDS, [{}, {}], 90, scripts=[UIDS, AS_NOBODY])
    for _, out in outs:
        kind, took, msg = out.split(" ", 2)
        assert kind == "CommError" and float(took) < 10.0, outs
        assert "same user" in msg, outs
    assert "uid 0" in outs[0][1] and "permission denied" in outs[1][1], outs


def test_a_rank_that_cannot_open_the_segment_fails_every_rank_promptly(tmp_path):
    """Rank 1 cannot open rank 0's segment (here: it looks in another shm
    directory, as ranks in different containers do; the same path serves ranks
    of different users): it says so in the set-up store, and every rank raises a
    CommError at once; rank 0 used to wait the whole attach timeout."""
    outs = [out for _, out in _two_ranks(UIDS, [{}, {"TPCOMM_SHM_DIR": str(tmp_path)}], 90)]
    for out in outs:
        kind, took, msg = out.split(" ", 2)
        assert kind == "CommError" and float(took) < 10.0, outs
    assert "cannot open segment" in outs[1] and "do not share" in outs[1], outs
    assert "rank 1: tpcomm: cannot open segment" in outs[0] and "same user" in outs[0], outs
