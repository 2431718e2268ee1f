"""`tpcomm doctor` on a healthy set-up and on broken ones: a tiny shm dir, a
missing one, stale segments (found by their liveness locks, removed by --clean)."""

from __future__ import annotations

import argparse
import fcntl
import os
import struct
import subprocess
import sys
import time

from tpcomm import _testing, doctor
from tpcomm.cli import main
from tpcomm.shm.segment import PREFIX

from ._helpers import mount_tiny_tmpfs


def _doctor(*argv):
    """Run the doctor in this process; returns (exit status, its output)."""
    p = argparse.ArgumentParser()
    doctor.add_arguments(p)
    lines = []
    rc = doctor.run(p.parse_args(list(argv)), out=lines.append)
    return rc, "\n".join(lines)


def _fake_segment(directory, name, world, age_s=60.0):
    path = os.path.join(directory, PREFIX + name)
    with open(path, "wb") as f:
        f.write(struct.pack("<QII", _testing.MAGIC, 2, world))
        f.write(b"\0" * 4096)
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_healthy(shm_dir):
    rc, text = _doctor("-n", "2")
    assert rc == 0, text
    assert "healthy: 0 failure(s)" in text
    assert f"shared memory: {shm_dir}" in text and "no stale tpcomm segments" in text
    assert _testing.kernel_isa() in text and "backend 'tpcomm' registered" in text
    assert "all_reduce: shared memory" in text and "one-shot below" in text
    assert "through the slots: a slot (1.0 MiB) at a time (TPCOMM_CHUNK_MIN_BYTES)" in text


def test_doctor_names_the_windows(shm_dir, monkeypatch):
    """Windows of sizes in the doctor's words: from, up to."""
    monkeypatch.setenv("TPCOMM_PROFILE", "0")
    monkeypatch.setenv("TPCOMM_CMA_ALLREDUCE_MIN_BYTES", str(1 << 20))
    monkeypatch.setenv("TPCOMM_CMA_ALLREDUCE_MAX_BYTES", str(16 << 20))
    monkeypatch.setenv("TPCOMM_NT_MIN_BYTES", "65536")
    monkeypatch.setenv("TPCOMM_NT_MAX_BYTES", str(4 << 20))
    rc, text = _doctor("-n", "2")
    assert rc == 0, text
    if "single-copy reads: on" in text or "single copy from" in text:
        assert "single copy from 1.0 MiB up to 16.0 MiB" in text
    assert "non-temporal stores into the slots: from 64.0 KiB up to 4.0 MiB" in text


def test_doctor_names_the_chunks(shm_dir, monkeypatch):
    monkeypatch.setenv("TPCOMM_CHUNK_MIN_BYTES", str(8 << 20))
    monkeypatch.setenv("TPCOMM_CHUNK_BYTES", str(128 << 10))
    rc, text = _doctor("-n", "2")
    assert rc == 0, text
    assert "a slot (1.0 MiB) at a time below 8.0 MiB, 128.0 KiB at a time from there" in text


def test_command_line_exit_status(shm_dir):
    r = subprocess.run(
        [sys.executable, "-m", "tpcomm", "doctor", "-n", "2", "--selftest"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gave the right sums" in r.stdout
    assert main(["doctor", "-n", "0"]) == 2


def test_stale_segments_found_and_cleaned(shm_dir):
    dead = _fake_segment(shm_dir, "h-g-dead", world=3)
    young = _fake_segment(shm_dir, "h-g-young", world=2, age_s=0)  # may be in set-up
    live = _fake_segment(shm_dir, "h-g-live", world=2)
    fd = os.open(live, os.O_RDWR)
    try:
        # a live rank 1: holds its liveness lock, as the engine does
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 1, 1, 0))
        rc, text = _doctor()
        assert rc == 0 and "stale segment " + dead in text
        assert young not in text and live not in text
        rc, text = _doctor("--clean")
        assert rc == 0 and "removed stale segment " + dead in text
        assert not os.path.exists(dead) and os.path.exists(live) and os.path.exists(young)
    finally:
        os.close(fd)
        for p in (dead, young, live):
            if os.path.exists(p):
                os.unlink(p)


def test_tiny_shm_dir_fails_with_the_fix(monkeypatch):
    d = mount_tiny_tmpfs("1m")
    try:
        monkeypatch.setenv("TPCOMM_SHM_DIR", d)
        rc, text = _doctor("-n", "8")
        assert rc == 1, text
        assert "FAIL" in text and "--shm-size" in text and "medium: Memory" in text
        assert "FAILED: 1 failure(s)" in text
    finally:
        subprocess.run(["umount", d], check=False)
        os.rmdir(d)


def test_missing_shm_dir_fails(monkeypatch, tmp_path):
    monkeypatch.setenv("TPCOMM_SHM_DIR", str(tmp_path / "nope"))
    rc, text = _doctor()
    assert rc == 1 and "does not exist" in text
