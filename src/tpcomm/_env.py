"""Every environment switch tpcomm reads, with its default next to it.

Values are read when a Communicator is created, so tests and users can change
them between communicators.  Three more switches are read by the C core itself,
once per process, and exist for tests: TPCOMM_NO_AVX512=1 (no AVX-512 kernels:
the next best variant runs), TPCOMM_NO_AVX512BF16=1 (round bfloat16 without
the AVX512_BF16 instruction) and TPCOMM_AVX512_F16=1 (the 512-bit float16
kernels even on AMD Zen 4, which runs the faster 256-bit ones).  TPCOMM_ISA
(isa below) picks a variant outright.
"""

from __future__ import annotations

import datetime
import os

__all__ = [
    "explicit",
    "timeout",
    "shm_dir",
    "slot_bytes",
    "spin_us",
    "yield_us",
    "nt_min_bytes",
    "cma",
    "cma_min_bytes",
    "cma_allreduce_min_bytes",
    "chunk_min_bytes",
    "chunk_bytes",
    "zero_copy_min_bytes",
    "zero_copy_max_bytes",
    "profile_path",
    "host_id_override",
    "cuda_algo",
    "cache_dir",
    "vllm_mode",
    "stats",
]

# Seconds any single wait may last while every peer is alive.  Dead peers are
# detected in milliseconds whatever this says; this only bounds a live but
# stuck peer (one that never calls the collective).
DEFAULT_TIMEOUT_S = 300.0
# Where segments live.  Must be a tmpfs for speed; tests point it at a small one.
DEFAULT_SHM_DIR = "/dev/shm"
# Bytes of one rank's slot (two per rank).  1 MiB keeps a round's working set
# in L2 on current x86 parts and makes a world-8 segment 16 MiB.
DEFAULT_SLOT_BYTES = 1 << 20
# Copies into a slot of at least this many bytes use non-temporal stores
# (-1: never).  See docs/PERFORMANCE.md for how it was chosen.
DEFAULT_NT_MIN_BYTES = -1
# Spin this long (with pause) before yielding the CPU; 0 when the ranks
# outnumber the cores (then spinning only steals the core a peer needs).
DEFAULT_SPIN_US = 50.0  # docs/DECISIONS.md, "Waits"
# Then sched_yield until this long, then sleep on a futex (wake-up ~70 us).
DEFAULT_YIELD_US = 1000.0

# The largest value each setting takes (a larger one is a ValueError on every
# rank, before anything is made).  TPCOMM_TIMEOUT also takes inf: no limit.
MAX_TIMEOUT_S = 1e9  # 31 years: the core treats this and more as no limit
MAX_SLOT_BYTES = 1 << 30  # the segment holds 2 slots per rank: 16 GiB at world 8
MAX_SPIN_US = 2000.0  # a spin holds the GIL and checks nothing: one liveness period
MAX_YIELD_US = 1e6
MAX_BYTES = 1 << 48  # switch points in bytes: larger means never anyway
MAX_THREADS = 256  # helper threads per rank (the core's limit)
# A rank's helper threads take copies, reductions and single-copy reads of at
# least this many bytes (smaller ones cost more to hand out than they save).
DEFAULT_THREADS_MIN_BYTES = 256 << 10


def _float(name: str, default: float, maximum: float, infinite: bool = False) -> float:
    """A non-negative number of at most ``maximum`` (``infinite``: "inf" too,
    meaning no limit)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value != value or value < 0:
        raise ValueError(f"{name}={raw!r} must be a non-negative number")
    if value > maximum and not (infinite and value == float("inf")):
        limit = f"at most {maximum:g}" + (", or inf for no limit" if infinite else "")
        raise ValueError(f"{name}={raw!r}: expected {limit}")
    return value


def _int(name: str, default: int, minimum: int, maximum: int, hint: str = "") -> int:
    """An int in [minimum, maximum]."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if not minimum <= value <= maximum:
        raise ValueError(f"{name}={raw!r}: expected an int in [{minimum}, {maximum}]{hint}")
    return value


def explicit(name: str) -> bool:
    """Whether the environment sets ``name`` to a value: unset, empty and
    "auto" all mean the default (a tuned profile's value, where there is one)."""
    return (os.environ.get(name) or "auto").strip().lower() != "auto"


def timeout() -> float:
    """TPCOMM_TIMEOUT, seconds (default 300)."""
    value = _float("TPCOMM_TIMEOUT", DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, infinite=True)
    if value == 0:
        raise ValueError("TPCOMM_TIMEOUT must be positive")
    return value


