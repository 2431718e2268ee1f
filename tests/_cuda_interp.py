"""Run by tests/test_cuda.py in a fresh interpreter with TRITON_INTERPRET=1.

Triton decides at import whether its standard library runs in the
interpreter, and importing tpcomm imports Triton (through torch._dynamo), so
the switch has to be in the environment before Python starts: the test runs
``python -m tests._cuda_interp CASE WORLD`` and reads one JSON line back.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import tpcomm
from tpcomm.cuda import CustomAllreduce


def _interpreted(comm, case):
    if case == "hosts":
        os.environ["TPCOMM_HOST_ID"] = f"host-{comm.rank}"
    car = CustomAllreduce(comm, "cpu", max_size=1 << 14)
    if car.disabled:
        return {"disabled": car.disabled_reason}
    g = torch.Generator().manual_seed(10 + comm.rank)
    out, bits = {}, []
    small = comm.world_size > 2  # oversubscribed here: fewer cases
    for dt in (
        (torch.float32, torch.bfloat16) if small else (torch.float32, torch.bfloat16, torch.float16)
    ):
        for n in (8, 4096 + 8) if small else (8, 1000, 4096 + 8, 9000):  # 9000 floats: 3 chunks
            for algo in ("one_shot", "two_shot"):
                car.algorithm = algo
                x = torch.randn(n, generator=g).to(dt) * 4
                y = car.all_reduce(x)
                ref = comm.all_gather(x.unsqueeze(0)).float().sum(0).to(dt)
                out[f"{dt} {n} {algo}"] = torch.equal(y, ref)
                bits.append(y)
    car.algorithm = None
    x = torch.randn(16, 4, generator=g)
    out["custom_all_reduce"] = torch.equal(
        car.custom_all_reduce(x), comm.all_gather(x.unsqueeze(0)).sum(0)
    )
    out["too big: None"] = car.custom_all_reduce(torch.ones(1 << 12)) is None
    out["all_gather"] = torch.equal(car.custom_all_gather(x), comm.all_gather(x))
    t = x.t()  # weakly contiguous, not contiguous: reduced in storage order
    out["transposed"] = torch.equal(car.all_reduce(t), comm.all_gather(t.unsqueeze(0)).sum(0))
    o = torch.empty(4, 16)
    out["into out"] = car.all_reduce(t, out=o) is o and torch.equal(o, out_t := car.all_reduce(t))
    out["strides kept"] = out_t.stride() == t.stride()
    w = comm.world_size
    z = torch.randn(8 * w, 4, generator=g).bfloat16()
    rs = car.custom_reduce_scatter(z)
    full = comm.all_gather(z.unsqueeze(0)).float().sum(0).bfloat16()
    out["reduce_scatter"] = torch.equal(rs, full.chunk(w)[comm.rank])
    out["reduce_scatter uneven: None"] = car.custom_reduce_scatter(torch.ones(w + 1, 4)) is None
    car.close()
    car.close()
    return out, [t.view(torch.uint8).tolist() for t in bits]


def main() -> None:
    """Arguments: CASE:WORLD ...; prints one JSON object {"CASE:WORLD": results}."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    res = {}
    for job in sys.argv[1:]:
        case, world = job.split(":")
        res[job] = tpcomm.launch(_interpreted, int(world), args=(case,), timeout=600)
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
