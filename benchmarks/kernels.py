"""The reduce kernels alone: GB/s of each variant this CPU runs, per dtype.

Two sources of 16 KiB each (the decode size: in the first cache levels, so
the kernel's instructions set its speed) and of 1 MiB (past L2 on most CPUs:
the memory does), dst = a + b, the best of 15 loops of calls, the dtypes'
loops in turns so that a change of the VM's speed meets them alike.  A call
from Python costs about half a microsecond, as long as the whole 16 KiB
float32 kernel: that cost, timed alone in the same turns (n = 0), is taken
off.  GB/s counts the bytes of one source; "x f32" is the dtype's GB/s over
float32's in the same variant.  At 16 KiB, float32's one-shot all_reduce
spends about as long in the kernel as in the copy; a 16-bit dtype whose
kernel is slower there cannot be as fast at the same bytes (see
benchmarks/dtypes.py).  Run by `make bench`.
"""

from __future__ import annotations

import os
import time

import torch

from tpcomm.ops import DTYPE_CODES, ReduceOp
from tpcomm.shm.engine import isa_variants, kernel_isa, reduce_kernel, select_kernels

SIZES = (16 << 10, 1 << 20)


def rates(dtypes: tuple, nbytes: int) -> list:
    """GB/s of each dtype's kernel, their loops in turns, the call's own cost
    (the same call with n = 0, timed in the same turns) taken off."""
    calls = []
    for dtype in dtypes:
        n = nbytes // dtype.itemsize
        a, b = (torch.randn(n).to(dtype) for _ in range(2))
        out = torch.empty_like(a)
        ptrs = [a.data_ptr(), b.data_ptr()]
        calls.append(((DTYPE_CODES[dtype], ReduceOp.SUM.value, out.data_ptr(), ptrs, n), a, b, out))
    calls.append(((*calls[0][0][:4], 0),))  # the call alone
    reps = 200 if nbytes >= 1 << 20 else 2000
    best = [float("inf")] * len(calls)
    for _ in range(15):
        for k, (args, *_keep) in enumerate(calls):
            t0 = time.perf_counter()
            for _ in range(reps):
                reduce_kernel(*args)
            best[k] = min(best[k], (time.perf_counter() - t0) / reps)
    call = best.pop()
    return [nbytes / max(t - call, 1e-9) / 1e9 for t in best]


def main() -> None:
    torch.set_num_threads(1)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    print("# reduce kernel alone, 2 sources, SUM, one thread (GB/s of one source)")
    heads = " ".join(f"{str(d)[6:]:>9} {'x f32':>6}" for d in dtypes)
    print(f"# {'size':>8} {'variant':>8} {heads}")
    for nbytes in SIZES:
        for isa in isa_variants():
            os.environ["TPCOMM_ISA"] = isa
            select_kernels()  # once per variant, outside the timed loops
            gb = rates(dtypes, nbytes)
            cols = " ".join(f"{r:>9.1f} {r / gb[0]:>6.2f}" for r in gb)
            size = f"{nbytes >> 10} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"
            print(f"  {size:>8} {isa:>8} {cols}   # {kernel_isa()}")
    os.environ.pop("TPCOMM_ISA", None)
    select_kernels()


if __name__ == "__main__":
    main()
