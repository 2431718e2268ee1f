"""Symmetric buffers: ``Communicator.empty`` tensors that live in shared memory.

Every rank calls ``empty`` with the same shape and dtype.  Each rank creates
a file of its own (same naming, O_EXCL, 0600, space reserved, its creator's
lock held until the name is gone), writes its name into its collective slot,
and after one round maps every peer's file; after a second round (everyone
mapped everything) each unlinks its own name, so, as with the segment,
nothing is left behind.  The engine learns every rank's address of the
buffer: an all_reduce whose tensor lies in it reads the peers' tensors in
place instead of copying them in first (see ``zero_copy_all_reduce`` in
``_native/zerocopy.c``).

Reclaiming: the tensors ``empty`` returns view the buffer through one
memoryview of this rank's mapping.  When the last of them is gone, the
memoryview is, and a weakref callback drops the buffer: the engine forgets it
(at once, or, while another thread is inside a call, at the next ``empty`` or
``close``) and this rank's mappings of every rank's file go.  A file's memory
returns to the shm directory when every rank has dropped its tensors.  Each
rank decides alone: the buffers are told apart by an id that is the same on
every rank (the communicator's count of ``empty`` calls), not by a position.
At most ``MAX_SYM`` (64) buffers live per communicator at once; one more is a
CommError on every rank, the communicator usable.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CommError
from . import segment
from .engine import KIND_EMPTY, MAX_SYM

if TYPE_CHECKING:
    from .engine import ShmEngine

__all__ = ["allocate", "peer_views", "MAX_LIVE"]

MAX_LIVE = MAX_SYM
_LEN = struct.Struct("<Q")
_PAGE = mmap.PAGESIZE


class _NotCreated(Exception):
    """A rank could not create its file: every rank raises CommError."""


class Buffer:
    """One symmetric buffer as this rank holds it: every rank's mapping (rank
    order; this rank's own among them) and the memoryview its tensors view."""

    __slots__ = ("maps", "view", "base", "__weakref__")

    def __init__(self, maps: list, base: int):
        self.maps = maps
        self.base = base
        self.view: Any = None  # a weakref to the memoryview, once handed out


def _map(fd: int, size: int) -> tuple[mmap.mmap, int]:
    mm = mmap.mmap(fd, size)
    view = torch.frombuffer(mm, dtype=torch.uint8)
    return mm, view.data_ptr()


def allocate(
    eng: ShmEngine, fn: str, shape: tuple, dtype: torch.dtype, dtype_code: int, key: int
) -> torch.Tensor:
    """Collective: a new tensor of ``shape``/``dtype`` in a symmetric buffer."""
    # several native calls and writes into this rank's slot: one thread's turn
    eng.hold(fn)
    try:
        eng.reclaim()
        return _allocate(eng, fn, shape, dtype, dtype_code, key)
    finally:
        eng.release()


def _allocate(
    eng: ShmEngine, fn: str, shape: tuple, dtype: torch.dtype, dtype_code: int, key: int
) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    size = max(_PAGE, (nbytes + _PAGE - 1) // _PAGE * _PAGE)
    eng.sym_count += 1  # every rank counts every empty(): the buffer's id
    ident = eng.sym_count
    # A rank that cannot create its file (the shm directory is full, too many
    # live buffers) still takes part in the first round, with "!" and the reason
    # instead of a name: every rank then raises the same CommError and the
    # communicator stays usable.
    path, own, own_addr, problem, fd = "", None, 0, "", -1
    if len(eng.symmetric) >= MAX_LIVE:
        problem = (
            f"it holds {MAX_LIVE} live buffers of this communicator, the most there may "
            f"be (drop the tensors of some: their buffers are then reclaimed)"
        )
    elif size >= 1 << 40:
        problem = f"{size} bytes is too large (a buffer is less than 1 TiB)"
    else:
        try:
            path, fd = segment.create(eng.world, eng.slot_bytes, "sym", size=size)
            own, own_addr = _map(fd, size)
        except (CommError, OSError) as e:
            if fd >= 0:
                os.close(fd)
                fd = -1
            if path:
                segment.unlink_quietly(path)
            path, problem = "", str(e) or type(e).__name__
    try:
        # fd holds the creator's lock until the name is gone (segment.sweep)
        maps, addrs = _exchange(eng, fn, dtype_code, numel, key, size, path, own, own_addr, problem)
    finally:
        if fd >= 0:
            os.close(fd)
    buf = Buffer(maps, own_addr)
    eng.add_symmetric(own_addr, size, addrs, ident)
    eng.symmetric[own_addr] = buf
    view = memoryview(own)
    # the tensors hold the memoryview; when the last goes, the buffer does
    buf.view = weakref.ref(view, _dropper(eng, own_addr))
    flat = torch.frombuffer(view, dtype=torch.uint8)[:nbytes]
    return flat.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)


