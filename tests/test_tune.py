"""Tuned profiles (`tpcomm tune`, tpcomm.shm.profile): the switch points follow
from what was measured, every rank uses rank 0's profile, a setting in the
environment still wins, a profile made elsewhere is ignored (logged once), and
tpcomm perf names the algorithm each size used."""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys

import pytest
import torch

from tpcomm import _env, _testing, tune
from tpcomm.shm import profile
from tpcomm.tune import switch_point, window, wins_from, with_float32


def test_switch_point():
    sizes = [1, 2, 3, 4]
    assert switch_point(sizes, [1.1, 1.0, 0.9, 0.8]) == 3
    assert switch_point(sizes, [0.9, 1.1, 0.9, 0.9]) == 3  # from where it keeps winning
    assert switch_point(sizes, [0.9] * 4) == 1
    assert switch_point(sizes, [0.9, 0.9, 0.9, 1.1]) == -1  # loses at the largest: never
    # within the margin (3 %) a ratio is a tie: it neither wins nor stops a win below it
    assert switch_point(sizes, [1.1, 0.99, 0.9, 1.02]) == 3
    assert switch_point(sizes, [0.98, 0.99, 1.01, 1.0]) == -1


def test_wins_from():
    sizes = [1, 2, 3, 4, 5, 6, 7, 8]
    # wins from 5, loses again at 8: from 5 (past it, chosen as calls run)
    assert wins_from(sizes, [1.3, 1.2, 1.1, 1.05, 0.8, 0.5, 0.7, 1.06]) == 5
    assert wins_from(sizes, [1.3, 1.2, 1.1, 1.05, 0.8, 0.5, 0.7, 0.9]) == 5
    assert wins_from(sizes, [1.3] * 8) == -1
    assert wins_from(sizes, [1.0] * 8) == -1  # ties only: never
    # the run with the most wins: 3-5 (two) over 1 (one) and 7-8 (one)
    assert wins_from(sizes, [0.9, 1.1, 0.9, 0.9, 1.0, 1.2, 0.9, 1.0]) == 3


def test_window():
    """A window: of the runs of sizes where the variant never loses by more
    than 3 %, the one where it wins (by 3 %) at the most sizes; from its
    first win to the run's last size, no end where the run reaches the
    largest size (single copy that wins at 4 and 16 MiB, loses at 64 MiB)."""
    sizes = [1, 4, 16, 64]
    assert window(sizes, [1.2, 0.8, 0.85, 1.19]) == (4, 16)
    assert window(sizes, [1.1, 1.0, 0.9, 0.8]) == (16, -1)  # as switch_point, no end
    assert window(sizes, [0.9] * 4) == (1, -1)
    assert window(sizes, [1.0] * 4) == (-1, -1)  # ties only: never
    assert window(sizes, [1.3] * 4) == (-1, -1)
    assert window(sizes, [0.9, 1.02, 1.1, 1.0]) == (1, 4)  # a tie inside, the loss ends it
    # two runs: the one with more wins; on a tie the larger sizes'
    assert window([1, 2, 3, 4, 5, 6], [0.9, 1.1, 0.9, 0.9, 1.2, 0.5]) == (3, 4)
    assert window([1, 2, 3, 4], [0.9, 1.1, 1.0, 0.9]) == (4, -1)


def test_16bit_two_shot_takes_float32s_window_where_it_never_loses():
    """16-bit two-shot goes where float32's does, and every size between the
    two windows, unless its own ratios show a 3 % loss there."""
    sizes = [1, 4, 16, 64]
    # its own ties at 16 (1.02): float32's (16, -1) joins its own (64, -1)
    assert with_float32(sizes, (64, -1), (16, -1), [1.2, 1.1, 1.02, 0.9]) == (16, -1)
    # a 3 % loss at 16: its own only
    assert with_float32(sizes, (64, -1), (16, -1), [1.2, 1.1, 1.04, 0.9]) == (64, -1)
    # never won on its own, ties across float32's window: float32's
    assert with_float32(sizes, (-1, -1), (4, 16), [1.2, 1.0, 0.99, 1.1]) == (4, 16)
    # the sizes between two windows count: a loss at 4 keeps them apart
    assert with_float32(sizes, (16, 16), (1, 1), [0.9, 1.05, 0.9, 1.2]) == (16, 16)
    assert with_float32(sizes, (16, 16), (1, 1), [0.9, 1.0, 0.9, 1.2]) == (1, 16)
    # float32 never two-shot: its own, whatever it is
    assert with_float32(sizes, (64, -1), (-1, -1), [1.2, 1.1, 1.1, 0.9]) == (64, -1)
    assert with_float32(sizes, (-1, -1), (-1, -1), [1.2] * 4) == (-1, -1)


