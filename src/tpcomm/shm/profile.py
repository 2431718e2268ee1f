"""Tuned profiles: the switch points `tpcomm tune` measured on this machine.

A profile is a JSON file (``TPCOMM_PROFILE``, default ``profile.json`` in the
cache directory) that says, per world size, in which window of sizes (from
how many bytes, up to how many) all_reduce goes two-shot and single-copy and
copies into the slots use non-temporal stores, from how many all_gather goes
single-copy, a rank's helper threads share the work, an all_reduce of
a comm.empty tensor reads the peers' tensors where they are, and an
all_reduce goes through the slots in cache-sized chunks (and that chunk).  Rank 0 reads it when a
Communicator is made and sends its settings to the other ranks with the
segment's name (:func:`encode` / :func:`decode`), so every rank uses rank 0's
profile; a setting given in the environment still wins on the rank that sets it
(and ranks that end up different get the usual error naming the setting).  A
profile made for another CPU model, CPU count or tpcomm version is ignored and
that is logged once.  Without a profile the built-in defaults apply.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

from .. import _env
from .._version import __version__

__all__ = [
    "FORMAT", "SETTINGS", "decode", "encode", "load", "machine", "read", "settings", "write",
]  # fmt: skip

FORMAT = 1
# setting -> the environment variable that overrides it
SETTINGS = {
    "twoshot_min_bytes": "TPCOMM_ALLREDUCE_ALGO",
    "twoshot_max_bytes": "TPCOMM_ALLREDUCE_ALGO",  # (its window's end; -1: none)
    "twoshot_min_bytes_16bit": "TPCOMM_ALLREDUCE_ALGO",  # bfloat16 and float16
    "twoshot_max_bytes_16bit": "TPCOMM_ALLREDUCE_ALGO",
    "cma_allreduce_min_bytes": "TPCOMM_CMA_ALLREDUCE_MIN_BYTES",
    "cma_allreduce_max_bytes": "TPCOMM_CMA_ALLREDUCE_MAX_BYTES",
    "cma_min_bytes": "TPCOMM_CMA_MIN_BYTES",
    "nt_min_bytes": "TPCOMM_NT_MIN_BYTES",  # non-temporal stores into the slots
    "nt_max_bytes": "TPCOMM_NT_MAX_BYTES",
    "threads_min_bytes": "TPCOMM_THREADS_MIN_BYTES",  # a rank's helper threads
    "zero_copy_min_bytes": "TPCOMM_ZERO_COPY_MIN_BYTES",  # all_reduce of comm.empty tensors
    "zero_copy_max_bytes": "TPCOMM_ZERO_COPY_MAX_BYTES",  # (up to here; -1: no limit)
    "chunk_min_bytes": "TPCOMM_CHUNK_MIN_BYTES",  # all_reduce chunk_bytes at a time
    "chunk_bytes": "TPCOMM_CHUNK_BYTES",  # (rank 0's: the ranks must agree)
}

_log = logging.getLogger("tpcomm")
_said: set = set()


def machine() -> dict:
    """What a profile must match: the CPU model as the kernel names it, the
    CPUs this host has, tpcomm's version."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "Model", "CPU part") and not model:
                    model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": model or "unknown", "cpus": os.cpu_count() or 1, "tpcomm": __version__}


