"""Helpers the test modules share: ports, starting ranks as separate
interpreters, a torch.distributed job inside launched ranks, a tiny tmpfs,
the checks of what ranks saw, and the zero-copy all_reduce's matrix of
cases.  (Independent references: ``_ref.py``; fixtures: ``conftest.py``.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

import tpcomm
from tpcomm import _env, _testing
from tpcomm.launch import free_port  # noqa: F401 (the tests import it from here)

from ._ref import DTYPES, FLOATS, digest, make, reference

# What a loaded 2-core machine may add to a wait that should end at once (a
# peer's death seen, an abort, Ctrl-C).  A bound on time in a test is a bound
# on a hang: each such bound is SLACK_S, compared against waits (the
# communicators' timeouts) several times longer, so it still tells "noticed"
# from "waited for the timeout" without needing an idle machine.
SLACK_S = 10.0


def torchrun_env(comm, port, **extra):
    """Set the variables torchrun would set for this rank (and ``extra``)."""
    os.environ.update(
        RANK=str(comm.rank),
        WORLD_SIZE=str(comm.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )


def init_dist(comm, port, backend="gloo"):
    """torch.distributed's world over a launched rank's place (``comm``'s)."""
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=comm.rank,
        world_size=comm.world_size,
    )


def script_ranks(
    script,
    envs,
    timeout=120,
    *,
    drop=("TPCOMM_",),
    keep=("TPCOMM_SHM_DIR",),
    stderr=False,
):
    """Run ``script`` (a string, or one per rank) as the ranks of a from_env job,
    each a fresh interpreter: rank r gets RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT and ``envs[r]``; the caller's variables starting with ``drop``
    are left out (but those named in ``keep``: the suite's shm directory, so
    that the ranks create, sweep and leak only there).  Every rank is killed at the
    end, however it went.  Returns (exit status, stdout[, stderr]) per rank."""
    port = free_port()
    scripts = [script] * len(envs) if isinstance(script, str) else list(script)
    procs = []
    try:
        for r, extra in enumerate(envs):
            env = {
                k: v for k, v in os.environ.items() if k in keep or not k.startswith(tuple(drop))
            }
            env.update(
                RANK=str(r), WORLD_SIZE=str(len(envs)), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )  # fmt: skip
            env.update(extra)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", scripts[r]],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE if stderr else None,
                    text=True,
                    cwd="/",
                )
            )
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    if stderr:
        return [(p.returncode, o.strip(), e) for p, (o, e) in zip(procs, outs)]
    return [(p.returncode, o.strip()) for p, (o, _) in zip(procs, outs)]


def mount_tiny_tmpfs(size: str) -> str:
    """A tmpfs of ``size`` on a new directory (skips where mounting is refused)."""
    d = tempfile.mkdtemp(prefix="tpc-tiny-")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d], capture_output=True
    )
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    return d


def unexpected_errors(cases) -> list[str]:
    """Run ``(call, exception type, text)`` cases; list every one that did not raise
    that type with ``text`` in its message.  A case whose type is None expects no
    error: ``(call, None, what it is, expected result)``, and its result must be
    equal (``torch.equal``) to the expected one."""
    import torch

    problems = []
    for call, exc, text, *expected in cases:
        if exc is None:
            try:
                got = call()
            except Exception as e:
                problems.append(f"{text}: raised {type(e).__name__}: {e}")
                continue
            if not (expected and torch.equal(got, expected[0])):
                problems.append(f"{text}: got {got!r}, expected {expected[:1]!r}")
            continue
        try:
            call()
            problems.append(f"{text}: no error")
        except exc as e:
            if text not in str(e):
                problems.append(f"{text}: got {e}")
        except Exception as e:
            problems.append(f"{text}: raised {type(e).__name__}: {e}")
    return problems


def comm_error_of(call) -> object:
    """What call() ended in: "no error", or [the CommError's type name, its message]."""
    try:
        call()
    except tpcomm.CommError as e:
        return [type(e).__name__, str(e)]
    return "no error"


def write_json(path: str, value) -> None:
    """What a rank saw, for the test process to read after the rank is gone."""
    with open(path, "w") as f:
        json.dump(value, f)


def assert_survivors_saw(outdir, dead: int, survivors) -> None:
    """Every survivor wrote [PeerFailedError.rank, time] (write_json) naming the
    dead rank, less than SLACK_S after the dead rank wrote its time to `killed`."""
    with open(os.path.join(outdir, "killed")) as f:
        killed = json.load(f)
    for r in survivors:
        with open(os.path.join(outdir, f"rank{r}")) as f:
            rank, t = json.load(f)
        assert rank == dead, (r, rank)
        assert t - killed < SLACK_S, (r, t - killed)


# -- the zero-copy all_reduce's matrix (test_zero_copy, test_allreduce) ----------

BIG = _env.DEFAULT_ZERO_COPY_MIN_BYTES // 2 + 15_000  # elements: above zero copy's
# default point for every dtype (2 bytes or more)


def zero_copy_rounds(n: int, w: int, itemsize: int, chunk: int) -> int:
    """The rounds of a zero-copy all_reduce of n elements: one for the data,
    one a piece (chunk bytes of the largest shard, whole shards without a
    chunk: its shard is n / w rounded up to 32 elements), one at the end."""
    shard = min(n, math.ceil(math.ceil(n / w) / 32) * 32)
    piece = chunk // itemsize // 32 * 32 if chunk else shard
    return 2 + max(1, math.ceil(shard / piece))


def zero_copy_matrix(comm, chunk=0):
    """Every dtype and op, at offsets; ``chunk``: in pieces of chunk bytes."""
    problems, digests = [], []
    _testing.set_zero_copy_auto(comm, False)  # zero copy, never the copies: rounds counted
    if chunk:
        _testing.engine(comm).adjust(chunk_min=0, chunk_bytes=chunk)
    try:
        _matrix(comm, chunk, problems, digests)
    finally:
        _testing.restore(comm)
    return problems, digests


def _matrix(comm, chunk, problems, digests):
    r, w = comm.rank, comm.world_size
    seed = 0
    for dtype in DTYPES:
        buf = comm.empty((BIG + 100,), dtype)
        for op in tpcomm.ReduceOp:
            if op is tpcomm.ReduceOp.AVG and dtype not in FLOATS:
                continue
            for n, off in ((BIG, 0), (BIG - 7, 64), (1027, 0)):
                seed += 1
                x = buf[off : off + n]
                x.copy_(make(r, n, dtype, seed))
                r0 = _testing.rounds(comm)
                comm.all_reduce(x, op)
                rounds = _testing.rounds(comm) - r0
                want = zero_copy_rounds(n, w, dtype.itemsize, chunk)
                if n >= BIG - 7 and rounds != want:
                    problems.append(f"{dtype} {op.name} n={n}: {rounds} rounds, not {want}")
                ref = reference([make(q, n, dtype, seed) for q in range(w)], op)
                if not torch.equal(x, ref):
                    problems.append(f"{dtype} {op.name} n={n} off={off}: differs from reference")
                digests.append(digest(x))