def timedelta(seconds: float) -> datetime.timedelta:
    """A timeout for torch's stores and groups: ``seconds``, where inf (no
    limit) and anything past MAX_TIMEOUT_S become MAX_TIMEOUT_S."""
    return datetime.timedelta(seconds=min(seconds, MAX_TIMEOUT_S))


def timeout_is_set() -> bool:
    """Whether TPCOMM_TIMEOUT is set (the backend then uses it instead of the
    group's timeout)."""
    return bool(os.environ.get("TPCOMM_TIMEOUT"))


def shm_dir() -> str:
    """TPCOMM_SHM_DIR (default /dev/shm)."""
    return os.environ.get("TPCOMM_SHM_DIR") or DEFAULT_SHM_DIR


def slot_bytes() -> int:
    """TPCOMM_SLOT_BYTES, rounded up to a 4 KiB page (default 1 MiB)."""
    value = int(_float("TPCOMM_SLOT_BYTES", DEFAULT_SLOT_BYTES, MAX_SLOT_BYTES))
    if value < 4096:
        raise ValueError(f"TPCOMM_SLOT_BYTES={value} is below the minimum 4096")
    return (value + 4095) // 4096 * 4096


def spin_us() -> float:
    """TPCOMM_SPIN_US (default 50)."""
    return _float("TPCOMM_SPIN_US", DEFAULT_SPIN_US, MAX_SPIN_US)


def yield_us() -> float:
    """TPCOMM_YIELD_US (default 1000)."""
    return _float("TPCOMM_YIELD_US", DEFAULT_YIELD_US, MAX_YIELD_US)


def nt_min_bytes() -> int:
    """TPCOMM_NT_MIN_BYTES: copies into a slot of at least this many bytes use
    non-temporal stores (default auto: -1, never, but the all_reduce chunks
    choose as they run, nt_auto)."""
    if nt_auto():
        return DEFAULT_NT_MIN_BYTES
    return _int("TPCOMM_NT_MIN_BYTES", DEFAULT_NT_MIN_BYTES, -1, MAX_BYTES, " (-1: never) or auto")


def nt_auto() -> bool:
    """Whether all_reduce chunks of 4 KiB and more choose plain or
    non-temporal stores as they run: unless TPCOMM_NT_MIN_BYTES fixes them."""
    return (os.environ.get("TPCOMM_NT_MIN_BYTES") or "auto").strip().lower() == "auto"


# all_gathers that move at least this many bytes in all read the peers' inputs
# straight from their memory (process_vm_readv) when every rank can: see
# docs/COLLECTIVES.md "Single-copy all_gather and all_to_all".  Switch points measured on the
# development machine with freshly written inputs, by world size as
# TWOSHOT_MIN_BYTES: world 2 gains from 3-4 MiB and loses below; worlds 3 and
# 4 (oversubscribed there) never gained, so -1: never, unless
# TPCOMM_CMA_MIN_BYTES says otherwise.
CMA_MIN_BYTES = {2: 4 << 20, 3: -1}


def cma() -> bool:
    """TPCOMM_CMA: 1 (default: single-copy all_gather where every rank can read its
    peers' memory) or 0 (never; on any rank, for every rank)."""
    value = os.environ.get("TPCOMM_CMA", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"TPCOMM_CMA={value!r}: expected 0 or 1")
    return value == "1"


def cma_min_bytes(world: int) -> int:
    """TPCOMM_CMA_MIN_BYTES: the smallest all_gather (total bytes) read single-copy
    (default: CMA_MIN_BYTES for this world size; -1: never)."""
    key = max(k for k in CMA_MIN_BYTES if k <= max(world, 2))
    return _int("TPCOMM_CMA_MIN_BYTES", CMA_MIN_BYTES[key], -1, MAX_BYTES, " (-1: never)")


def cma_allreduce_min_bytes() -> int:
    """TPCOMM_CMA_ALLREDUCE_MIN_BYTES: the smallest all_reduce (bytes) done by
    single copy where single-copy reads are on (default -1: never, unless a tuned
    profile says otherwise)."""
    return _int("TPCOMM_CMA_ALLREDUCE_MIN_BYTES", -1, -1, MAX_BYTES, " (-1: never)")


def cma_allreduce_max_bytes() -> int:
    """TPCOMM_CMA_ALLREDUCE_MAX_BYTES: the largest all_reduce (bytes) done by
    single copy, the end of its window (default -1: no end, unless a tuned
    profile says otherwise)."""
    return _int("TPCOMM_CMA_ALLREDUCE_MAX_BYTES", -1, -1, MAX_BYTES, " (-1: no end)")


