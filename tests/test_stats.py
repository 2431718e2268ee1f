"""The record of rounds and waits (Communicator.stats, TPCOMM_STATS, `tpcomm
doctor --stats`): counts that match the calls made, waits that a late peer
sends to sleep, lateness measured only when switched on, files written at
close, and the doctor printing them."""

from __future__ import annotations

import argparse
import os
import time

import torch

import tpcomm
from tpcomm import doctor, stats

CALLS = 40


def _late_peer(comm):
    """Rank 1 arrives 3 ms late at every other all_reduce: rank 0 waits past
    its yields (1 ms) and sleeps."""
    x = torch.ones(256)
    comm.stats(reset=True)
    for i in range(CALLS):
        if comm.rank == 1 and i % 2:
            time.sleep(0.003)
        comm.all_reduce(x)
    comm.barrier()
    return comm.stats(), float(x[0])


def test_the_record_counts_rounds_and_waits(tmp_path, monkeypatch):
    out = tmp_path / "stats"
    monkeypatch.setenv("TPCOMM_STATS", str(out))
    res = tpcomm.launch(_late_peer, world_size=2, timeout=120)
    for rank, (rec, value) in enumerate(res):
        assert value == 2.0**CALLS  # the sums themselves: 1+1, doubled each call
        assert rec["rank"] == rank and rec["world_size"] == 2
        assert rec["rounds"] == {"all_reduce": CALLS, "barrier": 1}, rec
        assert rec["instant"] + rec["waits"] == CALLS + 1
        assert rec["stamped"] is True
        assert sum(rec["ended"].values()) == rec["waits"]
    rec0 = res[0][0]
    # rank 0 waited 3 ms for half the calls: those ended asleep, seen late by
    # the futex wake-up, and the time waited covers the naps
    assert rec0["ended"]["sleep"] >= CALLS // 2 - 2, rec0
    assert rec0["sleeps"] >= rec0["ended"]["sleep"]
    assert rec0["wait_us"] >= (CALLS // 2) * 2000, rec0
    assert rec0["late"]["sleep"]["n"] >= CALLS // 2 - 2
    assert 0 < rec0["late"]["sleep"]["mean_us"] < 3000
    # the files written at close, one per rank, read back by the doctor
    records = stats.read_dir(str(out))
    assert sorted(r["rank"] for _, r in records) == [0, 1]
    p = argparse.ArgumentParser()
    doctor.add_arguments(p)
    lines = []
    assert doctor.run(p.parse_args(["--stats", str(out)]), out=lines.append) == 0
    text = "\n".join(lines)
    assert "rank 0/2" in text and "rank 1/2" in text and "asleep" in text


def _plain(comm):
    x = torch.ones(16)
    for _ in range(5):
        comm.all_reduce(x)
    rec = comm.stats()
    comm.close()
    return rec, comm.stats() == comm._final_stats


def test_without_tpcomm_stats_nothing_is_stamped_or_written(tmp_path, monkeypatch):
    monkeypatch.delenv("TPCOMM_STATS", raising=False)
    monkeypatch.chdir(tmp_path)
    for rec, kept in tpcomm.launch(_plain, world_size=2, timeout=120):
        assert rec["rounds"]["all_reduce"] == 5
        assert rec["stamped"] is False and rec["late"]["spin"]["n"] == 0
        assert kept  # after close: the record at close
    assert os.listdir(tmp_path) == []
