"""tpcomm.cuda.CustomAllreduce on a real GPU (run by scripts/gpu_check.sh).

Several ranks share GPU 0 (CUDA IPC works between processes on one device):
eager and CUDA-graph all-reduce at world 2 and 4, sizes from 16 B to twice
max_size, float32/float16/bfloat16, each result bitwise equal on every rank
and to a float32 sum in rank order computed on the CPU; all_gather and
reduce_scatter; the capture-count mismatch error; no GPU memory left after
close().  Skipped, with the reason, where there is no CUDA.
"""

from __future__ import annotations

import gc

import pytest
import torch

import tpcomm
from tpcomm.cuda import CustomAllreduce

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU here: scripts/gpu_check.sh runs these on a machine with one",
)

MAX = 1 << 20  # max_size for the tests: 2 x max_size stays quick
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ref(comm, x_cpu):
    """float32 sum of every rank's tensor in rank order, rounded once (on the CPU)."""
    return comm.all_gather(x_cpu.reshape(1, -1)).float().sum(0).to(x_cpu.dtype).view(x_cpu.shape)


def _same_everywhere(comm, y_cpu):
    allv = comm.all_gather(y_cpu.reshape(1, -1).view(torch.uint8))
    return all(torch.equal(allv[0], allv[r]) for r in range(comm.world_size))


def _eager(comm):
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    base = torch.cuda.memory_allocated(dev)
    car = CustomAllreduce(comm, dev, max_size=MAX)
    if car.disabled:
        return {"enabled": False, "reason": car.disabled_reason}
    checks = {"enabled": True}
    g = torch.Generator().manual_seed(comm.rank)
    for dt in DTYPES:
        es = torch.empty(0, dtype=dt).element_size()
        for nbytes in (16, 1024, 65536, MAX // 2 + 16, MAX - 16, MAX, 2 * MAX):
            for algo in (None, "one_shot", "two_shot"):
                car.algorithm = algo
                x_cpu = (torch.randn(nbytes // es, generator=g) * 8).to(dt)
                y = car.all_reduce(x_cpu.to(dev))
                y_cpu = y.cpu()
                key = f"{dt} {nbytes}B {algo or 'auto'}"
                checks[key] = torch.equal(y_cpu, _ref(comm, x_cpu))
                checks[key + " same bits"] = _same_everywhere(comm, y_cpu)
    car.algorithm = None
    x_cpu = torch.randn(1024, generator=g)
    got = car.custom_all_reduce(x_cpu.cuda())
    checks["custom_all_reduce"] = got is not None and torch.equal(got.cpu(), _ref(comm, x_cpu))
    checks["None at max_size"] = car.custom_all_reduce(torch.ones(MAX // 4, device=dev)) is None
    checks["None for 12 bytes"] = car.custom_all_reduce(torch.ones(3, device=dev)) is None
    checks["None for int32"] = (
        car.custom_all_reduce(torch.ones(4, dtype=torch.int32, device=dev)) is None
    )
    w = comm.world_size
    for dt in DTYPES:
        a = (torch.randn(64, 8, generator=g) * 4).to(dt)
        ag = car.custom_all_gather(a.cuda())
        checks[f"all_gather {dt}"] = ag is not None and torch.equal(ag.cpu(), comm.all_gather(a))
        z = (torch.randn(16 * w, 8, generator=g) * 4).to(dt)
        rs = car.custom_reduce_scatter(z.cuda())
        want = _ref(comm, z).chunk(w)[comm.rank]
        checks[f"reduce_scatter {dt}"] = rs is not None and torch.equal(rs.cpu(), want)
    del y, got, ag, rs
    car.close()
    car.close()
    comm.barrier()  # every rank has dropped its mappings of the others' buffers
    gc.collect()
    torch.cuda.ipc_collect()
    torch.cuda.synchronize(dev)
    checks["no GPU memory left after close"] = torch.cuda.memory_allocated(dev) == base
    return checks


def _graph(comm, mismatch):
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    car = CustomAllreduce(comm, dev, max_size=MAX)
    if car.disabled:
        return {"enabled": False, "reason": car.disabled_reason}
    checks = {"enabled": True}
    n = 4096
    for dt in DTYPES:
        for algo in ("one_shot", "two_shot"):
            car.algorithm = algo
            x = torch.zeros(n, dtype=dt, device=dev)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm-up: compiles the kernels outside the capture
                for _ in range(2):
                    car.all_reduce(x)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            calls = 2 if (mismatch and comm.rank == 0) else 1
            try:
                with car.capture(), torch.cuda.graph(graph):
                    y = car.custom_all_reduce(x)
                    if calls == 2:
                        car.custom_all_reduce(y)
                if mismatch:
                    return {"enabled": True, "mismatch raised": False}
            except ValueError as e:
                return {"enabled": True, "mismatch raised": "captured different numbers" in str(e)}
            for k in range(3):
                x_cpu = (
                    torch.randn(n, generator=torch.Generator().manual_seed(k * 10 + comm.rank)) * 8
                ).to(dt)
                x.copy_(x_cpu.to(dev))
                graph.replay()
                torch.cuda.synchronize(dev)
                key = f"graph {dt} {algo} replay {k}"
                checks[key] = torch.equal(y.cpu(), _ref(comm, x_cpu))
                checks[key + " same bits"] = _same_everywhere(comm, y.cpu())
            del graph, y
    car.close()
    return checks


def _assert_all(res):
    for r, checks in enumerate(res):
        assert checks.get("enabled"), f"rank {r}: disabled: {checks.get('reason')}"
        bad = {k: v for k, v in checks.items() if not v}
        assert not bad, f"rank {r}: {bad}"


@pytest.mark.parametrize("world", [2, 4])
def test_eager(world):
    _assert_all(tpcomm.launch(_eager, world, timeout=240))


@pytest.mark.parametrize("world", [2, 4])
def test_cuda_graphs(world):
    _assert_all(tpcomm.launch(_graph, world, args=(False,), timeout=240))


def test_capture_count_mismatch_fails_fast_on_every_rank():
    res = tpcomm.launch(_graph, 2, args=(True,), timeout=120)
    assert all(r.get("mismatch raised") for r in res), res