# an output of at least this many bytes whose pages are not there yet (a
# tensor just made) gets them in one call before a collective writes it:
# _native/pages.c, docs/ENGINE.md "Outputs without pages"
DEFAULT_POPULATE_MIN_BYTES = 256 << 10


def populate_min_bytes() -> int:
    """TPCOMM_POPULATE_MIN_BYTES: a collective's output of at least this many
    bytes that has no pages yet gets them in one call before it is written
    (default 256 KiB; -1: never, the copies fault them in page by page)."""
    return _int(
        "TPCOMM_POPULATE_MIN_BYTES", DEFAULT_POPULATE_MIN_BYTES, -1, MAX_BYTES, " (-1: never)"
    )


def nt_max_bytes() -> int:
    """TPCOMM_NT_MAX_BYTES: where stores are fixed (TPCOMM_NT_MIN_BYTES set), the
    largest copy into a slot that uses non-temporal stores (default -1: no end)."""
    return _int("TPCOMM_NT_MAX_BYTES", -1, -1, MAX_BYTES, " (-1: no end)")


def _algo(name: str) -> str:
    """An all-reduce algorithm setting: one_shot, two_shot or auto (default).
    The CPU and GPU settings take the same words; oneshot / twoshot (the CPU
    setting's old spelling) are read as one_shot / two_shot."""
    raw = os.environ.get(name) or "auto"
    value = {"oneshot": "one_shot", "twoshot": "two_shot"}.get(raw.lower(), raw.lower())
    if value not in ("one_shot", "two_shot", "auto"):
        raise ValueError(f"{name}={raw!r}: {name} must be one_shot, two_shot or auto")
    return value


def allreduce_algo() -> str:
    """TPCOMM_ALLREDUCE_ALGO: the CPU all-reduce's one_shot, two_shot or auto (default)."""
    return _algo("TPCOMM_ALLREDUCE_ALGO")


# auto: all-reduces of at least this many bytes go two-shot, by world size
# (measured on the development machine, see docs/PERFORMANCE.md); worlds
# not listed use the entry of the largest listed world below them.
TWOSHOT_MIN_BYTES = {2: 256 << 10}


def twoshot_min_bytes(world: int) -> int:
    """Bytes from which all_reduce goes two-shot at this world size (-1: never)."""
    algo = allreduce_algo()
    if algo == "one_shot":
        return -1
    if algo == "two_shot":
        return 0
    key = max(k for k in TWOSHOT_MIN_BYTES if k <= max(world, 2))
    return TWOSHOT_MIN_BYTES[key]


