"""tpcomm on GPUs: ``CustomAllreduce``, the one-node all-reduce over CUDA IPC buffers.

Kernels are Triton (``kernels.py``), buffers are shared with torch's CUDA IPC
handles (``ipc.py``): no CUDA C++ build.  Importing this package does not
import Triton; constructing a ``CustomAllreduce`` on a machine without CUDA
or Triton gives a disabled one (``disabled_reason`` says why) whose
``custom_all_reduce`` returns None: use NCCL.
"""

from .custom_all_reduce import (
    SUPPORTED_WORLD_SIZES,
    CustomAllreduce,
    check_capture_counts,
    choose_algorithm,
    chunks,
    is_weak_contiguous,
    why_disabled,
)

__all__ = [
    "CustomAllreduce",
    "SUPPORTED_WORLD_SIZES",
    "check_capture_counts",
    "choose_algorithm",
    "chunks",
    "is_weak_contiguous",
    "why_disabled",
]
