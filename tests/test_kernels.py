"""The native reduce kernels alone: every dtype x op x world against the torch
reference, with the last element right before a PROT_NONE guard page (vLLM's copy
read up to 63 bytes past its source), for lengths that exercise every vector tail."""

from __future__ import annotations

import ctypes
import mmap
import os
import pathlib

import pytest
import torch

from tpcomm import _testing
from tpcomm.ops import DTYPE_CODES, FLOAT_DTYPES, ReduceOp

from ._ref import DTYPES, make, reference

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


class Guarded:
    """n elements ending exactly at a PROT_NONE page."""

    def __init__(self, n: int, dtype: torch.dtype):
        es = torch.empty(0, dtype=dtype).element_size()
        self.nbytes = n * es
        data_pages = (self.nbytes + PAGE - 1) // PAGE or 1
        self.map = mmap.mmap(-1, (data_pages + 1) * PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.guard = base + data_pages * PAGE
        self.addr = self.guard - self.nbytes
        view = memoryview(self.map)[data_pages * PAGE - self.nbytes : data_pages * PAGE]
        self.tensor = torch.frombuffer(view, dtype=dtype) if n else torch.empty(0, dtype=dtype)
        assert _libc.mprotect(ctypes.c_void_p(self.guard), PAGE, 0) == 0

    def release(self):
        _libc.mprotect(ctypes.c_void_p(self.guard), PAGE, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_kernels_match_reference_at_page_edge(dtype, world):
    keep = []
    for n in (1, 3, 15, 17, 63, 255, 511, 513, 1029):
        for op in ReduceOp:
            if op is ReduceOp.AVG and dtype not in FLOAT_DTYPES:
                continue
            inputs = [make(r, n, dtype, seed=n) for r in range(world)]
            bufs = [Guarded(n, dtype) for _ in range(world + 1)]
            keep += bufs
            for b, x in zip(bufs, inputs):
                b.tensor.copy_(x)
            out = bufs[-1]
            _testing.reduce_kernel(
                DTYPE_CODES[dtype], op.value, out.addr, [b.addr for b in bufs[:-1]], n
            )
            ref = reference(inputs, op)
            assert torch.equal(out.tensor, ref), (dtype, op, n, world)
            # in place, as all_reduce uses it: the destination is rank 0's source
            _testing.reduce_kernel(
                DTYPE_CODES[dtype], op.value, bufs[0].addr, [b.addr for b in bufs[:-1]], n
            )
            assert torch.equal(bufs[0].tensor, ref)
    for b in keep:
        b.release()


def test_nan_propagates_through_max_and_min():
    a = torch.tensor([float("nan"), 1.0, 2.0])
    b = torch.tensor([0.0, float("nan"), 5.0])
    out = torch.empty(3)
    for op, fn in ((ReduceOp.MAX, torch.maximum), (ReduceOp.MIN, torch.minimum)):
        _testing.reduce_kernel(0, op.value, out.data_ptr(), [a.data_ptr(), b.data_ptr()], 3)
        ref = fn(a, b)
        assert torch.equal(out.isnan(), ref.isnan()) and out[2] == ref[2]


def test_bfloat16_denormals_round_like_torch():
    """vcvtne2ps2bf16 flushes denormals; the kernel must not (torch keeps them)."""
    from ._ref import reference

    tiny = torch.tensor([1e-39, -3e-39, 5e-40, 1.0, 2e-38] * 13, dtype=torch.bfloat16)
    inputs = [tiny, tiny.flip(0)]
    out = torch.empty_like(tiny)
    _testing.reduce_kernel(1, 0, out.data_ptr(), [x.data_ptr() for x in inputs], tiny.numel())
    assert torch.equal(out, reference(inputs, ReduceOp.SUM))
    assert (out.float().abs() < 1.1754944e-38).any() and (out != 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("world", [2, 3])
def test_special_values_like_torch(dtype, world):
    """NaN, infinities, sums that overflow, rounding ties and denormals, spread over
    full vector steps and a tail: every op gives torch's values (NaN where torch
    has NaN)."""
    from ._ref import reference

    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal / 4  # a denormal
    vals = [float("nan"), float("inf"), -float("inf"), big, -big, 1.0, 1.00390625, tiny, -0.0]
    n = 3 * 32 + 7
    g = torch.Generator().manual_seed(world)
    inputs = [
        torch.tensor(vals, dtype=torch.float32)[torch.randint(len(vals), (n,), generator=g)].to(
            dtype
        )
        for _ in range(world)
    ]
    out = torch.empty(n, dtype=dtype)
    for op in ReduceOp:
        _testing.reduce_kernel(
            DTYPE_CODES[dtype], op.value, out.data_ptr(), [x.data_ptr() for x in inputs], n
        )
        ref = reference(inputs, op)
        nan = ref.isnan()
        assert torch.equal(out.isnan(), nan), (dtype, op)
        assert torch.equal(out[~nan], ref[~nan]), (dtype, op)


_VARIANTS = [("TPCOMM_ISA", isa) for isa in _testing.isa_variants()]


def _cpu() -> tuple[set, str, str]:
    """This CPU's flags, vendor and family, as /proc/cpuinfo names them."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return set(info.get("flags", "").split()), info.get("vendor_id", ""), info.get("cpu family", "")


_FLAGS, _VENDOR, _FAMILY = _cpu()
_AVX512 = "avx512" in _testing.isa_variants()
# what each switch changes, and where that exists (elsewhere it tests nothing)
_SWITCHES = [
    ("TPCOMM_NO_AVX512", _AVX512, "no AVX-512 here: nothing to switch off"),
    (
        "TPCOMM_NO_AVX512BF16",
        _AVX512 and "avx512_bf16" in _FLAGS,
        "no AVX512_BF16 here: the integer bfloat16 rounding already runs, or no AVX-512",
    ),
    (
        "TPCOMM_AVX512_F16",
        _AVX512 and _VENDOR == "AuthenticAMD" and _FAMILY == "25",
        "not AMD Zen 4: the 512-bit float16 kernels already run, or no AVX-512",
    ),
]


@pytest.mark.parametrize(
    "switch, value",
    [
        *(
            pytest.param(name, "1", marks=pytest.mark.skipif(not there, reason=why))
            for name, there, why in _SWITCHES
        ),
        *_VARIANTS,
    ],
)
def test_other_kernel_paths(switch, value):
    """Every kernel variant this CPU runs (TPCOMM_ISA=scalar, avx2, avx512, neon;
    AVX-512 without the BF16 instruction, and with its 512-bit float16 kernels
    where AMD Zen 4 runs the 256-bit ones) passes the same tests; each runs in
    a fresh process, as a user's setting would."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, **{switch: value})
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "not other_kernel_paths",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_rank_two_threads(dtype):
    """The helper-thread split (1 rank x 2 and 3 threads): slices are elementwise,
    so the result is bitwise the single-thread reference, odd lengths included."""
    for n in (70_001, 300_000):  # above the 256 KiB split threshold
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            inputs = [make(r, n, dtype, seed=n + 1) for r in range(3)]
            ref = reference(inputs, op)
            for threads in (2, 3):
                out = torch.empty_like(inputs[0])
                _testing.reduce_kernel(
                    DTYPE_CODES[dtype],
                    op.value,
                    out.data_ptr(),
                    [x.data_ptr() for x in inputs],
                    n,
                    threads,
                )
                assert torch.equal(out, ref), (dtype, op, n, threads)


def test_a_variant_the_cpu_lacks_is_refused():
    """TPCOMM_ISA naming a variant this CPU cannot run: a ValueError that says
    which it can, before anything runs (the Communicator reads it with the other
    settings, so every rank refuses at once)."""
    import os
    import subprocess
    import sys

    lacking = next(v for v in ("neon", "avx2", "avx512") if v not in _testing.isa_variants())
    code = "from tpcomm import _testing; _testing.kernel_isa()"
    env = dict(os.environ, TPCOMM_ISA=lacking)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert f"ValueError: TPCOMM_ISA={lacking!r}: this CPU (or build) cannot run it" in r.stderr
    env["TPCOMM_ISA"] = "sse9"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "TPCOMM_ISA='sse9': no such kernel variant" in r.stderr


def _cpuinfo() -> dict:
    fields = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break  # the first CPU is enough
            k, _, v = line.partition(":")
            fields[k.strip()] = v.strip()
    return fields


@pytest.mark.skipif("avx512" not in _testing.isa_variants(), reason="no AVX-512 here")
def test_float16_runs_256_bit_on_zen4_only():
    """The avx512 variant hands float16 to the 256-bit kernels on AMD Zen 4
    (family 25 with AVX-512) and nowhere else, says so in kernel_isa (doctor,
    perf), and TPCOMM_AVX512_F16=1 takes it back."""
    import subprocess
    import sys

    cpu = _cpuinfo()
    zen4 = cpu.get("vendor_id") == "AuthenticAMD" and cpu.get("cpu family") == "25"
    code = "from tpcomm import _testing; print(_testing.kernel_isa())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPCOMM_")}
    said = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert said.stdout.startswith("avx512 ("), said.stderr
    assert ("float16 by 256-bit F16C (AMD Zen 4)" in said.stdout) == zen4, (said.stdout, cpu)
    env["TPCOMM_AVX512_F16"] = "1"
    said = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert said.stdout.startswith("avx512 (") and "256-bit" not in said.stdout


def _with_kernels(main_c: str, opt: str, runs: list) -> list:
    """Build main_c with the library's kernel sources (as make does) and run
    it with each argument list in runs: their CompletedProcess."""
    import shutil
    import subprocess
    import tempfile

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    srcs = sorted(str(p) for p in pathlib.Path("src/tpcomm/_native").glob("kernels*.c"))
    flags = ["-std=gnu11", opt, "-ffp-contract=off", "-fno-fast-math", "-Isrc/tpcomm/_native"]
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "kernels")
        subprocess.run([cc, *flags, "-o", exe, main_c, *srcs, "-lm"], check=True)
        return [
            subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)
            for args in runs
        ]


