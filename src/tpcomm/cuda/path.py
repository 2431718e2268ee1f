"""The CUDA path of a Communicator: CUDA tensors' all_reduce.

``CustomAllreduce`` (one per device, made on its first all_reduce) takes the
SUM of the sizes and dtypes it serves; everything else, and what it declines,
goes to NCCL: the caller's path, the group's, or a private NCCL group over
the set-up store, made on first use.  Importing this module imports neither
Triton nor CUDA.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import routing
from ..ops import ReduceOp, as_reduce_op
from ..paths import Path

__all__ = ["CudaPath"]


class CudaPath(Path):
    """CUDA tensors (all_reduce only: the other collectives take CPU tensors).

    Args:
        group: what ``CustomAllreduce`` exchanges its IPC handles over (the
            Communicator).
        make_nccl: a function making the NCCL ``DistPath``, called on the first
            all_reduce the custom path declines.
    """

    name = "cuda"

    def __init__(self, group: Any, make_nccl: Callable[[], Any]):
        self._group = group
        self._make_nccl = make_nccl
        self._nccl: Optional[Any] = None
        self._custom: dict = {}  # device -> CustomAllreduce, made on first use

    def should_use(self, call: Any) -> Optional[str]:
        return routing.cuda_objection(call)

    def all_reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        op = as_reduce_op("all_reduce", op)
        if op is ReduceOp.SUM:
            car = self._custom.get(tensor.device)
            if car is None:
                from .custom_all_reduce import CustomAllreduce

                car = self._custom[tensor.device] = CustomAllreduce(self._group, tensor.device)
            res = car.custom_all_reduce(tensor)
            if res is not None:
                return tensor.copy_(res)
        if self._nccl is None:
            self._nccl = self._make_nccl()
        return self._nccl.all_reduce(tensor, op)

    def close(self) -> None:
        for car in self._custom.values():
            car.close()
        self._custom.clear()
        self._nccl = None  # a caller's (the backend's) path: its owner releases it
