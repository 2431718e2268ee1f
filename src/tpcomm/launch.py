"""tpcomm.launch: run a function on N local ranks, no torch.distributed needed.

The ranks are forked from a forkserver that has imported torch and tpcomm
once, so a rank starts in milliseconds and never inherits a parent's OpenMP
state.  The parent hosts a TCPStore for the set-up only.  ``LocalGroup``
keeps the ranks alive between calls (the test suite and ``tpcomm perf`` use
it); ``launch`` is one group, one call.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import random
import signal
import socket
import time
import traceback
from typing import Any, Callable, Optional, Sequence

from . import _env, checks, construction
from .bootstrap import master_store
from .errors import LaunchError, PeerFailedError

__all__ = ["free_port", "launch", "LocalGroup"]

_ids = itertools.count()


def _ephemeral_ports() -> tuple:
    """The kernel's ephemeral port range (Linux's default where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that no socket holds now, for a rendezvous that
    ranks started on this machine make later (``init_method="tcp://..."``,
    MASTER_PORT).  Taken below the kernel's ephemeral range where there is
    room: a port from that range, free when checked and bound only later,
    can meanwhile become the local port of any socket that connects or binds
    port 0 (gloo's connections do), and the rendezvous then fails with
    EADDRINUSE.  Below the range only a program that names the port binds it.
    """
    lo, _hi = _ephemeral_ports()
    below = list(range(max(1024, lo - 12000), lo))
    for port in random.sample(below, min(len(below), 200)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the range: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _threads_per_rank(world: int, cpus: int, pin: bool) -> int:
    """torch's intra-op threads for each rank: OMP_NUM_THREADS when the
    launching process sets it, else the CPUs it may use shared out (one when
    pinned).  Ranks that each start a thread per core oversubscribe the
    machine, and OpenMP's spinning then stalls every parallel op (a 256 KiB
    copy_ took 1.6 ms with two ranks of two threads on two cores); torchrun
    guards against the same by setting OMP_NUM_THREADS=1."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return 1 if pin else max(1, cpus // world)


def _worker(
    rank: int,
    world: int,
    port: int,
    prefix: str,
    conn: Any,
    timeout: Optional[float],
    cpu: Optional[int],
    env: dict,
    threads: int,
) -> None:
    _die_with_parent()
    # The forkserver was started with the environment of its first use; give
    # this rank the TPCOMM_* switches of the launching process as they are now.
    for key in [k for k in os.environ if k.startswith("TPCOMM_")]:
        del os.environ[key]
    os.environ.update(env)
    if cpu is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {cpu})
    import torch
    from torch.distributed import TCPStore

    torch.set_num_threads(threads)

    from .communicator import Communicator

    try:
        comm = None
        store = None
        if world > 1:
            store = TCPStore(
                "127.0.0.1",
                port,
                is_master=False,
                timeout=_env.timedelta(timeout or 300),
            )
        seconds = checks.timeout_seconds("launch", timeout)
        comm = Communicator._made(construction.Setup(store, rank, world, prefix, "launch", seconds))
        del store
    except BaseException as e:
        conn.send(("err", traceback.format_exc(), type(e).__name__))
        return
    conn.send(("ready", None, None))
    with comm:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # the function could not be unpickled here
                conn.send(
                    (
                        "err",
                        f"rank {rank} cannot load the function to run: {e!r}. tpcomm.launch "
                        f"starts fresh processes: define the function at module level, in a "
                        f"module or in a script whose launch() call sits under "
                        f'`if __name__ == "__main__":`',
                        type(e).__name__,
                    )
                )
                continue
            if msg is None:
                break
            fn, args = msg
            try:
                reply = ("ok", fn(comm, *args), None)
            except BaseException as e:
                reply = ("err", traceback.format_exc(), type(e).__name__)
            try:
                conn.send(reply)
            except Exception as e:  # result not picklable
                conn.send(
                    ("err", f"rank {rank}: cannot send the result back: {e!r}", type(e).__name__)
                )


