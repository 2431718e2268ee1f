"""Reduce operations and the dtype tables shared by every path."""

from __future__ import annotations

import enum

import torch

__all__ = ["ReduceOp"]


class ReduceOp(enum.Enum):
    """Reduction applied by all_reduce / reduce_scatter.

    SUM and AVG accumulate floating types in float32 (bfloat16 and float16
    round once at the end); integer SUM wraps like torch.  AVG needs a
    floating dtype.
    """

    SUM = 0
    AVG = 1
    MAX = 2
    MIN = 3


# dtype -> code understood by the C core (its DT_* in _native/tpcomm.h;
# tests/test_core_abi.py checks the two agree)
DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int32: 3,
    torch.int64: 4,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HALF_DTYPES = (torch.bfloat16, torch.float16)  # all_reduce has their own two-shot switch point

# torch.distributed's ReduceOp values users may pass instead of ours
_DIST_OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "MAX": ReduceOp.MAX, "MIN": ReduceOp.MIN}


def as_reduce_op(fn: str, op):
    """Return ``op`` as a ReduceOp (torch.distributed's SUM/AVG/MAX/MIN too).

    Other torch.distributed ops (PRODUCT, BAND, ...) come back as they are:
    the engine does not implement them, the torch.distributed path may.

    Raises:
        TypeError: ``op`` is no reduce op at all.
    """
    if isinstance(op, ReduceOp):
        return op
    qual = type(op).__qualname__
    if "ReduceOp" in qual or "RedOpType" in qual:
        name = str(op).rsplit(".", 1)[-1]
        return _DIST_OPS.get(name, op)
    raise TypeError(f"{fn}: op must be a tpcomm.ReduceOp, got {type(op).__name__} {op!r}")


def op_name(op) -> str:
    return op.name if isinstance(op, ReduceOp) else str(op).rsplit(".", 1)[-1]


# (dtype, op) -> (dtype code, op code) for the fast path of all_reduce
AR_CODES = {
    (dt, op): (code, op.value)
    for dt, code in DTYPE_CODES.items()
    for op in ReduceOp
    if not (op is ReduceOp.AVG and dt not in FLOAT_DTYPES)
}


# Every dtype the data-moving collectives (all_gather, broadcast, gather,
# send/recv) carry; the code only identifies the dtype in a round's metadata.
ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "complex32"):
    if hasattr(torch, _name):
        ALL_DTYPES.append(getattr(torch, _name))
ANY_DTYPE_CODES = {dt: i for i, dt in enumerate(ALL_DTYPES)}
ANY_CODE_DTYPES = {i: dt for dt, i in ANY_DTYPE_CODES.items()}


def any_code(dtype: torch.dtype) -> int:
    """The metadata code of any dtype (data-moving collectives; 255: none)."""
    return ANY_DTYPE_CODES.get(dtype, 255)


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds exactly its values, contiguously.

    The engine reads and writes raw memory; a contiguous view that carries a
    pending conjugation (``x.conj()``) or negation (``x.conj().imag``) bit
    does not qualify: its memory holds other values than it shows.
    """
    return t.is_contiguous() and not t.is_neg() and not t.is_conj()


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when is_dense, else a dense copy of its values (a caller
    that writes the result back copies it into ``t``: ``copy_`` honours the bits)."""
    if is_dense(t):
        return t
    return t.resolve_conj().resolve_neg().contiguous()
