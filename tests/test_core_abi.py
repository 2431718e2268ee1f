"""Python's view of the C core's codes is the core's own.

Guards: the codes both languages use (dtype, op, collective kind, status, the
binary message header, the layout key of a flat layout) are defined once, in
``_native/tpcomm.h``; the Python tables that map torch's objects onto them
must give the same numbers, or every rank would describe its calls to its
peers wrongly.
"""

from __future__ import annotations

import struct

import torch

from tpcomm import ReduceOp, _native, _testing
from tpcomm.ops import ANY_DTYPE_CODES, DTYPE_CODES
from tpcomm.shm import engine, keys


def test_reduce_codes_are_the_cores():
    by_name = {
        torch.float32: "DT_F32",
        torch.bfloat16: "DT_BF16",
        torch.float16: "DT_F16",
        torch.int32: "DT_I32",
        torch.int64: "DT_I64",
    }
    assert {dt: getattr(_native, name) for dt, name in by_name.items()} == DTYPE_CODES
    assert {op.value for op in ReduceOp} == {getattr(_native, f"OP_{op.name}") for op in ReduceOp}
    for op in ReduceOp:
        assert op.value == getattr(_native, f"OP_{op.name}")


# The codes as written by hand here, not read from either side: the engine
# copies its names from the core, so comparing the two would test nothing.
# A change of a value on the wire is a change of the segment's format.
KINDS = {"ALL_REDUCE": 1, "BARRIER": 2, "ALL_GATHER": 3, "REDUCE_SCATTER": 4, "BROADCAST": 5,
         "GATHER": 6, "EMPTY": 7, "ALL_TO_ALL": 8, "DUP": 9, "REFUSED": 10}  # fmt: skip
STATUSES = {"OK": 0, "TIMEOUT": 1, "PEER_DEAD": 2, "MISMATCH": 3, "ABORTED": 4,
            "INTERRUPTED": 5, "CROSSED": 6, "BUSY": 7, "CLOSED": 8, "CMA": 9, "PROTO": 10,
            "SPLITS": 11}  # fmt: skip


def test_kinds_and_statuses_are_pinned():
    for name, value in KINDS.items():
        assert getattr(_native, f"KIND_{name}") == value, name
        assert getattr(engine, f"KIND_{name}") == value, name
    assert sorted(engine.KIND_NAMES) == sorted(KINDS.values())
    for name, value in STATUSES.items():
        assert getattr(_native, f"ST_{name}") == value, name
        assert getattr(engine, f"ST_{name}") == value, name
    assert {n for n in dir(engine) if n.startswith("ST_")} == {f"ST_{n}" for n in STATUSES}


def _headers(comm):
    """The core's header of a few messages (an engine's: it knows the tensors),
    read back by the core, and by hand (the format pinned here)."""
    eng = _testing.engine(comm)
    ts = [torch.zeros(2, 3), torch.ones(5, dtype=torch.int64), torch.empty(0, 4, 1)]
    head = eng.message_header(ts)
    by_hand = bytes((_native.P2P_BINARY, len(ts))) + b"".join(
        struct.pack(f"<BB{t.dim()}q", ANY_DTYPE_CODES[t.dtype], t.dim(), *t.shape) for t in ts
    )
    deep = torch.zeros((1,) * (_native.P2P_MAX_DIMS + 1))
    return (
        head == by_hand,
        _native.parse_header(head, len(ANY_DTYPE_CODES))
        == [(ANY_DTYPE_CODES[t.dtype], tuple(t.shape)) for t in ts],
        eng.message_header([torch.zeros(1)] * (_native.P2P_MAX_TENSORS + 1)) is None,
        eng.message_header([deep]) is None,
        eng.message_header([torch.zeros(4)[::2]]) is None,  # not plain: pickled instead
        _native.parse_header(head[:-1], 32) is None,  # cut short: not a header it knows
        _native.parse_header(head, 1) is None,  # a code past the table's
        _native.parse_header(b"\x80\x05", 32) is None,  # a pickle
    )


def test_message_header_is_what_the_core_reads(pools):
    assert pools.run(2, _headers) == [(True,) * 8] * 2
    assert len(ANY_DTYPE_CODES) <= 32  # the core's table of message dtypes (torch.c MAX_ANY)


def test_flat_layout_key_is_the_cores():
    for kind, n, w in ((engine.KIND_ALL_GATHER, 7, 2), (engine.KIND_GATHER, 1 << 40, 8)):
        assert keys.gather_key(kind, (), 0, (n,) * w, None) == _native.flat_key(kind, n, w)
        tag = (3 + 1) << 32
        assert keys.gather_key(kind, (), 0, (n,) * w, 3) == _native.flat_key(kind + tag, n, w)
    key = keys.reduce_scatter_key((), 0, (5, 5, 5))
    assert key == _native.flat_key(_native.RS_FLAT, 5, 3)
    # the definition, written out once more here, as the reference
    x = (engine.KIND_ALL_GATHER * 0x100000001B3) & (2**64 - 1)
    x ^= (7 * 0x9E3779B97F4A7C15) & (2**64 - 1)
    x ^= 2 << 48
    assert _native.flat_key(engine.KIND_ALL_GATHER, 7, 2) == x & 0x7FFFFFFFFFFFFFFF


def test_only_the_shm_package_calls_the_core():
    """One Python<->C boundary: outside ``tpcomm/shm`` no module imports the
    core, so a reader finds every call into C there."""
    import pathlib
    import re

    import tpcomm

    root = pathlib.Path(tpcomm.__file__).parent
    pattern = re.compile(
        r"^\s*(from\s+\.+\s+import\s+.*\b_native\b|import\s+tpcomm\._native)", re.M
    )
    outside = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.parts[-2] != "shm" and pattern.search(p.read_text())
    ]
    assert outside == []