def test_the_edges_of_a_window_are_measured_twice():
    """A window's first win and the loss that ends it are measured again, the
    repetitions joined, and the rule run again on all of them until every
    edge it gives has been measured twice: a first win that the second
    measurement undoes moves the window to the next size, which is then
    measured again itself."""
    sizes = [1, 2, 3, 4, 5]
    first = {1: 1.1, 2: 0.9, 3: 0.9, 4: 0.9, 5: 1.2}  # non-temporal / cached, 3 repetitions
    again = {2: 1.2, 3: 0.92, 5: 1.1}  # the second measurement's
    times = {s: {"cached": [1.0] * 3, "non-temporal": [r] * 3} for s, r in first.items()}
    res = {"nt_stores": times}
    assert window(sizes, [first[s] for s in sizes]) == (2, 4)
    asked = []

    def measure(cfg: dict) -> dict:
        (size,) = cfg["sizes"]
        asked.append((cfg["only"], size))
        return {"nt_stores": {size: {"cached": [1.0] * 3, "non-temporal": [again[size]] * 3}}}

    class Out:
        text = ""

        def write(self, s: str) -> None:
            self.text += s

    out = Out()
    tune._confirm(measure, {"sizes": sizes}, res, tune._copy_edges, out)
    # 2: 0.9 then 1.2, the median of the six 1.05: a loss, so the window starts
    # at 3 (0.9 and 0.92: a win); 5 ends it both times
    assert asked == [("nt_stores", 2), ("nt_stores", 3), ("nt_stores", 5)]
    assert [len(res["nt_stores"][s]["non-temporal"]) for s in sizes] == [3, 6, 6, 3, 6]
    rs = [statistics.median(res["nt_stores"][s]["non-temporal"]) for s in sizes]
    assert window(sizes, rs) == (3, 4)
    assert "nt_stores 2 bytes, non-temporal / cached 0.90 -> 1.05 (6 repetitions)" in out.text
    assert "nt_stores 3 bytes, non-temporal / cached 0.90 -> 0.91 (6 repetitions)" in out.text
    assert tune._window_edges(sizes, (3, 4)) == [3, 5]
    assert tune._window_edges(sizes, (3, -1)) == [3] and tune._window_edges(sizes, (-1, -1)) == []


def _with_float32(sizes: list, own: tuple, f32: tuple, rs: list) -> tuple:
    """with_float32's rule again, written another way (the test's reference):
    the sizes either window covers, filled between, if none loses by 3 %."""

    def covers(w: tuple, s: int) -> bool:
        return w[0] >= 0 and w[0] <= s and (w[1] < 0 or s <= w[1])

    if f32[0] < 0:
        return own
    idx = [i for i, s in enumerate(sizes) if covers(own, s) or covers(f32, s)]
    if not idx:
        return own
    first, last = idx[0], idx[-1]
    if any(rs[i] > 1.03 for i in range(first, last + 1)):
        return own
    open_end = (own[0] >= 0 and own[1] < 0) or f32[1] < 0
    return sizes[first], -1 if open_end else sizes[last]


def _window(sizes: list, rs: list) -> tuple:
    """The rule again, written another way (the test's reference): every
    stretch of sizes bounded by losses, scored by its wins."""
    best = (0, -1, -1)
    start = 0
    for end in range(len(sizes) + 1):
        if end == len(sizes) or rs[end] > 1.03:
            wins = [i for i in range(start, end) if rs[i] <= 0.97]
            if wins and len(wins) >= best[0]:
                hi = -1 if end == len(sizes) else sizes[end - 1]
                best = (len(wins), sizes[wins[0]], hi)
            start = end + 1
    return best[1:]


def _profile(path, worlds, **machine) -> str:
    prof = {
        "format": profile.FORMAT,
        "machine": {**profile.machine(), **machine},
        "command": "test",
        "worlds": worlds,
        "measured": {},
    }
    path.write_text(json.dumps(prof))
    return str(path)


