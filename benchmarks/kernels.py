"""The reduce kernels alone: GB/s of each variant this CPU runs, per dtype.

Two sources of 1 MiB each (hot in L2), dst = a + b, the best of 15 loops of
200 calls (one Python call each, ~1 us of the time), the dtypes' loops in
turns so that a change of the VM's speed meets them alike.  GB/s counts the
bytes of one source; "x f32" is the dtype's GB/s over float32's in the same
variant (the target: >= 0.8).  Run by `make bench`.
"""

from __future__ import annotations

import os
import time

import torch

from tpcomm.ops import DTYPE_CODES, ReduceOp
from tpcomm.shm.engine import isa_variants, kernel_isa, reduce_kernel, select_kernels

NBYTES = 1 << 20


def rates(dtypes: tuple) -> list:
    """GB/s of each dtype's kernel, their loops in turns."""
    calls = []
    for dtype in dtypes:
        n = NBYTES // dtype.itemsize
        a, b = (torch.randn(n).to(dtype) for _ in range(2))
        out = torch.empty_like(a)
        ptrs = [a.data_ptr(), b.data_ptr()]
        calls.append(((DTYPE_CODES[dtype], ReduceOp.SUM.value, out.data_ptr(), ptrs, n), a, b, out))
    best = [float("inf")] * len(dtypes)
    for _ in range(15):
        for k, (args, *_keep) in enumerate(calls):
            t0 = time.perf_counter()
            for _ in range(200):
                reduce_kernel(*args)
            best[k] = min(best[k], (time.perf_counter() - t0) / 200)
    return [NBYTES / t / 1e9 for t in best]


def main() -> None:
    torch.set_num_threads(1)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    print("# reduce kernel alone, 2 sources x 1 MiB, SUM, one thread (GB/s of one source)")
    print(f"# {'variant':>8} " + " ".join(f"{str(d)[6:]:>9} {'x f32':>6}" for d in dtypes))
    for isa in isa_variants():
        os.environ["TPCOMM_ISA"] = isa
        select_kernels()  # once per variant, outside the timed loops
        gb = rates(dtypes)
        cols = " ".join(f"{r:>9.1f} {r / gb[0]:>6.2f}" for r in gb)
        print(f"  {isa:>8} {cols}   # {kernel_isa()}")
    os.environ.pop("TPCOMM_ISA", None)
    select_kernels()


if __name__ == "__main__":
    main()
