"""PyTorch's own distributed test cases on cpu:tpcomm (tests/torch_suite).

Guards: every CPU collective, point-to-point and group case of torch's
``DistributedTest._DistTestBase`` that gloo passes also passes with its
process groups made on ``cpu:tpcomm`` (world 2, and 8: the group cases need
8); the cases that check the backend's name pass with ``BACKEND=tpcomm``; the
cases listed as not applicable fail only for the reason written beside them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .torch_suite.run import NOT_APPLICABLE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: float = 600) -> tuple[int, list, str]:
    """(exit status, the PASS/FAIL/SKIP lines, the ranks' stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.torch_suite.run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [
        ln for ln in proc.stdout.splitlines() if ln.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")
    ]
    return proc.returncode, lines, proc.stderr


@pytest.mark.parametrize("world", [2, 8])
def test_torchs_distributed_cases_pass_on_tpcomm(world):
    code, lines, err = _run("--world", str(world))
    failed = [ln for ln in lines if ln.startswith("FAIL")]
    assert code == 0 and not failed, (failed, err[-3000:])
    passed = sum(ln.startswith("PASS") for ln in lines)
    assert passed >= (90 if world == 8 else 70), lines  # torch 2.13: 93 and 74


def test_the_cases_that_check_the_backends_name():
    code, lines, err = _run("--backend", "named")
    assert code == 0 and [ln.split()[:2] for ln in lines] == [
        ["PASS", "test_Backend_enum_class"],
        ["PASS", "test_get_backend"],
    ], (lines, err[-2000:])


def test_not_applicable_cases_fail_for_the_reason_given():
    code, lines, err = _run("--not-applicable")
    failed = {ln.split()[1] for ln in lines if ln.startswith("FAIL")}
    assert failed == {"test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup"}
    assert failed <= set(NOT_APPLICABLE)
    assert "monitored_barrier is only implemented for GLOO backend" in err