def threads(world: int) -> int:
    """TPCOMM_THREADS: threads per rank for large copies and reductions.

    Default (auto): a rank pinned to a subset of the CPUs uses them (at most
    torch.get_num_threads()); an unpinned rank takes its share of the host,
    CPUs // ranks.  Never more threads than CPUs, so never oversubscribed.
    """
    if os.environ.get("TPCOMM_THREADS", "auto") != "auto":
        return _int("TPCOMM_THREADS", 1, 1, MAX_THREADS, " or auto")
    import torch

    total = os.cpu_count() or 1
    try:
        mine = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = total
    if mine < total:
        return max(1, min(mine, torch.get_num_threads()))
    return max(1, total // max(world, 1))


def threads_min_bytes() -> int:
    """TPCOMM_THREADS_MIN_BYTES: the smallest copy, reduction or single-copy read
    (bytes) a rank splits between its threads (default 256 KiB; -1: never)."""
    return _int(
        "TPCOMM_THREADS_MIN_BYTES", DEFAULT_THREADS_MIN_BYTES, -1, MAX_BYTES, " (-1: never)"
    )


DEFAULT_ZERO_COPY_MIN_BYTES = 1 << 20


def zero_copy_min_bytes() -> int:
    """TPCOMM_ZERO_COPY_MIN_BYTES: an all_reduce of a tensor from
    Communicator.empty of at least this many bytes reads the peers' tensors
    where they are (default 1 MiB; -1: never, it copies like any other)."""
    return _int(
        "TPCOMM_ZERO_COPY_MIN_BYTES", DEFAULT_ZERO_COPY_MIN_BYTES, -1, MAX_BYTES, " (-1: never)"
    )


def zero_copy_max_bytes() -> int:
    """TPCOMM_ZERO_COPY_MAX_BYTES: the largest such all_reduce that goes zero
    copy (default -1: no limit; within the limits rank 0 chooses zero copy or
    the copies as calls run)."""
    return _int("TPCOMM_ZERO_COPY_MAX_BYTES", -1, -1, MAX_BYTES, " (-1: no limit)")


def chunk_min_bytes() -> int:
    """TPCOMM_CHUNK_MIN_BYTES: an all_reduce through the slots of at least this
    many bytes goes TPCOMM_CHUNK_BYTES at a time instead of a slot at a time
    (default -1: never; tpcomm tune measures where it pays)."""
    return _int("TPCOMM_CHUNK_MIN_BYTES", -1, -1, MAX_BYTES, " (-1: never)")


def l2_bytes() -> int:
    """This CPU's level-2 cache per core as the kernel reports it (0: unknown)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(base)):
            d = os.path.join(base, index)
            with open(os.path.join(d, "level")) as f:
                if f.read().strip() != "2":
                    continue
            with open(os.path.join(d, "type")) as f:
                if f.read().strip() not in ("Unified", "Data"):
                    continue
            with open(os.path.join(d, "size")) as f:
                text = f.read().strip().upper()
            unit = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
            return int(text.rstrip("KM")) * unit
    except (OSError, ValueError):
        pass
    return 0


DEFAULT_CHUNK_BYTES = 256 << 10  # where the L2 is unknown


def chunk_bytes(slot: int) -> int:
    """TPCOMM_CHUNK_BYTES: the chunk of TPCOMM_CHUNK_MIN_BYTES, 4 KiB to a slot,
    rounded down to a 4 KiB page (default: half this CPU's L2, at least 64 KiB:
    a chunk and its slot's copy then stay in the core's cache between the copy
    in and the reduce)."""
    l2 = l2_bytes()
    default = max(64 << 10, l2 // 2) if l2 else DEFAULT_CHUNK_BYTES
    value = _int("TPCOMM_CHUNK_BYTES", default, 4096, MAX_SLOT_BYTES)
    return min(value // 4096 * 4096, slot)


def isa() -> str:
    """TPCOMM_ISA: the reduce kernels' variant, auto (default: the best the CPU
    has), scalar, avx2, avx512 or neon; the core refuses one the CPU lacks."""
    return (os.environ.get("TPCOMM_ISA") or "auto").strip().lower()


def host_id_override() -> str | None:
    """TPCOMM_HOST_ID: pretend to be on this host (tests of multi-host paths)."""
    return os.environ.get("TPCOMM_HOST_ID") or None


def cuda_algo() -> str:
    """TPCOMM_CUDA_ALGO: the GPU custom all-reduce's one_shot, two_shot or auto (default)."""
    return _algo("TPCOMM_CUDA_ALGO")


def profile_path() -> str | None:
    """TPCOMM_PROFILE: the tuned profile rank 0 reads (default: profile.json in the
    cache directory, written by `tpcomm tune`; 0 or none: no profile)."""
    value = os.environ.get("TPCOMM_PROFILE", "").strip()
    if value.lower() in ("0", "none", "off"):
        return None
    return value or os.path.join(cache_dir(), "profile.json")


def cache_dir() -> str:
    """TPCOMM_CACHE_DIR (default $XDG_CACHE_HOME/tpcomm or ~/.cache/tpcomm): where the
    GPU P2P verdict of a node, the tuned profile and the peers of `tpcomm perf` are kept."""
    return os.environ.get("TPCOMM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tpcomm"
    )


def vllm_mode() -> str:
    """TPCOMM_VLLM: what the vLLM plugin does in vLLM's processes: 1 (default:
    serve vLLM's tensor- and pipeline-parallel groups), 0 (nothing: vLLM's own
    communication), torch (nothing of tpcomm, and vLLM's shared memory off too:
    those groups on torch.distributed, for comparisons)."""
    raw = (os.environ.get("TPCOMM_VLLM") or "1").strip().lower()
    value = {"1": "on", "0": "off", "torch": "torch"}.get(raw)
    if value is None:
        raise ValueError(f"TPCOMM_VLLM={raw!r}: expected 1, 0 or torch")
    return value


def stats() -> str | None:
    """TPCOMM_STATS: None (default, unset or 0: off), "stderr" (1: each
    Communicator prints its record of rounds and waits at close) or a
    directory (one JSON file per Communicator there; tpcomm.stats)."""
    raw = (os.environ.get("TPCOMM_STATS") or "").strip()
    if raw in ("", "0"):
        return None
    if raw in ("1", "stderr"):
        return "stderr"
    return raw