@pytest.mark.skipif(not os.path.exists("tests/c/test_kernels.c"), reason="run from the repo root")
def test_c_kernel_test_runs_every_variant():
    """tests/c/test_kernels.c (make test-kernels): every variant this CPU runs is
    bitwise the portable kernels on random bit patterns, ties, zeros, NaN."""
    (r,) = _with_kernels("tests/c/test_kernels.c", "-O2", [[]])
    assert r.returncode == 0, r.stdout[-2000:]
    variants = [v for v in _testing.isa_variants() if v != "scalar"]
    assert f"# kernels: {len(variants)} variant(s)" in r.stdout and " 0 failed" in r.stdout


@pytest.mark.skipif(not os.path.exists("benchmarks/kernels.c"), reason="run from the repo root")
def test_kernel_benchmark_times_every_variant():
    """benchmarks/kernels.c (make bench: the kernels table) builds from the
    library's kernel sources and times every variant this CPU runs, each
    dtype's rate over float32's with that variant."""
    bad, r = _with_kernels("benchmarks/kernels.c", "-O3", [["0"], ["1"]])
    assert bad.returncode == 2 and "usage" in bad.stderr
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split() for line in r.stdout.splitlines() if not line.startswith("#")]
    variants = _testing.isa_variants()
    assert [row[2] for row in rows] == variants * 2  # 16 KiB, then 1 MiB
    assert [row[0] + row[1] for row in rows] == ["16KiB"] * len(variants) + ["1MiB"] * len(variants)
    for row in rows:
        gbs = [float(row[k]) for k in (3, 5, 7)]
        assert all(g > 0 for g in gbs) and row[4] == "1.00", row
        for g, ratio in zip(gbs[1:], (row[6], row[8])):
            assert abs(float(ratio) - g / gbs[0]) < 0.011 + 0.06 / gbs[0], row
