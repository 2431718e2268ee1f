"""Failures: a dead peer gives PeerFailedError on every survivor within 2 s, never a
hang; a live peer that never joins gives CommTimeoutError; nothing is left in the shm
directory, even after SIGKILL in the middle of a collective."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

import tpcomm
from tpcomm.launch import LocalGroup

from ._helpers import SLACK_S


def _write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def kill_mid_all_reduce(comm, victim, outdir, numel):
    """The victim SIGKILLs itself from another thread while inside large all-reduces."""
    x = torch.ones(numel)
    if comm.rank == victim:

        def die():
            time.sleep(0.3)
            _write(os.path.join(outdir, "killed"), {"t": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die, daemon=True).start()
    calls = 0
    try:
        while True:
            comm.all_reduce(x)
            calls += 1
    except tpcomm.PeerFailedError as e:
        _write(
            os.path.join(outdir, f"rank{comm.rank}"),
            {"t": time.time(), "rank": e.rank, "calls": calls, "msg": str(e)},
        )
        # the communicator stays failed: the next call raises at once
        try:
            comm.all_reduce(torch.ones(4))
        except tpcomm.PeerFailedError as again:
            return again.rank
        return None


@pytest.mark.parametrize("world,victim,numel", [(2, 1, 3 << 20), (3, 0, 1000), (4, 2, 1 << 20)])
def test_sigkill_mid_all_reduce(tmp_path, world, victim, numel):
    with LocalGroup(world, timeout=60) as g, pytest.raises(tpcomm.LaunchError) as info:
        g.run(kill_mid_all_reduce, victim, str(tmp_path), numel, timeout=60)
    assert info.value.rank == victim, info.value
    assert "SIGKILL" in str(info.value)
    killed = json.loads((tmp_path / "killed").read_text())["t"]
    for r in range(world):
        if r == victim:
            continue
        rec = json.loads((tmp_path / f"rank{r}").read_text())
        assert rec["rank"] == victim, rec
        assert rec["calls"] > 0, "the kill should land in the middle of the loop"
        assert rec["t"] - killed < SLACK_S, f"rank {r} took {rec['t'] - killed:.2f}s to notice"
        assert f"rank {victim}" in rec["msg"]


def dies_before_calling(comm):
    if comm.rank == 1:
        os._exit(3)  # leaves without calling the collective at all
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(10))
    except tpcomm.PeerFailedError as e:
        return e.rank, time.monotonic() - t0
    return None


def test_peer_exits_while_others_wait(tmp_path):
    with LocalGroup(3, timeout=60) as g, pytest.raises(tpcomm.LaunchError) as info:
        g.run(dies_before_calling, timeout=60)
    assert info.value.rank == 1
    assert "exited with code 3" in str(info.value)


def survivors_report(comm, outdir):
    if comm.rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(10))
        res = "no error"
    except tpcomm.PeerFailedError as e:
        res = [e.rank, time.monotonic() - t0]
    _write(os.path.join(outdir, f"rank{comm.rank}"), res)
    return res


def test_survivors_see_peer_failed(tmp_path):
    with LocalGroup(4, timeout=60) as g, pytest.raises(tpcomm.LaunchError):
        g.run(survivors_report, str(tmp_path), timeout=60)
    for r in (0, 2, 3):
        peer, took = json.loads((tmp_path / f"rank{r}").read_text())
        assert peer == 1
        assert took < SLACK_S


def whole_call_survivors(comm, which, outdir):
    """Rank 1 exits while the others wait in a whole-call C entry (the
    Communicator's method is the engine's C function): each survivor records
    the PeerFailedError it got, how long it took, and the method's type."""
    w = comm.world_size
    if comm.rank == 1:
        os._exit(3)
    x = torch.ones(8)
    calls = {
        "all_gather_into_tensor": lambda: comm.all_gather_into_tensor(torch.empty(8 * w), x),
        "reduce_scatter_tensor": lambda: comm.reduce_scatter_tensor(torch.empty(8), x.repeat(w)),
        "gather": lambda: comm.gather(x, 0),
        "gather out=": lambda: comm.gather(x, 2, out=torch.empty(8 * w)),
    }
    t0 = time.monotonic()
    try:
        calls[which]()
        res = "no error"
    except tpcomm.PeerFailedError as e:
        res = [e.rank, time.monotonic() - t0, type(getattr(comm, which.split()[0])).__name__]
    _write(os.path.join(outdir, f"rank{comm.rank}"), res)
    return res


