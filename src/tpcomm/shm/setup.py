"""How a segment comes to be shared: rank 0 creates it (``segment.py``) and
decides its layout and settings, the others open it by the name they derive
from what rank 0 publishes in the set-up store, every rank maps it and waits
for the others, and the ranks agree on single-copy reads.  Any failure is
told to the others, so that every rank raises at once; the segment's name is
unlinked as soon as every rank mapped it (or on any failure).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from .. import _env
from ..bootstrap import Watch, broadcast_from_rank0, death_explains, local_cpu_count
from ..errors import CommError, CommTimeoutError
from . import profile, segment
from .engine import ST_MISMATCH, ShmEngine, select_kernels
from .settings import NEVER, settings_for

__all__ = ["open_engine"]


def open_engine(
    store: Any,
    rank: int,
    world: int,
    prefix: str,
    group_tag: str,
    timeout: float,
    watch: Optional[Watch] = None,
) -> ShmEngine:
    """The engine of a Communicator whose ranks share this host (collective:
    every rank calls it with the same prefix and tag)."""
    eng = ShmEngine(rank, world, timeout)
    # Every setting is read (and checked) before anything exists: a bad value
    # raises the same error on every rank at once, none waits for another.
    slot_bytes = _env.slot_bytes()
    select_kernels()
    tuning = settings_for(world, slot_bytes)
    # rank 0's tuned profile (tpcomm tune), sent to the others with the segment
    tuned = profile.settings(world) if rank == 0 else {}
    # Ranks that outnumber the cores gain nothing by spinning: the peer they
    # wait for needs the core.  (Pinned ranks see one CPU; count the host's.)
    oversubscribed = world > max(local_cpu_count(), os.cpu_count() or 1)
    spin = 0.0 if oversubscribed else _env.spin_us()
    # nor can rank 0 time its copies there: the cores' other ranks preempt
    # them, so the stores stay as TPCOMM_NT_MIN_BYTES says (docs/DECISIONS.md)
    fixed_stores = oversubscribed
    # and their rounds keep one place in the slots: ranks that share a core find
    # it in their own cache (_native/tpcomm.h, slot_pos); rank 0's choice holds
    slot_moves = not oversubscribed
    # Every rank must agree on the layout: rank 0 decides it, writes the
    # header, and only then publishes the path (with the slot size).
    fd = -1
    try:
        if rank == 0:
            try:
                tuning = settings_for(world, slot_bytes, tuned)
                eng.path, fd = segment.create(world, slot_bytes, group_tag)
                eng.map(fd, slot_bytes, spin, tuning, fixed_stores, slot_moves)
            except CommError as e:
                broadcast_from_rank0(store, prefix, 0, "segment", "!" + str(e), timeout, watch)
                raise
            # the slot size and the name's random token only: the peers
            # derive the path themselves (the store is not trusted)
            token = segment.token_of(eng.path)
            told = f"{slot_bytes}:{token}:{profile.encode(tuned)}"
            broadcast_from_rank0(store, prefix, 0, "segment", told, timeout, watch)
        else:
            value = broadcast_from_rank0(store, prefix, rank, "segment", None, timeout, watch)
            try:
                slot_text, _, rest = value.partition(":")
                token, _, tuned_text = rest.partition(":")
                slot_bytes = _published_slot(slot_text)
                try:
                    tuned = profile.decode(tuned_text)
                except ValueError as e:
                    raise CommError(str(e)) from None
                tuning = settings_for(world, slot_bytes, tuned)
                path = segment.derive(group_tag, token)
                fd = segment.open_existing(path, world, slot_bytes)
            except CommError as e:  # tell the others, who wait for this rank to attach
                store.set(f"{prefix}/attach-failed", f"rank {rank}: {e}")
                raise
            eng.path = path  # checked: from here on, this rank may unlink it
            eng.map(fd, slot_bytes, spin, tuning, fixed_stores, slot_moves)
        os.close(fd)
        fd = -1
        eng.attach()
        ok = _wait_attached(eng, store, prefix, timeout, watch)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if eng.path:
            segment.unlink_quietly(eng.path)
        eng.close()
        raise
    # All ranks mapped it (or the wait gave up): nobody needs the name now.
    segment.unlink_quietly(eng.path)
    if not ok:
        eng.close()
        raise CommTimeoutError(
            f"tpcomm: only some of the {world} ranks attached to the segment within "
            f"{timeout:g}s; the others are missing or were started with a different world size"
        )
    eng.ready(slot_bytes, tuned)
    # exchange nothing more through the store: drop the reference
    del store
    # single-copy all_gather: on when every rank can read every other one
    if world > 1:
        status, _ = eng.agree_single_copy(*tuning.cma_plan)
        if status == ST_MISMATCH:  # the ranks' settings differ: say which, on every rank
            info = eng.error_info()
            eng.close()
            raise ValueError(_settings_differ(info, rank))
        if status:
            eng.close()
            eng.raise_status(status, "Communicator")
    return eng


def _wait_attached(
    eng: ShmEngine, store: Any, prefix: str, timeout: float, watch: Optional[Watch] = None
) -> bool:
    """Wait until every rank mapped the segment; a rank that could not (it
    runs as another user, the file failed its checks) says so in the store,
    and then every rank raises its CommError at once instead of timing out."""
    key = f"{prefix}/attach-failed"
    deadline = time.monotonic() + timeout
    while True:
        if eng.attached(min(0.05, max(deadline - time.monotonic(), 0.0))):
            return True
        try:
            failed = store.check([key])
        except Exception as e:  # the store is gone (the rank hosting it died?)
            if watch is not None:
                death_explains(watch, "every rank to attach to the segment")
            raise CommError(f"tpcomm: the set-up store failed while ranks attached: {e}") from None
        if failed:
            why = store.get(key).decode()
            raise CommError(
                f"tpcomm: {why} (this is rank {eng.rank}, uid {os.getuid()}: every rank "
                f"must run as the same user and see the same {_env.shm_dir()})"
            )
        if watch is not None:
            watch.check("every rank to attach to the segment")
        if time.monotonic() >= deadline:
            return False


def _published_slot(text: str) -> int:
    """The slot size rank 0 published, checked (the store is not trusted)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not (4096 <= value <= _env.MAX_SLOT_BYTES and value % 4096 == 0):
        raise CommError(
            f"tpcomm: rank 0 published slot size {text!r}: refused (not a multiple of "
            f"4096 in [4096, {_env.MAX_SLOT_BYTES}])"
        )
    return value


def _settings_differ(info: dict, rank: int) -> str:
    """The ValueError of ranks whose switch points differ (cma_init's round)."""

    def show(v: int) -> str:
        return "never" if v == NEVER else f"{v} bytes"

    peer, parts = info["rank"], []
    if info["my_count"] != info["count"]:
        parts.append(
            f"two-shot all_reduce from {show(info['my_count'])} on rank {rank} but from "
            f"{show(info['count'])} on rank {peer} (TPCOMM_ALLREDUCE_ALGO)"
        )
    if info["my_arg"] != info["arg"]:
        parts.append(
            f"single-copy reads from {show(info['my_arg'])} on rank {rank} but from "
            f"{show(info['arg'])} on rank {peer} (TPCOMM_CMA_MIN_BYTES, TPCOMM_CMA)"
        )
    return (
        "Communicator: the ranks' settings differ where they must agree: "
        + "; ".join(parts)
        + "; set them alike on every rank (nothing was made)"
    )