class LocalGroup:
    """``world_size`` local ranks, each holding a Communicator, kept alive between calls.

    Args:
        world_size: number of ranks (>= 1).
        timeout: the communicators' timeout (seconds); default TPCOMM_TIMEOUT.
        pin: pin rank r to CPU r (mod the CPUs this process may use).
        start_timeout: seconds to wait for the ranks to start.

    Each rank runs torch with ``OMP_NUM_THREADS`` intra-op threads when the
    launching process sets it, else with its share of the CPUs this process
    may use (``cpus // world_size``, at least one; one when pinned), so that
    the ranks together do not oversubscribe the machine.

    Any failure in ``run`` ends every rank: the group cannot be used again.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: Optional[float] = None,
        pin: bool = False,
        start_timeout: float = 120.0,
    ):
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"launch: world_size must be an int, got {type(world_size).__name__}")
        if world_size < 1:
            raise ValueError(f"launch: world_size must be >= 1, got {world_size}")

        self.world_size = world_size
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "tpcomm"])
        self._store = None
        port = 0
        if world_size > 1:
            # loopback only: the ranks are local, nobody else has a say in set-up
            self._store = master_store("127.0.0.1", 0, None, start_timeout)
            port = self._store.port
        prefix = f"tpcomm/launch/{os.getpid()}/{next(_ids)}"
        cpus = sorted(os.sched_getaffinity(0))
        env = {k: v for k, v in os.environ.items() if k.startswith("TPCOMM_")}
        threads = _threads_per_rank(world_size, len(cpus), pin)
        try:
            for r in range(world_size):
                parent, child = ctx.Pipe()
                cpu = cpus[r % len(cpus)] if pin else None
                p = ctx.Process(
                    target=_worker,
                    name=f"tpcomm-rank{r}",
                    args=(r, world_size, port, prefix, child, timeout, cpu, env, threads),
                    daemon=True,
                )
                p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
            self._collect("start", start_timeout, expect="ready")
        except BaseException:
            self.close()
            raise
        # The ranks talk through shared memory from now on; the store stays up for
        # the private gloo group a rank makes on its first call the engine lacks.

    def run(self, fn: Callable[..., Any], *args: Any, timeout: Optional[float] = None) -> list:
        """Call ``fn(comm, *args)`` on every rank; return the results in rank order.

        Raises:
            LaunchError: a rank raised, died, or the call ran past ``timeout``;
                every rank has been ended.
        """
        if not self._procs:
            raise LaunchError("launch: this group is closed", rank=-1)
        for c in self._conns:
            c.send((fn, args))
        return self._collect(getattr(fn, "__name__", "fn"), timeout, expect="ok")

    def _collect(self, what: str, timeout: Optional[float], expect: str) -> list:
        n = self.world_size
        results: list[Any] = [None] * n
        pending = set(range(n))
        failures: dict[int, tuple[str, str]] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        grace_end = None
        while pending:
            now = time.monotonic()
            limit = deadline if grace_end is None else grace_end
            if limit is not None and now >= limit:
                break
            waits = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            ready = mpc.wait(waits, None if limit is None else limit - now)
            for r in list(pending):
                conn, proc = self._conns[r], self._procs[r]
                if conn in ready or (proc.sentinel in ready and conn.poll()):
                    try:
                        kind, value, exc = conn.recv()
                    except (EOFError, OSError):
                        kind, value, exc = "dead", None, None
                elif proc.sentinel in ready:
                    kind, value, exc = "dead", None, None
                else:
                    continue
                pending.discard(r)
                if kind == expect:
                    results[r] = value
                elif kind == "err":
                    failures[r] = (exc or "Exception", value)
                else:
                    proc.join(1)
                    code = proc.exitcode
                    how = (
                        f"killed by signal {signal.Signals(-code).name}"
                        if code and code < 0
                        else f"exited with code {code}"
                    )
                    failures[r] = ("died", f"rank {r} {how} during {what}")
            if failures and grace_end is None:
                # let the other ranks report too, to tell cause from consequence
                grace_end = time.monotonic() + 0.5
        if failures or pending:
            self.close()
            if not failures:
                raise LaunchError(
                    f"launch: {what} timed out after {timeout}s; ranks {sorted(pending)} did "
                    f"not finish; every rank was ended",
                    rank=min(pending),
                )
            # the root cause: a rank that did not merely see a peer fail
            consequences = {PeerFailedError.__name__}
            causes = [r for r, (exc, _) in sorted(failures.items()) if exc not in consequences]
            rank = causes[0] if causes else min(failures)
            exc, text = failures[rank]
            raise LaunchError(
                f"launch: rank {rank} failed in {what} ({exc}):\n{text}",
                rank=rank,
                remote_traceback=text,
            )
        return results

    def close(self) -> None:
        """End every rank (politely, then by force) and reap them.  Idempotent."""
        for c in self._conns:
            with contextlib.suppress(Exception):
                c.send(None)
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        for c in self._conns:
            c.close()
        self._procs = []
        self._conns = []
        self._store = None

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: Optional[float] = None,
) -> list:
    """Spawn ``world_size`` local ranks and call ``fn(comm, *args)`` in each.

    ``fn`` and ``args`` must be picklable (a module-level function; in a
    script, guard the call with ``if __name__ == "__main__":``).

    Args:
        fn: called as ``fn(comm, *args)`` with each rank's Communicator.
        world_size: number of ranks.
        args: extra arguments, the same for every rank.
        timeout: seconds for the whole call (None: no limit) and for the
            communicators' waits.

    Returns:
        The ranks' return values, in rank order.

    Raises:
        LaunchError: a rank raised or died (``.rank`` and
            ``.remote_traceback`` say which and how); the other ranks were
            ended, and nothing is left running or mapped.
    """
    with LocalGroup(world_size, timeout=timeout) as group:
        return group.run(fn, *args, timeout=timeout)
