"""Triton kernels of the custom all-reduce: every rank reads its peers' buffers.

Memory every kernel sees, per rank (``ptrs`` tables hold each rank's address
of a buffer, in the caller's address space: CUDA IPC on a GPU, the shared
segment under the Triton interpreter in tests):

* ``data``: the IPC buffer the input is copied into (or, for inputs captured
  in a CUDA graph, the registered input itself);
* ``sig``: the signal buffer, int32 flags laid out ``[3 stages][BLOCKS][W]``:
  stage 0 "start", 1 "middle" (two-shot), 2 "end"; entry ``[s][b][p]`` of rank
  r's buffer is written by rank p's program b;
* ``cnt``: this rank's own per-program call counters (not shared).

Synchronisation, per program (CTA) b, never across programs, so no grid-wide
barrier is needed: program b of every rank handles the same element ranges.

1. ``flag = cnt[b] + 1`` (a device-side counter: a CUDA graph replays the
   kernel with the counter advancing, as the seed does);
2. start barrier: store ``flag`` into ``sig[0][b][rank]`` of every peer
   (release, system scope), then wait until ``sig[0][b][p] == flag`` in our own
   buffer for every p (acquire, system scope): every peer's input is in place;
3. the work (one-shot: reduce everything; two-shot: reduce our part in place,
   middle barrier, gather the parts);
4. end barrier (same as start, stage 2): nobody overwrites its buffer with
   the next call's input while a peer still reads it;
5. ``cnt[b] = flag``.

Flags only grow (32-bit, wrapping after 4 billion calls), and a peer can be at
most one call ahead (the end barrier), so waiting for equality is exact.
Sums run in float32 in rank order 0..W-1, so every rank gets the same bits;
bfloat16 is rounded to nearest-even by hand (the Triton interpreter truncates).
"""

from __future__ import annotations

import triton
import triton.language as tl

STAGES = 3


