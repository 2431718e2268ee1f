"""Shared-memory segments: create, attach, unlink, space checks, validation.

A segment is one file in the shm directory (``TPCOMM_SHM_DIR``, default
``/dev/shm``), named ``tpcomm-<host>-<group>-<token>``: the random token makes
every job's name new (a leftover from a crash can never make O_EXCL fail), the
host and group say whose it is when ``tpcomm doctor`` lists strays.  Rank 0
creates it (O_EXCL, mode 0600) and reserves its space with posix_fallocate,
so a /dev/shm that is too small fails now with a clear message instead of a
SIGBUS later.  Every rank maps it, and as soon as all have, it is unlinked:
from then on nothing is left behind whatever happens to the processes, even
``kill -9``.

Before that, a file has a live owner as long as its creator holds the OFD lock
on ``CREATOR_BYTE`` (taken right after the O_EXCL open, kept until the name is
gone: the kernel drops it when the process dies, however it dies) or a rank
holds its liveness lock (byte ``rank``, ``_native/engine.c``).  A file older
than a few seconds that nobody holds is what a job killed during its set-up
left: the next ``create`` of this user on the host removes it (``sweep``), and
``tpcomm doctor`` lists it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import socket
import stat
import struct
import time
from typing import Optional

from .. import _env
from ..errors import CommError
from . import engine

__all__ = [
    "PREFIX",
    "segment_size",
    "create",
    "open_existing",
    "unlink_quietly",
    "host_tag",
    "owners",
    "stale",
    "sweep",
]

PREFIX = "tpcomm-"
# the byte whose OFD lock the creator of a file holds until its name is gone
# (far past any rank's liveness byte; a lock past the end of a file is allowed)
CREATOR_BYTE = 1 << 40
# files younger than this are never taken for strays: their creator may be
# between the O_EXCL open and taking its lock
STALE_AGE_S = 5.0
_MAGIC_FMT = struct.Struct("<QII")  # magic, version, world: the start of the header


def segment_size(world: int, slot_bytes: int) -> int:
    """Bytes of a segment for ``world`` ranks with ``slot_bytes`` per slot."""
    return engine.segment_size(world, slot_bytes)


def host_tag() -> str:
    """The host name, made safe for a file name (at most 32 characters)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:32] or "host"


def space_message(directory: str, need: int, free: int) -> str:
    return (
        f"tpcomm: the shared-memory directory {directory} has {free} bytes free but this "
        f"communicator needs {need} bytes ({need / 2**20:.1f} MiB). Make it larger: "
        f"`docker run --shm-size=1g ...`, a Kubernetes emptyDir with medium: Memory, or "
        f"`mount -o remount,size=2G {directory}`; or point TPCOMM_SHM_DIR at a larger tmpfs, "
        f"or lower TPCOMM_SLOT_BYTES."
    )


def create(world: int, slot_bytes: int, group_tag: str, size: int | None = None) -> tuple[str, int]:
    """Create a new segment file with its space reserved (``size`` bytes, by
    default the layout's for ``world`` and ``slot_bytes``).

    Returns:
        (path, fd): the file's path and an fd open read-write on it.

    Raises:
        CommError: the directory is missing, not writable, or too small.
    """
    directory = _env.shm_dir()
    need = segment_size(world, slot_bytes) if size is None else size
    try:
        st = os.statvfs(directory)
    except OSError as e:
        raise CommError(
            f"tpcomm: cannot use the shared-memory directory {directory}: {e.strerror}; "
            f"set TPCOMM_SHM_DIR to a tmpfs directory"
        ) from None
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise CommError(space_message(directory, need, free))
    sweep(directory)
    name = f"{PREFIX}{host_tag()}-{group_tag}-{secrets.token_hex(8)}"
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        _lock(fd, CREATOR_BYTE)
    except OSError as e:
        raise CommError(f"tpcomm: cannot create segment {path}: {e.strerror}") from None
    try:
        os.posix_fallocate(fd, 0, need)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM) or e.errno not in (
            errno.EOPNOTSUPP,
            errno.EINVAL,
        ):
            os.close(fd)
            unlink_quietly(path)
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise CommError(space_message(directory, need, free)) from None
            raise CommError(
                f"tpcomm: cannot reserve {need} bytes in {path}: {e.strerror}"
            ) from None
        # A file system without fallocate: fall back to ftruncate (sparse).
        os.ftruncate(fd, need)
    return path, fd


