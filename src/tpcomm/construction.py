"""How a Communicator comes to be: where its set-up store and names come from,
and the paths it is given.

``group_setup`` (inside a torch.distributed job) and ``env_setup``
(torchrun-style environment) find the store, rank, world size and key prefix;
``build`` then makes the paths, in ``routing.order``: world size 1 is the
local path; otherwise, after the peers can watch this rank (``bootstrap.Watch``)
and the ranks have exchanged their hosts, shared memory (every rank on this
host) or a hierarchy (several hosts), with torch.distributed last and CUDA
first.
"""

from __future__ import annotations

import collections
import hashlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import _env, routing
from .bootstrap import Watch, exchange, host_identity, master_store
from .cuda.path import CudaPath
from .dist_path import DistPath, private_gloo, private_nccl
from .errors import CommError
from .hierarchical import Hierarchy
from .paths import Path
from .shm.engine import ShmEngine
from .shm.path import ShmPath
from .shm.setup import open_engine

__all__ = ["Setup", "build", "engine_of", "env_setup", "group_setup"]

# Communicators created on the same ranks get the same sequence number on
# every rank because every rank creates them in the same order (a collective
# contract, as in torch.distributed.new_group).
_created: collections.Counter = collections.Counter()

# the set-up stores this process hosts for from_env, by (MASTER_ADDR, MASTER_PORT)
_hosted: dict = {}


@dataclass
class Setup:
    """What a Communicator is made from (its set-up store, its place, its names)."""

    store: Any
    rank: int
    world: int
    prefix: str  # the store keys' prefix
    tag: str  # the segments' name tag
    timeout: float
    group: Any = None  # the torch.distributed group, when made over one
    fallback: Optional[DistPath] = None  # the caller's torch.distributed path
    cuda_fallback: Optional[DistPath] = None  # the caller's NCCL path
    watch: Optional[Watch] = None


@dataclass
class Paths:
    """The paths build() made, in the order routing tries them."""

    order: list
    shm: Optional[ShmPath] = None
    hier: Optional[Hierarchy] = None
    dist: Optional[DistPath] = None
    cuda: Optional[CudaPath] = None
    watch: Optional[Watch] = None

    @property
    def fast(self) -> Path:
        """The path whose one-call entries the Communicator tries first:
        shared memory's, or the first path (whose entries decline)."""
        return self.shm if self.shm is not None else self.order[0]


def engine_of(comm: Any) -> Optional[ShmEngine]:
    """The shared-memory engine build() gave a Communicator (None: world size
    1, across hosts, closed): how tpcomm tune and tpcomm perf reach its
    settings and plans (ShmEngine's public methods)."""
    shm = getattr(comm, "_shm", None)
    return None if shm is None else shm.engine


def group_setup(group: Any, seconds: float) -> Setup:
    """A Communicator over a torch.distributed group (None: the world)."""
    import torch.distributed as dist

    fn = "Communicator"
    if not (dist.is_available() and dist.is_initialized()):
        raise CommError(
            f"{fn}: torch.distributed is not initialized; call "
            f"dist.init_process_group(...) first, or use Communicator.from_env() or "
            f"tpcomm.launch()"
        )
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"{fn}: this process (global rank {dist.get_rank()}) is not a member of the given group"
        )
    world = dist.get_world_size(group)
    ranks = tuple(dist.get_process_group_ranks(group))
    tag = hashlib.sha1(repr(ranks).encode()).hexdigest()[:8]
    _created[tag] += 1
    prefix = f"tpcomm/g{tag}/{_created[tag]}"
    store = dist.distributed_c10d._get_default_store()
    # a rank's process record also under its global rank: a later
    # communicator of the same processes sees a rank that died before it
    # got that far (bootstrap.Watch)
    also = {r: f"tpcomm/proc/{g}" for r, g in enumerate(ranks)}
    watch = Watch.over(store, prefix, rank, world, also)
    return Setup(store, rank, world, prefix, f"g{tag}", seconds, group, watch=watch)