def engines_under_profiles(comm, paths, explicit):
    """Rank r reads paths[r] when a dup() is made; only rank 0's counts."""
    os.environ["TPCOMM_PROFILE"] = paths[comm.rank]
    for k, v in explicit.items():
        os.environ[k] = v
    try:
        d = comm.dup()
        try:
            eng = _testing.engine(d)
            # what the engine does: rounds of one bfloat16 and one float32 all_reduce of 64 KiB
            rounds = []
            for dt in (torch.bfloat16, torch.float32):
                before = _testing.rounds(d)
                d.all_reduce(torch.ones(65536 // dt.itemsize, dtype=dt))
                rounds.append(_testing.rounds(d) - before)
            half = eng.twoshot_min16
            s = eng.current
            copies = (s.nt_min, s.threads_min, s.chunk_min, s.chunk_bytes, s.zc_min, s.zc_max)
            ends = (s.twoshot_max, s.twoshot_max16, s.cma_ar_max, s.nt_max)
            return (
                eng.twoshot_min,
                eng.cma_ar_min,
                eng.cma_min,
                eng.tuned,
                half,
                rounds,
                copies,
                ends,
            )
        finally:
            d.close()
    finally:
        os.environ.pop("TPCOMM_PROFILE")
        for k in explicit:
            os.environ.pop(k)


def test_every_rank_uses_rank_0s_profile(pools, tmp_path):
    mine = {
        "twoshot_min_bytes": 1 << 20,
        "twoshot_min_bytes_16bit": 4096,
        "cma_allreduce_min_bytes": 3 << 20,
        "cma_min_bytes": 5 << 20,
        "nt_min_bytes": 2 << 20,
        "threads_min_bytes": 6 << 20,
        "chunk_min_bytes": 7 << 20,
        "chunk_bytes": 128 << 10,
        "zero_copy_min_bytes": 8 << 20,
        "zero_copy_max_bytes": 9 << 20,
        "twoshot_max_bytes": 11 << 20,
        "twoshot_max_bytes_16bit": 12 << 20,
        "cma_allreduce_max_bytes": 13 << 20,
        "nt_max_bytes": 14 << 20,
    }
    other = {"twoshot_min_bytes": 0, "cma_allreduce_min_bytes": -1, "cma_min_bytes": -1}
    paths = [
        _profile(tmp_path / "a.json", {"2": mine}),
        _profile(tmp_path / "b.json", {"2": other}),
    ]
    res = pools.run(2, engines_under_profiles, paths, {})
    want = (mine["twoshot_min_bytes"], mine["cma_allreduce_min_bytes"], mine["cma_min_bytes"])
    assert [r[:3] for r in res] == [want, want]
    assert res[1][3] == mine  # what rank 0 sent
    # 64 KiB: bfloat16 two-shot (two rounds) from 4 KiB, float32 one-shot below 1 MiB
    assert [r[4:6] for r in res] == [(4096, [2, 1])] * 2
    # the stores', threads' and chunks' points, rank 0's chunk, zero copy's window
    assert [r[6] for r in res] == [(2 << 20, 6 << 20, 7 << 20, 128 << 10, 8 << 20, 9 << 20)] * 2
    # the windows' ends
    assert [r[7] for r in res] == [(11 << 20, 12 << 20, 13 << 20, 14 << 20)] * 2
    # a profile for world 2 serves world 3 too (the largest world measured up to
    # it), but for two-shot's window, whose cost at world 2 says nothing of 3:
    # there the default
    res = pools.run(3, engines_under_profiles, paths + paths[:1], {})
    assert [r[:2] for r in res] == [(_env.twoshot_min_bytes(3), want[1])] * 3
    assert [r[4] for r in res] == [_env.twoshot_min_bytes(3)] * 3  # 16-bit's too
    # a setting in the environment wins over the profile, on the ranks that set it
    env = {"TPCOMM_ALLREDUCE_ALGO": "one_shot", "TPCOMM_CMA_MIN_BYTES": "-1"}
    env.update(TPCOMM_NT_MIN_BYTES="-1", TPCOMM_THREADS_MIN_BYTES="4096")
    env.update(TPCOMM_CHUNK_MIN_BYTES="-1", TPCOMM_ZERO_COPY_MIN_BYTES="0")
    env.update(TPCOMM_CMA_ALLREDUCE_MAX_BYTES="-1", TPCOMM_NT_MAX_BYTES=str(15 << 20))
    res = pools.run(2, engines_under_profiles, paths, env)
    assert [r[:2] for r in res] == [(-1, mine["cma_allreduce_min_bytes"])] * 2
    assert [r[4:6] for r in res] == [(-1, [1, 1])] * 2
    assert [r[6] for r in res] == [(-1, 4096, -1, 128 << 10, 0, 9 << 20)] * 2
    # TPCOMM_ALLREDUCE_ALGO given: two-shot's window has no end either
    assert [r[7] for r in res] == [(-1, -1, -1, 15 << 20)] * 2


def test_a_profile_made_elsewhere_is_ignored_and_said_once(tmp_path, caplog, monkeypatch):
    path = _profile(tmp_path / "p.json", {"2": {"twoshot_min_bytes": 0}}, cpu="Another CPU")
    prof, why = profile.read(path)
    assert prof is None and "made for cpu 'Another CPU'" in why
    monkeypatch.setenv("TPCOMM_PROFILE", path)
    with caplog.at_level(logging.WARNING, logger="tpcomm"):
        assert profile.settings(2) == {} and profile.settings(2) == {}
    assert sum("tuned profile ignored" in r.message for r in caplog.records) == 1
    older = _profile(tmp_path / "q.json", {"2": {"twoshot_min_bytes": 0}}, tpcomm="0.0.1")
    assert "made for tpcomm '0.0.1'" in profile.read(older)[1]
    (tmp_path / "bad.json").write_text("{not json")
    assert "unreadable" in profile.read(str(tmp_path / "bad.json"))[1]
    monkeypatch.setenv("TPCOMM_PROFILE", "0")
    assert profile.read()[0] is None and profile.settings(2) == {}


def test_settings_from_rank_0_are_checked():
    assert profile.decode(profile.encode({"twoshot_min_bytes": 4096})) == {
        "twoshot_min_bytes": 4096
    }
    assert profile.decode("") == {}
    for junk in ("rm=1", "twoshot_min_bytes=x", "twoshot_min_bytes=-5", "cma_min_bytes=1e9"):
        with pytest.raises(ValueError):
            profile.decode(junk)


def test_tune_writes_the_switch_points_of_what_it_measured(tmp_path):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "tpcomm", "tune", "-N", "2", "-b", "16K", "-e", "1M", "-f", "8"]
    # 2 threads per rank, measured against one even where they share the cores
    cmd += ["-R", "3", "--target", "0.005", "--threads", "2", "--no-pin", "-o", str(out)]
    env = {**os.environ, "TPCOMM_CHUNK_BYTES": "65536"}  # chunks measured from 128 KiB
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "profile written to" in r.stdout and "fastest" in r.stdout
    assert "a plain 1 MiB all_reduce:" in r.stdout and "us after" in r.stdout
    prof, why = profile.read(str(out))
    assert prof is not None, why
    got, res = prof["worlds"]["2"], prof["measured"]["2"]
    before, after = res["reference_s"]  # the machine's speed around the measurements
    assert before > 0 and after > 0
    assert ("changed speed" in r.stdout) == bool(profile.steadiness(before, after))
    sizes = [16 << 10, 128 << 10, 1 << 20]

    def ratio(coll, s, algo, *base):  # the median of each repetition's own ratio
        t = res[coll][str(s)]
        return statistics.median(
            t[algo][r] / min(t[b][r] for b in base) for r in range(len(t[algo]))
        )

    def point(rs: list) -> int:  # the first clear win (3 %) that no larger size undoes
        for i, s in enumerate(sizes):
            if rs[i] <= 0.97 and all(r <= 1.03 for r in rs[i:]):
                return s
        return -1

    def reps(coll: str, s: int) -> int:  # 3, or 6 where measured again
        (n,) = {len(v) for v in res[coll][str(s)].values()}
        assert n in (3, 6) and min(min(v) for v in res[coll][str(s)].values()) > 0
        return n

    def edges(coll: str, w: tuple) -> None:  # its first size, the size past its end
        if w[0] >= 0:
            assert reps(coll, w[0]) == 6, (coll, w)
            after = [s for s in sizes if w[1] >= 0 and s > w[1]]
            assert all(reps(coll, s) == 6 for s in after[:1])
            assert f"measured again, the edge of a choice: {coll} {w[0]} bytes" in r.stdout

    for coll in ("all_reduce", "all_reduce_bf16", "all_reduce_f16", "all_gather", "nt_stores"):
        assert all(reps(coll, s) in (3, 6) for s in sizes)
    two = [ratio("all_reduce", s, "two-shot", "one-shot") for s in sizes]
    assert (got["twoshot_min_bytes"], got["twoshot_max_bytes"]) == _window(sizes, two)
    edges("all_reduce", _window(sizes, two))

    def both16(s: int) -> float:  # bfloat16's and float16's times summed, per repetition
        b, f = res["all_reduce_bf16"][str(s)], res["all_reduce_f16"][str(s)]
        two = [x + y for x, y in zip(b["two-shot"], f["two-shot"])]
        one = [x + y for x, y in zip(b["one-shot"], f["one-shot"])]
        return statistics.median(t / o for t, o in zip(two, one))

    two16 = [both16(s) for s in sizes]
    own16 = _window(sizes, two16)
    want16 = _with_float32(sizes, own16, _window(sizes, two), two16)
    assert (got["twoshot_min_bytes_16bit"], got["twoshot_max_bytes_16bit"]) == want16
    edges("all_reduce_bf16", want16)  # the window written, both 16-bit floats
    edges("all_reduce_f16", want16)
    if res["single_copy_possible"]:
        sc = [ratio("all_reduce", s, "single-copy", "one-shot", "two-shot") for s in sizes]
        cma_window = (got["cma_allreduce_min_bytes"], got["cma_allreduce_max_bytes"])
        assert cma_window == _window(sizes, sc)
        edges("all_reduce", cma_window)
        ag = [ratio("all_gather", s, "single-copy", "copy") for s in sizes]
        assert got["cma_min_bytes"] == point(ag)
        assert point(ag) < 0 or reps("all_gather", point(ag)) == 6
    else:
        assert "cma_allreduce_min_bytes" not in got
    nt = [ratio("nt_stores", s, "non-temporal", "cached") for s in sizes]
    assert (got["nt_min_bytes"], got["nt_max_bytes"]) == _window(sizes, nt)
    edges("nt_stores", _window(sizes, nt))
    threads = [ratio("threads", s, "threads", "one thread") for s in sizes]
    assert got["threads_min_bytes"] == point(threads) and res["threads_per_rank"] == 2
    zc = [ratio("zero_copy", s, "zero-copy", "copies") for s in sizes]
    # where it starts to win (the rule has its own test above); no end, no
    # "never": past that point rank 0 chooses as calls run
    assert got.get("zero_copy_min_bytes", -1) == wins_from(sizes, zc)
    assert "zero_copy_max_bytes" not in got
    # a slot at a time against 64 KiB at a time, past one chunk only
    assert sorted(res["chunks"], key=int) == [str(128 << 10), str(1 << 20)]
    sizes = sizes[1:]
    chunks = [ratio("chunks", s, "chunks", "slots") for s in sizes]
    assert got["chunk_min_bytes"] == point(chunks)
    assert got.get("chunk_bytes") == (65536 if point(chunks) >= 0 else None)


def test_steadiness_warns_when_the_machine_changed_speed():
    """tpcomm tune times a plain all_reduce before and after its measurements:
    within 1.5x either way is steady; beyond, or a time of 0, a warning that
    gives both times."""
    assert profile.steadiness(60e-6, 60e-6) == ""
    assert profile.steadiness(60e-6, 89e-6) == "" and profile.steadiness(89e-6, 60e-6) == ""
    for before, after in ((60e-6, 91e-6), (250e-6, 61e-6)):
        warning = profile.steadiness(before, after)
        assert warning.startswith("warning:") and "changed speed" in warning
        assert f"{before * 1e6:.1f} us before" in warning
        assert f"{after * 1e6:.1f} us after" in warning
    assert profile.steadiness(0.0, 60e-6).startswith("warning:")


def test_tune_measures_again_while_the_machine_changed_speed():
    """speed_moved is what tune compares with the steadiness limit to measure a
    world again (--tries, the steadiest try kept); --tries must be 1 or more."""
    speed_moved = profile.speed_moved

    assert speed_moved(60e-6, 60e-6) == 1.0
    assert speed_moved(60e-6, 90e-6) == speed_moved(90e-6, 60e-6) == 1.5  # the limit: steady
    assert speed_moved(60e-6, 240e-6) == 4.0 and speed_moved(0.0, 1e-6) == float("inf")
    assert (speed_moved(60e-6, 91e-6) <= profile.STEADY) == (not profile.steadiness(60e-6, 91e-6))
    cmd = [sys.executable, "-m", "tpcomm", "tune", "--tries", "0", "--dry-run"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--tries: 1 or more" in r.stderr, r.stderr[-2000:]


def test_doctor_repeats_the_warning_of_an_unsteady_profile(tmp_path, monkeypatch):
    from tpcomm import doctor

    path = tmp_path / "profile.json"
    measured = {"2": {"reference_s": [60e-6, 250e-6]}, "4": {"reference_s": [60e-6, 61e-6]}}
    profile.write({2: {"twoshot_min_bytes": 1 << 20}, 4: {}}, measured, "tpcomm tune", str(path))
    monkeypatch.setenv("TPCOMM_PROFILE", str(path))
    lines = []
    rep = doctor.Report(lines.append)
    assert doctor._check_profile(rep, 2) == {"twoshot_min_bytes": 1 << 20}
    warned = [line for line in lines if "changed speed" in line]
    assert len(warned) == 1 and "world 2:" in warned[0] and "250.0 us after" in warned[0]


def test_tune_says_threads_were_not_measured_with_one_per_rank(tmp_path):
    cmd = [sys.executable, "-m", "tpcomm", "tune", "-b", "64K", "-e", "64K", "-R", "1"]
    cmd += ["--target", "0.002", "--threads", "1", "--dry-run"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "threads: not measured (1 per rank" in r.stdout and "nt_min_bytes=" in r.stdout
    assert "threads_min_bytes" not in r.stdout and "no profile written" in r.stdout


def test_perf_names_the_algorithm_of_each_size(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "tpcomm", "perf", "all_reduce", "-b", "1K", "-e", "1M"]
    cmd += ["-f", "32", "-n", "10", "-J", str(out)]
    env = {**os.environ, "TPCOMM_PROFILE": "0", "TPCOMM_CMA_ALLREDUCE_MIN_BYTES": str(1 << 20)}
    env.update(TPCOMM_CHUNK_MIN_BYTES=str(1 << 20), TPCOMM_CHUNK_BYTES="65536")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    algos = [row["algorithm"].removesuffix("/nt") for row in rows]  # whatever the stores
    assert algos[:2] == ["one-shot", "one-shot"]  # 1 KiB, 32 KiB: below the 256 KiB default
    # 1 MiB: two-shot in chunks of 64 KiB where single copy is refused
    assert algos[2] in ("single-copy", "two-shot/64K")
    assert all(line.split()[-1].removesuffix("/nt") == a for line, a in zip(_rows(r.stdout), algos))


def _rows(text: str) -> list:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def windows_in_force(comm):
    """The windows as the engine runs them: all_reduce's plan per size, and
    real all_reduces inside and outside a window (rounds: two-shot 2, one-shot 1)."""
    d = comm.dup()
    try:
        eng = _testing.engine(d)
        eng.adjust(twoshot_min=8192, twoshot_max=65536, chunk_min=-1)
        sizes = (4096, 8192, 65536, 131072)
        plans = [eng.all_reduce_plan(n)[0] for n in sizes]
        rounds, sums = [], []
        for n in sizes:
            x = torch.full((n // 4,), float(d.rank + 1))
            before = _testing.rounds(d)
            d.all_reduce(x)
            rounds.append(_testing.rounds(d) - before)
            sums.append(bool((x == 3).all()))
        single = None
        if eng.agree_single_copy(True, 0)[1]:  # where the ranks may read each other
            eng.adjust(cma_ar_min=1 << 20, cma_ar_max=2 << 20)
            single = [eng.all_reduce_plan(n)[0] for n in (512 << 10, 1 << 20, 2 << 20, 4 << 20)]
        eng.restore()
        return plans, rounds, sums, single
    finally:
        d.close()


def test_the_engine_runs_the_windows(pools):
    for plans, rounds, sums, single in pools.run(2, windows_in_force):
        assert plans == ["one-shot", "two-shot", "two-shot", "one-shot"]
        assert rounds == [1, 2, 2, 1] and all(sums)
        if single is not None:
            assert single[1:3] == ["single-copy", "single-copy"]
            assert "single-copy" not in (single[0], single[3])
