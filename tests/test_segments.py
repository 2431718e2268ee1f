"""Segments: names, modes, space reservation, header validation, unlink after set-up.

Guards the lifecycle promises: names carry host, group and a fresh random token;
files are created O_EXCL with mode 0600; a shm directory that is too small gives a
clear CommError (bytes needed, how to get them) instead of SIGBUS; the file is gone
from the directory as soon as every rank has mapped it.
"""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile

import pytest

import tpcomm
from tpcomm import _testing
from tpcomm.shm import segment


def test_create_names_modes_and_space(shm_dir):
    p1, fd1 = segment.create(2, 4096, "gtest")
    p2, fd2 = segment.create(2, 4096, "gtest")
    try:
        assert p1 != p2
        name = os.path.basename(p1)
        assert name.startswith(f"tpcomm-{segment.host_tag()}-gtest-")
        assert len(name.rsplit("-", 1)[1]) == 16  # 64-bit random token
        st = os.fstat(fd1)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == _testing.segment_size(2, 4096)
        # reserved, not sparse
        assert st.st_blocks * 512 >= st.st_size
    finally:
        for p, fd in ((p1, fd1), (p2, fd2)):
            os.close(fd)
            segment.unlink_quietly(p)


def test_open_checks_size(shm_dir):
    p, fd = segment.create(2, 4096, "gtest")
    try:
        with pytest.raises(tpcomm.CommError, match="bytes, expected"):
            segment.open_existing(p, 3, 4096)
        with pytest.raises(tpcomm.CommError, match="cannot open segment"):
            segment.open_existing(p + "-missing", 2, 4096)
    finally:
        os.close(fd)
        segment.unlink_quietly(p)


def test_engine_rejects_a_foreign_header(shm_dir):
    """A file that is not a tpcomm segment of this layout is refused on attach."""
    from tpcomm.shm.engine import ShmEngine

    p, fd = segment.create(2, 4096, "gtest")
    try:
        eng = ShmEngine.__new__(ShmEngine)
        eng.rank, eng.world, eng.path = 1, 2, p
        with pytest.raises(tpcomm.CommError, match="magic=0"):
            eng._map(fd, 2, 4096, 0.0, 5.0)  # nobody wrote a header
        eng.close()
    finally:
        os.close(fd)
        segment.unlink_quietly(p)


def _mount_tiny_tmpfs(size: str):
    d = tempfile.mkdtemp(prefix="tpc-tiny-")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d], capture_output=True
    )
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    return d


def test_tiny_shm_dir_gives_clear_error(monkeypatch):
    d = _mount_tiny_tmpfs("64k")
    try:
        monkeypatch.setenv("TPCOMM_SHM_DIR", d)
        with pytest.raises(tpcomm.CommError) as info:
            segment.create(2, 1 << 20, "gtest")
        msg = str(info.value)
        need = _testing.segment_size(2, 1 << 20)
        assert f"needs {need} bytes" in msg and "--shm-size" in msg and d in msg
        assert os.listdir(d) == []
        # through launch: every rank fails set-up with the same message, no crash
        with pytest.raises(tpcomm.LaunchError) as info:
            tpcomm.launch(_noop, 2, timeout=60)
        assert "--shm-size" in str(info.value) and "CommError" in str(info.value)
        assert os.listdir(d) == []
    finally:
        subprocess.run(["umount", d], check=False)
        os.rmdir(d)


def test_fallocate_failure_is_caught(monkeypatch):
    """statvfs can say yes and the reservation still fail (a race with other users)."""
    d = _mount_tiny_tmpfs("256k")
    try:
        monkeypatch.setenv("TPCOMM_SHM_DIR", d)
        real = os.statvfs

        class Big:
            def __init__(self, st):
                self.f_bavail, self.f_frsize = 1 << 30, 4096

        monkeypatch.setattr(os, "statvfs", lambda p: Big(real(p)))
        with pytest.raises(tpcomm.CommError, match="--shm-size"):
            segment.create(2, 1 << 20, "gtest")
        assert os.listdir(d) == []
    finally:
        subprocess.run(["umount", d], check=False)
        os.rmdir(d)


def _noop(comm):
    return comm.rank


def segment_gone(comm):
    eng = comm._engine
    return os.path.exists(eng.path), os.path.dirname(eng.path), _testing.peer_pids(eng)


def test_unlinked_once_everyone_mapped(pools, shm_dir):
    res = pools.run(3, segment_gone)
    for exists, directory, pids in res:
        assert not exists
        assert directory == shm_dir
        assert len(set(pids)) == 3 and all(p > 0 for p in pids)


def test_missing_directory_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TPCOMM_SHM_DIR", str(tmp_path / "nope"))
    with pytest.raises(tpcomm.CommError, match="TPCOMM_SHM_DIR"):
        segment.create(2, 4096, "gtest")
