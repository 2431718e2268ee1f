"""The shared-memory path: every collective and message of a Communicator
whose ranks share this host, over one ``ShmEngine``.

Each collective is a sequence of rounds of the collective channel (see
``_native/tpcomm.h``): before a round a rank writes its slot of parity
``(round + 1) & 1``; ``sync`` publishes the round's metadata (kind, dtype,
count, layout key) and waits for every peer; after it a rank reads the peers'
slots of that parity.  A slot is rewritten two rounds later, by which time
every peer has finished reading it, so one wait per round suffices.  The
rounds' loops run in C (``_native/rounds.c``); this module passes addresses,
sizes and layout keys (``keys.py``) and turns a status into an exception.
Messages are ``messages.py``.

The common cases also have one-call C entries (``fast_*``: ``_native/torch.c``
for all_reduce, ``_native/coll_tensors.c`` for the other collectives and
``_native/p2p_tensors.c`` for send, recv and sendrecv) that the
Communicator tries first; they compute the same metadata as the general
methods here, so ranks on either road meet the same rounds.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .. import checks, layout, routing
from ..errors import CommError
from ..ops import DTYPE_CODES, any_code, dense, is_dense
from ..paths import NOT_PLAIN, Path, copy_in, take_message
from . import messages, symmetric
from .engine import (
    KIND_ALL_GATHER,
    KIND_ALL_TO_ALL,
    KIND_BARRIER,
    KIND_BROADCAST,
    KIND_DUP,
    KIND_GATHER,
    KIND_REDUCE_SCATTER,
    ShmEngine,
)
from .keys import empty_key, flat_key, gather_key, reduce_scatter_key

__all__ = ["ShmPath"]

_Tensor = torch.Tensor


class ShmPath(Path):
    """The collectives over one mapped segment (every rank on this host)."""

    name = "shm"

    def __init__(self, engine: ShmEngine, fallbacks: tuple):
        self.engine = engine
        self.rank = engine.rank
        self.world = engine.world
        self.ident = engine.ident
        engine.install_fast_paths(fallbacks)
        # the whole-call entries (the Communicator's methods themselves: the
        # rest of a call goes to the fallbacks) and the one-call entries,
        # bound C methods (no Python frame in between; _native/torch.c,
        # coll_tensors.c and p2p_tensors.c): each of the latter answers None (not its case), or
        # did the call (its errors raised by the engine's raise_status)
        self.fast_all_reduce = engine.fast_all_reduce
        self.whole_all_gather_into_tensor = engine.whole_all_gather_into_tensor
        self.whole_reduce_scatter_tensor = engine.whole_reduce_scatter_tensor
        self.whole_gather = engine.whole_gather
        self.fast_all_gather = engine.fast_all_gather
        self.fast_gather = engine.fast_gather
        self.fast_reduce_scatter = engine.fast_reduce_scatter
        self.fast_broadcast = engine.fast_broadcast
        self.fast_all_to_all = engine.fast_all_to_all
        self.fast_send = engine.p2p_send_tensors
        self.fast_recv = engine.p2p_recv
        self.fast_sendrecv = engine.p2p_sendrecv

    @staticmethod
    def should_use(call: routing.Call) -> Optional[str]:
        """Shared memory takes every call but the reductions it lacks."""
        return routing.engine_objection(call)

    # -- state -------------------------------------------------------------

    @property
    def failed(self) -> bool:
        return self.engine.failed

    @property
    def single_copy(self) -> bool:
        return self.engine.cma

    def record(self, reset: bool = False, stamp: Optional[bool] = None) -> dict:
        """The core's record of rounds and waits (Communicator.stats)."""
        return self.engine.record(reset, stamp)

    def refuse(self) -> None:
        self.engine.refuse()

    def hold(self, fn: str) -> None:
        self.engine.hold(fn)

    def release(self) -> None:
        self.engine.release()

    def abort(self) -> None:
        self.engine.abort()

    def close(self) -> None:
        self.engine.close()

    def _sync(self, kind: int, fn: str) -> None:
        status = self.engine.sync(kind, 0, 0, 0, 0)
        if status:
            self.engine.raise_status(status, fn)

    def dup_round(self, fn: str) -> None:
        """One round before a dup(), like any collective: a rank that called
        something else meets a mismatch here at once (on every rank), instead
        of this rank waiting in the set-up store for the whole timeout."""
        self._sync(KIND_DUP, fn)

    def barrier(self, fn: str) -> None:
        self._sync(KIND_BARRIER, fn)

    # -- reductions --------------------------------------------------------

    def all_reduce(self, tensor: _Tensor, op: Any) -> _Tensor:
        return self.engine.all_reduce(tensor, op)

    def reduce_scatterv(
        self, fn: str, tensor: _Tensor, sizes: Sequence[int], d: int, op: Any
    ) -> _Tensor:
        # along d where the data is: `rows` rows (one per index of the dims
        # before d), each the ranks' blocks side by side; rank r gets the
        # reduction of block r of every row (_native/rounds.c reduce_scatterv)
        x = dense(tensor)
        shape = tuple(x.shape)
        rows = layout.prod(shape[:d])
        inner = layout.prod(shape[d + 1 :]) if rows else 0  # no rows: nothing to move
        res = torch.empty((*shape[:d], sizes[self.rank], *shape[d + 1 :]), dtype=tensor.dtype)
        key = reduce_scatter_key(shape[:d] + shape[d + 1 :], d, tuple(sizes))
        status = self.engine.reduce_scatterv(
            KIND_REDUCE_SCATTER, x.data_ptr(), DTYPE_CODES[tensor.dtype],
            [s * inner for s in sizes], res.data_ptr(), op.value, key, max(rows, 1),
        )  # fmt: skip
        if status:
            self.engine.raise_status(status, fn)
        return res

    # -- gathers -----------------------------------------------------------

    def _gatherv_raw(
        self,
        fn: str,
        kind: int,
        mine: int,
        counts: Sequence[int],
        out: Any,
        dtype_code: int,
        numel: int,
        key: int,
        rows: int = 1,
    ) -> None:
        """Every rank contributes ``counts[r]`` bytes (at address ``mine`` here);
        the buffer at ``out`` (None on ranks that receive nothing, as in gather)
        gets them all in rank order; a list of addresses (one per rank, rows 1)
        receives rank r's bytes at ``out[r]``.  With ``rows`` > 1 (a gather along
        a dim other than 0), every contribution is ``rows`` equal blocks and row
        ``a`` of ``out`` is every rank's block ``a`` in rank order."""
        status = self.engine.gatherv(kind, mine, counts, out, dtype_code, numel, key, rows)
        if status:
            self.engine.raise_status(status, fn)

    def gatherv(
        self,
        fn: str,
        tensor: _Tensor,
        sizes: Sequence[int],
        d: int,
        root: Optional[int],
        out: Optional[_Tensor] = None,
    ) -> Optional[_Tensor]:
        # along d where the data is: rank r's tensor is `rows` blocks (one per
        # index of the dims before d), and row a of the result is every rank's
        # block a in rank order
        kind = KIND_ALL_GATHER if root is None else KIND_GATHER
        x = dense(tensor)
        shape = tuple(x.shape)
        rows = layout.prod(shape[:d])
        rest = shape[:d] + shape[d + 1 :]
        full = (*shape[:d], sum(sizes), *shape[d + 1 :])
        res = None
        if root is None or root == self.rank:
            res = out if out is not None else torch.empty(full, dtype=tensor.dtype)
        inner = layout.prod(shape[d + 1 :]) * rows * tensor.element_size()
        self._gatherv_raw(
            fn, kind, x.data_ptr(), [s * inner for s in sizes],
            res.data_ptr() if res is not None else None, any_code(tensor.dtype),
            sum(sizes) * layout.prod(rest), gather_key(kind, rest, d, tuple(sizes), root),
            max(rows, 1),
        )  # fmt: skip
        return res

    def fast_gather_dim(self, fn: str, tensor: Any, dim: Any, root: Any, out: Any) -> Any:
        """all_gather / gather (root) of a plain tensor (``ShmEngine.plain``) along an
        int dim in range, into a fitting ``out`` or a new tensor: one C check and
        the rounds, with gatherv's rows and layout key.  NOT_PLAIN when the call
        is not that case (the general road then checks and reports)."""
        eng = self.engine
        if type(dim) is not int or (
            root is not None and not (type(root) is int and 0 <= root < self.world)
        ):
            return NOT_PLAIN
        a = eng.plain(tensor)
        if a is None:
            return NOT_PLAIN
        nd = tensor.dim()
        if not -nd <= dim < nd:
            return NOT_PLAIN
        d = dim % nd
        shape = tensor.shape
        w = self.world
        full = (*shape[:d], w * shape[d], *shape[d + 1 :])
        res = None
        if root is None or root == self.rank:
            if out is None:
                res = torch.empty(full, dtype=tensor.dtype)
            else:
                b = eng.plain(out)
                if b is None or b[0] != a[0] or out.shape != full:
                    return NOT_PLAIN
                res = out
        rest = tuple(shape[:d]) + tuple(shape[d + 1 :])
        kind = KIND_ALL_GATHER if root is None else KIND_GATHER
        self._gatherv_raw(
            fn, kind, a[1], [a[2] * layout.ANY_SIZE[a[0]]] * w,
            res.data_ptr() if res is not None else None, a[0], a[2] * w,
            gather_key(kind, rest, d, (shape[d],) * w, root), layout.prod(shape[:d]) or 1,
        )  # fmt: skip
        return res

    def gather_list(
        self, fn: str, outs: Sequence[Any], tensor: _Tensor, root: Optional[int]
    ) -> None:
        if not self.gather_direct(fn, outs, tensor, root):
            super().gather_list(fn, outs, tensor, root)

    def gather_direct(
        self, fn: str, outs: Sequence[Any], tensor: _Tensor, root: Optional[int]
    ) -> bool:
        """Every rank's ``tensor`` (flattened) straight into ``outs[r]``: no
        gathered temporary and no copy per part, for plain tensors of one dtype
        and element count (``ShmEngine.plain``); False (nothing done) otherwise.
        The same rounds and layout key as a 1-d all_gather / gather, so ranks
        that take this way and ranks that do not still agree."""
        eng = self.engine
        w = self.world
        a = eng.plain(tensor)
        if a is None:
            return False
        addrs: Optional[list] = None
        if root is None or root == self.rank:
            addrs = []
            for o in outs:
                b = eng.plain(o)
                if b is None or b[0] != a[0] or b[2] != a[2]:
                    return False
                addrs.append(b[1] or 0)
        kind = KIND_ALL_GATHER if root is None else KIND_GATHER
        self._gatherv_raw(
            fn, kind, a[1] or 0, [a[2] * layout.ANY_SIZE[a[0]]] * w, addrs, a[0], a[2] * w,
            gather_key(kind, (), 0, (a[2],) * w, root),
        )  # fmt: skip
        return True

    # -- broadcast, all to all -----------------------------------------------

    def broadcast(self, fn: str, tensor: _Tensor, src: int) -> _Tensor:
        work = dense(tensor)
        status = self.engine.broadcast(
            KIND_BROADCAST, work.data_ptr(), work.numel() * work.element_size(), src,
            any_code(tensor.dtype), tensor.numel(),
        )  # fmt: skip
        if status:
            self.engine.raise_status(status, fn)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def all_to_all(self, fn: str, output: _Tensor, input: _Tensor, outs: list, ins: list) -> None:
        even = not ins and not outs
        if even:
            try:
                self._even_all_to_all_check(fn, output, input)
            except ValueError:
                self.engine.refuse()  # the peers raise naming this rank, at once
                raise
        eng = self.engine
        eng.hold(fn)  # the split table and the rounds are one thread's turn
        try:
            self._all_to_all(fn, output, input, outs, ins)
        finally:
            eng.release()

    def _even_all_to_all_check(self, fn: str, output: _Tensor, input: _Tensor) -> None:
        """Without split sizes: even blocks, checked here and by the rounds'
        metadata (the block size), before anything is copied."""
        w = self.world
        rows_in, row = layout.rows(input)
        rows_out, out_row = layout.rows(output)
        if rows_in % w or rows_out != rows_in or input.dtype != output.dtype or row != out_row:
            raise ValueError(
                f"{fn}: input {tuple(input.shape)} {input.dtype} and output "
                f"{tuple(output.shape)} {output.dtype}: without split sizes both need the "
                f"same shape and dtype, with rows divisible by the {w} ranks"
            )

    def _all_to_all(self, fn: str, output: _Tensor, input: _Tensor, outs: list, ins: list) -> None:
        w = self.world
        rows_in, row = layout.rows(input)
        rows_out, out_row = layout.rows(output)
        x = dense(input)
        res = output if is_dense(output) else torch.empty(output.shape, dtype=output.dtype)
        if layout.dense_overlap(x, res):
            x = x.clone()
        if not ins and not outs:
            # even blocks: all to all of bytes, block j of every rank to rank j;
            # the metadata is the block size (checked above)
            sb = [rows_in // w * row] * w
            at = layout.offsets(sb)
            most = sb[0]
            status = self.engine.alltoallv(
                KIND_ALL_TO_ALL, x.data_ptr(), sb, at, res.data_ptr(), sb, at, most,
                any_code(input.dtype), most, flat_key(KIND_ALL_TO_ALL, most, w),
            )  # fmt: skip
        else:
            # any split sizes, even uniform ones (they depend on data, as in MoE
            # dispatch, so ranks may differ): every rank's table, checked by every
            # rank, then the rounds, in one call (_native/rounds.c alltoall_splits)
            status = self.engine.alltoall_splits(
                KIND_ALL_TO_ALL, x.data_ptr(), ins or [rows_in // w] * w, res.data_ptr(),
                outs or [rows_out // w] * w, rows_in, rows_out, row, out_row,
                any_code(input.dtype), any_code(output.dtype),
            )  # fmt: skip
        if status:
            self.engine.raise_status(status, fn)
        if res is not output:
            output.copy_(res)

    # -- symmetric memory ----------------------------------------------------

    def empty(self, fn: str, shape: tuple, dtype: torch.dtype) -> _Tensor:
        return symmetric.allocate(
            self.engine, fn, shape, dtype, any_code(dtype), empty_key(shape, dtype)
        )

    def peer_buffers(self, fn: str, tensor: _Tensor) -> list:
        return symmetric.peer_views(self.engine, tensor)

    # -- point to point ------------------------------------------------------

    def send(self, fn: str, dst: int, tensors: Sequence[_Tensor], extra: Any) -> None:
        messages.send(self.engine, fn, dst, tensors, extra)

    def recv(self, fn: str, src: int, out: Optional[Sequence[_Tensor]] = None) -> tuple[list, Any]:
        return messages.recv(self.engine, fn, src, out)

    def recv_rest(self, fn: str, src: int, out: Any, header: bytes) -> list:
        """The end of a receive whose header ``fast_recv`` read and left to
        Python (pickled, or not ``out``'s)."""
        return messages.recv_rest(self.engine, fn, src, out, header)[0]

    def recv_any(self, fn: str, out: Optional[Sequence[_Tensor]]) -> tuple[int, list]:
        status, src = self.engine.p2p_wait_any()
        if status:
            self.engine.raise_status(status, fn)
        got = self.fast_recv(src, out)
        if type(got) is list:
            return src, got
        if got is not None:
            return src, self.recv_rest(fn, src, out, got)
        return src, self.recv(fn, src, out)[0]

    def try_send(self, fn: str, dst: int, tensors: Sequence[_Tensor]) -> bool:
        """Send only if the channel's ring takes the whole message now (the
        arguments are checked here: the paths that never send take any)."""
        tensors = checks.tensor_list(fn, tensors)
        dst = checks.rank(fn, "dst", dst, self.world, not_rank=self.rank)
        datas = [dense(t) for t in tensors]
        status = self.engine.send_if_room(dst, messages.message_pieces(self.engine, datas, None))
        if status:
            self.engine.raise_status(status, "send")
        return status is not None

    def sendrecv(
        self,
        fn: str,
        tensors: Sequence[_Tensor],
        dst: int,
        src: int,
        out: Optional[Sequence[_Tensor]],
    ) -> list:
        datas = [dense(t) for t in tensors]  # alive until the call is done: pieces point in
        if out is not None and layout.any_overlap(datas, out):
            # receiving into what is being sent (a shift in place): the send and
            # the receive progress together, so the data is sent from a copy
            datas = [t.clone() for t in datas]
        header = b""  # matches no message: it lands in a bytearray
        dests: list = []
        if out is not None and all(is_dense(o) for o in out):
            header = messages.expected_header(self.engine, out) or b""
            dests = [(o.data_ptr(), n) for o in out if (n := o.numel() * o.element_size())]
        ops = [(1, dst, messages.message_pieces(self.engine, datas, None)), (0, src, header, dests)]
        odd = messages.batch(self.engine, fn, ops)
        del datas
        if not odd:
            return list(out)  # type: ignore[arg-type]
        return self.sendrecv_rest(fn, src, out, odd[0][1], odd[0][2])

    def sendrecv_rest(
        self, fn: str, src: int, out: Optional[Sequence[_Tensor]], got_header: bytes, data: Any
    ) -> list:
        """The end of a sendrecv whose message did not match ``out`` (or had
        none): it was received whole into ``data``."""
        specs, extra = messages.decode_header(got_header)
        if extra is not None:
            raise CommError(f"{fn}: rank {src} sent a dict or a scatter part, not a tensor list")
        got = messages.tensors_from_bytes(specs, data, fn, src)
        if out is None:
            return got
        have = [(o.dtype, tuple(o.shape)) for o in out]
        if have != [(t.dtype, tuple(t.shape)) for t in got]:
            raise ValueError(
                f"{fn}: rank {src} sent {messages.show(specs)} but out= holds "
                f"{messages.show(have)} (the message was received and dropped)"
            )
        return copy_in(out, got)  # out is not dense: copy in

    def batch(self, fn: str, ops: list) -> list:
        """Every send and receive progressed together in one C call
        (_native/p2p_batch.c)."""
        keep, native = [], []
        for what, tensors, peer in ops:
            if what == "send":
                datas = [dense(t) for t in tensors]
                keep.append(datas)
                native.append((1, peer, messages.message_pieces(self.engine, datas, None)))
            elif (
                all(is_dense(t) for t in tensors)
                and (header := messages.expected_header(self.engine, tensors)) is not None
            ):
                dests = [(t.data_ptr(), n) for t in tensors if (n := t.numel() * t.element_size())]
                native.append((0, peer, header, dests))
            else:  # matches no message: it lands aside, and is copied in below
                native.append((0, peer, b"", []))
        odd = messages.batch(self.engine, fn, native)
        del keep
        errors: list = [None] * len(ops)
        for i, header, data in odd:  # a message that is not exactly what the recv expected
            specs, extra = messages.decode_header(header)
            try:
                got = messages.tensors_from_bytes(specs, data, fn, ops[i][2])
            except CommError as e:  # a header that lies about its data, received and dropped
                errors[i] = e
                continue
            errors[i] = take_message(ops[i][1], ops[i][2], got, extra)
        return errors
