"""tpcomm: fast collectives for tensor-parallel inference.

Ranks on one host talk through POSIX shared memory; see ``Communicator``.
Importing tpcomm registers the torch.distributed backend ``tpcomm``
(``dist.init_process_group("cpu:tpcomm,cuda:nccl")``).
"""

from ._version import __version__
from .communicator import Communicator
from .dist_backend import ProcessGroupTpcomm, register
from .errors import CommError, CommTimeoutError, LaunchError, PeerFailedError
from .launch import launch
from .ops import ReduceOp

__all__ = [
    "__version__",
    "Communicator",
    "ReduceOp",
    "CommError",
    "PeerFailedError",
    "CommTimeoutError",
    "LaunchError",
    "launch",
    "ProcessGroupTpcomm",
]

register()
