"""Rendezvous: how the ranks of a communicator find each other and the segment.

Everything goes through a torch ``Store`` (the torch.distributed group's, a
TCPStore from the environment, or the launcher's), under a key prefix that is
unique per communicator.  The store is used only during set-up: after it,
the ranks talk through shared memory alone (rank 0, which hosts a TCPStore,
may be the one that dies).
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import time
import weakref
from typing import Any, Callable, Optional

from . import _env
from .errors import CommError, CommTimeoutError, PeerFailedError

__all__ = [
    "host_identity",
    "exchange",
    "broadcast_from_rank0",
    "death_explains",
    "master_store",
    "Watch",
    "process_record",
    "threaded",
]

# a set-up wait looks at the store after 0.1 ms, then ever less often, at
# least every 20 ms; at the peers' processes every 20 ms
_FIRST_PAUSE_S = 0.0001
_POLL_S = 0.02


# torch.distributed objects with threads of their own that this process made
# (gloo / NCCL groups, a hosted TCPStore): a child made by fork() inherits them
# without their threads, and destroying one there waits for those threads
# forever (a child that only closed its parent's Communicator hung on exit).
# In the child each gets one reference more, so it is never destroyed there.
_THREADED: weakref.WeakSet = weakref.WeakSet()


def _never_destroyed_in_child() -> None:
    for obj in list(_THREADED):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


os.register_at_fork(after_in_child=_never_destroyed_in_child)


def threaded(obj: Any) -> Any:
    """Register an object with threads of its own (see _THREADED); returns it."""
    _THREADED.add(obj)
    return obj


def master_store(host: str, port: int, world: Any, timeout: float) -> Any:
    """The TCPStore a rank hosts for the set-up, listening on ``host`` only
    (torch's own listens on every interface: anyone who reaches the port could
    write set-up keys).  Falls back to torch's when ``host`` is not an address
    of this machine (the store is then reachable as before)."""
    import errno

    from torch.distributed import TCPStore

    fd = None
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(1024)
        except BaseException:
            sock.close()
            raise
        fd = sock.detach()  # the store owns it from here on (and closes it)
    except OSError as e:
        if e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise
    return threaded(
        TCPStore(
            host,
            port,
            world,
            is_master=True,
            timeout=_env.timedelta(timeout),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    )


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "no-boot-id"


def host_identity() -> str:
    """Who counts as 'the same host': hostname + boot id, or TPCOMM_HOST_ID."""
    override = _env.host_id_override()
    if override:
        return override
    return f"{socket.gethostname()}/{_boot_id()}"


@functools.cache
def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "no-pid-ns"


def _start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (clock ticks after boot), or None when
    there is no such process or it is a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    if not fields or fields[0] in ("Z", "X", "x"):
        return None
    return fields[19] if len(fields) > 19 else None


def process_record() -> str:
    """This process as its set-up peers can check it is alive: boot id, pid
    namespace, pid, start time (a pid reused by another process has another)."""
    pid = os.getpid()
    return f"{_boot_id()} {_pid_namespace()} {pid} {_start_time(pid)}"


def _dead_pid(record: str) -> Optional[int]:
    """The pid of a record whose process is gone; None if it lives or cannot be
    checked from here (another host, another pid namespace)."""
    parts = record.split()
    if len(parts) != 4 or parts[0] != _boot_id() or parts[1] != _pid_namespace():
        return None
    try:
        pid = int(parts[2])
    except ValueError:
        return None
    return pid if _start_time(pid) != parts[3] else None


class Watch:
    """Which of a set-up's peers died, while it waits for them.

    Every rank publishes its process record (``process_record``) before it
    waits on anything; a rank's record may live under several keys (this
    communicator's, a process-wide one that a later communicator of the same
    processes also finds).  ``dead()`` reads the records it lacks and checks
    every peer on this host: the survivors of a peer that dies during set-up
    (creation, ``dup()``) raise PeerFailedError within a poll, not at the end
    of the timeout.  A peer that died before it published anything, or runs on
    another host, can only be waited for.
    """

    def __init__(self, store: Any, rank: int, keys: dict, known: Optional[dict] = None):
        self.store = store
        self.rank = rank
        self.keys = keys  # rank -> the keys its record may be under, in order
        self.known: dict = dict(known or {})  # rank -> record

    @staticmethod
    def _own(prefix: str, world: int) -> dict:
        """The keys of the records of a communicator's set-up under ``prefix``."""
        return {r: [f"{prefix}/proc/{r}"] for r in range(world)}

    @classmethod
    def over(
        cls, store: Any, prefix: str, rank: int, world: int, also: Optional[dict] = None
    ) -> Watch:
        """The watch of a new communicator's set-up under ``prefix``; ``also``:
        each rank's process-wide key, which a later communicator of the same
        processes finds too."""
        keys = cls._own(prefix, world)
        for r, key in (also or {}).items():
            keys[r].append(key)
        return cls(store, rank, keys)

    def publish(self) -> None:
        record = process_record()
        self.known[self.rank] = record
        for key in self.keys.get(self.rank, ()):
            self.store.set(key, record)

    def sub(self, store: Any, prefix: str, ranks: list, rank: int) -> Watch:
        """The watch of a communicator under ``prefix`` over ``ranks`` of this one
        (renumbered from 0): its own keys first, this one's after, and the
        records this one knows."""
        keys = self._own(prefix, len(ranks))
        for i, g in enumerate(ranks):
            keys[i] += self.keys.get(g, [])
        known = {i: self.known[g] for i, g in enumerate(ranks) if g in self.known}
        return Watch(store, rank, keys, known)

    def dead(self) -> Optional[tuple[int, int]]:
        """(rank, pid) of a peer known to be dead, or None."""
        for r, keys in self.keys.items():
            if r == self.rank:
                continue
            record = self.known.get(r)
            if record is None:
                for key in keys:
                    try:
                        if self.store.check([key]):
                            record = self.known[r] = self.store.get(key).decode()
                            break
                    except Exception:  # the store is gone: its host died, maybe
                        break
            pid = _dead_pid(record) if record is not None else None
            if pid is not None:
                return r, pid
        return None

    def check(self, what: str) -> None:
        """PeerFailedError if a peer died."""
        found = self.dead()
        if found is not None:
            r, pid = found
            raise PeerFailedError(
                f"tpcomm: rank {r} (pid {pid}) died during set-up, while rank {self.rank} "
                f"waited for {what}",
                rank=r,
            )


