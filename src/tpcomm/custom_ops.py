"""tpcomm's collectives as torch custom ops, so that torch.compile keeps them in the graph.

A function that calls ``comm.all_reduce(x)`` (or all_gather, reduce_scatter,
broadcast, all_gather_into_tensor, reduce_scatter_tensor) compiles with
``fullgraph=True``: under torch.compile those methods call the ops below
(``torch.ops.tpcomm.*``), each with a fake implementation that gives the
result's shape, and the compiled graph calls the engine when it runs.

The ops name the communicator by a string unique in the process (custom ops
take tensors and plain values, not Python objects).  ``comm.all_reduce`` is a
C function in eager mode (see Communicator._setup); a dynamo polyfill makes it
trace as the op.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import itertools
import sys
import weakref
from typing import Any, Optional

import torch

from .errors import CommError
from .ops import ReduceOp
from .shm.engine import NativeEngine

__all__ = ["register", "unregister"]

_comms: dict[str, Any] = {}  # name -> weakref to the Communicator
_engines: dict[int, str] = {}  # id(native engine) -> name, for the polyfill
_ids = itertools.count()


def register(comm: Any, ident: Optional[int]) -> str:
    """Give ``comm`` a name the ops can find it by (``ident``: its native
    engine's identity, which a traced fast all_reduce carries; None: none)."""
    name = f"c{next(_ids)}"
    _comms[name] = weakref.ref(comm)
    if ident is not None:
        _engines[ident] = name
    return name


def unregister(comm: Any) -> None:
    name = getattr(comm, "_op_name", "")
    _comms.pop(name, None)
    for ident in [i for i, n in _engines.items() if n == name]:
        del _engines[ident]


def _comm(name: str) -> Any:
    ref = _comms.get(name)
    comm = ref() if ref is not None else None
    if comm is None:
        raise CommError(f"tpcomm: the Communicator of a compiled call ({name}) is closed")
    return comm


def _op(op: Any) -> int:
    if isinstance(op, ReduceOp):
        return op.value
    raise TypeError(
        f"under torch.compile, op must be a tpcomm.ReduceOp, got {type(op).__name__} {op!r}"
    )


# -- the ops: eager implementations call the Communicator's checked methods ---


@torch.library.custom_op("tpcomm::all_reduce_", mutates_args=("tensor",))
def _all_reduce(tensor: torch.Tensor, op: int, comm: str) -> None:
    _comm(comm).all_reduce(tensor, ReduceOp(op))


@_all_reduce.register_fake
def _(tensor: torch.Tensor, op: int, comm: str) -> None:
    return None


@torch.library.custom_op("tpcomm::broadcast_", mutates_args=("tensor",))
def _broadcast(tensor: torch.Tensor, src: int, comm: str) -> None:
    _comm(comm).broadcast(tensor, src)


@_broadcast.register_fake
def _(tensor: torch.Tensor, src: int, comm: str) -> None:
    return None


@torch.library.custom_op("tpcomm::all_gather", mutates_args=())
def _all_gather(tensor: torch.Tensor, dim: int, comm: str) -> torch.Tensor:
    return _comm(comm).all_gather(tensor, dim)


@_all_gather.register_fake
def _(tensor: torch.Tensor, dim: int, comm: str) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] *= _comm(comm).world_size
    return tensor.new_empty(shape)


@torch.library.custom_op("tpcomm::reduce_scatter", mutates_args=())
def _reduce_scatter(tensor: torch.Tensor, dim: int, op: int, comm: str) -> torch.Tensor:
    return _comm(comm).reduce_scatter(tensor, dim, ReduceOp(op))


@_reduce_scatter.register_fake
def _(tensor: torch.Tensor, dim: int, op: int, comm: str) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] //= _comm(comm).world_size
    return tensor.new_empty(shape)


@torch.library.custom_op("tpcomm::all_gather_into_tensor_", mutates_args=("output",))
def _all_gather_into(output: torch.Tensor, input: torch.Tensor, comm: str) -> None:
    _comm(comm).all_gather_into_tensor(output, input)


@_all_gather_into.register_fake
def _(output: torch.Tensor, input: torch.Tensor, comm: str) -> None:
    return None


@torch.library.custom_op("tpcomm::reduce_scatter_tensor_", mutates_args=("output",))
def _reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, op: int, comm: str) -> None:
    _comm(comm).reduce_scatter_tensor(output, input, ReduceOp(op))


@_reduce_scatter_into.register_fake
def _(output: torch.Tensor, input: torch.Tensor, op: int, comm: str) -> None:
    return None


# -- what the Communicator's methods call while torch.compile traces them ------


def all_reduce(comm: Any, tensor: torch.Tensor, op: Any) -> torch.Tensor:
    torch.ops.tpcomm.all_reduce_(tensor, _op(op), comm._op_name)
    return tensor


def broadcast(comm: Any, tensor: torch.Tensor, src: int) -> torch.Tensor:
    torch.ops.tpcomm.broadcast_(tensor, src, comm._op_name)
    return tensor


def all_gather(comm: Any, tensor: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.ops.tpcomm.all_gather(tensor, dim, comm._op_name)


def reduce_scatter(comm: Any, tensor: torch.Tensor, dim: int, op: Any) -> torch.Tensor:
    return torch.ops.tpcomm.reduce_scatter(tensor, dim, _op(op), comm._op_name)


def all_gather_into_tensor(comm: Any, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    torch.ops.tpcomm.all_gather_into_tensor_(output, input, comm._op_name)
    return output


def reduce_scatter_tensor(
    comm: Any, output: torch.Tensor, input: torch.Tensor, op: Any
) -> torch.Tensor:
    torch.ops.tpcomm.reduce_scatter_tensor_(output, input, _op(op), comm._op_name)
    return output


def _polyfill() -> None:
    """Make dynamo trace the eager whole-call entries (the Communicator's
    all_reduce, all_gather_into_tensor and reduce_scatter_tensor are the
    engine's C methods) as the ops."""
    try:
        from torch._dynamo.decorators import substitute_in_graph
    except ImportError:  # a torch without dynamo: nothing to trace
        return

    @substitute_in_graph(NativeEngine.fast_all_reduce, skip_signature_check=True)
    def fast_all_reduce(engine: Any, tensor: torch.Tensor, op: Any = ReduceOp.SUM) -> Any:
        torch.ops.tpcomm.all_reduce_(tensor, _op(op), _engines[id(engine)])
        return tensor

    @substitute_in_graph(NativeEngine.whole_all_gather_into_tensor, skip_signature_check=True)
    def whole_all_gather_into_tensor(engine: Any, output: torch.Tensor, input: torch.Tensor) -> Any:
        torch.ops.tpcomm.all_gather_into_tensor_(output, input, _engines[id(engine)])
        return output

    @substitute_in_graph(NativeEngine.whole_reduce_scatter_tensor, skip_signature_check=True)
    def whole_reduce_scatter_tensor(
        engine: Any, output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM
    ) -> Any:
        torch.ops.tpcomm.reduce_scatter_tensor_(output, input, _op(op), _engines[id(engine)])
        return output


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run ``callback`` right after module ``name`` is first imported (one shot)."""

    def __init__(self, name: str, callback: Any):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module
        callback = self.callback

        def exec_module(module: Any) -> None:
            run(module)
            callback()

        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec


# torch._dynamo costs ~2 s to import: register the polyfill when something else
# (torch.compile) imports it, or now if it is already there.
if "torch._dynamo" in sys.modules:
    _polyfill()
else:
    sys.meta_path.insert(0, _AfterImport("torch._dynamo", _polyfill))
