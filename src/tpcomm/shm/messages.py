"""Point-to-point messages over the segment: their format and their calls.

A channel per ordered pair (sender -> receiver) holds a ring of 64 small
chunks (``_native/tpcomm.h`` P2P_RING), a "sent" counter in the sender's
control block and a "consumed" counter in the receiver's.  Chunk k of the
byte stream goes to ring entry k % 64 once the receiver has consumed chunk
k - 64, so ``send`` returns without waiting for the receiver whenever the
ring has room, and a large message is copied out by the receiver while the
sender is still copying its next chunks in.  A message is ``[header length,
data length] + header + tensor bytes``; the header carries every tensor's
dtype and shape (and, for tensor dicts and scatter parts, the rest).
"""

from __future__ import annotations

import math
import pickle
import struct
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..errors import CommError
from ..ops import ANY_CODE_DTYPES, dense, is_dense
from .engine import copy, parse_header

if TYPE_CHECKING:
    from .engine import ShmEngine

__all__ = [
    "batch",
    "decode_header",
    "expected_header",
    "message_pieces",
    "recv",
    "send",
    "tensors_from_bytes",
]

_PREFIX = struct.Struct("<QQ")  # header bytes, data bytes


# A message's header says what tensors follow.  Plain tensor lists (no extra)
# get the core's binary header (_native/p2p.c header_*: written and read there
# only, here through ShmEngine.message_header and _native.parse_header); anything else is
# pickled (a pickle starts with 0x80, never P2P_BINARY).


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor as an exact torch.Tensor (a subclass's data, viewed)."""
    return t if type(t) is torch.Tensor else t.as_subclass(torch.Tensor)


def message_pieces(eng: ShmEngine, datas: Sequence[torch.Tensor], extra: Any) -> list:
    """The byte stream of a message of dense tensors (and a picklable ``extra``):
    the prefix and header as bytes, then (address, nbytes) of each tensor (the
    caller keeps ``datas`` alive while the pieces are in use)."""
    header = expected_header(eng, datas) if extra is None else None
    if header is None:
        meta = ([(str(t.dtype).rsplit(".", 1)[-1], tuple(t.shape)) for t in datas], extra)
        header = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = [t.numel() * t.element_size() for t in datas]
    pieces: list = [_PREFIX.pack(len(header), sum(sizes)) + header]
    pieces += [(t.data_ptr(), n) for t, n in zip(datas, sizes) if n]
    return pieces


def send(eng: ShmEngine, fn: str, dst: int, tensors: Sequence[torch.Tensor], extra: Any) -> None:
    """Stream the tensors (and a picklable ``extra``) to ``dst`` (the loop is C)."""
    datas = [dense(t) for t in tensors]  # alive until the send is done: pieces point in
    status = eng.p2p_send(dst, message_pieces(eng, datas, extra))
    del datas
    if status:
        eng.raise_status(status, fn)


def expected_header(eng: ShmEngine, tensors: Sequence[torch.Tensor]) -> bytes | None:
    """The header a send of exactly these (dense) tensors carries; None when that
    is not the binary form (p2p_batch compares headers byte for byte)."""
    return eng.message_header([_plain(t) for t in tensors])


def decode_header(header: bytes) -> tuple[list[tuple[torch.dtype, tuple]], Any]:
    """A message header as ([(dtype, shape), ...], extra)."""
    specs = parse_header(header)
    if specs is not None:
        return [(ANY_CODE_DTYPES[code], shape) for code, shape in specs], None
    named, extra = pickle.loads(header)
    return [(getattr(torch, name), tuple(shape)) for name, shape in named], extra


def _lying_header(fn: str, src: int, need: int, carried: int) -> CommError:
    """The error of a message from ``src`` whose header's tensors need ``need``
    bytes of data where it carried ``carried`` (a peer's bug: the sizes come from
    shared memory); the message was received and dropped, the channel in step."""
    return CommError(
        f"{fn}: rank {src} sent a message whose header describes {need} bytes of data, "
        f"but it carried {carried}"
    )


def tensors_from_bytes(
    specs: Sequence[tuple[torch.dtype, tuple]], data: Any, fn: str, src: int
) -> list:
    """New tensors of ``specs`` ((dtype, shape) each) filled from the message data
    ``data`` (a bytearray: the tensors' bytes back to back, so not aligned for a
    view), which rank ``src`` sent to call ``fn``.  One C memcpy per tensor:
    torch's slicing and ``copy_`` cost several microseconds each, more than the
    rest of a small receive."""
    need = sum(math.prod(shape) * dt.itemsize for dt, shape in specs)
    if need != len(data):
        raise _lying_header(fn, src, need, len(data))
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr() if len(data) else 0
    out, at = [], 0
    for dt, shape in specs:
        t = torch.empty(shape, dtype=dt)
        n = t.nbytes
        if n:
            copy(t.data_ptr(), base + at, n)
        out.append(t)
        at += n
    return out


def batch(eng: ShmEngine, fn: str, ops: list) -> list:
    """Point-to-point operations progressed together (_native/p2p_batch.c):
    ``(1, dst, message_pieces)`` sends, ``(0, src, expected_header, [(address,
    nbytes), ...])`` receives.  Returns ``(index, header, data)`` of each
    receive whose message did not match its header or size: received whole
    into ``data`` (a bytearray) instead, nothing written."""
    status, odd = eng.p2p_batch(ops)
    if status:
        eng.raise_status(status, fn)
    return odd


def recv(
    eng: ShmEngine, fn: str, src: int, out: Sequence[torch.Tensor] | None = None
) -> tuple[list[torch.Tensor], Any]:
    """Receive the next message from ``src``: (tensors, extra).

    With ``out`` (contiguous tensors matching the message), the data lands in
    them instead of new tensors.  A message that does not match is still
    received whole (into new tensors, so the channel stays in step) and then
    raises ValueError.
    """
    status, header = eng.p2p_recv_head(src)
    if status:
        eng.raise_status(status, fn)
    return recv_rest(eng, fn, src, out, header)


def recv_rest(
    eng: ShmEngine, fn: str, src: int, out: Sequence[torch.Tensor] | None, header: bytes
) -> tuple[list[torch.Tensor], Any]:
    """The rest of ``recv`` once the message's header is read (the header holds
    the engine for this thread until the body is read: _native/p2p.c recv_head)."""
    try:
        return _recv_body(eng, fn, src, out, header)
    finally:
        eng.rx_release()  # a no-op once the body is read


def _recv_body(
    eng: ShmEngine, fn: str, src: int, out: Sequence[torch.Tensor] | None, header: bytes
) -> tuple[list[torch.Tensor], Any]:
    specs, extra = decode_header(header)
    problem = None
    tensors = None
    if out is not None:
        have = [(t.dtype, tuple(t.shape)) for t in out]
        if have == specs and all(is_dense(t) for t in out):
            tensors = list(out)
        else:
            problem = (
                f"{fn}: rank {src} sent {show(specs)} but out= holds {show(have)} "
                f"(or a tensor that is not dense: non-contiguous, or a conj/neg view)"
            )
    if tensors is None:
        tensors = [torch.empty(shape, dtype=dt) for dt, shape in specs]
    dests = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]
    try:
        status = eng.p2p_recv_body(dests)
    except ValueError as e:  # the data was another size than the header said: dropped
        raise _lying_header(fn, src, *e.args) from None
    if status:
        eng.raise_status(status, fn)
    if problem:
        raise ValueError(problem)
    return tensors, extra


def show(specs: Sequence[tuple]) -> list:
    return [(str(dt).rsplit(".", 1)[-1], tuple(shape)) for dt, shape in specs]
