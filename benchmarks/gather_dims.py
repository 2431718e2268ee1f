"""Gathers and reduce-scatters along the last dim, as tensor-parallel layers call them.

A column-parallel layer that gathers its output (vLLM's gather_output, the
logits of the LM head) calls all_gather(x, dim=-1) on [tokens, hidden / world]
activations; the sequence-parallel reduce-scatter splits the last dim too.
This times, at world size 2, each collective along dim 0 and along dim -1 of
the same [rows, cols] tensor (per call, the slower rank's best of 5 loops),
next to gloo doing the same thing the way an engine without a dim argument
does it (dist.all_gather_into_tensor into [world, rows, cols], then a
movedim copy).

Run: .venv/bin/python benchmarks/gather_dims.py [rows]x[cols] ... (default:
a decode step and a prefill chunk, hidden 4096 split in two, bfloat16).
"""

import socket
import sys
import time

import torch
import torch.distributed as dist

import tpcomm


def _best(fn, n, sync):
    best = float("inf")
    for _ in range(5):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def _gloo_all_gather_last(x, w):
    rows, cols = x.shape
    out = torch.empty((w * rows, cols), dtype=x.dtype)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x)
    return out.view(w, rows, cols).movedim(0, 1).reshape(rows, w * cols)


def _data(rc, rank, dtype):
    n = rc[0] * rc[1]
    return (torch.arange(n) % 251 + rank).reshape(rc).to(dtype)


def _run(comm, shapes, dtype, port):
    w, r = comm.world_size, comm.rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=w)
    rows = []
    for rc in shapes:
        x = _data(rc, r, dtype)
        big = x.numel() * x.element_size() >= 1 << 20
        n = 200 if big else 2000
        cases = [
            ("all_gather", 0, lambda x=x: comm.all_gather(x, 0)),
            ("all_gather", -1, lambda x=x: comm.all_gather(x, -1)),
            ("gather", 0, lambda x=x: comm.gather(x, 0, 0)),
            ("gather", -1, lambda x=x: comm.gather(x, 0, -1)),
            ("reduce_scatter", 0, lambda x=x: comm.reduce_scatter(x, 0)),
            ("reduce_scatter", -1, lambda x=x: comm.reduce_scatter(x, -1)),
        ]
        ref = torch.cat([_data(rc, q, dtype) for q in range(w)], -1)
        assert torch.equal(comm.all_gather(x, -1), ref), "all_gather dim -1 differs from torch.cat"
        assert torch.equal(_gloo_all_gather_last(x, w), ref), "gloo differs from torch.cat"
        for name, d, fn in cases:
            rows.append((rc, name, d, _best(fn, n, comm.barrier), None))
        gl = _best(lambda x=x: _gloo_all_gather_last(x, w), max(n // 20, 10), dist.barrier)
        rows.append((rc, "all_gather", -1, None, gl))
    dist.destroy_process_group()
    return rows


def main():
    shapes = [tuple(int(v) for v in a.split("x")) for a in sys.argv[1:]] or [(4, 2048), (512, 2048)]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = tpcomm.launch(_run, 2, args=(shapes, torch.bfloat16, port), timeout=600)
    print(f"# {'shape':>12} {'collective':>15} {'dim':>4} {'tpcomm(us)':>11} {'gloo(us)':>10}")
    for row0, row1 in zip(*res):
        rc, name, d, t0, g0 = row0
        t = max(t0, row1[3]) if t0 is not None else None
        g = max(g0, row1[4]) if g0 is not None else None
        shape = "x".join(map(str, rc))
        ts = f"{t:11.2f}" if t is not None else f"{'':>11}"
        gs = f"{g:10.1f}" if g is not None else f"{'':>10}"
        print(f"  {shape:>12} {name:>15} {d:>4} {ts} {gs}")


if __name__ == "__main__":
    main()
