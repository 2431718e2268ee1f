"""Every dtype the engine moves, through every data-moving collective and
point-to-point call, compared byte for byte with what each rank sent.

Guards: the message and collective codes of every dtype in ``ANY_DTYPE_CODES``
(float8, uint16/32/64 and complex32 too, which torch's own comparisons partly
lack: bytes are compared here), on the shared-memory path and at world size 1.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tpcomm.ops import ALL_DTYPES

N = 37  # odd: no vector width divides it


def _data(rank: int, dtype: torch.dtype, n: int = N) -> torch.Tensor:
    """Rank-specific bytes viewed as ``dtype`` (bool: 0 or 1)."""
    g = torch.Generator().manual_seed(7 * rank + ALL_DTYPES.index(dtype))
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


def _bytes(t: torch.Tensor) -> list:
    return t.contiguous().view(torch.uint8).tolist()


def _every_dtype(comm):
    warnings.simplefilter("ignore")  # complex32 is "experimental"
    r, w = comm.rank, comm.world_size
    other = (r + 1) % w
    wrong = []
    for dt in ALL_DTYPES:
        mine, all_ = _data(r, dt), [_data(q, dt) for q in range(w)]
        everyone = [b for q in range(w) for b in _bytes(all_[q])]

        def check(name, got, want, dt=dt):
            if got is None or _bytes(got) != want:
                wrong.append((str(dt), name))

        check("all_gather", comm.all_gather(mine), everyone)
        out = torch.empty(w * N, dtype=dt)
        check("all_gather_into_tensor", comm.all_gather_into_tensor(out, mine), everyone)
        sizes = [N - q for q in range(w)]
        parts = [_data(q, dt, sizes[q]) for q in range(w)]
        check(
            "all_gatherv",
            comm.all_gatherv(parts[r], sizes),
            [b for p in parts for b in _bytes(p)],
        )
        got = comm.gather(mine, dst=w - 1)
        if r == w - 1:
            check("gather", got, everyone)
        outs = [torch.empty(N, dtype=dt) for _ in range(w)]
        comm.all_gather_into_list(outs, mine)
        check("all_gather_into_list", torch.cat([o.view(torch.uint8) for o in outs]), everyone)
        b = mine.clone()
        check("broadcast", comm.broadcast(b, src=0), _bytes(all_[0]))
        part = torch.empty(N, dtype=dt)
        comm.scatter(part, [_data(10 + q, dt) for q in range(w)] if r == 0 else None, src=0)
        check("scatter", part, _bytes(_data(10 + r, dt)))
        # all_to_all_single: block j of rank q's input goes to rank j
        x = _data(r, dt, 3 * w)
        a2a = comm.all_to_all_single(torch.empty(3 * w, dtype=dt), x)
        want = [b for q in range(w) for b in _bytes(_data(q, dt, 3 * w)[3 * r : 3 * r + 3])]
        check("all_to_all_single", a2a, want)
        if w > 1:
            prev = (r - 1) % w
            got = comm.sendrecv([mine], dst=other, src=prev)[0]
            check("sendrecv", got, _bytes(all_[prev]))
            if r == 0:
                comm.send([mine, mine[:3]], dst=1)
            elif r == 1:
                got = comm.recv(0)
                check("send/recv", torch.cat([t.view(torch.uint8) for t in got]),
                      _bytes(all_[0]) + _bytes(all_[0][:3]))  # fmt: skip
            into = torch.empty(N, dtype=dt)
            comm.batch_isend_irecv([("send", [mine], other), ("recv", [into], prev)])
            check("batch_isend_irecv", into, _bytes(all_[prev]))
    return wrong


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_dtype_moves_byte_for_byte(pools, world):
    assert pools.run(world, _every_dtype) == [[]] * world


# one dtype of each family: float, half, int, byte, bool, complex
A2A_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64]


def _a2a_against_gloo(comm, port):
    """all_to_all_single on tpcomm and on gloo, the same inputs: even blocks,
    uneven splits (a rank sends some peers nothing), all-empty splits."""
    import torch.distributed as dist

    from ._helpers import init_dist

    init_dist(comm, port)
    r, w = comm.rank, comm.world_size
    wrong = []
    try:
        for dt in A2A_DTYPES:
            for case in ("even", "uneven", "empty"):
                if case == "even":
                    ins = outs = None
                else:
                    # rank q sends rank j (q + 2 j) % 3 rows (0 for some pairs); none if empty
                    def rows(q, j, case=case):
                        return 0 if case == "empty" else (q + 2 * j) % 3

                    ins = [rows(r, j) for j in range(w)]
                    outs = [rows(q, r) for q in range(w)]
                n_in = 2 * w if ins is None else sum(ins)
                n_out = 2 * w if outs is None else sum(outs)
                x = _data(r, dt, n_in * 3).view(n_in, 3) if n_in else torch.empty(0, 3, dtype=dt)
                mine = torch.empty(n_out, 3, dtype=dt)
                comm.all_to_all_single(mine, x, outs, ins)
                theirs = torch.empty(n_out, 3, dtype=dt)
                # gloo moves bytes alike for every dtype: compare through uint8
                if dt.is_complex:
                    xs, ts = torch.view_as_real(x), torch.view_as_real(theirs)
                else:
                    xs, ts = x, theirs
                dist.all_to_all_single(ts, xs.contiguous(), outs, ins)
                if _bytes(mine) != _bytes(theirs):
                    wrong.append((str(dt), case))
    finally:
        dist.destroy_process_group()
    return wrong


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_all_to_all_single_matches_gloo(world):
    import tpcomm

    from ._helpers import free_port

    assert tpcomm.launch(_a2a_against_gloo, world, args=(free_port(),), timeout=500) == [[]] * world
