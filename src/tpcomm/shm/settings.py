"""The engine's settings: what each switch point and choice is, read from the
environment (``_env``) or rank 0's tuned profile (``profile.py``), each
checked.  ``tpcomm doctor`` prints them; ``setup.py`` gives them to a new
engine.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .. import _env
from . import profile

__all__ = ["NEVER", "Settings", "settings_for"]

NEVER = (1 << 64) - 1  # a switch point of -1 (never), as the core compares it


class Settings(NamedTuple):
    """The engine's settings (settings_for)."""

    nt_min: int  # copies into a slot of this many bytes use non-temporal stores (-1: never)
    nt_auto: bool  # all_reduce chunks of 4 KiB and more choose their stores as they run
    yield_us: float  # how long a wait yields before it sleeps
    threads: int  # threads per rank
    threads_min: int  # the smallest job they share (-1: never)
    twoshot_min: int  # all_reduce two-shot from (float32 and the integers)
    twoshot_min16: int  # the same for bfloat16 and float16
    cma_ar_min: int  # all_reduce single-copy from (-1: never)
    cma_min: int  # all_gather (and all_to_all) single-copy from (-1: never)
    cma: bool  # single-copy reads allowed at all (TPCOMM_CMA)
    zc_min: int  # all_reduce of a comm.empty tensor: zero-copy from (-1: never)
    zc_max: int  # up to (-1: no limit)
    chunk_min: int  # all_reduce through the slots chunk_bytes at a time from (-1: never)
    chunk_bytes: int  # that chunk (the others go a slot at a time)
    zc_auto: bool = True  # rank 0 chooses zero copy or the copies as calls run
    # the windows' ends (bytes included; -1: no end): each from its *_min up to here
    twoshot_max: int = -1
    twoshot_max16: int = -1
    cma_ar_max: int = -1
    nt_max: int = -1
    # an output of this many bytes with no pages yet gets them first (-1: never)
    populate_min: int = _env.DEFAULT_POPULATE_MIN_BYTES

    @property
    def cma_plan(self) -> tuple:
        """cma_init's arguments: (single-copy reads wanted, all_gather's switch
        point); wanted where some collective would use them."""
        want = self.cma and (self.cma_min >= 0 or self.cma_ar_min >= 0)
        return want, self.cma_min if self.cma_min >= 0 else NEVER


def settings_for(world: int, slot: int, tuned: Optional[dict] = None) -> Settings:
    """The engine's settings, each checked.  ``tuned``: rank 0's profile
    (shm/profile.py), used where this rank's environment does not set it."""
    tuned = tuned or {}

    def pick(key: str, default: int) -> int:
        env = profile.SETTINGS[key]
        return default if key not in tuned or _env.explicit(env) else tuned[key]

    two = pick("twoshot_min_bytes", _env.twoshot_min_bytes(world))
    chunk = pick("chunk_bytes", _env.chunk_bytes(slot)) // 4096 * 4096  # a profile's too
    return Settings(
        nt_min=pick("nt_min_bytes", _env.nt_min_bytes()),
        nt_auto=_env.nt_auto(),
        yield_us=_env.yield_us(),
        threads=_env.threads(world),
        threads_min=pick("threads_min_bytes", _env.threads_min_bytes()),
        twoshot_min=two,
        twoshot_min16=pick("twoshot_min_bytes_16bit", two),  # 16-bit: as the rest by default
        cma_ar_min=pick("cma_allreduce_min_bytes", _env.cma_allreduce_min_bytes()),
        cma_min=pick("cma_min_bytes", _env.cma_min_bytes(world)),
        cma=_env.cma(),
        zc_min=pick("zero_copy_min_bytes", _env.zero_copy_min_bytes()),
        zc_max=pick("zero_copy_max_bytes", _env.zero_copy_max_bytes()),
        chunk_min=pick("chunk_min_bytes", _env.chunk_min_bytes()),
        chunk_bytes=min(max(4096, chunk), slot),
        twoshot_max=pick("twoshot_max_bytes", -1),
        twoshot_max16=pick("twoshot_max_bytes_16bit", pick("twoshot_max_bytes", -1)),
        cma_ar_max=pick("cma_allreduce_max_bytes", _env.cma_allreduce_max_bytes()),
        nt_max=pick("nt_max_bytes", _env.nt_max_bytes()),
        populate_min=_env.populate_min_bytes(),
    )