@triton.jit
def _signal(sig_ptrs, stage, b, rank, flag, W: tl.constexpr, BLOCKS: tl.constexpr):
    """Tell every rank that program b of this rank reached ``stage``, then wait for them.

    The CTA barriers around it order the other threads' memory operations with
    the one thread's release store and acquire load (as the seed's
    __syncthreads() around its flag accesses); the interpreter ignores them."""
    tl.debug_barrier()
    for p in tl.static_range(W):
        peer = tl.load(sig_ptrs + p).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(peer + (stage * BLOCKS + b) * W + rank, flag, sem="release", scope="sys")
    own = tl.load(sig_ptrs + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(W):
        slot = own + (stage * BLOCKS + b) * W + p
        seen = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
        while seen != flag:
            seen = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
    tl.debug_barrier()


@triton.jit
def _enter(sig_ptrs, cnt, b, rank, W: tl.constexpr, BLOCKS: tl.constexpr):
    """This call's flag for program b, once every rank's program b has started it."""
    flag = tl.load(cnt + b) + 1
    _signal(sig_ptrs, 0, b, rank, flag, W, BLOCKS)
    return flag


@triton.jit
def _leave(sig_ptrs, cnt, b, rank, flag, W: tl.constexpr, BLOCKS: tl.constexpr):
    """End barrier (nobody rewrites a buffer a peer still reads), then count the call."""
    _signal(sig_ptrs, 2, b, rank, flag, W, BLOCKS)
    tl.store(cnt + b, flag)


@triton.jit
def _round(acc, OUT: tl.constexpr):
    """float32 -> the output dtype, rounding to nearest even."""
    if OUT == tl.bfloat16:  # noqa: SIM300
        bits = acc.to(tl.int32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        rounded = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.where(acc != acc, acc.to(tl.bfloat16), rounded)
    else:
        return acc.to(OUT)


@triton.jit
def _sum_from(data_ptrs, offs, mask, W: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(W):
        src = tl.load(data_ptrs + p).to(tl.pointer_type(DT))
        acc += tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _reduce_range(
    data_ptrs,
    out,
    base,
    m,
    b,
    W: tl.constexpr,
    BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    """out[:m] = sum over ranks of data[p][base : base + m], program b's blocks
    (b*BLOCK, step BLOCKS*BLOCK), in rank order, rounded once."""
    for start in range(b * BLOCK, m, BLOCKS * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < m
        acc = _sum_from(data_ptrs, base + offs, mask, W, DT, BLOCK)
        tl.store(out + offs, _round(acc, DT), mask=mask)


@triton.jit
def one_shot(
    data_ptrs,
    sig_ptrs,
    cnt,
    out,
    n,
    rank,
    W: tl.constexpr,
    BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    """out = sum over ranks of data[p][:n]; program b does elements b*BLOCK, step BLOCKS*BLOCK."""
    b = tl.program_id(0)
    flag = _enter(sig_ptrs, cnt, b, rank, W, BLOCKS)
    _reduce_range(data_ptrs, out, 0, n, b, W, BLOCKS, BLOCK, DT)
    _leave(sig_ptrs, cnt, b, rank, flag, W, BLOCKS)


@triton.jit
def two_shot(
    data_ptrs,
    tmp_ptrs,
    sig_ptrs,
    cnt,
    out,
    n,
    part,
    rank,
    W: tl.constexpr,
    BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    """Reduce-scatter then all-gather.  Part p is elements [p*part, min(n, (p+1)*part)):
    rank p reduces it from every rank's data into its own scratch buffer ``tmp``
    (the inputs stay untouched: inside a CUDA graph they are the user's), then
    every rank gathers part p from rank p's scratch buffer.  Program b handles
    the same offsets inside every part, so a per-program middle barrier is
    enough before reading the peers' reduced parts."""
    b = tl.program_id(0)
    flag = _enter(sig_ptrs, cnt, b, rank, W, BLOCKS)
    mine = tl.load(tmp_ptrs + rank).to(tl.pointer_type(DT))
    lo = rank * part
    _reduce_range(data_ptrs, mine + lo, lo, tl.minimum(part, n - lo), b, W, BLOCKS, BLOCK, DT)
    _signal(sig_ptrs, 1, b, rank, flag, W, BLOCKS)
    for p in tl.static_range(W):
        src = tl.load(tmp_ptrs + p).to(tl.pointer_type(DT))
        for start in range(b * BLOCK, part, BLOCKS * BLOCK):
            offs = p * part + start + tl.arange(0, BLOCK)
            mask = (offs < n) & (offs < (p + 1) * part)
            tl.store(out + offs, tl.load(src + offs, mask=mask), mask=mask)
    _leave(sig_ptrs, cnt, b, rank, flag, W, BLOCKS)


@triton.jit
def all_gather(
    data_ptrs,
    sig_ptrs,
    cnt,
    out,
    n,
    rank,
    W: tl.constexpr,
    BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    """out[p*n : (p+1)*n] = data[p][:n] for every rank p."""
    b = tl.program_id(0)
    flag = _enter(sig_ptrs, cnt, b, rank, W, BLOCKS)
    for p in tl.static_range(W):
        src = tl.load(data_ptrs + p).to(tl.pointer_type(DT))
        for start in range(b * BLOCK, n, BLOCKS * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(out + p * n + offs, tl.load(src + offs, mask=mask), mask=mask)
    _leave(sig_ptrs, cnt, b, rank, flag, W, BLOCKS)


@triton.jit
def reduce_scatter(
    data_ptrs,
    sig_ptrs,
    cnt,
    out,
    m,
    rank,
    W: tl.constexpr,
    BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    """out[:m] = sum over ranks of data[p][rank*m : (rank+1)*m]."""
    b = tl.program_id(0)
    flag = _enter(sig_ptrs, cnt, b, rank, W, BLOCKS)
    _reduce_range(data_ptrs, out, rank * m, m, b, W, BLOCKS, BLOCK, DT)
    _leave(sig_ptrs, cnt, b, rank, flag, W, BLOCKS)