@pytest.mark.parametrize(
    "which", ["all_gather_into_tensor", "reduce_scatter_tensor", "gather", "gather out="]
)
def test_whole_call_entries_see_peer_failed(tmp_path, which):
    with LocalGroup(3, timeout=60) as g, pytest.raises(tpcomm.LaunchError) as info:
        g.run(whole_call_survivors, which, str(tmp_path), timeout=60)
    assert info.value.rank == 1
    for r in (0, 2):
        peer, took, kind = json.loads((tmp_path / f"rank{r}").read_text())
        assert peer == 1
        assert took < SLACK_S
        assert kind == "builtin_function_or_method"


def one_rank_stays_away(comm):
    if comm.rank == 2:
        time.sleep(3.0)  # alive, but never joins the collective
        return "slept"
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(10))
    except tpcomm.CommTimeoutError as e:
        return ["timeout", time.monotonic() - t0, str(e)]
    return "finished"


def test_live_peer_that_never_joins_times_out():
    with LocalGroup(3, timeout=1.0) as g:
        res = g.run(one_rank_stays_away, timeout=60)
    assert res[2] == "slept"
    took = []
    for r in (0, 1):
        kind, t, msg = res[r]
        assert kind == "timeout"
        assert "timed out" in msg or "waited" in msg
        took.append(t)
    # the first rank to time out waited the full second; the other may have
    # started its wait later and learns through the abort word
    assert max(took) > 0.9 and max(took) < 1.0 + SLACK_S, took


def close_then_peer_waits(comm):
    if comm.rank == 0:
        comm.close()
        comm.close()  # idempotent
        try:
            comm.all_reduce(torch.ones(3))
        except tpcomm.CommError as e:
            return ["closed", str(e)]
        return "no error"
    try:
        comm.all_reduce(torch.ones(3))
    except tpcomm.PeerFailedError as e:
        return ["peer", e.rank]
    return "no error"


def test_closed_peer_is_reported_not_waited_for():
    with LocalGroup(2, timeout=60) as g:
        res = g.run(close_then_peer_waits, timeout=60)
    assert res[0][0] == "closed" and "all_reduce" in res[0][1] and "closed" in res[0][1]
    assert res[1] == ["peer", 0]


def raises_on_rank(comm, bad):
    if comm.rank == bad:
        raise KeyError("boom from the user's function")
    comm.all_reduce(torch.ones(3))  # blocks: the bad rank never joins
    return comm.rank


def _rank_processes():
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children() if p.name.startswith("tpcomm-rank")}


def test_launch_reports_the_failing_rank_and_ends_the_others():
    before = _rank_processes()  # the session's worker pools
    t0 = time.monotonic()
    with pytest.raises(tpcomm.LaunchError) as info:
        tpcomm.launch(raises_on_rank, 3, args=(2,), timeout=60)
    assert time.monotonic() - t0 < 30
    err = info.value
    assert err.rank == 2
    assert "KeyError" in err.remote_traceback and "boom" in err.remote_traceback
    assert "rank 2" in str(err)
    # nothing left running
    assert _rank_processes() == before


def interrupted_while_waiting(comm, where):
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def call():
        if where == "all_reduce":
            comm.all_reduce(torch.ones(4))
        elif where == "sendrecv":  # the batch wait of sendrecv (p2p_batch)
            comm.sendrecv([torch.ones(4)], 1 - comm.rank, 1 - comm.rank)
        else:  # the same wait, from sendrecv's one C call (out=)
            comm.sendrecv([torch.ones(4)], 1 - comm.rank, 1 - comm.rank, out=[torch.empty(4)])

    if comm.rank == 1:
        time.sleep(2.0)  # late: rank 0 is waiting when Ctrl-C arrives
        try:
            call()
        except tpcomm.PeerFailedError as e:
            return ["peer", e.rank, "interrupted" in str(e)]
        return "no error"
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        call()
    except KeyboardInterrupt:
        return ["interrupt", time.monotonic() - t0]
    return "no error"