def _dropper(eng: ShmEngine, base: int) -> Any:
    ref = weakref.ref(eng)

    def dropped(_view: Any) -> None:
        e = ref()
        if e is not None:
            e.sym_dropped(base)

    return dropped


def _exchange(
    eng: ShmEngine, fn: str, dtype_code: int, numel: int, key: int, size: int, path: str,
    own: Any, own_addr: int, problem: str,
) -> tuple[list, list]:  # fmt: skip
    """The two rounds of allocate: this rank's name out, every peer's file
    mapped; every rank's mapping and its address here, in rank order."""
    me = eng.rank
    try:
        # this rank's name's token (peers derive the path), or "!" and why
        word = ("!" + problem if problem else segment.token_of(path)).encode()[
            : min(eng.slot_bytes, 4096) - _LEN.size
        ]
        p = (eng.round + 1) & 1
        ctypes.memmove(eng.slot_addr(me, p), _LEN.pack(len(word)) + word, _LEN.size + len(word))
        status = eng.sync(KIND_EMPTY, dtype_code, 0, numel, key)
        if status:
            eng.raise_status(status, fn)
        words = []
        for r in range(eng.world):
            at = eng.slot_addr(r, p)
            (n,) = _LEN.unpack(ctypes.string_at(at, _LEN.size))
            words.append(ctypes.string_at(at + _LEN.size, min(n, 4096)).decode(errors="replace"))
        failed = [(r, w[1:]) for r, w in enumerate(words) if w.startswith("!")]
        if failed:
            if path:
                segment.unlink_quietly(path)
            r, why = failed[0]
            raise _NotCreated(
                f"{fn}: rank {r} could not create its shared buffer of {size} bytes"
                f"{f' (and {len(failed) - 1} more ranks)' if len(failed) > 1 else ''}: {why}"
            )
        maps, addrs = [], []
        for r in range(eng.world):
            if r == me:
                maps.append(own)
                addrs.append(own_addr)
                continue
            peer = segment.derive("sym", words[r])  # read from shared memory: checked
            pfd = segment.open_existing(peer, eng.world, eng.slot_bytes, size=size, header=False)
            try:
                mm, addr = _map(pfd, size)
            finally:
                os.close(pfd)
            maps.append(mm)
            addrs.append(addr)
        status = eng.sync(KIND_EMPTY, dtype_code, 0, numel, key)
        if status:
            eng.raise_status(status, fn)
    except _NotCreated as e:
        raise CommError(str(e)) from None  # every rank raises it; nothing to abort
    except ValueError:
        # a mismatched call (a peer called another collective): every rank got
        # the ValueError from the same round and stays in step, as after any
        # collective's mismatch; the communicator stays usable
        segment.unlink_quietly(path)
        raise
    except BaseException:
        segment.unlink_quietly(path)
        eng.abort()  # the others must not wait for us
        raise
    segment.unlink_quietly(path)
    return maps, addrs


def peer_views(eng: ShmEngine, t: torch.Tensor) -> list:
    """Every rank's copy of the symmetric buffer ``t`` lies in, as uint8 tensors
    over this process's mappings (rank order); ValueError if ``t`` lies in none."""
    at = t.data_ptr()
    for buf in list(eng.symmetric.values()):
        mine = buf.maps[eng.rank]
        if buf.base <= at < buf.base + max(len(mine), 1):
            return [torch.frombuffer(m, dtype=torch.uint8) for m in buf.maps]
    raise ValueError(
        "peer_buffers: the tensor is not in a buffer made by this Communicator's empty()"
    )
