"""Exceptions raised by tpcomm.

Bad arguments raise the built-in ``TypeError`` / ``ValueError`` (the message
names the function, the value seen and the value expected).  Failures at run
time raise :class:`CommError` or one of its subclasses.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["CommError", "PeerFailedError", "CommTimeoutError", "LaunchError"]

# Code written for torch.distributed catches torch's error types: tpcomm's are
# also instances of them (all RuntimeErrors), keeping their own names and
# fields.  A CommError is a DistError; a peer's failure and a timeout are
# DistBackendErrors, as NCCL's are.
try:
    from torch.distributed import DistBackendError as _DistBackendError
    from torch.distributed import DistError as _DistError
except ImportError:  # torch without distributed support
    _DistError = _DistBackendError = RuntimeError  # type: ignore[misc,assignment]


class CommError(_DistError):
    """A collective could not be completed (or set up) at run time (also a
    ``torch.distributed.DistError``, a RuntimeError)."""


class PeerFailedError(CommError, _DistBackendError):
    """A peer rank died or left while this rank was waiting for it.

    Attributes:
        rank: the rank (in the communicator) that failed.
    """

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank))


class CommTimeoutError(CommError, _DistBackendError):
    """A wait ran past the communicator's timeout while every peer was alive.

    Attributes:
        rank: the rank that was being waited for, or that timed out first.
    """

    def __init__(self, message: str, rank: Optional[int] = None):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank))


class LaunchError(CommError):
    """A rank started by :func:`tpcomm.launch` failed.

    Attributes:
        rank: the first rank that failed (the root cause where it can be told).
        remote_traceback: that rank's formatted traceback, or a description of
            how it died.
    """

    def __init__(self, message: str, rank: int, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank, self.remote_traceback))
