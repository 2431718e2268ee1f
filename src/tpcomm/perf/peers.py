"""The shared-memory all-reduces a user would pick instead of tpcomm, for
``tpcomm perf --compare vllm,deepspeed``: vLLM's CPU communicator
(``csrc/cpu/shm.cpp``, compiled unmodified from vLLM's pinned source
distribution) and DeepSpeed's shm comm op (built by DeepSpeed's own op builder).

Each is built once, in the launching process, into the cache directory
(``TPCOMM_CACHE_DIR``, ``peers/``); a peer that cannot run here (the CPU lacks
what its build needs, a dtype it has no kernel for, a world size it does not
serve, a package that is missing) is given as a reason instead, which the table
prints in its row.  In the ranks, :class:`Peer` sets the library up as its own
Python side does and calls it the way its users do (through ``torch.ops``);
the segments each creates are removed by name when the ranks are done
(:func:`remove_segments`), whatever happened to them.
"""

from __future__ import annotations

import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sysconfig
import tarfile
import urllib.request
from typing import Any, Optional

import torch

from .. import _env
from ..ops import ReduceOp

__all__ = [
    "DEEPSPEED_VERSION", "NAMES", "VLLM_SHA256", "VLLM_URL", "VLLM_VERSION", "Peer",
    "prepare", "remove_segments", "vllm_archive",
]  # fmt: skip

NAMES = ("vllm", "vllm_kernel", "deepspeed")
_VLLM = ("vllm", "vllm_kernel")  # vLLM's kernel as vLLM calls it, and with the thinnest call

VLLM_VERSION = "0.34.0"
VLLM_URL = (
    "https://files.pythonhosted.org/packages/92/21/"
    "6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/vllm-0.34.0.tar.gz"
)
VLLM_SHA256 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
# what vLLM's shm.cpp is compiled from: the file, the headers it includes
_VLLM_FILES = ("csrc/cpu/shm.cpp", "csrc/cpu/cpu_types.hpp", "csrc/cpu/cpu_types_x86.hpp")
VLLM_WORLDS = (2, 3, 4, 8)  # shm_allreduce_sum's cases

