"""Outputs without pages (_native/pages.c): a collective's output that has no
pages yet (a tensor just made, as vLLM's all_gather makes one every call) gets
them in one madvise call before the rounds write it.

Every result is checked against torch on one process; the record's
``populated`` count says which calls gave their output its pages first.  The
fresh outputs are private anonymous mappings nobody has touched: what glibc
hands torch.empty for a few MiB.
"""

from __future__ import annotations

import mmap

import pytest
import torch

from tpcomm import _testing, stats
from tpcomm.launch import LocalGroup

MiB = 1 << 20
PROBE_EVERY = 64  # pages.c: a size found present is probed again after this many calls


def fresh(nbytes: int, dtype=torch.float32) -> torch.Tensor:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=dtype)  # the tensor keeps the mapping alive


def part(q: int, numel: int, salt: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * 0.5 + q * 1000.0 + salt


def _outputs(comm) -> dict:
    r, w = comm.rank, comm.world_size
    got = {}

    def run(name, fn, out, want, reprobe=True):
        if reprobe:  # each case on its own: what earlier sizes found is forgotten
            _testing.reprobe(comm)
        before = comm.stats()["populated"]
        fn()
        ok = want is None or torch.equal(out, want)
        got[name] = (comm.stats()["populated"] - before, ok)

    # all_gather into fresh pages (2 MiB in all), then the same tensor again,
    # then a fresh one of that size: skipped until the size is probed again
    n = MiB // 4 // w * 2
    x = part(r, n, 1)
    want = torch.cat([part(q, n, 1) for q in range(w)])
    out = fresh(w * n * 4)
    run("all_gather", lambda: comm.all_gather_into_tensor(out, x), out, want)
    run("all_gather again", lambda: comm.all_gather_into_tensor(out, x), out, want, False)
    out2 = fresh(w * n * 4)
    run("all_gather fresh, size just seen present", lambda: comm.all_gather_into_tensor(out2, x),
        out2, want, False)  # fmt: skip

    # in place: this rank's input lies in the output, the other places are fresh
    n = 3 * MiB // 4 // w
    out = fresh(w * n * 4)
    out[r * n : (r + 1) * n] = part(r, n, 2)
    want = torch.cat([part(q, n, 2) for q in range(w)])
    run("all_gather in place",
        lambda: comm.all_gather_into_tensor(out, out[r * n : (r + 1) * n]), out, want)  # fmt: skip

    # single copy (16 MiB in all, past TPCOMM_CMA_MIN_BYTES at world 2)
    n = 16 * MiB // 4 // w
    x = part(r, n, 3)
    out = fresh(w * n * 4)
    run("all_gather single copy", lambda: comm.all_gather_into_tensor(out, x), out,
        torch.cat([part(q, n, 3) for q in range(w)]))  # fmt: skip

    # gather into a list of fresh tensors on the last rank (about 1 MiB in all)
    n = MiB // 4 // w + 1000
    dst = w - 1
    outs = [fresh(n * 4) for _ in range(w)] if r == dst else None
    x = part(r, n, 4)
    run("gather", lambda: comm.gather_into_list(outs, x, dst=dst), None, None)
    if outs:
        right = all(torch.equal(o, part(q, n, 4)) for q, o in enumerate(outs))
        got["gather"] = (got["gather"][0], right)

    # broadcast from rank 0 into fresh pages elsewhere (512 KiB)
    n = MiB // 8
    t = part(0, n, 5).clone() if r == 0 else fresh(n * 4)
    run("broadcast", lambda: comm.broadcast(t, src=0), t, part(0, n, 5))

    # reduce_scatter into a fresh output (4 MiB each)
    n = 4 * MiB // 4
    x = torch.cat([part(r + q, n, 6) for q in range(w)])
    out = fresh(n * 4)
    want = sum(part(q + r, n, 6).double() for q in range(w)).float()
    run("reduce_scatter", lambda: comm.reduce_scatter_tensor(out, x), out, want)

    # all_to_all into a fresh output (8 MiB: single copy at world 2)
    n = 8 * MiB // 4 // w
    x = torch.cat([part(r * w + j, n, 7) for j in range(w)])
    out = fresh(w * n * 4)
    run("all_to_all", lambda: comm.all_to_all_single(out, x), out,
        torch.cat([part(q * w + r, n, 7) for q in range(w)]))  # fmt: skip

    # a message received into fresh tensors (1.5 MiB), rank 0 to rank 1
    n = 3 * MiB // 8
    if r == 0:
        comm.send([part(0, n, 8), part(1, n // 2, 8)], 1)
    elif r == 1:
        outs = [fresh(n * 4), fresh(n // 2 * 4)]
        run("recv", lambda: comm.recv(0, outs), None, None)
        right = torch.equal(outs[0], part(0, n, 8)) and torch.equal(outs[1], part(1, n // 2, 8))
        got["recv"] = (got["recv"][0], right)

    rec = comm.stats()
    got["bytes"] = rec["populated_bytes"]
    got["describe"] = stats.describe(rec)
    return got


@pytest.mark.parametrize("world", [2, 3])
def test_outputs_without_pages_get_them_first(world):
    """Every collective's result is right, and a fresh output got its pages
    first on every rank that writes one; one whose pages are there did not."""
    with LocalGroup(world, timeout=60) as g:
        results = g.run(_outputs, timeout=240)
    for rank, got in enumerate(results):
        wrong = [k for k, v in got.items() if isinstance(v, tuple) and not v[1]]
        assert not wrong, (rank, wrong)
        assert got["all_gather"][0] == 1
        assert got["all_gather again"][0] == 0
        assert got["all_gather fresh, size just seen present"][0] == 0
        assert got["all_gather in place"][0] == 1
        assert got["all_gather single copy"][0] == 1
        assert got["gather"][0] == (1 if rank == world - 1 else 0)
        assert got["broadcast"][0] == (0 if rank == 0 else 1)
        assert got["reduce_scatter"][0] == 1
        assert got["all_to_all"][0] == 1
        assert got.get("recv", (1,))[0] == 1
        # about every byte they write (whole pages only)
        assert got["bytes"] >= 30 * MiB * (world - 1) // world
        assert "outputs given their pages first" in got["describe"]


def _never(comm) -> list:
    r, w = comm.rank, comm.world_size
    n = MiB // 2
    x = part(r, n, 8)
    out = fresh(w * n * 4)
    comm.all_gather_into_tensor(out, x)
    want = torch.cat([part(q, n, 8) for q in range(w)])
    return [comm.stats()["populated"], torch.equal(out, want)]


def test_populate_off(monkeypatch):
    """TPCOMM_POPULATE_MIN_BYTES=-1: the copies fault the pages in, as before."""
    monkeypatch.setenv("TPCOMM_POPULATE_MIN_BYTES", "-1")
    with LocalGroup(2, timeout=60) as g:
        assert g.run(_never, timeout=120) == [[0, True], [0, True]]


def _probes(comm) -> list:
    """A size found present skips the probe for PROBE_EVERY - 1 calls, then
    probes again: a fresh output there gets its pages."""
    r, w = comm.rank, comm.world_size
    n = MiB // 4
    x = part(r, n, 9)
    want = torch.cat([part(q, n, 9) for q in range(w)])
    warm = torch.empty(w * n).fill_(1.0)  # its pages are there
    comm.all_gather_into_tensor(warm, x)
    comm.all_gather_into_tensor(warm, x)  # present: the next 63 of this size skip
    counts, right = [], True
    for _ in range(PROBE_EVERY):
        out = fresh(w * n * 4)
        before = comm.stats()["populated"]
        comm.all_gather_into_tensor(out, x)
        counts.append(comm.stats()["populated"] - before)
        right &= torch.equal(out, want)
    return [counts, right]


def test_a_size_seen_present_is_probed_again_later():
    with LocalGroup(2, timeout=60) as g:
        for counts, right in g.run(_probes, timeout=120):
            assert right
            assert counts == [0] * (PROBE_EVERY - 2) + [1, 1]
