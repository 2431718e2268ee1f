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

import pytest

import tpcomm
from tpcomm import _testing
from tpcomm.shm import segment

from ._helpers import mount_tiny_tmpfs


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
    from tpcomm.shm.settings import settings_for

    p, fd = segment.create(2, 4096, "gtest")
    try:
        eng = ShmEngine(1, 2, 5.0)
        eng.path = p
        with pytest.raises(tpcomm.CommError, match="magic=0"):
            eng.map(fd, 4096, 0.0, settings_for(2, 4096), False)  # nobody wrote a header
        eng.close()
    finally:
        os.close(fd)
        segment.unlink_quietly(p)


def test_tiny_shm_dir_gives_clear_error(monkeypatch):
    d = mount_tiny_tmpfs("64k")
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
    d = mount_tiny_tmpfs("256k")
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
    eng = _testing.engine(comm)
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


def test_a_peer_names_a_token_never_a_path(shm_dir):
    """What a peer publishes (the store, or a symmetric buffer's slot) is only the
    random token of a name; the directory is this rank's setting and the name
    tpcomm's pattern, so no value can point a rank at another file."""
    for bad in ("../../etc/passwd", "/tmp/victim", "0123456789abcdeF", "0123456789abcde", ""):
        with pytest.raises(tpcomm.CommError, match="not 16 hex digits: refused"):
            segment.derive("g1", bad)
    path = segment.derive("g1", "0123456789abcdef")
    assert os.path.dirname(path) == shm_dir
    assert os.path.basename(path) == f"tpcomm-{segment.host_tag()}-g1-0123456789abcdef"
    p, fd = segment.create(2, 4096, "g1")
    os.close(fd)
    assert segment.derive("g1", segment.token_of(p)) == p
    os.unlink(p)


def test_a_peer_segment_is_checked_before_a_byte_is_written(shm_dir, tmp_path):
    """A file at a segment's name that tpcomm did not make (a symbolic link to a
    victim, another mode, no header, a directory) is refused with a CommError
    before anything is written to it, and is left where it is: a store value used
    to make a rank write into, then delete, any file of its user."""
    need = segment.segment_size(2, 4096)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * (need // 8))

    def name(token: str) -> str:
        return segment.derive("g2", token)

    cases = []
    link = name("00000000000000aa")
    os.symlink(victim, link)
    cases.append((link, "symbolic link"))
    loose = name("00000000000000bb")
    with open(loose, "wb") as f:
        f.write(b"\0" * need)
    os.chmod(loose, 0o644)
    cases.append((loose, "mode 644"))
    blank = name("00000000000000cc")
    with open(blank, "wb") as f:
        f.write(b"\0" * need)
    os.chmod(blank, 0o600)
    cases.append((blank, "not a tpcomm segment"))
    folder = name("00000000000000dd")
    os.mkdir(folder)
    cases.append((folder, "segment"))

    def content(path: str):
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            return f.read()

    for path, words in cases:
        before = content(path)
        with pytest.raises(tpcomm.CommError, match=words):
            segment.open_existing(path, 2, 4096)
        assert os.path.lexists(path), path  # not unlinked
        assert content(path) == before, path  # not written
    assert victim.read_bytes() == b"precious" * (need // 8)
    os.unlink(link)
    os.unlink(loose)
    os.unlink(blank)
    os.rmdir(folder)


def test_a_published_slot_size_is_checked():
    from tpcomm.shm.setup import _published_slot

    assert _published_slot("1048576") == 1 << 20
    for bad in ("9223372036854775808", "4097", "0", "-4096", "x", ""):
        with pytest.raises(tpcomm.CommError, match="published slot size"):
            _published_slot(bad)