DEEPSPEED_VERSION = "0.19.8"
_HALF = (torch.bfloat16, torch.float16)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cache() -> str:
    return os.path.join(_env.cache_dir(), "peers")


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def vllm_archive(download: bool = True) -> str:
    """vLLM's source archive in the cache, checked against its pinned sha256
    (``TPCOMM_VLLM_SDIST`` names a local copy instead of the download).  pip
    cannot fetch it (its metadata step needs CUDA), so it is fetched as a file.
    Raises RuntimeError saying what failed."""
    path = os.environ.get("TPCOMM_VLLM_SDIST") or os.path.join(
        _cache(), f"vllm-{VLLM_VERSION}.tar.gz"
    )
    if not os.path.exists(path):
        if not download:
            raise RuntimeError(f"{path} is missing")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.part"
        try:
            with urllib.request.urlopen(VLLM_URL, timeout=120) as r, open(tmp, "wb") as f:
                shutil.copyfileobj(r, f, 1 << 20)
            os.replace(tmp, path)
        except OSError as e:
            raise RuntimeError(f"could not download {VLLM_URL}: {e}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != VLLM_SHA256:
        raise RuntimeError(
            f"{path}: sha256 {h.hexdigest()}, expected {VLLM_SHA256} (vLLM {VLLM_VERSION})"
        )
    return path


def _vllm_library() -> str:
    """Build (once) vLLM's shm.cpp with tpcomm's binding (vllm_peer.cpp); the
    library's path.  Raises RuntimeError with the reason it cannot be built."""
    if platform.machine() != "x86_64" or "avx512f" not in _cpu_flags():
        raise RuntimeError(
            "vLLM builds csrc/cpu/shm.cpp only for x86 with AVX-512F (its "
            "cmake/cpu_extension.cmake leaves it out of the AVX2 build); this CPU has no avx512f"
        )
    from torch.utils import cpp_extension

    binding = os.path.join(os.path.dirname(__file__), "vllm_peer.cpp")
    with open(binding, "rb") as f:
        key = hashlib.sha256(f.read() + torch.__version__.encode()).hexdigest()[:12]
    out_dir = os.path.join(_cache(), f"vllm-{VLLM_VERSION}-{key}")
    lib = os.path.join(out_dir, "tpcomm_vllm_peer.so")
    if os.path.exists(lib):
        return lib
    src = os.path.join(out_dir, "src")
    with tarfile.open(vllm_archive()) as tar:
        for name in _VLLM_FILES:
            member = tar.getmember(f"vllm-{VLLM_VERSION}/{name}")
            os.makedirs(os.path.join(src, os.path.dirname(name)), exist_ok=True)
            with tar.extractfile(member) as r, open(os.path.join(src, name), "wb") as w:
                shutil.copyfileobj(r, w)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O3", "-march=native", "-fopenmp"]
    cmd += ["-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", os.path.join(src, "csrc")]
    for d in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]:
        cmd += ["-isystem", d]
    cmd += [os.path.join(src, "csrc/cpu/shm.cpp"), binding, "-o", lib + ".part"]
    for d in cpp_extension.library_paths():
        cmd += ["-L", d, f"-Wl,-rpath,{d}"]
    cmd += ["-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"building vLLM's shm.cpp failed: {tail}")
    os.replace(lib + ".part", lib)
    return lib


def _deepspeed_op() -> Any:
    """DeepSpeed's shm comm op, loaded (built once) by its own op builder into
    the cache.  Raises RuntimeError with the reason it cannot be."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no accelerator probe (and its warning)
    try:
        import deepspeed  # noqa: F401
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    except Exception as e:  # ImportError, or DeepSpeed's own start-up checks
        raise RuntimeError(
            f"DeepSpeed is not importable ({type(e).__name__}: {e}); "
            f"pip install deepspeed=={DEEPSPEED_VERSION}"
        ) from None
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(_cache(), "torch_extensions"))
    builder = ShareMemCommBuilder()
    if not builder.is_compatible():
        raise RuntimeError("DeepSpeed's ShareMemCommBuilder says this system is not compatible")
    try:
        return builder.load(verbose=False)
    except Exception as e:
        raise RuntimeError(f"DeepSpeed's shm op did not build: {type(e).__name__}: {e}") from None


def prepare(names: tuple, dtype: torch.dtype, world: int, collective: str, op: str) -> dict:
    """For each peer, None (built and ready) or why it cannot run here.  Run in
    the launching process, so that ranks never race to build."""
    out: dict = {}
    for name in names:
        try:
            if collective != "all_reduce" or op != "SUM":
                raise RuntimeError(f"{name}'s shared-memory path has all_reduce SUM only")
            if dtype not in _DTYPES:
                raise RuntimeError(f"{name} reduces float32, bfloat16 and float16 only")
            if name in _VLLM:
                if world not in VLLM_WORLDS:
                    raise RuntimeError(f"vLLM's shm all-reduce serves world sizes {VLLM_WORLDS}")
                _vllm_library()
            else:
                level = _deepspeed_op().vector_kernel_level()
                if dtype in _HALF and level < 2:
                    raise RuntimeError(
                        f"DeepSpeed's {str(dtype)[6:]} kernel needs AVX-512BW, which this CPU "
                        "lacks (DeepSpeed hands such a call to torch.distributed)"
                    )
                if level < 1:
                    raise RuntimeError("DeepSpeed's shm kernels need AVX2")
            out[name] = None
        except RuntimeError as e:
            out[name] = str(e)
    return out


def _segment_names(tag: str) -> tuple:
    """The /dev/shm names the peers create for this run's tag."""
    ds = f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{tag}_*"
    return (f"vllm-shm-tpcomm-perf-{tag}_*", f"vllm-shm-tpcomm-perf-{tag}k_*", ds)


def remove_segments(tag: str) -> None:
    """Unlink what vLLM and DeepSpeed left in /dev/shm for this run (neither
    removes its segments when a process ends)."""
    for pattern in _segment_names(tag):
        for path in glob.glob(os.path.join("/dev/shm", pattern)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _module(lib: str) -> Any:
    """The vLLM peer library as a Python module (its bare call)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tpcomm_vllm_peer", lib)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Peer:
    """One rank's handle on a peer: set up as its Python side does, then
    ``all_reduce(x)`` in place, called as its users call it."""

    def __init__(self, name: str, comm: Any, tag: str):
        self.name = name
        world, rank = comm.world_size, comm.rank
        if name in _VLLM:
            lib = _vllm_library()
            torch.ops.load_library(lib)
            ops = torch.ops.tpcomm_vllm_peer
            shm_name = f"vllm-shm-tpcomm-perf-{tag}" + ("k" if name == "vllm_kernel" else "")
            # vLLM's CPU communicator: the fewest torch threads of any rank
            threads = torch.tensor([torch.get_num_threads()], dtype=torch.int64)
            comm.all_reduce(threads, ReduceOp.MIN)
            handle = ops.init_shm_manager(shm_name, world, rank, int(threads.item()))
            comm.barrier()
            ops.join_shm_manager(handle, shm_name)
            comm.barrier()
            if name == "vllm":
                self._call = lambda x: ops.shm_allreduce(handle, x)
            else:  # the same kernel, called from Python with nothing in between
                bare = _module(lib).shm_allreduce
                self._call = lambda x: bare(handle, x)
        elif name == "deepspeed":
            # DeepSpeed's shm segments are named after MASTER_ADDR and MASTER_PORT
            os.environ.update(LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=tag)
            _deepspeed_op().initialize(world, rank)
            comm.barrier()
            ds = torch.ops.deepspeed.inference_all_reduce_
            self._call = ds
        else:
            raise ValueError(f"unknown peer {name!r} (known: {', '.join(NAMES)})")

    def all_reduce(self, x: torch.Tensor, op: Optional[Any] = None) -> None:
        self._call(x)
