"""tpcomm inside vLLM: a ``vllm.general_plugins`` entry point.

Installed into vLLM's environment, tpcomm serves the communicator calls of
every tensor-parallel and pipeline-parallel group of vLLM's CPU platform:
``all_reduce``, ``gather``, ``all_gather_into_tensor`` (vLLM's ``all_gather``),
``send_tensor_dict`` and ``recv_tensor_dict``, the five calls vLLM's own
shared-memory object (``_CPUSHMDistributed``) serves.  What vLLM sends to
torch.distributed directly, and the groups it does not route through that
object (data, expert parallel), stay as vLLM has them.

How it plugs in (the path of a call, read from the top):

1. vLLM loads the entry point ``tpcomm`` of the group ``vllm.general_plugins``
   in each of its processes (``register`` below; idempotent, as vLLM asks).
2. On the CPU platform, within the vLLM versions this module knows
   (``KNOWN_VLLM``), ``register`` wraps ``CpuCommunicator.__init__``.
3. For a group named ``tp...`` or ``pp...`` of two or more ranks, the wrapper
   makes a ``tpcomm.Communicator`` over the group's ``device_group``
   (collective: every rank of the group builds its communicator at the same
   point), then runs vLLM's own ``__init__`` with vLLM's shared memory out of
   the way (no segment of vLLM's is made), and sets the communicator's
   ``dist_module`` to ``VllmModule`` below, which calls the Communicator.
4. ``CpuCommunicator.destroy`` closes the Communicator.

Anything else leaves vLLM's path in place and says why in vLLM's log: another
platform (silently: nothing to do), an unknown vLLM version, a stateless or
one-rank group, a Communicator that could not be made (a small /dev/shm, say).
``VLLM_PLUGINS`` (vLLM's own switch) leaves the plugin out like any other;
``TPCOMM_VLLM=0`` turns it off with tpcomm installed, and ``TPCOMM_VLLM=torch``
takes vLLM's shared memory away without putting tpcomm in its place (vLLM then
runs these groups on torch.distributed, gloo, as it does on every CPU without
AVX-512: a baseline for comparisons).

What the plugin took is logged once per process; ``TPCOMM_STATS`` (see
``tpcomm.stats``) writes each Communicator's record of calls and waits.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from . import _env

__all__ = ["register", "VllmModule", "KNOWN_VLLM", "ENGINE_SPIN_US", "served_groups"]

# vLLM versions whose CpuCommunicator this module has been tested against
# ([low, high): the constructor's arguments, ``dist_module`` and
# ``supports_tensor_dict``, the ``tp``/``pp`` group names)
KNOWN_VLLM = ((0, 32), (0, 33))

# TPCOMM_SPIN_US inside vLLM's processes unless set: spin up to 2 ms (the
# core's limit), which leaves no time to yield (TPCOMM_YIELD_US is 1 ms), then
# sleep.  Ranks that outnumber the cores still never spin (shm/setup.py).
ENGINE_SPIN_US = "2000"

# vLLM's own __init__ runs under this prefix on the name of a group the plugin
# takes: vLLM picks its shm object for names starting "tp" or "pp" only
_HIDDEN = "_tpcomm:"

_registered = False
# the groups this process's Communicators serve: unique_name -> Communicator
_served: dict[str, Any] = {}


def _log() -> logging.Logger:
    # under vLLM's logger, so that vLLM's handlers and level show it
    return logging.getLogger("vllm.tpcomm")


def served_groups() -> dict[str, Any]:
    """The vLLM groups this process's tpcomm Communicators serve (name ->
    Communicator); empty where the plugin took nothing."""
    return dict(_served)


def _version_tuple(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (-1, -1)


def register() -> None:
    """The entry point vLLM calls (with no arguments) in each of its processes."""
    global _registered
    if _registered:
        return
    _registered = True
    mode = _env.vllm_mode()
    if mode == "off":
        _log().info("tpcomm: TPCOMM_VLLM=0, vLLM's own communication stays in place")
        return
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception as e:  # a broken vLLM: it will say so itself
        _log().warning("tpcomm: vLLM could not be imported (%s); plugin inactive", e)
        return
    if not current_platform.is_cpu():
        return  # another platform: nothing here to serve
    version = getattr(vllm, "__version__", "unknown")
    low, high = KNOWN_VLLM
    if not low <= _version_tuple(version) < high:
        _log().warning(
            "tpcomm: vLLM %s is outside the versions the plugin knows (%d.%d to before "
            "%d.%d); vLLM's own CPU communication stays in place",
            version, *low, *high,
        )  # fmt: skip
        return
    # vLLM binds each worker to its own core and spins in its own waits: a
    # tpcomm wait there spins up to 2 ms before it sleeps, never yields (the
    # record of the decode loop: docs/DECISIONS.md); what the user sets wins
    os.environ.setdefault("TPCOMM_SPIN_US", ENGINE_SPIN_US)
    from vllm.distributed.device_communicators import cpu_communicator as cc

    cls = cc.CpuCommunicator
    if getattr(cls.__init__, "_tpcomm", False):
        return  # patched already (a second load of this module)
    original_init, original_destroy = cls.__init__, cls.destroy

    def __init__(self, cpu_group, device=None, device_group=None, unique_name="", *a, **kw):
        if mode == "torch" and _ours(unique_name):
            # vLLM without its shared memory: torch.distributed (gloo), as on a CPU
            # without AVX-512; for comparisons
            original_init(self, cpu_group, device, device_group, _HIDDEN + unique_name, *a, **kw)
            self.unique_name = unique_name
            _log().info(
                "tpcomm: TPCOMM_VLLM=torch, vLLM group %s on torch.distributed", unique_name
            )
            return
        comm = _take(device_group, unique_name)
        if comm is None:
            original_init(self, cpu_group, device, device_group, unique_name, *a, **kw)
            return
        # vLLM's own init, told a name it makes no shared memory for (it picks
        # its shm object for tp/pp names only); the real name is put back
        original_init(self, cpu_group, device, device_group, _HIDDEN + unique_name, *a, **kw)
        self.unique_name = unique_name
        self.dist_module = VllmModule(comm, unique_name)
        self.supports_tensor_dict = True
        _served[unique_name] = comm
        _log().info(
            "tpcomm: serving vLLM group %s (rank %d of %d) through shared memory",
            unique_name, comm.rank, comm.world_size,
        )  # fmt: skip

    def destroy(self):
        module = getattr(self, "dist_module", None)
        if isinstance(module, VllmModule):
            module.close()
        return original_destroy(self)

    __init__._tpcomm = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    cls.destroy = destroy


def _ours(unique_name: str) -> bool:
    """The groups vLLM serves with its shared memory, and so the plugin: tensor
    and pipeline parallel (vLLM keeps the others on torch.distributed)."""
    return unique_name.startswith("tp") or unique_name.startswith("pp")


def _take(device_group: Any, unique_name: str) -> Any:
    """A tpcomm Communicator for this vLLM group, or None (vLLM's path stays,
    with the reason logged)."""
    if not _ours(unique_name):
        return None
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    if device_group is None or _world.pg_map.get(device_group) is None:
        _log().info("tpcomm: vLLM group %s is stateless; vLLM's path stays", unique_name)
        return None
    if dist.get_world_size(device_group) < 2:
        return None  # one rank: nothing to exchange
    from .communicator import Communicator

    try:
        return Communicator(group=device_group)
    except Exception as e:
        _log().warning(
            "tpcomm: cannot serve vLLM group %s (%s: %s); vLLM's path stays",
            unique_name, type(e).__name__, e,
        )  # fmt: skip
        return None


class VllmModule:
    """What vLLM's ``CpuCommunicator`` calls as its ``dist_module``, served by a
    tpcomm Communicator (the five calls of vLLM's shared-memory object, with
    its signatures)."""

    def __init__(self, comm: Any, name: str):
        self.comm = comm
        self.name = name
        # one C call per all_reduce: vLLM's CpuCommunicator.all_reduce passes
        # group= (ignored: the Communicator is that group's)
        self._all_reduce = comm.all_reduce

    def all_reduce(self, input: torch.Tensor, group: Any = None) -> None:
        self._all_reduce(input)

    def gather(
        self,
        input: torch.Tensor,
        gather_list: list | None,
        dst: int = -1,
        group: Any = None,
    ) -> None:
        # vLLM passes the destination's global rank (torch.distributed style)
        import torch.distributed as dist

        local = dist.get_group_rank(group, dst) if group is not None else dst
        self.comm.gather_into_list(gather_list, input, dst=local)

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, group: Any = None
    ) -> None:
        self.comm.all_gather_into_tensor(output, input)

    def send_tensor_dict(self, tensor_dict: dict, dst: int) -> None:
        # dst: the rank in the group (vLLM's GroupCoordinator passes it so)
        self.comm.send_tensor_dict(tensor_dict, dst)

    def recv_tensor_dict(self, src: int) -> dict:
        return self.comm.recv_tensor_dict(src)

    def close(self) -> None:
        _served.pop(self.name, None)
        self.comm.close()
