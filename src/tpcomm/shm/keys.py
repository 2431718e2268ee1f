"""Layout keys: a 64-bit digest of a collective's shapes, dims, sizes and
root, published with every round as the metadata's ``arg`` so that ranks
whose calls disagree are told so (a ``ValueError`` naming both sides).

One function per family.  A flat, even layout (dim 0, no other dims, the same
size on every rank) is the core's ``flat_key``, which its one-call fast paths
compute too, so that a rank on a fast path and a rank on the general path
still agree.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Optional

__all__ = ["empty_key", "flat_key", "gather_key", "reduce_scatter_key"]

from .engine import RS_FLAT, flat_key  # the core's, which its one-call paths compute


def _digest(parts: tuple) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFFFFFFFFFF


def _even(sizes: tuple) -> bool:
    return bool(sizes) and all(s == sizes[0] for s in sizes)


@functools.lru_cache(maxsize=4096)
def gather_key(kind: int, rest: tuple, d: int, sizes: tuple, root: Optional[int]) -> int:
    """all_gather (``root`` None) and gather: the other dims ``rest``, the dim
    ``d``, every rank's size along it.  Flat and even: flat_key(kind, n, w),
    with a root flat_key(kind + ((root + 1) << 32), n, w)."""
    if rest == () and d == 0 and _even(sizes):
        tag = 0 if root is None else (root + 1) << 32
        return flat_key(kind + tag, sizes[0], len(sizes))
    return _digest((kind, rest, d, sizes, root))


@functools.lru_cache(maxsize=4096)
def reduce_scatter_key(rest: tuple, d: int, sizes: tuple) -> int:
    """reduce_scatter: flat and even is flat_key(RS_FLAT, n, w)."""
    if rest == () and d == 0 and _even(sizes):
        return flat_key(RS_FLAT, sizes[0], len(sizes))
    return _digest((rest, d, sizes))


@functools.lru_cache(maxsize=1024)
def empty_key(shape: tuple, dtype: Any) -> int:
    """Communicator.empty: the shape and dtype every rank allocates."""
    return _digest(("empty", shape, str(dtype)))
