"""Argument checks of the public collectives, in one place.

Each check raises before anything is touched: ``TypeError`` for an argument
of the wrong kind, ``ValueError`` for a wrong value; the message starts with
the function's name and says what was seen and what is accepted.  The
Communicator's methods call these first, then route the call.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional, Union

import torch

from . import _env
from .ops import FLOAT_DTYPES, ReduceOp, as_reduce_op, is_dense
from .routing import Call

__all__ = [
    "Timeout",
    "all_reduce_call",
    "dim",
    "divided",
    "gather_out",
    "input_list",
    "output_list",
    "p2p_ops",
    "rank",
    "recv_out",
    "reduce_op",
    "same_dtype",
    "shape",
    "sizes",
    "splits",
    "tensor",
    "tensor_dict",
    "tensor_list",
    "timeout_seconds",
    "writable",
]

_Tensor = torch.Tensor
_STRIDED = torch.strided
# torch's own check of a tensor whose elements share memory (what copy_ refuses)
_OVERLAP = getattr(torch, "_debug_has_internal_overlap", None)

Timeout = Union[None, float, int, datetime.timedelta]


def timeout_seconds(fn: str, timeout: Timeout) -> float:
    """A timeout argument in seconds (None: TPCOMM_TIMEOUT)."""
    if timeout is None:
        return _env.timeout()
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"{fn}: timeout must be seconds or a timedelta, got {type(timeout).__name__}"
        )
    if not timeout > 0:
        raise ValueError(f"{fn}: timeout must be positive, got {timeout}")
    return float(timeout)


def tensor(fn: str, t: Any, name: str = "tensor") -> None:
    """A tensor a collective moves (any dtype, no arithmetic)."""
    if not isinstance(t, _Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{fn}: {name} must be a CPU tensor, got one on {t.device}")
    if t.layout is not _STRIDED:
        raise ValueError(f"{fn}: {name} must be dense (strided), got layout {t.layout}")
    if t.is_quantized:  # its data without its scale and zero point means nothing
        raise ValueError(
            f"{fn}: {name} is quantized ({t.dtype}); collectives move plain tensors: "
            f"pass t.int_repr() (and the scale and zero point), or t.dequantize()"
        )


def reduce_op(fn: str, t: Any, op: Any) -> Any:
    """A reducing call's tensor and op; the op as a ReduceOp (or the
    torch.distributed op the engine lacks: routing sends that call on)."""
    tensor(fn, t)
    op = as_reduce_op(fn, op)
    if op is ReduceOp.AVG and not (t.is_floating_point() or t.is_complex()):
        raise TypeError(
            f"{fn}: ReduceOp.AVG needs a floating dtype ({', '.join(map(str, FLOAT_DTYPES))}),"
            f" got {t.dtype}; use ReduceOp.SUM and divide"
        )
    return op


def writable(fn: str, t: _Tensor, name: str = "tensor") -> None:
    """A tensor a call writes into must own its elements: an expand()ed view
    (or any whose elements share memory) cannot hold a result."""
    if _OVERLAP is not None and _OVERLAP(t) == 1:  # MemOverlap::Yes
        raise ValueError(
            f"{fn}: {name} has elements that share memory (an expand()ed or overlapping "
            f"view, strides {tuple(t.stride())}), so the result cannot be written "
            f"into it; pass a tensor that owns its elements (e.g. .clone())"
        )


def same_dtype(fn: str, output: _Tensor, input: _Tensor) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"{fn}: output dtype {output.dtype} differs from input dtype {input.dtype}")


def world_times(
    fn: str, big: _Tensor, big_name: str, small: _Tensor, small_name: str, world: int
) -> None:
    """The torch-style gather and scatter pairs: ``big`` holds world_size times
    ``small``'s elements."""
    if big.numel() != world * small.numel():
        raise ValueError(
            f"{fn}: {big_name} has {big.numel()} elements, expected world_size "
            f"x {small_name} = {world} x {small.numel()}"
        )


