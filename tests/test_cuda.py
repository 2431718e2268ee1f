"""tpcomm.cuda.CustomAllreduce on every machine.

* The decisions that need no GPU: why it is disabled, the one-shot/two-shot
  switch, chunking, the capture-count check, the gate of should_custom_ar.
* The disabled paths here (no CUDA): a disabled instance answers None.
* The Triton kernels themselves, run by the Triton interpreter on the CPU
  (TRITON_INTERPRET=1) across real processes whose buffers are tpcomm
  shared memory: one-shot and two-shot all-reduce, all-gather and
  reduce-scatter, compared bit for bit with a float32 sum in rank order and
  across ranks.  The GPU run (CUDA IPC, graphs) is tests/gpu/ via
  scripts/gpu_check.sh, on a machine with a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tpcomm.cuda import (
    CustomAllreduce,
    check_capture_counts,
    choose_algorithm,
    chunks,
    is_weak_contiguous,
    why_disabled,
)

OK = dict(
    world=2, same_host=True, have_cuda=True, have_triton=True, fully_connected=False, p2p_ok=True
)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({}, None),
        ({"have_cuda": False}, "CUDA is not available"),
        ({"have_triton": False}, "Triton is not installed"),
        ({"world": 1}, "world size 1"),
        ({"same_host": False}, "spans hosts"),
        ({"world": 3}, "world size 3 is not one of"),
        ({"world": 16}, "world size 16 is not one of"),
        ({"world": 4}, "not all connected by NVLink"),
        ({"world": 4, "fully_connected": True}, None),
        ({"world": 8, "fully_connected": True, "p2p_ok": False}, "IPC round trip"),
        ({"p2p_ok": None}, None),  # not checked yet: nothing against it so far
    ],
)
def test_why_disabled(change, reason):
    got = why_disabled(**{**OK, **change})
    assert got is None if reason is None else reason in got


def test_algorithm_switch():
    K = 1024
    assert all(choose_algorithm(2, n) == "one_shot" for n in (0, 256 * K, 64 * K * K))
    assert choose_algorithm(4, 512 * K - 1) == "one_shot"
    assert choose_algorithm(4, 512 * K) == "two_shot"
    assert choose_algorithm(6, 256 * K - 1) == "one_shot"
    assert choose_algorithm(8, 256 * K - 1) == "one_shot"
    assert choose_algorithm(8, 256 * K) == "two_shot"
    assert choose_algorithm(2, 1 << 30, "two_shot") == "two_shot"
    assert choose_algorithm(8, 1 << 30, "one_shot") == "one_shot"
    with pytest.raises(ValueError, match="one_shot, two_shot or auto"):
        choose_algorithm(2, 0, "three_shot")


def test_algorithm_switch_from_the_environment(monkeypatch):
    monkeypatch.setenv("TPCOMM_CUDA_ALGO", "two_shot")
    assert choose_algorithm(2, 16) == "two_shot"
    assert choose_algorithm(2, 16, "one_shot") == "one_shot"  # the argument wins
    monkeypatch.setenv("TPCOMM_CUDA_ALGO", "fastest")
    with pytest.raises(ValueError, match="TPCOMM_CUDA_ALGO must be"):
        choose_algorithm(2, 16)


@pytest.mark.parametrize(
    "numel, esize, max_size",
    [(0, 4, 64), (1, 2, 16), (100, 4, 64), (1000, 2, 1024), (4096, 4, 4096), (7, 4, 4)],
)
def test_chunks_cover_exactly(numel, esize, max_size):
    got = chunks(numel, esize, max_size)
    assert got[0][0] == 0 and got[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))  # no gap, no overlap
    assert all((hi - lo) * esize <= max_size for lo, hi in got)
    assert len(got) == max(1, -(-numel * esize // max_size))


def test_chunks_reject_tiny_max_size():
    with pytest.raises(ValueError, match="smaller than one element"):
        chunks(10, 8, 4)


def test_capture_counts():
    check_capture_counts([3, 3, 3])
    with pytest.raises(ValueError, match="rank 0: 3, rank 1: 2"):
        check_capture_counts([3, 2])


def test_weak_contiguity():
    t = torch.empty(8, 4)
    assert is_weak_contiguous(t)
    assert is_weak_contiguous(t[4:])  # the tail of its storage
    assert not is_weak_contiguous(t[:4, :2])
    assert is_weak_contiguous(t.t())  # a permutation of one dense block


def _gate(world=2, fully_connected=False, max_size=1024):
    car = CustomAllreduce.__new__(CustomAllreduce)
    car.disabled, car.world_size, car.fully_connected, car.max_size = (
        False,
        world,
        fully_connected,
        max_size,
    )
    return car


def test_should_custom_ar():
    car = _gate()
    assert car.should_custom_ar(torch.empty(4))  # 16 bytes
    assert car.should_custom_ar(torch.empty(8, dtype=torch.bfloat16))
    assert not car.should_custom_ar(torch.empty(3))  # 12 bytes: not a 16-byte multiple
    assert not car.should_custom_ar(torch.empty(4, dtype=torch.float64))
    assert not car.should_custom_ar(torch.empty(4, dtype=torch.int32))
    assert not car.should_custom_ar(torch.empty(256))  # 1024 bytes: not below max_size
    assert car.should_custom_ar(torch.empty(252))
    assert not car.should_custom_ar(torch.empty(8, 8)[:, :4])  # not weakly contiguous
    assert not car.should_custom_ar(torch._neg_view(torch.empty(4)))  # memory holds -values
    assert not _gate(world=4).should_custom_ar(torch.empty(4))  # 4 GPUs over PCIe
    assert _gate(world=4, fully_connected=True).should_custom_ar(torch.empty(4))
    car.disabled = True
    assert not car.should_custom_ar(torch.empty(4))


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of 16"):
        CustomAllreduce(None, "cuda:0", max_size=1000)
    with pytest.raises(ValueError, match="positive int"):
        CustomAllreduce(None, "cuda:0", max_size=0)
    with pytest.raises(ValueError, match="one_shot, two_shot or auto"):
        CustomAllreduce(None, "cuda:0", algorithm="fast")


def _no_cuda_here(comm):
    car = CustomAllreduce(comm, torch.device("cuda", 0))
    out = (car.disabled, car.disabled_reason, car.custom_all_reduce(torch.ones(4)))
    out += (car.custom_all_gather(torch.ones(4)), car.custom_reduce_scatter(torch.ones(4)))
    try:
        car.all_reduce(torch.ones(4))
        err = None
    except RuntimeError as e:
        err = str(e)
    car.close()
    car.close()
    return out + (err, repr(car))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_disabled_without_cuda(pools):
    for disabled, reason, ar, ag, rs, err, text in pools.run(2, _no_cuda_here):
        assert disabled and reason == "CUDA is not available"
        assert ar is None and ag is None and rs is None
        assert "disabled (CUDA is not available)" in err and "disabled" in text


def _world_one(comm):
    car = CustomAllreduce(comm, 0)
    return car.disabled, car.disabled_reason


def test_disabled_at_world_size_one(pools):
    assert pools.run(1, _world_one) == [(True, "world size 1: nothing to reduce")]


# -- the kernels, under the Triton interpreter -------------------------------------

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="the kernel tests need Triton (pip install triton)",
)


JOBS = ("kernels:2", "kernels:4", "hosts:2", "size:3")


@pytest.fixture(scope="module")
def interpreted():
    """Every interpreter job in one fresh process (Triton and the forkserver start once)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "tests._cuda_interp", *JOBS]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@needs_triton
@pytest.mark.timeout(600)  # the first test also pays the fixture: ~30 s quiet, 60 s loaded
@pytest.mark.parametrize("world", [2, 4])
def test_kernels_under_the_interpreter(interpreted, world):
    res = interpreted[f"kernels:{world}"]
    for out, _ in res:
        assert len(out) > 10 and all(out.values()), {k: v for k, v in out.items() if not v}
    for _, bits in res[1:]:  # every rank holds the same bits
        assert bits == res[0][1]


@needs_triton
@pytest.mark.timeout(600)  # when run alone it pays the fixture
def test_disabled_across_hosts_and_at_unsupported_sizes(interpreted):
    assert (
        interpreted["hosts:2"]
        == [{"disabled": "the group spans hosts (CUDA IPC works inside one host)"}] * 2
    )
    assert interpreted["size:3"] == [{"disabled": "world size 3 is not one of (2, 4, 6, 8)"}] * 3
