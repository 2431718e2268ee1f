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


def _passed(lines: list) -> set:
    return {ln.split()[1] for ln in lines if ln.startswith("PASS")}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world", [2, 8])
def test_torchs_distributed_cases_pass_on_tpcomm_as_on_gloo(world):
    """The same case list on gloo and on cpu:tpcomm, in turn: every case gloo
    passes passes on tpcomm (named when one does not), none fails."""
    g_code, g_lines, g_err = _run("--world", str(world), "--backend", "gloo", timeout=900)
    code, lines, err = _run("--world", str(world), timeout=900)
    failed = [ln for ln in lines if ln.startswith("FAIL")]
    assert code == 0 and not failed, (failed, err[-3000:])
    on_gloo = _passed(g_lines)
    assert len(on_gloo) >= 50, (g_lines, g_err[-2000:])  # the harness itself works
    lost = sorted(on_gloo - _passed(lines))
    assert lost == [], f"gloo passes, tpcomm does not: {lost}"


def test_the_cases_that_check_the_backends_name():
    code, lines, err = _run("--backend", "named")
    assert code == 0 and [ln.split()[:2] for ln in lines] == [
        ["PASS", "test_Backend_enum_class"],
        ["PASS", "test_get_backend"],
    ], (lines, err[-2000:])


@pytest.mark.timeout(900)
def test_not_applicable_cases_fail_for_the_reason_given():
    """At world 8, where they run (the two allreduce_hang cases need 8 GPUs),
    every not-applicable case fails, and for the reason written beside it."""
    code, lines, err = _run("--world", "8", "--not-applicable", timeout=600)
    failed = {ln.split()[1]: ln for ln in lines if ln.startswith("FAIL")}
    skipped = {ln.split()[1].rstrip(":") for ln in lines if ln.startswith("SKIP")}
    assert set(failed) | skipped == set(NOT_APPLICABLE), lines
    assert skipped <= {"test_monitored_barrier_allreduce_hang",
                       "test_monitored_barrier_allreduce_hang_wait_all_ranks"}, lines  # fmt: skip
    for line in failed.values():
        assert "monitored_barrier is only implemented for GLOO backend" in line, line