def rank(fn: str, name: str, value: Any, world: int, not_rank: Optional[int] = None) -> int:
    """A rank in [0, world); ``not_rank``: this rank, which a send or recv may not name."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be an int rank, got {type(value).__name__}")
    if not 0 <= value < world:
        raise ValueError(f"{fn}: {name}={value} is out of range [0, {world})")
    if value == not_rank:
        raise ValueError(f"{fn}: {name}={value} is this rank; send to another rank")
    return value


def dim(fn: str, t: _Tensor, d: Any) -> int:
    """A dim of ``t``, as a non-negative int."""
    if isinstance(d, bool) or not isinstance(d, int):
        raise TypeError(f"{fn}: dim must be an int, got {type(d).__name__}")
    nd = t.dim()
    if not -nd <= d < nd:
        raise ValueError(
            f"{fn}: dim {d} is out of range for a {nd}-d tensor (expected {-nd} <= dim < {nd})"
            if nd
            else f"{fn}: a 0-d tensor has no dim {d}"
        )
    return d % nd


def sizes(
    fn: str,
    value: Any,
    world: int,
    t: Optional[_Tensor] = None,
    d: int = 0,
    rank: Optional[int] = None,
) -> list[int]:
    """One non-negative size per rank; with ``t``, they add up to its size
    along ``d`` (reduce_scatterv), or with ``rank`` too, this rank's is its
    size along ``d`` (all_gatherv)."""
    if not isinstance(value, (list, tuple)) or len(value) != world:
        raise ValueError(
            f"{fn}: sizes must be a list of {world} ints (one per rank), got {value!r}"
        )
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in value):
        raise ValueError(f"{fn}: sizes must be non-negative ints, got {list(value)}")
    got = [int(s) for s in value]
    if t is not None and rank is None and sum(got) != t.shape[d]:
        raise ValueError(f"{fn}: sizes add up to {sum(got)} but dim {d} has size {t.shape[d]}")
    if t is not None and rank is not None and t.shape[d] != got[rank]:
        raise ValueError(
            f"{fn}: rank {rank} has size {t.shape[d]} along dim {d} but sizes[{rank}] = {got[rank]}"
        )
    return got


def divided(fn: str, t: _Tensor, d: int, world: int) -> int:
    """reduce_scatter's part along ``d``: the world size must divide it."""
    size = t.shape[d]
    if size % world:
        raise ValueError(
            f"{fn}: dim {d} has size {size}, which world size {world} "
            f"does not divide; use reduce_scatterv with explicit sizes"
        )
    return size // world


def all_reduce_call(fn: str, t: Any, op: Any) -> Any:
    """all_reduce's tensor and op, as routing's Call (with the op as a
    ReduceOp): a CUDA tensor (the CUDA path checks it), a sparse CPU tensor
    (torch.distributed sums it), or a dense CPU tensor it writes into."""
    if isinstance(t, _Tensor) and t.is_cuda:
        return Call(fn, cuda=True, op=as_reduce_op(fn, op))
    if isinstance(t, _Tensor) and t.is_sparse and t.is_cpu:
        return Call(fn, sparse=True, op=as_reduce_op(fn, op))
    op = reduce_op(fn, t, op)
    writable(fn, t)
    return Call(fn, dtype=t.dtype, op=op)


def gather_out(fn: str, out: Any, t: _Tensor, d: int, world: int) -> Optional[Exception]:
    """What is wrong with gather's ``out`` on the root (the error to raise
    once the gather completed), or None (no out, or it fits)."""
    if out is None:
        return None
    shape = list(t.shape)
    shape[d] *= world
    try:
        tensor(fn, out, "out")
        writable(fn, out, "out")
        if out.dtype != t.dtype or list(out.shape) != shape:
            raise ValueError(
                f"{fn}: out has dtype {out.dtype} and shape {tuple(out.shape)}, "
                f"expected {t.dtype} and {tuple(shape)}"
            )
    except (TypeError, ValueError) as e:
        return e
    return None


