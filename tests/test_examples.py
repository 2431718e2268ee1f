"""examples/tp_decode.py: a sharded decoder over tpcomm matches the same model in
one process (and its gloo run too), at a small size."""

from __future__ import annotations

import os
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "tp_decode.py")


def test_tp_decode_small():
    r = subprocess.run(
        [
            sys.executable,
            EXAMPLE,
            "--ranks",
            "2",
            "--layers",
            "2",
            "--hidden",
            "256",
            "--heads",
            "4",
            "--ffn",
            "512",
            "--vocab",
            "512",
            "--steps",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "logits match the single-process model" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("  ")]
    assert [row[0] for row in rows] == ["float32", "bfloat16"]
