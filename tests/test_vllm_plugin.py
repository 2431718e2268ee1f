"""The vLLM plugin's own logic, with a stand-in for the few vLLM names it
touches (``vllm.__version__``, ``vllm.platforms.current_platform``,
``CpuCommunicator``), so that it runs where vLLM is not installed: what it
takes and leaves (platform, version, ``TPCOMM_VLLM``, group names), that it
is idempotent, that the groups it takes are served by a Communicator with
vLLM's signatures (against gloo), and that destroy closes it.  vLLM itself:
tests/test_vllm.py."""

from __future__ import annotations

import importlib
import logging
import sys
import types

import pytest
import torch
import torch.distributed as dist

import tpcomm

from ._helpers import free_port, init_dist


class _Platform:
    def __init__(self, cpu: bool):
        self.cpu = cpu

    def is_cpu(self) -> bool:
        return self.cpu


class _OwnShm:
    """vLLM's own shared-memory object, as far as the plugin can tell."""


def _fake_vllm(version="0.32.0", cpu=True):
    """Modules standing in for vLLM's, in sys.modules; returns the stand-in
    CpuCommunicator class."""

    class CpuCommunicator:
        def __init__(self, cpu_group, device=None, device_group=None, unique_name="", *a):
            self.cpu_group, self.device_group = cpu_group, device_group
            self.unique_name = unique_name
            # vLLM: its shm object for tp/pp names, else torch.distributed
            own = unique_name.startswith("tp") or unique_name.startswith("pp")
            self.dist_module = _OwnShm() if own else dist
            self.supports_tensor_dict = own
            self.destroyed = False

        def destroy(self):
            self.destroyed = True

    mods = {
        "vllm": types.ModuleType("vllm"),
        "vllm.platforms": types.ModuleType("vllm.platforms"),
        "vllm.distributed": types.ModuleType("vllm.distributed"),
        "vllm.distributed.device_communicators": types.ModuleType("dc"),
        "vllm.distributed.device_communicators.cpu_communicator": types.ModuleType("cc"),
    }
    mods["vllm"].__version__ = version
    mods["vllm.platforms"].current_platform = _Platform(cpu)
    mods["vllm.distributed.device_communicators.cpu_communicator"].CpuCommunicator = CpuCommunicator
    mods["vllm.distributed.device_communicators"].cpu_communicator = mods[
        "vllm.distributed.device_communicators.cpu_communicator"
    ]
    sys.modules.update(mods)
    return CpuCommunicator