def output_list(fn: str, outputs: Any, world: int, numel: int) -> list[_Tensor]:
    """The list forms' outputs: one per rank, each ``numel`` elements, written."""
    outs = tensor_list(fn, outputs, written=True)
    if len(outs) != world:
        raise ValueError(f"{fn}: expected {world} output tensors, got {len(outs)}")
    for o in outs:
        if o.numel() != numel:
            raise ValueError(
                f"{fn}: output tensors must have {numel} elements each, got {o.numel()}"
            )
    return outs


def input_list(fn: str, parts: Any, world: int) -> list[_Tensor]:
    """scatter's parts on the source: one per rank."""
    parts = tensor_list(fn, parts)
    if len(parts) != world:
        raise ValueError(f"{fn}: expected {world} input tensors, got {len(parts)}")
    return parts


def shape(fn: str, value: Any, dtype: Any) -> tuple:
    """empty()'s shape (an int or a sequence of ints >= 0) and dtype."""
    if isinstance(value, int):
        value = (value,)
    if not isinstance(value, (tuple, list, torch.Size)) or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in value
    ):
        raise ValueError(f"{fn}: shape must be non-negative ints, got {value!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{fn}: dtype must be a torch.dtype, got {type(dtype).__name__}")
    return tuple(int(s) for s in value)


def recv_out(fn: str, out: Any) -> Optional[list[_Tensor]]:
    """A receive's ``out=``: None, or dense tensors it writes into."""
    if out is None:
        return None
    out = tensor_list(fn, out, written=True)
    for i, o in enumerate(out):
        if not is_dense(o):
            raise ValueError(
                f"{fn}: out tensors must be dense (contiguous, not a conj/neg view); "
                f"tensors[{i}] is not dense: shape {tuple(o.shape)}, strides "
                f"{o.stride()}; nothing was received"
            )
    return out


def p2p_ops(fn: str, ops: Any, world: int, me: int) -> list:
    """batch_isend_irecv's ops as checked ``(what, tensors, peer)``."""
    checked = []
    for i, op in enumerate(ops):
        if not (isinstance(op, tuple) and len(op) == 3 and op[0] in ("send", "recv")):
            raise TypeError(f"{fn}: ops[{i}] must be ('send' | 'recv', tensors, peer)")
        what, tensors, peer = op
        tensors = tensor_list(fn, tensors, written=what == "recv")
        name = "dst" if what == "send" else "src"
        checked.append((what, tensors, rank(fn, name, peer, world, not_rank=me)))
    return checked


def tensor_dict(fn: str, data: Any) -> None:
    """send_tensor_dict's dict: its tensor values are checked as any tensor."""
    if not isinstance(data, dict):
        raise TypeError(f"{fn}: data must be a dict, got {type(data).__name__}")
    for key, value in data.items():
        if isinstance(value, _Tensor):
            tensor(fn, value, f"data[{key!r}]")


def tensor_list(fn: str, tensors: Any, written: bool = False) -> list[_Tensor]:
    """A list or tuple of tensors (``written``: a call writes into them)."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(
            f"{fn}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}"
        )
    for i, t in enumerate(tensors):
        tensor(fn, t, f"tensors[{i}]")
        if written:
            writable(fn, t, f"tensors[{i}]")
    return list(tensors)


def splits(fn: str, name: str, value: Any) -> list[int]:
    """all_to_all split sizes: None (even), or a list of ints (checked against
    the peers' by the collective itself)."""
    if value is None:
        return []
    if type(value) is list and all(type(v) is int for v in value):  # the common case
        return value
    if not isinstance(value, (list, tuple)) or any(
        isinstance(v, bool) or not isinstance(v, int) for v in value
    ):
        raise TypeError(f"{fn}: {name} must be a list of ints, got {value!r}")
    return [int(v) for v in value]
