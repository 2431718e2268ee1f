"""Run by tests/test_vllm.py in vLLM's Python: two ranks call a vLLM
``CpuCommunicator`` the way vLLM's GroupCoordinator does, with the tpcomm
plugin registered, and check each call against torch on one process; where
vLLM has its own shared memory (AVX-512), ``send_tensor_dict`` and
``recv_tensor_dict`` also go through vLLM's own object on the same dicts.

    python tests/_vllm_calls.py OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def dicts(seed: int) -> list:
    """The dicts a pipeline stage sends: tensors of several dtypes and shapes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate((1, 7, 4096, 3 * 1024 * 1024)):
        out.append(
            {
                "hidden_states": torch.randn(n, generator=g).to(torch.bfloat16),
                "residual": torch.randn(2, n, generator=g),
                "positions": torch.arange(i, i + 5, dtype=torch.int64),
                "empty": torch.empty(0, dtype=torch.float16),
            }
        )
    return out


def rank_main(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("VLLM_DIST_IDENT", f"tpcomm-test-{port}")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import tpcomm.vllm_plugin as plugin

    plugin.register()
    plugin.register()  # vLLM may load a plugin more than once: idempotent
    from vllm.distributed.device_communicators import cpu_communicator as cc

    pg = dist.new_group([0, 1], backend="gloo")
    result = {"rank": rank}
    comm = cc.CpuCommunicator(pg, device_group=pg, unique_name="tp:0")
    result["module"] = type(comm.dist_module).__name__
    result["supports_tensor_dict"] = comm.supports_tensor_dict
    result["served"] = sorted(plugin.served_groups())

    # all_reduce, gather (dst as vLLM passes it: the group rank, converted to
    # global inside), all_gather, against torch on one process
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(3, 1000, generator=g).to(torch.bfloat16) for _ in range(2)]
    x = full[rank].clone()
    got = comm.all_reduce(x)
    want = (full[0].float() + full[1].float()).to(torch.bfloat16)
    result["all_reduce"] = bool(torch.equal(got, want))
    gathered = comm.gather(full[rank], dst=1, dim=-1)
    result["gather"] = (
        bool(torch.equal(gathered, torch.cat(full, dim=-1))) if rank == 1 else gathered is None
    )
    result["all_gather"] = bool(torch.equal(comm.all_gather(full[rank], dim=0), torch.cat(full)))

    # send_tensor_dict / recv_tensor_dict: rank 0 sends, rank 1 receives
    sent = dicts(11)
    own = None
    if hasattr(torch.ops._C, "init_shm_manager"):
        # vLLM's own object, over its own group, on the same dicts
        pg2 = dist.new_group([0, 1], backend="gloo")
        other = cc.CpuCommunicator(pg2, device_group=pg2, unique_name="dp:0")
        other.unique_name = "pp:0"
        own = cc._CPUSHMDistributed(other)
    result["vllm_own"] = own is not None
    ok, ok_own = True, True
    for d in sent:
        if rank == 0:
            comm.send_tensor_dict(d, 1)
            if own is not None:
                own.send_tensor_dict(d, 1)
        else:
            back = comm.recv_tensor_dict(0)
            ok &= back.keys() == d.keys() and all(
                back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in d.items()
            )
            if own is not None:
                theirs = own.recv_tensor_dict(0)
                ok_own &= theirs.keys() == back.keys() and all(
                    torch.equal(theirs[k], back[k]) for k in back
                )
    result["tensor_dict"] = bool(ok)
    result["tensor_dict_same_as_vllm"] = bool(ok_own)
    result["stats"] = comm.dist_module.comm.stats()
    dist.barrier()
    comm.destroy()
    result["closed"] = comm.dist_module.comm.closed
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(rank_main, args=(port, sys.argv[1]), nprocs=2, join=True)
