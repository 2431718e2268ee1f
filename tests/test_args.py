"""Bad arguments and mismatched calls.

Bad arguments raise TypeError/ValueError/CommError with the function name and the
values in the message, before the shared memory is touched (the round counter does
not move, the communicator stays usable).  Ranks that call with a different op,
dtype or element count all get a ValueError naming both sides, and no tensor is
written.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import tpcomm
from tpcomm import _testing

from ._helpers import SLACK_S, script_ranks, unexpected_errors


class NotATensor:
    pass


class MyTensor(torch.Tensor):
    pass


def _quantized():
    import warnings

    with warnings.catch_warnings():  # torch deprecates making them, not having them
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)


def quantized_everywhere(comm):
    """Every collective refuses a quantized tensor before touching anything: its
    bytes without its scale and zero point mean nothing on another rank."""
    q = _quantized()
    w, r = comm.world_size, comm.rank
    calls = {
        "all_gather": lambda: comm.all_gather(q),
        "all_gather_into_tensor": lambda: comm.all_gather_into_tensor(torch.empty(4 * w), q),
        "gather": lambda: comm.gather(q),
        "broadcast": lambda: comm.broadcast(q, 0),
        "reduce_scatter": lambda: comm.reduce_scatter(q),
        "sendrecv": lambda: comm.sendrecv([q], (r + 1) % w, (r - 1) % w),
    }
    out = []
    for fn, call in calls.items():
        r0 = _testing.rounds(comm)
        try:
            call()
            out.append(f"{fn}: no error")
        except ValueError as e:
            if not str(e).startswith(fn) or "quantized" not in str(e):
                out.append(f"{fn}: {e}")
        if _testing.rounds(comm) != r0:
            out.append(f"{fn}: touched shared memory")
    x = torch.ones(3)
    comm.all_reduce(x)
    return out, x.tolist()


def test_quantized_tensors_are_refused_by_every_collective(pools):
    assert pools.run(2, quantized_everywhere) == [([], [2.0] * 3)] * 2


def bad_arguments(comm):
    cases = [
        ((NotATensor(),), TypeError, "tensor must be a torch.Tensor"),
        (([1.0, 2.0],), TypeError, "tensor must be a torch.Tensor"),
        (
            (torch.ones(3, dtype=torch.int32), tpcomm.ReduceOp.AVG),
            TypeError,
            "AVG needs a floating",
        ),
        ((torch.ones(3), "sum"), TypeError, "op must be a tpcomm.ReduceOp"),
        ((torch.ones(3), 0), TypeError, "op must be a tpcomm.ReduceOp"),
        ((torch.ones(3, device="meta"),), ValueError, "must be a CPU tensor"),
        ((torch.ones(1).expand(4),), ValueError, "has elements that share memory"),
        ((_quantized(),), ValueError, "is quantized (torch.qint8)"),
    ]
    out = []
    for args, exc, text in cases:
        r0 = _testing.rounds(comm)
        try:
            comm.all_reduce(*args)
            out.append(f"{text}: no error")
        except exc as e:
            msg = str(e)
            if "all_reduce" not in msg or text not in msg:
                out.append(f"bad message for {text}: {msg}")
        except Exception as e:  # wrong type
            out.append(f"{text}: raised {type(e).__name__}: {e}")
        if _testing.rounds(comm) != r0:
            out.append(f"{text}: touched shared memory")
    try:
        comm.all_reduce()
        out.append("no-arg: no error")
    except TypeError:
        pass
    # a sparse tensor is summed by torch.distributed (gloo's sparse all-reduce)
    sp = torch.tensor([0.0, 2.0, 0.0, 1.0]).to_sparse()
    comm.all_reduce(sp)
    want = torch.tensor([0.0, 2.0, 0.0, 1.0]) * comm.world_size
    if not (sp.is_sparse and torch.equal(sp.to_dense(), want)):
        out.append(f"sparse all_reduce: {sp}")
    # a Tensor subclass takes the checked path and works
    x = torch.ones(4).as_subclass(MyTensor)
    comm.all_reduce(x)
    if not torch.equal(torch.Tensor(x), torch.full((4,), float(comm.world_size))):
        out.append("subclass result wrong")
    # still usable
    y = torch.ones(5)
    comm.all_reduce(y)
    if not torch.equal(y, torch.full((5,), float(comm.world_size))):
        out.append("unusable after errors")
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_bad_arguments(pools, world):
    for problems in pools.run(world, bad_arguments):
        assert problems == []


def mismatched(comm, what):
    r = comm.rank
    if what == "numel":
        x = torch.full((10 + (r == 1),), float(r + 1))
        op = tpcomm.ReduceOp.SUM
    elif what == "dtype":
        x = torch.full((10,), r + 1, dtype=torch.float32 if r != 1 else torch.int32)
        op = tpcomm.ReduceOp.SUM
    elif what == "op":
        x = torch.full((10,), float(r + 1))
        op = tpcomm.ReduceOp.MAX if r == 1 else tpcomm.ReduceOp.SUM
    elif what == "large":  # a chunked call against a small one
        x = torch.full(((3 << 20) if r == 1 else 5,), float(r + 1))
        op = tpcomm.ReduceOp.SUM
    before = x.clone()
    try:
        comm.all_reduce(x, op)
        result = "no error"
    except ValueError as e:
        result = str(e)
    untouched = torch.equal(x, before)
    # the communicator is still in step afterwards
    y = torch.ones(3)
    comm.all_reduce(y)
    return result, untouched, y.tolist()


@pytest.mark.parametrize("what", ["numel", "dtype", "op", "large"])
def test_mismatch_raises_on_every_rank(pools, what):
    world = 3
    results = pools.run(world, mismatched, what)
    for r, (msg, untouched, y) in enumerate(results):
        assert msg.startswith("all_reduce: mismatched collective"), msg
        assert "rank 1 called" in msg or (r == 1 and "rank 1 called" in msg), msg
        assert untouched, f"rank {r}: tensor written despite the mismatch"
        assert y == [world] * 3
    # rank 0 names its own call and rank 1's
    msg0 = results[0][0]
    if what == "numel":
        assert "numel=10" in msg0 and "numel=11" in msg0
    elif what == "dtype":
        assert "torch.float32" in msg0 and "torch.int32" in msg0
    elif what == "op":
        assert "op=SUM" in msg0 and "op=MAX" in msg0


def barrier_vs_all_reduce(comm):
    try:
        if comm.rank == 0:
            comm.barrier()
        else:
            comm.all_reduce(torch.ones(2))
        return "no error"
    except ValueError as e:
        return str(e)


def test_different_collectives_are_a_mismatch(pools):
    for msg in pools.run(2, barrier_vs_all_reduce):
        assert "mismatched collective" in msg and "barrier()" in msg and "all_reduce(" in msg


def closed_use(comm):
    comm.close()
    out = []
    for call in (lambda: comm.all_reduce(torch.ones(2)), comm.barrier):
        try:
            call()
            out.append("no error")
        except tpcomm.CommError as e:
            out.append(str(e))
    return out


def test_closed_communicator():
    for msgs in tpcomm.launch(closed_use, 2, timeout=60):
        assert msgs[0] == "all_reduce: the Communicator is closed"
        assert msgs[1] == "barrier: the Communicator is closed"


def copies(comm):
    import copy
    import pickle

    out = []
    for call in (lambda: pickle.dumps(comm), lambda: copy.copy(comm), lambda: copy.deepcopy(comm)):
        try:
            call()
            out.append("no error")
        except TypeError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_communicator_cannot_be_pickled_or_copied(pools, world):
    for msgs in pools.run(world, copies):
        assert len(msgs) == 3
        for m in msgs:
            assert m.startswith("Communicator cannot be pickled or copied"), m


def written_views(comm):
    """Every call that writes into a tensor refuses one whose elements share
    memory (an expand()ed view) before anything is touched, on every rank."""
    w, other = comm.world_size, 1 - comm.rank
    shared = torch.zeros(1).expand(2 * w)
    cases = [
        (lambda: comm.broadcast(shared, 0), ValueError, "broadcast: tensor has elements"),
        (
            lambda: comm.all_gather_into_tensor(shared, torch.ones(2)),
            ValueError,
            "all_gather_into_tensor: output has elements",
        ),
        (
            lambda: comm.reduce_scatter_tensor(torch.zeros(1).expand(2), torch.ones(2 * w)),
            ValueError,
            "reduce_scatter_tensor: output has elements",
        ),
        (
            lambda: comm.all_to_all_single(shared, torch.ones(2 * w)),
            ValueError,
            "all_to_all_single: output has elements",
        ),
        (lambda: comm.recv(other, out=[shared]), ValueError, "recv: tensors[0] has elements"),
        (
            lambda: comm.recv(other, out=[torch.zeros(8)[::2]]),
            ValueError,
            "recv: out tensors must be dense",
        ),
        (
            lambda: comm.sendrecv([torch.ones(2)], other, other, out=[shared]),
            ValueError,
            "sendrecv: tensors[0] has elements",
        ),
    ]
    r0 = _testing.rounds(comm)
    problems = unexpected_errors(cases)
    if _testing.rounds(comm) != r0:
        problems.append("touched shared memory")
    y = comm.all_reduce(torch.ones(2))
    return problems, y.tolist()


def test_written_tensors_must_own_their_elements(pools):
    for problems, y in pools.run(2, written_views):
        assert problems == [] and y == [2.0, 2.0]


def test_launch_arguments():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        tpcomm.launch(closed_use, 0)
    with pytest.raises(TypeError, match="world_size must be an int"):
        tpcomm.launch(closed_use, 2.0)


def torch_threads(comm):
    return torch.get_num_threads()


def test_launch_shares_the_cpus_between_the_ranks(monkeypatch):
    """Each rank gets its share of the CPUs as torch threads (ranks with a thread
    per core each oversubscribe the machine), or OMP_NUM_THREADS when set."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert tpcomm.launch(torch_threads, 2, timeout=60) == [max(1, cpus // 2)] * 2
    assert tpcomm.launch(torch_threads, 1, timeout=60) == [cpus]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert tpcomm.launch(torch_threads, 2, timeout=60) == [3, 3]