@pytest.fixture
def plugin(monkeypatch):
    """A fresh tpcomm.vllm_plugin (its once-per-process flag cleared) over the
    stand-in; sys.modules restored afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    monkeypatch.delenv("TPCOMM_VLLM", raising=False)
    monkeypatch.delenv("TPCOMM_SPIN_US", raising=False)
    import tpcomm.vllm_plugin as p

    p = importlib.reload(p)
    yield p
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_takes_nothing_outside_the_cpu_platform_or_known_versions(plugin, caplog, monkeypatch):
    cls = _fake_vllm(cpu=False)
    before = cls.__init__
    plugin.register()
    assert cls.__init__ is before  # a GPU platform: nothing to do, nothing said

    plugin = importlib.reload(plugin)
    cls = _fake_vllm(version="0.40.1")
    before = cls.__init__
    with caplog.at_level(logging.INFO, logger="vllm.tpcomm"):
        plugin.register()
    assert cls.__init__ is before
    assert "vLLM 0.40.1 is outside the versions the plugin knows" in caplog.text

    plugin = importlib.reload(plugin)
    cls = _fake_vllm()
    before = cls.__init__
    monkeypatch.setenv("TPCOMM_VLLM", "0")
    with caplog.at_level(logging.INFO, logger="vllm.tpcomm"):
        plugin.register()
    assert cls.__init__ is before and "TPCOMM_VLLM=0" in caplog.text
    monkeypatch.setenv("TPCOMM_VLLM", "maybe")
    plugin = importlib.reload(plugin)
    with pytest.raises(ValueError, match="TPCOMM_VLLM='maybe': expected 1, 0 or torch"):
        plugin.register()


def test_register_is_idempotent_and_sets_the_engine_spin(plugin, monkeypatch):
    cls = _fake_vllm()
    plugin.register()
    patched = cls.__init__
    assert patched is not None and getattr(patched, "_tpcomm", False)
    plugin.register()
    importlib.reload(plugin).register()  # a second copy of the module: still one wrapper
    assert cls.__init__ is patched
    import os

    assert os.environ["TPCOMM_SPIN_US"] == plugin.ENGINE_SPIN_US
    # a value the user set wins
    plugin = importlib.reload(plugin)
    monkeypatch.setenv("TPCOMM_SPIN_US", "7")
    _fake_vllm()
    plugin.register()
    assert os.environ["TPCOMM_SPIN_US"] == "7"


def _serve(comm, port, mode):
    """A rank: vLLM's stand-in with the plugin registered, a tp group and a dp
    group; what each CpuCommunicator got, and the calls' results."""
    import tpcomm.vllm_plugin as plugin

    plugin = importlib.reload(plugin)  # a rank process may have served a test before
    import os

    os.environ["TPCOMM_VLLM"] = mode
    cls = _fake_vllm()
    plugin.register()
    init_dist(comm, port)
    try:
        world = dist.new_group([0, 1])
        out = {}
        tp = cls(world, device_group=world, unique_name="tp:0")
        dp = cls(world, device_group=world, unique_name="dp:0")
        out["tp"] = (type(tp.dist_module).__name__, tp.supports_tensor_dict, tp.unique_name)
        out["dp"] = type(dp.dist_module).__name__
        out["served"] = sorted(plugin.served_groups())
        if mode == "1":
            g = torch.Generator().manual_seed(3)
            full = [torch.randn(4, 33, generator=g) for _ in range(2)]
            x = full[comm.rank].clone()
            tp.dist_module.all_reduce(x, group=world)
            y = full[comm.rank].clone()
            dist.all_reduce(y)
            out["all_reduce"] = bool(torch.equal(x, y))
            gl = [torch.empty(4, 33) for _ in range(2)] if comm.rank == 1 else None
            tp.dist_module.gather(full[comm.rank], gl, dst=1, group=world)
            out["gather"] = comm.rank == 0 or all(torch.equal(a, b) for a, b in zip(gl, full))
            o = torch.empty(8, 33)
            tp.dist_module.all_gather_into_tensor(o, full[comm.rank], group=world)
            out["all_gather"] = bool(torch.equal(o, torch.cat(full)))
            d = {"h": full[0].to(torch.bfloat16), "n": 7, "e": torch.empty(0, dtype=torch.int64)}
            if comm.rank == 0:
                tp.dist_module.send_tensor_dict(d, 1)
                out["dict"] = True
            else:
                back = tp.dist_module.recv_tensor_dict(0)
                out["dict"] = (
                    back.keys() == d.keys()
                    and torch.equal(back["h"], d["h"])
                    and back["n"] == 7
                    and back["e"].numel() == 0
                )
            served = tp.dist_module.comm
            tp.destroy()
            out["closed"] = served.closed and tp.destroyed
            out["served_after"] = sorted(plugin.served_groups())
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["1", "0", "torch"])
def test_the_groups_it_takes(mode):
    """TPCOMM_VLLM=1: the tp group is served by tpcomm with vLLM's signatures
    (results equal gloo's), the dp group stays on torch.distributed; 0: vLLM's
    own everywhere; torch: torch.distributed for tp too."""
    res = tpcomm.launch(_serve, 2, args=(free_port(), mode), timeout=120)
    for out in res:
        if mode == "1":
            assert out["tp"] == ("VllmModule", True, "tp:0")
            assert out["served"] == ["tp:0"] and out["served_after"] == []
            for k in ("all_reduce", "gather", "all_gather", "dict", "closed"):
                assert out[k] is True, (k, out)
        elif mode == "0":
            assert out["tp"] == ("_OwnShm", True, "tp:0") and out["served"] == []
        else:
            assert out["tp"] == ("module", False, "tp:0") and out["served"] == []
        assert out["dp"] == "module"
