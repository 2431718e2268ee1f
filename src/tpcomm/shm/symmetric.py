"""Symmetric buffers: ``Communicator.empty`` tensors that live in shared memory.

Every rank calls ``empty`` with the same shape and dtype.  Each rank creates
a file of its own (same naming, O_EXCL, 0600, space reserved), writes its name
into its collective slot, and after one round maps every peer's file; after a
second round (everyone mapped everything) each unlinks its own name, so, as
with the segment, nothing is left behind.  The engine learns every rank's
address of the buffer: an all_reduce whose tensor lies in it reads the peers'
tensors in place instead of copying them in first (see
``zero_copy_all_reduce`` in ``_native/allreduce.c``).  The mappings live as long as the
communicator or any tensor viewing them.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import TYPE_CHECKING

import torch

from .. import _native
from ..errors import CommError
from . import segment
from .engine import KIND_EMPTY

if TYPE_CHECKING:
    from .engine import ShmEngine

__all__ = ["allocate", "peer_views"]

_LEN = struct.Struct("<Q")
_PAGE = mmap.PAGESIZE
_WORD_MAX = 2048  # a rank's file name, or "!" and why it has none (slots: >= 4 KiB)


class _NotCreated(Exception):
    """A rank could not create its file: every rank raises CommError."""


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
    # A rank that cannot create its file (the shm directory is full) still takes
    # part in the first round, with "!" and the reason instead of a name: every
    # rank then raises the same CommError and the communicator stays usable.
    path, own, own_addr, problem = "", None, 0, ""
    try:
        path, fd = segment.create(eng.world, eng.slot_bytes, "sym", size=size)
        try:
            own, own_addr = _map(fd, size)
        finally:
            os.close(fd)
    except (CommError, OSError) as e:
        if path:
            segment.unlink_quietly(path)
        path, problem = "", str(e) or type(e).__name__
    me = eng.rank
    try:
        # this rank's name's token (peers derive the path), or "!" and why
        word = ("!" + problem if problem else segment.token_of(path)).encode()[
            : min(eng.slot_bytes, 4096) - _LEN.size
        ]
        p = (eng._native.round + 1) & 1
        ctypes.memmove(eng.slot_addr(me, p), _LEN.pack(len(word)) + word, _LEN.size + len(word))
        status = eng._native.sync(KIND_EMPTY, dtype_code, 0, numel, key)
        if status:
            eng.raise_status(status, fn)
        words = []
        for r in range(eng.world):
            at = eng.slot_addr(r, p)
            (n,) = _LEN.unpack(ctypes.string_at(at, _LEN.size))
            words.append(ctypes.string_at(at + _LEN.size, n).decode(errors="replace"))
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
        status = eng._native.sync(KIND_EMPTY, dtype_code, 0, numel, key)
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
        if eng._native is not None and not eng.failed:
            eng._native.abort(_native.ST_PEER_DEAD)  # the others must not wait for us
        raise
    segment.unlink_quietly(path)
    eng._native.add_symmetric(own_addr, size, addrs)
    eng.symmetric.append(maps)
    flat = torch.frombuffer(own, dtype=torch.uint8)[:nbytes]
    return flat.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)


def peer_views(eng: ShmEngine, t: torch.Tensor) -> list:
    """Every rank's copy of the symmetric buffer ``t`` lies in, as uint8 tensors
    over this process's mappings (rank order); ValueError if ``t`` lies in none."""
    at = t.data_ptr()
    for maps in eng.symmetric:
        views = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        mine = views[eng.rank]
        if mine.data_ptr() <= at < mine.data_ptr() + max(mine.numel(), 1):
            return views
    raise ValueError(
        "peer_buffers: the tensor is not in a buffer made by this Communicator's empty()"
    )
