"""Buffers every rank can address: CUDA IPC on a GPU, shared memory in tests.

``Group`` adapts what the ranks talk over during set-up (a torch.distributed
ProcessGroup that carries CPU tensors, or a tpcomm Communicator) to what
set-up needs: ``all_gather_object``.

``share(nbytes, ...)`` allocates a zeroed buffer on this rank and returns it
with every rank's address of its peers' buffers (a device int64 tensor, the
table the kernels read).  On CUDA the handles are torch's own
(``UntypedStorage._share_cuda_`` / ``_new_shared_cuda``, what
torch.multiprocessing uses), so no CUDA C++ or cuda-python is needed.  On the
CPU (the Triton interpreter, tests only) the buffer is a tpcomm symmetric
buffer (``Communicator.empty``), mapped by every rank.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Group", "Shared", "share", "open_handle"]


class Group:
    """Set-up traffic over a ProcessGroup (CPU-capable) or anything with a
    Communicator's collectives (all_gather, all_gatherv, empty, peer_buffers)."""

    def __init__(self, group: Any):
        self.comm = (
            group if hasattr(group, "all_gatherv") and hasattr(group, "peer_buffers") else None
        )
        if self.comm is not None:
            self.rank, self.world = self.comm.rank, self.comm.world_size
            self.pg = None
        else:
            import torch.distributed as dist

            self.pg = group if group is not None else dist.group.WORLD
            self.rank = dist.get_rank(self.pg)
            self.world = dist.get_world_size(self.pg)

    def all_gather_object(self, obj: Any) -> list:
        if self.comm is not None:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            sizes = self.comm.all_gather(torch.tensor([data.numel()], dtype=torch.int64))
            blob = self.comm.all_gatherv(data, sizes.tolist())
            out, at = [], 0
            for n in sizes.tolist():
                out.append(pickle.loads(blob[at : at + n].numpy().tobytes()))
                at += n
            return out
        import torch.distributed as dist

        got: list = [None] * self.world
        dist.all_gather_object(got, obj, group=self.pg)
        return got


@dataclass
class Shared:
    """One buffer per rank: ``local`` (this rank's, uint8) and ``ptrs`` (every
    rank's address, int64, on the buffer's device); ``keep`` holds the peers'
    mappings open."""

    local: torch.Tensor
    ptrs: torch.Tensor
    keep: list = field(default_factory=list)

    def close(self) -> None:
        self.keep.clear()


def share(nbytes: int, device: torch.device, group: Group) -> Shared:
    """Collective: a zeroed ``nbytes`` buffer per rank, addressable by all."""
    if device.type == "cuda":
        local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        handles = group.all_gather_object(local.untyped_storage()._share_cuda_())
        addrs, keep = [], []
        for r, h in enumerate(handles):
            if r == group.rank:
                addrs.append(local.data_ptr())
                continue
            peer = open_handle(h, device)
            keep.append(peer)
            addrs.append(peer.data_ptr())
        ptrs = torch.tensor(addrs, dtype=torch.int64, device=device)
        return Shared(local, ptrs, keep)
    if group.comm is None:
        raise ValueError("tpcomm.cuda: CPU buffers (Triton interpreter) need a tpcomm Communicator")
    return _share_cpu(nbytes, group.comm)


def open_handle(handle: tuple, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over a peer's CUDA allocation, from ``_share_cuda_()``'s tuple."""
    storage = torch.UntypedStorage._new_shared_cuda(*handle)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _share_cpu(nbytes: int, comm: Any) -> Shared:
    local = comm.empty((nbytes,), torch.uint8)
    local.zero_()
    if not comm.shared_memory:  # world size 1
        return Shared(local, torch.tensor([local.data_ptr()], dtype=torch.int64), [])
    comm.barrier()  # every rank zeroed its buffer before anyone reads it
    views = comm.peer_buffers(local)  # this process's mapping of every rank's buffer
    addrs = [v.data_ptr() for v in views]
    addrs[comm.rank] = local.data_ptr()
    return Shared(local, torch.tensor(addrs, dtype=torch.int64), views)