def test_timeout_argument_checked():
    with pytest.raises(ValueError, match="timeout must be positive"):
        tpcomm.Communicator(timeout=-1)
    with pytest.raises(TypeError, match="timeout must be seconds"):
        tpcomm.Communicator(timeout="soon")


def test_no_torch_distributed_is_a_clear_error():
    with pytest.raises(tpcomm.CommError, match="torch.distributed is not initialized"):
        tpcomm.Communicator()


def test_from_env_needs_the_variables(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK is not set"):
        tpcomm.Communicator.from_env()


def test_launch_explains_a_function_the_ranks_cannot_load():
    """A function that exists only in the parent (a REPL, a dynamic module) gives a
    LaunchError that says what to do, not a bare crash of the rank."""
    import types

    mod = types.ModuleType("tpcomm_ghost_module")
    exec("def f(comm):\n    return comm.rank\n", mod.__dict__)
    sys.modules[mod.__name__] = mod
    try:
        with pytest.raises(tpcomm.LaunchError, match="cannot load the function") as info:
            tpcomm.launch(mod.f, 2, timeout=60)
        assert "module level" in str(info.value)
    finally:
        del sys.modules[mod.__name__]


BAD_SETTING = r"""
import os, sys, time, tpcomm
t0 = time.time()
try:
    tpcomm.Communicator.from_env(timeout=60)
    print("no error", flush=True)
except Exception as e:
    print(type(e).__name__, str(e).splitlines()[0], round(time.time() - t0, 1), flush=True)
if os.environ["RANK"] == "0":
    time.sleep(8)  # rank 0 hosts the store: it stays up, so nobody fails by its exit
"""


@pytest.mark.parametrize(
    "name, value",
    [
        ("TPCOMM_ALLREDUCE_ALGO", "bogus"),
        ("TPCOMM_CMA", "yes"),
        ("TPCOMM_ISA", "sse9"),
        ("TPCOMM_SLOT_BYTES", "9223372036854775808"),  # was SIGSEGV on every rank
        ("TPCOMM_THREADS", "300"),  # was a ValueError on one rank, a timeout on the other
    ],
)
def test_a_bad_setting_fails_every_rank_at_once(name, value):
    """A bad TPCOMM_* value is read before the segment exists: every rank raises
    the same ValueError at once; none waits for a rank that will never come
    (rank 1 used to wait for rank 0's segment until the rendezvous timeout)."""
    outs = [out for _, out in script_ranks(BAD_SETTING, [{name: value}] * 2, 60, drop=())]
    for line in outs:
        kind, _, rest = line.partition(" ")
        assert kind == "ValueError" and f"{name}={value!r}" in rest, line
        assert float(rest.rsplit(" ", 1)[1]) < SLACK_S, line


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("TPCOMM_SLOT_BYTES", "9223372036854775808", "expected at most 1.07374e+09"),
        ("TPCOMM_SLOT_BYTES", "inf", "expected at most"),
        ("TPCOMM_TIMEOUT", "1e30", "expected at most 1e+09, or inf for no limit"),
        ("TPCOMM_TIMEOUT", "nan", "must be a non-negative number"),
        ("TPCOMM_NT_MIN_BYTES", str(2**63), "expected an int in [-1, 281474976710656]"),
        ("TPCOMM_THREADS", str(2**63), "expected an int in [1, 256]"),
        ("TPCOMM_SPIN_US", "1e8", "expected at most 2000"),
        ("TPCOMM_YIELD_US", "inf", "expected at most 1e+06"),
        ("TPCOMM_CMA_MIN_BYTES", str(2**63), "expected an int in [-1, 281474976710656]"),
    ],
)
def test_every_setting_has_a_documented_range(monkeypatch, name, value, words):
    """Out-of-range settings are a ValueError naming the setting, the value and the
    range (they were OverflowErrors, SIGSEGVs, or an endless spin); they are read
    before a segment exists (the test above shows every rank refusing at once)."""
    from tpcomm import _env

    monkeypatch.setenv(name, value)
    read = {
        "TPCOMM_SLOT_BYTES": _env.slot_bytes,
        "TPCOMM_TIMEOUT": _env.timeout,
        "TPCOMM_NT_MIN_BYTES": _env.nt_min_bytes,
        "TPCOMM_THREADS": lambda: _env.threads(2),
        "TPCOMM_SPIN_US": _env.spin_us,
        "TPCOMM_YIELD_US": _env.yield_us,
        "TPCOMM_CMA_MIN_BYTES": lambda: _env.cma_min_bytes(2),
    }[name]
    with pytest.raises(ValueError) as e:
        read()
    assert f"{name}={value!r}" in str(e.value) and words in str(e.value), str(e.value)


def no_limit(comm):
    x = torch.ones(8)
    comm.all_reduce(x)
    return x.tolist()


@pytest.mark.parametrize("how", ["TPCOMM_TIMEOUT=inf", "timeout=1e11"])
def test_no_limit_is_a_timeout_too(monkeypatch, how):
    """An infinite timeout (TPCOMM_TIMEOUT=inf) and a huge one (timeout=1e11, meant
    as never) are waits without a deadline; 1e11 s used to become 0 ns in the
    core and every wait failed at once."""
    from tpcomm.launch import LocalGroup

    if how.startswith("TPCOMM"):
        monkeypatch.setenv("TPCOMM_TIMEOUT", "inf")
        group = LocalGroup(2)
    else:
        group = LocalGroup(2, timeout=1e11)
    with group as g:
        assert g.run(no_limit, timeout=60) == [[2.0] * 8] * 2