# How long a failed store waits for the watch to see a peer's death first:
# the kernel closes a killed process's sockets before its process record shows
# it dead (a zombie), so the store's error can come first.
_STORE_GRACE_S = 5.0


def death_explains(watch: Watch, what: str) -> None:
    """The store failed: PeerFailedError if a peer died (the store's host,
    most likely), seen within _STORE_GRACE_S; else return (a CommError
    follows).  The same error class whichever the waiter noticed first."""
    end = time.monotonic() + _STORE_GRACE_S
    while True:
        watch.check(what)
        if time.monotonic() >= end:
            return
        time.sleep(_POLL_S)


def _wait(
    store: Any, keys: list[str], timeout: float, what: str, watch: Optional[Watch] = None
) -> None:
    """Wait until every key is in the store (see _wait_until)."""
    _wait_until(lambda: store.check(keys), timeout, what, watch)


def _wait_until(
    ready: Callable[[], bool], timeout: float, what: str, watch: Optional[Watch] = None
) -> None:
    """Wait until ``ready()`` (a question to the store) is true; a dead peer
    (``watch``) is a PeerFailedError at once, a failing store a CommError.

    Asks again after 0.1 ms, then 25 % later each time, at most every 20 ms: a
    quick exchange waits little past its keys' arrival, a long one costs the
    store (rank 0's thread) little.  The store's own wait with a short timeout
    would wake sooner, but torch logs two warning lines for every such wait
    that times out: a peer a few seconds late (loading a model) filled the
    log.  The watch looks at the peers every 20 ms."""
    start = time.monotonic()
    deadline, next_watch, pause = start + timeout, start + _POLL_S, _FIRST_PAUSE_S
    while True:
        try:
            if ready():
                return
        except Exception as e:  # the store is gone (the rank hosting it died?)
            if watch is not None:
                death_explains(watch, what)
            raise CommError(
                f"tpcomm: the set-up store failed while waiting for {what}: {e}"
            ) from None
        now = time.monotonic()
        if watch is not None and now >= next_watch:
            watch.check(what)
            next_watch = now + _POLL_S
        if now >= deadline:
            raise CommTimeoutError(
                f"tpcomm: rendezvous timed out after {timeout:g}s waiting for {what}"
            )
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 1.25, _POLL_S)


def exchange(
    store: Any,
    prefix: str,
    rank: int,
    world: int,
    name: str,
    value: str,
    timeout: float,
    watch: Optional[Watch] = None,
) -> list[str]:
    """Every rank publishes ``value``; returns all ranks' values in rank order.

    Rank 0 returns only after every rank has read them all: under
    ``from_env`` it hosts the store, and a rank 0 that raised right away (the
    ranks span hosts, say) would take the store down under the others' reads.
    """
    store.set(f"{prefix}/{name}/{rank}", value)
    keys = [f"{prefix}/{name}/{r}" for r in range(world)]
    _wait(store, keys, timeout, f"every rank's {name}", watch)
    values = [store.get(k).decode() for k in keys]
    done = f"{prefix}/{name}/read"
    if store.add(done, 1) < world and rank == 0:
        _wait_until(
            lambda: store.add(done, 0) >= world,
            timeout,
            f"every rank to read the {name}s",
            watch,
        )
    return values


def broadcast_from_rank0(
    store: Any,
    prefix: str,
    rank: int,
    name: str,
    value: str | None,
    timeout: float,
    watch: Optional[Watch] = None,
) -> str:
    """Rank 0 publishes ``value``; every rank returns it.

    A value starting with ``!`` is an error rank 0 hit during set-up; the
    other ranks raise it too instead of waiting for a segment that will never
    come.
    """
    key = f"{prefix}/{name}"
    if rank == 0:
        assert value is not None
        store.set(key, value)
    else:
        _wait(store, [key], timeout, f"rank 0's {name}", watch)
        value = store.get(key).decode()
    if value.startswith("!"):
        raise CommError(value[1:] if rank == 0 else f"rank 0 failed to set up: {value[1:]}")
    return value


def local_cpu_count() -> int:
    """CPUs this process may run on (affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
