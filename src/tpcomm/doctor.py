"""``tpcomm doctor``: will tpcomm work here, how fast a path will it take, and why.

Checks, each printed as OK / WARN / FAIL with the fix where there is one:

* the C core: loaded, and which vector path it dispatches to;
* torch: version, whether torch.distributed and the ``tpcomm`` backend are there;
* the shm directory: exists, writable, a tmpfs, its size and free space against
  what a communicator of ``-n`` ranks needs (with the Docker / Kubernetes fix);
* stale segments: tpcomm files in the shm directory whose ranks are all dead
  (no rank holds its liveness lock); ``--clean`` removes them;
* CPUs: count, this process's affinity, NUMA nodes, oversubscription;
* for ``-n`` ranks: which path each collective takes and why (settings
  included), so "why is this slow" has an answer.

The exit status is 1 when something would fail (a FAIL line), else 0.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Any, Callable, Optional

from . import _env
from .bootstrap import local_cpu_count
from .shm import profile, segment
from .shm.segment import space_message
from .shm.settings import settings_for

__all__ = ["add_arguments", "run", "stale_segments", "segment_owners", "Report"]


class Report:
    def __init__(self, out: Callable[[str], None]):
        self.out = out
        self.failed = 0
        self.warned = 0

    def section(self, title: str) -> None:
        self.out(f"\n{title}")

    def ok(self, text: str) -> None:
        self.out(f"  OK    {text}")

    def info(self, text: str) -> None:
        self.out(f"        {text}")

    def warn(self, text: str) -> None:
        self.warned += 1
        self.out(f"  WARN  {text}")

    def fail(self, text: str) -> None:
        self.failed += 1
        self.out(f"  FAIL  {text}")


# -- segments --------------------------------------------------------------


def segment_owners(path: str) -> Optional[tuple[int, int]]:
    """(ranks in the header, ranks alive) of one segment file (shm/segment.py)."""
    return segment.owners(path)


def stale_segments(directory: str, min_age_s: float = 5.0) -> list[tuple[str, int, float]]:
    """tpcomm files in ``directory`` that no live rank holds: (path, bytes, age s)."""
    return segment.stale(directory, min_age_s)


# -- facts -----------------------------------------------------------------


def _mount_of(path: str) -> tuple[str, str]:
    """(mount point, fs type) of the file system holding ``path``."""
    best = ("", "")
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                    best[0]
                ):
                    best = (mnt, parts[2])
    except OSError:
        pass
    return best


def _numa_nodes() -> list[str]:
    nodes = []
    for d in sorted(glob.glob("/sys/devices/system/node/node[0-9]*")):
        try:
            with open(os.path.join(d, "cpulist")) as f:
                nodes.append(f"{os.path.basename(d)}: cpus {f.read().strip()}")
        except OSError:
            pass
    return nodes


def _window(lo: int, hi: int) -> str:
    """A window of sizes in words: from lo, up to hi (-1: no end)."""
    return f"from {_human(lo)}" + (f" up to {_human(hi)}" if hi >= 0 else "")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# -- the checks ------------------------------------------------------------


def _check_core(rep: Report) -> Any:
    rep.section("C core")
    try:
        from .shm import engine
    except ImportError as e:
        rep.fail(f"tpcomm._native did not load: {e}; reinstall tpcomm (pip install .)")
        return None
    try:
        rep.ok(f"tpcomm._native loaded; reduce kernels: {engine.kernel_isa()}")
    except ValueError as e:  # TPCOMM_ISA names a variant this CPU lacks
        rep.fail(f"{e}; every Communicator would refuse to start")
        return engine
    rep.info(f"  kernel variants this CPU runs: {', '.join(engine.isa_variants())} (TPCOMM_ISA)")
    for var in ("TPCOMM_NO_AVX512", "TPCOMM_NO_AVX512BF16", "TPCOMM_AVX512_F16"):
        if os.environ.get(var):
            rep.warn(f"{var} is set: a slower kernel path is forced (meant for tests)")
    return engine


def _check_torch(rep: Report) -> None:
    rep.section("torch")
    import torch

    rep.ok(f"torch {torch.__version__}")
    import torch.distributed as dist

    if not dist.is_available():
        rep.warn("torch.distributed is not available: no fallback path, no backend")
        return
    from .dist_backend import BACKEND_NAME

    registered = BACKEND_NAME.upper() in dist.Backend._plugins
    (rep.ok if registered else rep.fail)(
        f"torch.distributed backend '{BACKEND_NAME}' "
        + ("registered (init_process_group('cpu:tpcomm,cuda:nccl'))" if registered else "missing")
    )
    gloo = dist.is_gloo_available()
    (rep.ok if gloo else rep.warn)(
        "gloo available (fallback and between hosts)" if gloo else "gloo missing: no fallback"
    )
    import importlib.util

    have_triton = importlib.util.find_spec("triton") is not None
    if torch.cuda.is_available():
        rep.ok(f"CUDA: {torch.cuda.device_count()} device(s), CUDA {torch.version.cuda}")
        if have_triton:
            rep.ok("Triton present: CUDA all_reduce tries tpcomm.cuda.CustomAllreduce, then NCCL")
        else:
            rep.warn("Triton missing: CUDA all_reduce goes to NCCL (pip install triton)")
        if importlib.util.find_spec("pynvml") is None:
            rep.info("nvidia-ml-py missing: more than 2 GPUs count as not NVLink-connected")
    else:
        rep.info("CUDA: not available (the GPU custom all-reduce is off; docs/GPU.md)")


def _check_shm(rep: Report, world: int, clean: bool) -> None:
    from .shm.segment import segment_size

    directory = _env.shm_dir()
    rep.section(
        f"shared memory: {directory}"
        + (" (TPCOMM_SHM_DIR)" if os.environ.get("TPCOMM_SHM_DIR") else "")
    )
    if not os.path.isdir(directory):
        rep.fail(f"{directory} does not exist; create a tmpfs there or set TPCOMM_SHM_DIR")
        return
    if not os.access(directory, os.W_OK | os.X_OK):
        rep.fail(f"{directory} is not writable by uid {os.getuid()}; set TPCOMM_SHM_DIR")
        return
    mnt, fstype = _mount_of(directory)
    if fstype in ("tmpfs", "ramfs", "hugetlbfs"):
        rep.ok(f"{fstype} mounted at {mnt}")
    else:
        rep.warn(
            f"{directory} is on {fstype or 'an unknown file system'} ({mnt or '?'}), not a "
            f"tmpfs: segments may be written to disk; point TPCOMM_SHM_DIR at a tmpfs"
        )
    st = os.statvfs(directory)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    slot = _env.slot_bytes()
    need = segment_size(max(world, 2), slot)
    rep.info(f"size {_human(total)}, free {_human(free)}")
    if free < need:
        rep.fail(space_message(directory, need, free))
    else:
        rep.ok(
            f"a {world}-rank communicator needs {_human(need)} "
            f"(slot {_human(slot)}; TPCOMM_SLOT_BYTES): fits {free // need} times"
        )
    if total < 256 << 20:
        rep.warn(
            f"{directory} is only {_human(total)} (Docker's default is 64 MiB): "
            f"`docker run --shm-size=1g`, or a Kubernetes emptyDir with medium: Memory"
        )
    _check_remove_ipc(rep)
    stale = stale_segments(directory)
    if not stale:
        rep.ok("no stale tpcomm segments")
    for path, size, age in stale:
        if clean:
            try:
                os.unlink(path)
                rep.ok(f"removed stale segment {path} ({_human(size)}, {age:.0f} s old)")
            except OSError as e:
                rep.fail(f"cannot remove {path}: {e.strerror}")
        else:
            rep.warn(
                f"stale segment {path} ({_human(size)}, {age:.0f} s old, every rank dead); "
                f"`tpcomm doctor --clean` removes it"
            )


def _check_remove_ipc(rep: Report) -> None:
    for conf in ["/etc/systemd/logind.conf", *glob.glob("/etc/systemd/logind.conf.d/*.conf")]:
        try:
            with open(conf) as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines():
            if line.strip().replace(" ", "").lower() == "removeipc=yes":
                rep.warn(
                    f"{conf}: RemoveIPC=yes deletes a user's shared memory when their last "
                    f"session ends; run jobs under a service account or set RemoveIPC=no"
                )


def _check_cpus(rep: Report, world: int) -> None:
    rep.section("CPUs")
    online = os.cpu_count() or 1
    mine = local_cpu_count()
    rep.ok(f"{online} CPUs online, {mine} in this process's affinity")
    nodes = _numa_nodes()
    if len(nodes) > 1:
        rep.info(f"{len(nodes)} NUMA nodes: " + "; ".join(nodes))
        rep.info("pin each rank to one node (numactl / taskset) for the best bandwidth")
    elif nodes:
        rep.info("1 NUMA node")
    if world > mine:
        rep.warn(
            f"{world} ranks on {mine} CPUs: ranks share cores, so waits yield at once "
            f"(no spinning) and each collective costs scheduler round trips"
        )


# routing.route's path names, as the report says them
_PATH_WORDS = {
    "local": "local (world size 1: a copy at most)",
    "cuda": "tpcomm.cuda custom all-reduce, then NCCL",
    "shm": "shared memory",
    "hier": "hierarchical (shared memory in each host, gloo between host leaders)",
    "dist": "torch.distributed (the group's backend, else a private gloo group)",
}


def _route_samples() -> list:
    """(label, routing.Call) of the calls the report routes."""
    import torch
    import torch.distributed as dist

    from .ops import DTYPE_CODES, ReduceOp
    from .routing import Call

    dts = ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES)
    f32, f64, prod, add = torch.float32, torch.float64, dist.ReduceOp.PRODUCT, ReduceOp.SUM
    return [
        (f"all_reduce ({dts}; SUM/AVG/MAX/MIN)", Call("all_reduce", dtype=f32, op=add)),
        ("all_reduce of float64, complex, int8, bool", Call("all_reduce", dtype=f64, op=add)),
        ("all_reduce with PRODUCT or a bitwise op", Call("all_reduce", dtype=f32, op=prod)),
        ("all_reduce of a CUDA tensor", Call("all_reduce", cuda=True)),
        ("all_gather (even sizes), broadcast, barrier", Call("all_gather")),
        ("all_gatherv with uneven sizes", Call("all_gather", even=False)),
        ("gather (to a root)", Call("gather", rooted=True)),
        ("all_to_all_single", Call("all_to_all")),
        ("send / recv / sendrecv / batch_isend_irecv", Call("p2p")),
        ("empty() buffers", Call("empty")),
    ]  # fmt: skip


def _print_routes(rep: Report, paths: list) -> None:
    from .routing import route

    for label, call in _route_samples():
        r = route(paths, call)
        why = f" ({r.reason})" if r.reason else ""
        words = _PATH_WORDS[r.path]
        if call.kind == "empty" and r.path != "shm":
            words = "ordinary memory (nothing to share)"
        rep.info(f"  {label}: {words}{why}")


def _native_nt() -> bool:
    """Whether the reduce kernels in use come with a non-temporal copy."""
    from .shm.engine import kernel_isa

    return kernel_isa().split()[0] in ("avx2", "avx512")


def _check_paths(rep: Report, world: int) -> None:
    from . import routing
    from .ops import DTYPE_CODES

    rep.section(f"paths for {world} rank(s) on this host (routing.route decides)")
    paths = routing.plan(world)
    if world == 1:
        _print_routes(rep, paths)
        return
    dts = ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES)
    tuned = _check_profile(rep, world)
    slot_bytes = _env.slot_bytes()
    s = settings_for(world, slot_bytes, tuned)
    two, two16, single = s.twoshot_min, s.twoshot_min16, s.cma_ar_min

    def source(key: str) -> str:
        env = profile.SETTINGS[key]
        return "tuned profile" if key in tuned and not _env.explicit(env) else env

    if two < 0:
        ar = "one-shot for every size"
    elif two == 0 and s.twoshot_max < 0:
        ar = "two-shot for every size"
    elif s.twoshot_max < 0:
        ar = f"one-shot below {_human(two)}, two-shot from there"
    else:
        ar = f"two-shot {_window(two, s.twoshot_max)}, one-shot below and above"
    ar += f" ({source('twoshot_min_bytes')})"
    if (two16, s.twoshot_max16) != (two, s.twoshot_max):
        ar += (
            f"; bfloat16 and float16 two-shot "
            f"{_window(two16, s.twoshot_max16) if two16 >= 0 else 'never'} "
            f"({source('twoshot_min_bytes_16bit')})"
        )
    if single >= 0 and s.cma:
        ar += (
            f"; single copy {_window(single, s.cma_ar_max)} where the ranks may read each "
            f"other ({source('cma_allreduce_min_bytes')})"
        )
    first = routing.route(paths, _route_samples()[0][1]).path
    rep.ok(f"all_reduce: {_PATH_WORDS[first]}, {ar}; {dts}; SUM/AVG/MAX/MIN")
    if s.threads == 1 or s.threads_min < 0:
        shared = "one thread for every job"
    else:
        shared = f"sharing jobs of {_human(s.threads_min)} and more"
    rep.info(
        f"  threads per rank: {s.threads} (TPCOMM_THREADS), {shared} "
        f"({source('threads_min_bytes')})"
    )
    nt = "never" if s.nt_min < 0 else _window(s.nt_min, s.nt_max)
    if s.nt_auto and _native_nt():
        rep.info(
            "  stores into the slots: each all_reduce chunk chooses plain or non-temporal as "
            f"it runs (TPCOMM_NT_MIN_BYTES=auto); chunks threads share: non-temporal {nt} "
            f"({source('nt_min_bytes')})"
        )
    else:
        rep.info(f"  non-temporal stores into the slots: {nt} ({source('nt_min_bytes')})")
    slot = _human(slot_bytes)
    if s.chunk_min < 0 or s.chunk_bytes >= slot_bytes:
        rep.info(f"  through the slots: a slot ({slot}) at a time ({source('chunk_min_bytes')})")
    else:
        rep.info(
            f"  through the slots: a slot ({slot}) at a time below {_human(s.chunk_min)}, "
            f"{_human(s.chunk_bytes)} at a time from there, zero copy that much of every "
            f"shard ({source('chunk_min_bytes')}; chunk: {source('chunk_bytes')})"
        )
    _print_routes(rep, paths)
    _check_cma(rep, world, s.cma_min)
    zc = "never" if s.zc_min < 0 else f"from {_human(s.zc_min)}"
    if s.zc_min >= 0 and s.zc_max >= 0:
        zc += f" up to {_human(s.zc_max)}"
    if s.zc_min >= 0:  # rank 0 times both as calls run (not oversubscribed)
        zc += (
            ", or the copies where rank 0 measures them cheaper as calls run (unless the "
            "ranks outnumber the cores)"
        )
    rep.ok(f"all_reduce of a comm.empty() tensor: zero-copy {zc} ({source('zero_copy_min_bytes')})")
    rep.info("dist backend 'tpcomm': the same, plus scatter; isend/irecv and batch_isend_irecv")
    rep.info("run together when waited on (never deadlocked); recv without a source")
    rep.info("(dist.recv(t), comm.recv_any) takes the first message from any rank")
    rep.info("the same ranks spread over 2 hosts (hostname + boot id, TPCOMM_HOST_ID):")
    _print_routes(rep, routing.plan(world, 2))
    spin = 0.0 if world > local_cpu_count() else _env.spin_us()
    rep.info(
        f"waits: spin {spin:g} us, then yield up to {_env.yield_us():g} us, then sleep; "
        f"timeout {_env.timeout():g} s (TPCOMM_TIMEOUT)"
    )


def _yama_scope() -> Optional[int]:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _check_profile(rep: Report, world: int) -> dict:
    """The tuned profile rank 0 would read here (tpcomm tune), and its settings
    for this world size."""
    prof, why = profile.read()
    if prof is None:
        rep.info(f"tuned profile: none used: {why}; the built-in switch points apply")
        return {}
    tuned = profile.settings(world, prof)
    shown = ", ".join(f"{k} {_human(v) if v >= 0 else 'never'}" for k, v in sorted(tuned.items()))
    rep.ok(
        f"tuned profile {_env.profile_path()} ({prof.get('command', 'tpcomm tune')}; "
        f"worlds {', '.join(sorted(prof['worlds']))}): at {world} ranks {shown or 'nothing'}"
    )
    for w, res in sorted(prof.get("measured", {}).items()):
        ref = res.get("reference_s") if isinstance(res, dict) else None
        warning = profile.steadiness(*ref) if isinstance(ref, list) and len(ref) == 2 else ""
        if warning:
            rep.warn(f"tuned profile, world {w}: {warning}")
    return tuned


def _check_cma(rep: Report, world: int, nbytes: int) -> None:
    """Whether all_gather, all_to_all and sendrecv can read the peers' data
    single-copy (process_vm_readv), from nbytes (-1: never)."""
    least = _human(max(nbytes, 0))
    scope = _yama_scope()
    if not _env.cma():
        rep.info(
            "all_gather, all_to_all and large sendrecv messages: always two copies "
            "through shared memory (TPCOMM_CMA=0)"
        )
    elif nbytes < 0:
        rep.info(
            f"all_gather, all_to_all and large sendrecv messages: two copies through "
            f"shared memory (at {world} ranks a single copy "
            f"was not faster where measured; TPCOMM_CMA_MIN_BYTES=N turns it on from N bytes)"
        )
    elif scope is not None and scope >= 1:
        rep.info(
            f"all_gather, all_to_all and large sendrecv messages: two copies through "
            f"shared memory: Yama ptrace_scope={scope} "
            f"forbids ranks to read each other's memory (process_vm_readv); from {least} "
            f"a single copy is faster (sysctl kernel.yama.ptrace_scope=0 allows it; tpcomm "
            f"does not change who may read its processes)"
        )
    else:
        rep.ok(
            f"all_gather and all_to_all_single of >= {least} in all, and sendrecv "
            f"messages of 1.5 channel rings or more: single copy, each rank reads its "
            f"peers' data with process_vm_readv (checked between the ranks when a "
            f"communicator is created; TPCOMM_CMA=0 turns it off)"
        )


def _selftest(rep: Report, world: int) -> None:
    rep.section(f"self-test: all_reduce on {world} local ranks")
    import torch

    from .launch import launch

    try:
        res = launch(_selftest_rank, world, timeout=60)
    except Exception as e:
        rep.fail(f"the self-test failed: {e}")
        return
    want = float(sum(range(1, world + 1)))
    if all(r == [want] * 4 for r, _ in res):
        rep.ok(f"all_reduce over {world} ranks gave the right sums (torch {torch.__version__})")
    else:
        rep.fail(f"all_reduce gave wrong sums: {[r for r, _ in res]}")
    if world > 1 and settings_for(world, _env.slot_bytes(), profile.settings(world)).cma_plan[0]:
        cma = "on" if res[0][1] else "off (the ranks may not read each other's memory)"
        rep.info(f"single-copy reads between these ranks: {cma}")


def _selftest_rank(comm: Any) -> list:
    import torch

    x = torch.full((4,), float(comm.rank + 1))
    comm.all_reduce(x)
    return x.tolist(), comm.single_copy


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-n", "--nranks", type=int, default=2, help="world size to check for (default 2)"
    )
    p.add_argument("--clean", action="store_true", help="remove stale segments (ranks all dead)")
    p.add_argument(
        "--selftest", action="store_true", help="also run an all_reduce on -n local ranks"
    )
    p.add_argument(
        "--stats",
        metavar="DIR",
        help="print the records of rounds and waits that Communicators wrote to DIR "
        "(TPCOMM_STATS=DIR) and nothing else",
    )


def _print_stats(path: str, out: Callable[[str], None]) -> int:
    from . import stats

    try:
        records = stats.read_dir(path)
    except OSError as e:
        print(f"tpcomm doctor: --stats {path}: {e.strerror}", file=sys.stderr)
        return 2
    if not records:
        out(f"no records in {path} (TPCOMM_STATS={path} writes them when Communicators close)")
        return 0
    for name, rec in records:
        out(stats.describe(rec, f"{name} (pid {rec.get('pid', '?')})"))
    return 0


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    if args.nranks < 1:
        print(f"tpcomm doctor: -n must be >= 1, got {args.nranks}", file=sys.stderr)
        return 2
    if getattr(args, "stats", None):
        return _print_stats(args.stats, out)
    rep = Report(out)
    from ._version import __version__

    out(f"tpcomm {__version__}, Python {sys.version.split()[0]}, pid {os.getpid()}")
    core = _check_core(rep)
    _check_torch(rep)
    if core is not None:
        _check_shm(rep, args.nranks, args.clean)
    _check_cpus(rep, args.nranks)
    _check_paths(rep, args.nranks)
    if args.selftest and not rep.failed:
        _selftest(rep, args.nranks)
    out(
        f"\n{'FAILED' if rep.failed else 'healthy'}: {rep.failed} failure(s), "
        f"{rep.warned} warning(s)"
    )
    return 1 if rep.failed else 0
