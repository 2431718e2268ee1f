"""tpcomm: fast collectives for tensor-parallel inference.

Ranks on one host talk through POSIX shared memory; see ``Communicator``.
"""

from ._version import __version__
from .communicator import Communicator
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
]
