"""Layout arithmetic of the collectives: where parts start, the bytes a tensor
spans, rows of a gather along a later dim.  Pure functions of shapes and
sizes, shared by the Communicator's paths."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .ops import ALL_DTYPES

__all__ = ["ANY_SIZE", "any_overlap", "offsets", "prod", "rows", "span"]

_Tensor = torch.Tensor

# bytes per element, by the dtype code of a message (ops.ALL_DTYPES): what the
# core's plain-tensor check returns
ANY_SIZE = tuple(dt.itemsize for dt in ALL_DTYPES)


def prod(shape: Any) -> int:
    """The product of a shape's sizes (1 for no dims)."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


def rows(t: _Tensor) -> tuple[int, int]:
    """(rows, bytes per row) of an all_to_all tensor (a 0-d one is one row)."""
    return (t.shape[0] if t.dim() else 1), prod(t.shape[1:]) * t.element_size()


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of ``sizes`` starts when laid out back to back."""
    out, at = [], 0
    for v in sizes:
        out.append(at)
        at += v
    return out


def span(t: _Tensor) -> tuple[int, int]:
    """The bytes [lo, hi) a tensor's elements lie in (for a strided view, the
    whole stretch they spread over: conservative)."""
    lo = t.data_ptr()
    return lo, lo + t.element_size() * (
        1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    )


def dense_overlap(x: _Tensor, y: _Tensor) -> bool:
    """Whether two dense (contiguous) tensors share memory."""
    xa, ya = x.data_ptr(), y.data_ptr()
    xn, yn = x.numel() * x.element_size(), y.numel() * y.element_size()
    return bool(xn and yn and xa < ya + yn and ya < xa + xn)


def any_overlap(xs: Sequence[_Tensor], ys: Sequence[_Tensor]) -> bool:
    """Whether any tensor of ``xs`` shares memory with any of ``ys`` (_span)."""
    a = sorted(span(t) for t in xs if t.numel())
    b = sorted(span(t) for t in ys if t.numel())
    i = j = 0
    while i < len(a) and j < len(b):  # two sorted lists of intervals: a merge
        if a[i][0] < b[j][1] and b[j][0] < a[i][1]:
            return True
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return False