def env_setup(seconds: float) -> Setup:
    """A Communicator from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    from torch.distributed import TCPStore

    fn = "Communicator.from_env"
    env = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        value = os.environ.get(name)
        if not value:
            raise ValueError(
                f"{fn}: environment variable {name} is not set (torchrun sets "
                f"RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
            )
        env[name] = value
    try:
        rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
    except ValueError:
        raise ValueError(
            f"{fn}: RANK, WORLD_SIZE and MASTER_PORT must be integers, got {env}"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"{fn}: RANK={rank} must be in [0, WORLD_SIZE={world})")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = None
    if world > 1 and rank == 0 and not agent:  # listening on MASTER_ADDR only
        # one per address and port for the life of the process: a communicator
        # made again after close() uses it again (peers may still be
        # connected to it; a new one on the same port would cut them off)
        key = (env["MASTER_ADDR"], port)
        store = _hosted.get(key)
        if store is None:
            store = _hosted[key] = master_store(env["MASTER_ADDR"], port, world, seconds)
    elif world > 1:
        store = TCPStore(
            env["MASTER_ADDR"],
            port,
            world,
            is_master=False,
            timeout=_env.timedelta(seconds),
            wait_for_workers=False,
        )
    _created["env"] += 1
    prefix = f"tpcomm/env/{_created['env']}"
    also = {r: f"tpcomm/env/proc/{r}" for r in range(world)}
    watch = Watch.over(store, prefix, rank, world, also)
    return Setup(store, rank, world, prefix, "env", seconds, watch=watch)


def _over(s: Setup, given: Optional[DistPath], private: Callable, kind: str) -> DistPath:
    """A torch.distributed path: the caller's (``given``), the group's, or a
    private ``kind`` group (``private``: private_gloo, private_nccl) over the
    set-up store, made on first use (dist_path.py)."""
    if given is not None:
        return given
    if s.group is not None:
        return DistPath(s.group, s.rank, s.world)
    store, prefix, rank, world, timeout = s.store, s.prefix, s.rank, s.world, s.timeout
    return DistPath(
        lambda: private(store, f"{prefix}/{kind}", rank, world, timeout),
        rank,
        world,
        label=f"{kind}, tpcomm's own",
    )


def dist_path(s: Setup) -> Optional[DistPath]:
    """The torch.distributed path of CPU tensors (none at world size 1)."""
    return None if s.world == 1 else _over(s, s.fallback, private_gloo, "gloo")


def cuda_path(comm: Any, s: Setup) -> CudaPath:
    """CUDA tensors: the custom all-reduce over ``comm``, then NCCL (made on the
    first all_reduce the custom path declines)."""
    return CudaPath(comm, lambda: _over(s, s.cuda_fallback, private_nccl, "nccl"))


def build(
    comm: Any,
    s: Setup,
    make_local: Callable[[int, int, str, list, Watch], Any],
    fallbacks: tuple,
) -> Paths:
    """The paths of ``comm``, in routing's order.  ``make_local(rank, world,
    prefix, members)`` makes a host's own Communicator (a hierarchy's);
    ``fallbacks`` are what the whole-call entries (all_reduce,
    all_gather_into_tensor, reduce_scatter_tensor, gather) hand the rest of the
    calls to."""
    dist = dist_path(s)
    cuda = cuda_path(comm, s)
    if s.world == 1:
        return Paths(routing.order(1, cuda, None, dist), dist=dist, cuda=cuda)
    # before any wait: the peers can tell this rank died (bootstrap.Watch)
    watch = s.watch if s.watch is not None else Watch.over(s.store, s.prefix, s.rank, s.world)
    watch.publish()
    # the host and the process: the second lets the watch check every peer
    # from here on, even once the store is gone (its host, rank 0, died)
    mine = f"{host_identity()}\n{watch.known[s.rank]}"
    both = exchange(s.store, s.prefix, s.rank, s.world, "host", mine, s.timeout, watch)
    hosts = [v.rpartition("\n")[0] for v in both]
    watch.known.update((r, v.rpartition("\n")[2]) for r, v in enumerate(both))
    if len(set(hosts)) != 1:

        def local(r: int, w: int, p: str, members: list) -> tuple:
            comm = make_local(r, w, p, members, watch)
            return comm, comm._fast  # the host's Communicator, and its engine's path

        hier = Hierarchy(local, s.store, s.prefix, s.rank, s.world, hosts, s.timeout)
        order = routing.order(s.world, cuda, hier, dist)
        return Paths(order, hier=hier, dist=dist, cuda=cuda, watch=watch)
    engine = open_engine(s.store, s.rank, s.world, s.prefix, s.tag, s.timeout, watch)
    shm = ShmPath(engine, fallbacks)
    order = routing.order(s.world, cuda, shm, dist)
    return Paths(order, shm=shm, dist=dist, cuda=cuda, watch=watch)
