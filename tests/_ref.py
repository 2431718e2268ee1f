"""Independent references: data derived from (rank, case), reductions in torch."""

from __future__ import annotations

import hashlib

import torch

import tpcomm

OPS = list(tpcomm.ReduceOp)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


MOVE_DTYPES = DTYPES + [torch.float64, torch.bool, torch.int8, torch.uint8, torch.complex64]


def make(rank: int, numel, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank-specific data of any dtype (numel may be a shape), reproducible on any rank."""
    shape = (numel,) if isinstance(numel, int) else tuple(numel)
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype in FLOATS or dtype == torch.float64:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 4).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g).to(dtype)
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def reference(inputs: list[torch.Tensor], op: tpcomm.ReduceOp) -> torch.Tensor:
    """The contract, computed by torch on one process: float32 accumulation in
    rank order 0..W-1, one rounding at the end; integers exact."""
    dtype = inputs[0].dtype
    acc_dtype = torch.float32 if dtype in FLOATS else dtype
    acc = inputs[0].to(acc_dtype).clone()
    for x in inputs[1:]:
        x = x.to(acc_dtype)
        if op in (tpcomm.ReduceOp.SUM, tpcomm.ReduceOp.AVG):
            acc = acc + x
        elif op is tpcomm.ReduceOp.MAX:
            acc = torch.maximum(acc, x)
        else:
            acc = torch.minimum(acc, x)
    if op is tpcomm.ReduceOp.AVG:
        acc = acc / len(inputs)
    return acc.to(dtype)


def reference_f64(inputs: list[torch.Tensor], op: tpcomm.ReduceOp) -> torch.Tensor:
    """The same reduction in float64 (exact for the integer data used here)."""
    xs = torch.stack([x.to(torch.float64) for x in inputs])
    if op is tpcomm.ReduceOp.SUM:
        return xs.sum(0)
    if op is tpcomm.ReduceOp.AVG:
        return xs.mean(0)
    if op is tpcomm.ReduceOp.MAX:
        return xs.max(0).values
    return xs.min(0).values


def digest(t: torch.Tensor) -> str:
    """Hash of the exact bytes, to compare results across ranks."""
    t = t.contiguous()
    if t.numel() == 0:
        return "empty"
    return hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest()