def read(path: Optional[str] = None) -> tuple:
    """(profile, None) for this machine's profile at path (default: the
    configured one), else (None, why not)."""
    path = path or _env.profile_path()
    if path is None:
        return None, "TPCOMM_PROFILE turns profiles off"
    if not os.path.exists(path):
        return None, f"no profile at {path} (tpcomm tune writes one)"
    try:
        with open(path) as f:
            prof = json.load(f)
        worlds = prof["worlds"]
        if prof.get("format") != FORMAT or not isinstance(worlds, dict):
            raise ValueError(f"format {prof.get('format')!r}, expected {FORMAT}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{path} is unreadable ({e})"
    here, made = machine(), prof.get("machine", {})
    for key in ("cpu", "cpus", "tpcomm"):
        if made.get(key) != here[key]:
            return None, f"{path} was made for {key} {made.get(key)!r}, this is {here[key]!r}"
    return prof, None


def load(path: Optional[str] = None) -> Optional[dict]:
    """This machine's profile, or None (none there, or made elsewhere: logged once)."""
    prof, why = read(path)
    quiet = why is None or why.startswith(("no profile", "TPCOMM_PROFILE")) or why in _said
    if not quiet:
        _said.add(why)
        _log.warning("tpcomm: tuned profile ignored: %s", why)
    return prof


# One-shot's and two-shot's window: one-shot has every rank read and reduce
# every rank's data, so what it costs grows with the world size, and two-shot's
# does not: a window measured at one world size says nothing of a larger one
# (world 2's profile on AMD Zen 4 kept 8 ranks one-shot to 16 MiB, where
# two-shot took 0.35-0.46 of the time at 256 KiB-1 MiB).
WORLD_BOUND = (
    "twoshot_min_bytes",
    "twoshot_max_bytes",
    "twoshot_min_bytes_16bit",
    "twoshot_max_bytes_16bit",
)


def settings(world: int, prof: Optional[dict] = None) -> dict:
    """The profile's settings for this world size (the entry of the largest
    world size measured up to it; from a smaller world's, not two-shot's
    window: WORLD_BOUND), checked; {} without a profile."""
    prof = load() if prof is None else prof
    if not prof:
        return {}
    sizes = [int(k) for k in prof["worlds"] if str(k).isdigit() and int(k) <= max(world, 2)]
    if not sizes:
        return {}
    entry = prof["worlds"][str(max(sizes))]
    keys = [k for k in SETTINGS if k in entry and (max(sizes) >= world or k not in WORLD_BOUND)]
    return decode(encode({k: entry[k] for k in keys}))


def encode(values: dict) -> str:
    """The settings as rank 0 sends them: 'key=bytes,...'."""
    return ",".join(f"{k}={int(v)}" for k, v in sorted(values.items()))


def decode(text: str) -> dict:
    """Settings from rank 0 (the store is not trusted: unknown keys and values
    out of range are a ValueError)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in SETTINGS or not value.lstrip("-").isdigit():
            raise ValueError(f"tpcomm: a tuned setting {item!r} is not one tpcomm writes")
        v = int(value)
        if not -1 <= v <= _env.MAX_BYTES:
            raise ValueError(f"tpcomm: tuned setting {key}={v} out of range")
        out[key] = v
    return out


def write(worlds: dict, measured: dict, command: str, path: Optional[str] = None) -> str:
    """Write a profile for this machine; its path."""
    path = path or _env.profile_path() or os.path.join(_env.cache_dir(), "profile.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    prof = {
        "format": FORMAT,
        "machine": machine(),
        "command": command,
        "worlds": {str(k): v for k, v in worlds.items()},
        "measured": measured,
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(prof, f, indent=1)
    os.replace(tmp, path)
    return path


# The machine's speed, checked before and after tpcomm tune's measurements: a
# plain all_reduce of REFERENCE_BYTES (float32, the settings agreed at
# creation) that took more than STEADY times as long at one end as at the
# other says the machine changed speed while tuning (a shared VM does, for
# minutes; so does a machine that other work starts on), and switch points
# measured across such a change may compare variants timed at different speeds.
REFERENCE_BYTES = 1 << 20
STEADY = 1.5


def speed_moved(before: float, after: float) -> float:
    """How far the machine's speed moved between two timings of the same call:
    the larger over the smaller (infinite where one is 0)."""
    return max(before, after) / min(before, after) if min(before, after) > 0 else float("inf")


def steadiness(before: float, after: float, limit: float = STEADY) -> str:
    """ "" where the reference all_reduce took about as long (seconds) before
    the measurements as after them (within ``limit`` times), else a warning."""
    if speed_moved(before, after) <= limit:
        return ""
    return (
        f"warning: a plain {REFERENCE_BYTES >> 20} MiB all_reduce took {before * 1e6:.1f} us "
        f"before the measurements and {after * 1e6:.1f} us after: this machine changed speed "
        "while tuning, so the switch points may compare variants timed at different speeds; "
        "run tpcomm tune again when the machine is quiet"
    )