@pytest.mark.parametrize("where", ["all_reduce", "sendrecv", "sendrecv_out"])
def test_ctrl_c_does_not_wait_for_the_timeout(where):
    """A signal handler that raises (Ctrl-C) ends a wait within ~50 ms of running,
    not after TPCOMM_TIMEOUT; the peers are told the rank left."""
    with LocalGroup(2, timeout=60) as g:
        res = g.run(interrupted_while_waiting, where, timeout=60)
    kind, took = res[0]
    assert kind == "interrupt" and took < SLACK_S, res[0]  # the timeout: 60 s
    assert res[1] == ["peer", 0, True]


def dies_with_a_forked_helper(comm, outdir):
    """Rank 0 forks a helper that outlives it (a DataLoader worker, a tokenizer
    process), then is SIGKILLed: the helper must not keep it looking alive."""
    if comm.rank == 0:
        pid = os.fork()
        if pid == 0:  # the helper: inherits the mapping and descriptors, then sleeps
            time.sleep(60)
            os._exit(0)
        _write(os.path.join(outdir, "helper"), pid)
        time.sleep(0.3)
        _write(os.path.join(outdir, "killed"), time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(torch.ones(16))
    except tpcomm.PeerFailedError as e:
        _write(os.path.join(outdir, "rank1"), [e.rank, time.time()])
    return None


def test_a_forked_helper_does_not_keep_a_dead_rank_alive(tmp_path):
    try:
        with LocalGroup(2, timeout=60) as g, pytest.raises(tpcomm.LaunchError) as info:
            g.run(dies_with_a_forked_helper, str(tmp_path), timeout=60)
        assert info.value.rank == 0
        killed = json.loads((tmp_path / "killed").read_text())
        rank, t = json.loads((tmp_path / "rank1").read_text())
        assert rank == 0
        assert t - killed < SLACK_S, f"rank 1 took {t - killed:.2f}s to notice"
    finally:
        helper = tmp_path / "helper"
        if helper.exists():
            try:
                os.kill(json.loads(helper.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def forked_child_uses_the_parent_communicator(comm):
    """A forked child cannot use its parent's communicator (a clear error, nothing
    touched); its exit, finalizers and close() included, leaves the parent's intact."""
    child_said = None
    # the private gloo group exists (float64 goes to it): the child inherits it
    # without its threads and must never destroy it (it used to hang there)
    comm.all_reduce(torch.ones(2, dtype=torch.float64))
    if comm.rank == 0:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            msgs = []
            for call in (
                lambda: comm.all_reduce(torch.ones(4)),
                lambda: comm.all_gather(torch.ones(4)),
                lambda: comm.send([torch.ones(2)], dst=1),
                lambda: comm.barrier(),
            ):
                try:
                    call()
                    msgs.append("no error")
                except tpcomm.CommError as e:
                    msgs.append(str(e))
            comm.close()
            os.write(w, json.dumps(msgs).encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            child_said = json.loads(f.read())
        os.waitpid(pid, 0)
    x = comm.all_reduce(torch.full((5,), float(comm.rank + 1)))
    return child_said, x.tolist(), comm.all_gather(torch.ones(2) * comm.rank).tolist()


def test_a_forked_child_cannot_use_the_parent_communicator(pools):
    res = pools.run(2, forked_child_uses_the_parent_communicator)
    said = res[0][0]
    assert len(said) == 4
    for msg in said:
        assert "a child made by fork() cannot use its parent's Communicator" in msg, msg
    for _, summed, gathered in res:  # the parent's communicator is intact
        assert summed == [3.0] * 5 and gathered == [0.0, 0.0, 1.0, 1.0]