def _lock(fd: int, byte: int) -> None:
    """Take the OFD write lock on ``byte`` of fd's file (OSError if held)."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, byte, 1, 0))


def _lock_held(fd: int, byte: int) -> bool:
    """Does some open file description hold a lock on ``byte`` (F_OFD_GETLK)?"""
    flock = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0)
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, flock)
    return struct.unpack("hhqqi4x", got)[0] != fcntl.F_UNLCK


def owners(path: str) -> Optional[tuple[int, int]]:
    """(ranks in the header, ranks alive) of one file of this user; None if it
    cannot be read.  Its creator holding ``CREATOR_BYTE`` counts as one alive; a
    file without a segment header (a symmetric buffer's, or one being created)
    counts as one rank."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        head = os.pread(fd, _MAGIC_FMT.size, 0)
        world = 1
        if len(head) == _MAGIC_FMT.size:
            magic, _version, w = _MAGIC_FMT.unpack(head)
            if magic == engine.MAGIC and 0 < w <= engine.MAX_WORLD:
                world = w
        if _lock_held(fd, CREATOR_BYTE):
            return world, 1
        return world, sum(_lock_held(fd, r) for r in range(world))
    except OSError:
        return None
    finally:
        os.close(fd)


def stale(directory: str, min_age_s: float = STALE_AGE_S) -> list[tuple[str, int, float]]:
    """This user's tpcomm files in ``directory`` that nobody holds: (path, bytes,
    age s).  Files younger than ``min_age_s`` are left out."""
    found = []
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return found
    for entry in sorted(entries, key=lambda e: e.name):
        if not entry.name.startswith(PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        age = now - st.st_mtime
        if age < min_age_s or st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            continue
        held = owners(entry.path)
        if held is not None and held[1] == 0:
            found.append((entry.path, st.st_size, age))
    return found


def sweep(directory: str) -> list[str]:
    """Remove what ``stale`` finds (a job killed during its set-up left it);
    the paths removed."""
    removed = []
    for path, _size, _age in stale(directory):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


_TOKEN = re.compile(r"[0-9a-f]{16}")
# the start of a segment's header (_native/tpcomm.h hdr_t): magic, version,
# world, slot_bytes, total_bytes
_HEADER = struct.Struct("<QIIQQ")


def token_of(path: str) -> str:
    """The random part of a segment's name: what rank 0 tells its peers."""
    return os.path.basename(path)[-16:]


def derive(group_tag: str, token: str) -> str:
    """The path of a peer's segment from its token: the directory is this rank's
    own setting and the name tpcomm's pattern; a token from the (untrusted)
    store that is not 16 hex digits is refused, so it can never name another
    file."""
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise CommError(
            f"tpcomm: a peer named segment {token!r}, not 16 hex digits: refused (the "
            f"set-up store or shared memory holds something tpcomm did not write)"
        )
    return os.path.join(_env.shm_dir(), f"{PREFIX}{host_tag()}-{group_tag}-{token}")


def open_existing(
    path: str, world: int, slot_bytes: int, size: int | None = None, header: bool = True
) -> int:
    """Open a segment another rank created, and check it before a byte is
    written: not a symbolic link (O_NOFOLLOW), a regular file of this user with
    mode 0600 and the layout's size, and (``header``) the header rank 0 wrote.
    A file that fails is left alone: never written, never unlinked.

    Raises:
        CommError: the file is gone, or is not what it must be.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CommError(
                f"tpcomm: segment {path} is a symbolic link: refused (something other "
                f"than tpcomm put it there)"
            ) from None
        if e.errno == errno.EACCES:
            raise CommError(
                f"tpcomm: cannot open segment {path} created by rank 0: permission denied. "
                f"The ranks must run as the same user (this one is uid {os.getuid()}); "
                f"segments are private to their owner (mode 0600)"
            ) from None
        raise CommError(
            f"tpcomm: cannot open segment {path} created by rank 0: {e.strerror}. If the ranks "
            f"run in different containers or hosts, they do not share {os.path.dirname(path)}."
        ) from None
    try:
        st = os.fstat(fd)
        need = segment_size(world, slot_bytes) if size is None else size
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "not a regular file"
        elif st.st_uid != os.getuid():
            problem = (
                f"owned by uid {st.st_uid}, not {os.getuid()} (the ranks must run as the same user)"
            )
        elif stat.S_IMODE(st.st_mode) != 0o600:
            problem = f"mode {stat.S_IMODE(st.st_mode):o}, not 600"
        elif st.st_size != need:
            problem = f"{st.st_size} bytes, expected {need}"
        elif header:
            head = os.pread(fd, _HEADER.size, 0)
            magic, version, w, slot, total = _HEADER.unpack(head.ljust(_HEADER.size, b"\0"))
            if (magic, version, w, slot, total) != (
                engine.MAGIC,
                engine.VERSION,
                world,
                slot_bytes,
                need,
            ):
                problem = (
                    f"not a tpcomm segment of this layout (header: magic {magic:#x}, version "
                    f"{version}, world {w}, slot {slot}, size {total}; expected version "
                    f"{engine.VERSION}, world {world}, slot {slot_bytes}, size {need})"
                )
    except BaseException:
        os.close(fd)
        raise
    if problem:
        os.close(fd)
        raise CommError(f"tpcomm: segment {path} is {problem}: refused, left as it is")
    return fd


def unlink_quietly(path: str) -> None:
    """Unlink ``path``; another rank may have done it already."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
