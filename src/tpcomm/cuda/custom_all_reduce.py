"""``CustomAllreduce``: one-node all-reduce where every GPU reads its peers' buffers.

The surface of the seed (vLLM's ``custom_all_reduce.py``), in Python with
Triton kernels (``kernels.py``) and torch's CUDA IPC handles (``ipc.py``):

* ``CustomAllreduce(group, device, max_size=8 MiB)``: collective; ``disabled``
  (with ``disabled_reason``, logged once) for world size 1, a group spanning
  hosts, an unsupported world size, more than two GPUs without NVLink between
  all of them, no working IPC between the GPUs, no CUDA or no Triton;
* ``should_custom_ar(t)``, ``custom_all_reduce(t) -> Tensor | None`` (None:
  use NCCL), out-of-place ``all_reduce(inp, out=None, registered=False)``
  (inputs above ``max_size`` in chunks), ``capture()`` for CUDA graphs,
  ``custom_all_gather``, ``custom_reduce_scatter``, ``close()``.

The decisions that need no GPU are plain functions (``why_disabled``,
``choose_algorithm``, ``chunks``, ``check_capture_counts``) and are tested on
every machine; docs/GPU.md says what has run on a GPU.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from typing import Any, Iterator, Optional, Sequence

import torch

from .. import _env
from ..bootstrap import host_identity
from .ipc import Group, Shared, open_handle, share

__all__ = [
    "CustomAllreduce",
    "why_disabled",
    "choose_algorithm",
    "chunks",
    "check_capture_counts",
    "is_weak_contiguous",
    "SUPPORTED_WORLD_SIZES",
]

log = logging.getLogger("tpcomm")

SUPPORTED_WORLD_SIZES = (2, 4, 6, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_MAX_SIZE = 8 << 20
BLOCKS = 16  # programs per kernel; each needs its own flags, so this is fixed at set-up
BLOCK = 1024  # elements per program per step
GRAPH_SLOTS = 8192  # captured all-reduces per communicator (rows of the pointer table)


# -- decisions without a GPU -----------------------------------------------------


def why_disabled(
    *,
    world: int,
    same_host: bool,
    have_cuda: bool,
    have_triton: bool,
    fully_connected: bool,
    p2p_ok: Optional[bool],
) -> Optional[str]:
    """Why the custom all-reduce cannot run here, or None when it can.

    ``p2p_ok`` is None when the IPC check has not run (it runs last: it costs a
    round trip between the GPUs).
    """
    if not have_cuda:
        return "CUDA is not available"
    if not have_triton:
        return "Triton is not installed (pip install triton)"
    if world == 1:
        return "world size 1: nothing to reduce"
    if not same_host:
        return "the group spans hosts (CUDA IPC works inside one host)"
    if world not in SUPPORTED_WORLD_SIZES:
        return f"world size {world} is not one of {SUPPORTED_WORLD_SIZES}"
    if world > 2 and not fully_connected:
        return (
            f"{world} GPUs are not all connected by NVLink: over PCIe the custom "
            f"all-reduce gains little on NCCL beyond two GPUs"
        )
    if p2p_ok is False:
        return "the CUDA IPC round trip between the GPUs failed (P2P not working)"
    return None


def choose_algorithm(world: int, nbytes: int, override: Optional[str] = None) -> str:
    """``"one_shot"`` or ``"two_shot"``: the seed's switch.

    World size 2 is always one-shot; up to 4 ranks one-shot below 512 KiB, up to
    8 below 256 KiB; two-shot otherwise.  ``override`` ("one_shot"/"two_shot"),
    or TPCOMM_CUDA_ALGO, wins.
    """
    if override is not None and override not in ("one_shot", "two_shot", "auto"):
        raise ValueError(f"algorithm must be one_shot, two_shot or auto, got {override!r}")
    override = override or _env.cuda_algo()
    if override in ("one_shot", "two_shot"):
        return override
    if world == 2:
        return "one_shot"
    if world <= 4 and nbytes < 512 * 1024:
        return "one_shot"
    if world <= 8 and nbytes < 256 * 1024:
        return "one_shot"
    return "two_shot"


def chunks(numel: int, element_size: int, max_size: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of at most ``max_size`` bytes covering ``numel``."""
    step = max_size // element_size
    if step <= 0:
        raise ValueError(f"max_size {max_size} is smaller than one element ({element_size} B)")
    return [(s, min(numel, s + step)) for s in range(0, numel, step)] or [(0, 0)]


def check_capture_counts(counts: Sequence[int]) -> None:
    """Every rank must have captured the same number of all-reduces."""
    if len(set(counts)) > 1:
        detail = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise ValueError(
            f"CustomAllreduce.capture: the ranks captured different numbers of "
            f"all-reduces ({detail}); every rank must capture the same calls in the same order"
        )


def is_weak_contiguous(t: torch.Tensor) -> bool:
    """Contiguous, or a view whose elements fill the tail of its storage densely."""
    if t.is_contiguous():
        return True
    nbytes = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    return nbytes == t.numel() * t.element_size()


# -- the P2P check: a real IPC round trip, once per node ---------------------------

_p2p_lock = threading.Lock()
_p2p_memo: dict[str, bool] = {}


def _cache_path() -> str:
    return os.path.join(_env.cache_dir(), "p2p.json")


def _p2p_key(host: str, uuids: Sequence[str]) -> str:
    return f"{host}|{','.join(sorted(set(uuids)))}|cuda {torch.version.cuda}"


def p2p_works(group: Group, device: torch.device, host: str, uuids: Sequence[str]) -> bool:
    """Collective: can every rank read every peer's memory through a CUDA IPC handle?

    Each rank fills a small buffer with a pattern of its own, the ranks swap
    handles, open them and copy the peers' buffers back on their own device.
    The verdict is remembered in this process and in ``p2p.json`` under
    TPCOMM_CACHE_DIR (default ~/.cache/tpcomm), keyed by host, GPUs and CUDA
    version, so a node runs the round trip once.
    """
    key = _p2p_key(host, uuids)
    with _p2p_lock:
        cached = _p2p_memo.get(key)
        if cached is None:
            try:
                with open(_cache_path()) as f:
                    cached = json.load(f).get(key)
            except (OSError, ValueError):
                cached = None
    known = group.all_gather_object(cached)
    if all(k is not None for k in known):
        return all(known)
    ok = _p2p_round_trip(group, device)
    verdict = all(group.all_gather_object(ok))
    with _p2p_lock:
        _p2p_memo[key] = verdict
        if group.rank == 0:
            path = _cache_path()
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                try:
                    with open(path) as f:
                        table = json.load(f)
                except (OSError, ValueError):
                    table = {}
                table[key] = verdict
                tmp = f"{path}.{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump(table, f)
                os.replace(tmp, path)
            except OSError as e:
                log.info("tpcomm.cuda: cannot cache the P2P verdict in %s: %s", path, e)
    return verdict


def _p2p_round_trip(group: Group, device: torch.device) -> bool:
    n = 1024
    mine = torch.arange(n, dtype=torch.int32, device=device) * 7 + group.rank
    try:
        handles = group.all_gather_object(mine.untyped_storage()._share_cuda_())
    except Exception:
        handles = None
    if handles is None:
        return False
    ok = True
    for r, h in enumerate(handles):
        if r == group.rank:
            continue
        try:
            peer = open_handle(h, device)[: n * 4].view(torch.int32)
            got = peer.clone()  # a copy through the IPC mapping
            torch.cuda.synchronize(device)
            want = torch.arange(n, dtype=torch.int32, device=device) * 7 + r
            ok = ok and bool(torch.equal(got, want))
            del peer
        except Exception as e:
            log.info("tpcomm.cuda: IPC round trip to rank %d failed: %s", r, e)
            ok = False
    torch.cuda.synchronize(device)
    group.all_gather_object(None)  # nobody frees its buffer while a peer still reads it
    return ok


def _nvlink_all(uuids: Sequence[str]) -> bool:
    """Are all these GPUs connected to each other by NVLink?  (needs nvidia-ml-py)"""
    if len(set(uuids)) == 1:
        return True  # one GPU shared by every rank: its own memory
    try:
        import pynvml
    except ImportError:
        log.info("tpcomm.cuda: nvidia-ml-py is not installed; cannot tell NVLink from PCIe")
        return False
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByUUID(u) for u in sorted(set(uuids))]
        for i, a in enumerate(handles):
            for b in handles[i + 1 :]:
                status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                if status != pynvml.NVML_P2P_STATUS_OK:
                    return False
        return True
    except Exception as e:
        log.info("tpcomm.cuda: NVML could not tell the links: %s", e)
        return False
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# -- the communicator ----------------------------------------------------------------


class CustomAllreduce:
    """All-reduce (and all-gather, reduce-scatter) through peer-readable GPU buffers.

    Args:
        group: a torch.distributed ProcessGroup that carries CPU tensors (gloo,
            tpcomm; used for set-up only), or a tpcomm Communicator.
        device: this rank's GPU (``int``, ``"cuda:1"`` or a ``torch.device``).
        max_size: bytes of the largest input reduced in one go (larger inputs go
            in chunks through ``all_reduce``; ``should_custom_ar`` says no above it).
        algorithm: "one_shot", "two_shot" or None (the seed's size switch).
    """

    def __init__(
        self,
        group: Any,
        device: Any,
        max_size: int = DEFAULT_MAX_SIZE,
        *,
        algorithm: Optional[str] = None,
    ):
        self.disabled = True
        self.disabled_reason: Optional[str] = None
        self._closed = False
        self._capturing = False
        self._graph_inputs: list[torch.Tensor] = []
        self._graph_used = 0  # rows of the graph pointer table taken by earlier captures
        self._graph_keep: list[torch.Tensor] = []
        self._shared: list[Shared] = []
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size <= 0:
            raise ValueError(f"CustomAllreduce: max_size must be a positive int, got {max_size!r}")
        if max_size % 16:
            raise ValueError(f"CustomAllreduce: max_size must be a multiple of 16, got {max_size}")
        if algorithm is not None:
            choose_algorithm(2, 0, algorithm)  # validates
        self.max_size = max_size
        self.algorithm = algorithm
        self.group = Group(group)
        self.rank, self.world_size = self.group.rank, self.group.world
        self.device = _as_device(device)
        interp = _interpreting() and self.device.type == "cpu"
        have_cuda = interp or (self.device.type == "cuda" and torch.cuda.is_available())
        if self.world_size == 1:
            self._disable(
                why_disabled(
                    world=1,
                    same_host=True,
                    have_cuda=True,
                    have_triton=True,
                    fully_connected=True,
                    p2p_ok=True,
                )
            )
            return
        # one exchange of every rank's facts: every rank takes the same branches below
        everyone = self.group.all_gather_object((host_identity(), have_cuda, _have_triton()))
        hosts = [h for h, _, _ in everyone]
        facts = dict(
            world=self.world_size,
            same_host=len(set(hosts)) == 1,
            have_cuda=all(c for _, c, _ in everyone),
            have_triton=all(t for _, _, t in everyone),
            fully_connected=False,
            p2p_ok=None,
        )
        reason = why_disabled(**{**facts, "fully_connected": True})
        if reason is None and not interp:
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"  # NVML's spelling
            uuids = self.group.all_gather_object(uuid)
            facts["fully_connected"] = _nvlink_all(uuids)
            reason = why_disabled(**facts)
            if reason is None:
                facts["p2p_ok"] = p2p_works(self.group, self.device, hosts[0], uuids)
                reason = why_disabled(**facts)
        elif reason is None:
            facts["fully_connected"] = True  # the interpreter: one host's memory
            reason = why_disabled(**facts)
        self.fully_connected = facts["fully_connected"]
        if reason is not None:
            self._disable(reason)
            return
        self._setup_buffers()
        self.disabled = False

    def _disable(self, reason: Optional[str]) -> None:
        self.disabled = True
        self.disabled_reason = reason
        log.info("tpcomm.cuda: custom all-reduce disabled: %s", reason)

    def _setup_buffers(self) -> None:
        w, dev = self.world_size, self.device
        sig_bytes = 3 * BLOCKS * w * 4
        self._data = share(self.max_size, dev, self.group)
        self._tmp = share(self.max_size, dev, self.group)
        self._sig = share(sig_bytes, dev, self.group)
        self._shared = [self._data, self._tmp, self._sig]
        self._cnt = torch.zeros(BLOCKS, dtype=torch.int32, device=dev)
        # one row of peer addresses per captured call (filled after the capture)
        self._graph_ptrs: Optional[torch.Tensor] = None

    # -- gating ---------------------------------------------------------------------

    def should_custom_ar(self, inp: torch.Tensor) -> bool:
        """Can ``custom_all_reduce`` take this tensor?  (dtype, 16-byte multiple,
        weakly contiguous, not a negative view, smaller than max_size, on two GPUs
        or NVLink-connected)"""
        if self.disabled:
            return False
        if inp.dtype not in DTYPES or inp.is_neg():  # peers read raw memory (docs/COLLECTIVES.md)
            return False
        nbytes = inp.numel() * inp.element_size()
        if nbytes % 16 or not is_weak_contiguous(inp):
            return False
        if self.world_size == 2 or self.fully_connected:
            return nbytes < self.max_size
        return False

    # -- all-reduce -----------------------------------------------------------------

    def custom_all_reduce(self, inp: torch.Tensor) -> Optional[torch.Tensor]:
        """The reduced tensor (new), or None: then use NCCL.  Works inside ``capture()``."""
        if self.disabled or not self.should_custom_ar(inp):
            return None
        if self._capturing:
            if torch.cuda.is_current_stream_capturing():
                return self.all_reduce(inp, registered=True)
            return torch.empty_like(inp)  # warm-up run: same allocation pattern
        return self.all_reduce(inp, registered=False)

    def all_reduce(
        self, inp: torch.Tensor, *, out: Optional[torch.Tensor] = None, registered: bool = False
    ) -> torch.Tensor:
        """Out-of-place all-reduce (SUM).  ``registered``: ``inp``'s memory is read by
        the peers where it is (inside ``capture()``); otherwise it is copied into
        this rank's IPC buffer first, in chunks of ``max_size`` bytes."""
        self._check_usable("all_reduce")
        if not is_weak_contiguous(inp):
            raise ValueError("CustomAllreduce.all_reduce: the input must be weakly contiguous")
        # Work in the input's storage order (a weakly contiguous tensor is one dense
        # block): the result has the input's strides, element for element.
        same = out is not None and out.stride() == inp.stride() and is_weak_contiguous(out)
        target = out if same else torch.empty_like(inp)
        n = inp.numel()
        flat_in = inp.as_strided((n,), (1,), inp.storage_offset())
        flat_out = target.as_strided((n,), (1,), target.storage_offset())
        for lo, hi in chunks(n, inp.element_size(), self.max_size):
            if hi > lo:
                self._reduce_chunk(flat_in[lo:hi], flat_out[lo:hi], registered)
        if out is None:
            return target
        if target is not out:
            out.copy_(target)
        return out

    def _reduce_chunk(self, inp: torch.Tensor, out: torch.Tensor, registered: bool) -> None:
        from . import kernels

        n = inp.numel()
        data_ptrs = self._register_input(inp) if registered else self._stage(inp)
        algo = choose_algorithm(self.world_size, n * inp.element_size(), self.algorithm)
        if algo == "one_shot":
            self._launch(kernels.one_shot, inp.dtype, data_ptrs, self._sig.ptrs, self._cnt, out, n)
        else:
            # two-shot: rank p reduces part p of every input into its scratch buffer, then
            # every rank gathers the parts; the inputs stay untouched (in a graph they are
            # the user's)
            part = -(-n // self.world_size)
            self._launch(
                kernels.two_shot,
                inp.dtype,
                data_ptrs,
                self._tmp.ptrs,
                self._sig.ptrs,
                self._cnt,
                out,
                n,
                part,
            )

    def _stage(self, inp: torch.Tensor) -> torch.Tensor:
        """Copy ``inp`` (flattened) into this rank's IPC buffer; the peers' address table."""
        nbytes = inp.numel() * inp.element_size()
        self._data.local[:nbytes].view(inp.dtype).copy_(inp.reshape(-1))
        return self._data.ptrs

    def _launch(self, kernel: Any, dtype: torch.dtype, *args: Any) -> None:
        """One program per flag slot; every kernel takes this rank last, then the shapes."""
        kernel[(BLOCKS,)](
            *args,
            self.rank,
            W=self.world_size,
            BLOCKS=BLOCKS,
            BLOCK=BLOCK,
            DT=_triton_dtype(dtype),
        )

    # -- all-gather and reduce-scatter --------------------------------------------

    def custom_all_gather(self, inp: torch.Tensor) -> Optional[torch.Tensor]:
        """Every rank's ``inp`` concatenated along dim 0 (a new tensor), or None: use NCCL."""
        if self.disabled or self._capturing or inp.dtype not in DTYPES:
            return None
        nbytes = inp.numel() * inp.element_size()
        if nbytes % 16 or nbytes > self.max_size or not is_weak_contiguous(inp):
            return None
        from . import kernels

        data_ptrs = self._stage(inp)
        out = torch.empty(
            (self.world_size * inp.shape[0], *inp.shape[1:]) if inp.dim() else (self.world_size,),
            dtype=inp.dtype,
            device=inp.device,
        )
        self._launch(
            kernels.all_gather, inp.dtype, data_ptrs, self._sig.ptrs, self._cnt, out, inp.numel()
        )
        return out

    def custom_reduce_scatter(self, inp: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's 1/world part (along dim 0) of the sum of every rank's ``inp``,
        or None: use NCCL."""
        if self.disabled or self._capturing or inp.dtype not in DTYPES or inp.dim() == 0:
            return None
        nbytes = inp.numel() * inp.element_size()
        if inp.shape[0] % self.world_size or nbytes > self.max_size:
            return None
        if (nbytes // self.world_size) % 16 or not is_weak_contiguous(inp):
            return None
        from . import kernels

        m = inp.numel() // self.world_size
        data_ptrs = self._stage(inp)
        out = torch.empty(
            (inp.shape[0] // self.world_size, *inp.shape[1:]), dtype=inp.dtype, device=inp.device
        )
        self._launch(
            kernels.reduce_scatter, inp.dtype, data_ptrs, self._sig.ptrs, self._cnt, out, m
        )
        return out

    # -- CUDA graphs ----------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Capture all-reduces into a CUDA graph; on exit every rank registers the
        inputs it captured with its peers (collective).  Ranks that captured
        different numbers of calls get a ValueError, all of them."""
        self._check_usable("capture")
        if self._graph_ptrs is None:  # allocated now: a fill inside the graph would replay
            self._graph_ptrs = torch.zeros(
                (GRAPH_SLOTS, self.world_size), dtype=torch.int64, device=self.device
            )
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False
            self.register_graph_buffers()

    def _register_input(self, inp: torch.Tensor) -> torch.Tensor:
        """The row of the graph pointer table this captured call will read."""
        if self._graph_ptrs is None:
            raise RuntimeError("CustomAllreduce: registered inputs exist only inside capture()")
        i = self._graph_used + len(self._graph_inputs)
        if i >= GRAPH_SLOTS:
            raise RuntimeError(f"CustomAllreduce: more than {GRAPH_SLOTS} captured all-reduces")
        self._graph_inputs.append(inp)
        return self._graph_ptrs[i]

    def register_graph_buffers(self) -> None:
        """Swap the IPC handles of the captured inputs and fill the pointer table."""
        if self.disabled:
            return
        mine = []
        for t in self._graph_inputs:
            storage = t.untyped_storage()
            offset = t.data_ptr() - storage.data_ptr()
            mine.append((storage._share_cuda_(), offset))
        everyone = self.group.all_gather_object(mine)
        check_capture_counts([len(x) for x in everyone])
        rows = []
        for i, t in enumerate(self._graph_inputs):
            row = []
            for r in range(self.world_size):
                if r == self.rank:
                    row.append(t.data_ptr())
                    continue
                handle, offset = everyone[r][i]
                peer = open_handle(handle, self.device)
                self._graph_keep.append(peer)
                row.append(peer.data_ptr() + offset)
            rows.append(row)
        if rows and self._graph_ptrs is not None:
            lo = self._graph_used  # rows of earlier captures stay: their graphs replay them
            self._graph_ptrs[lo : lo + len(rows)].copy_(torch.tensor(rows, dtype=torch.int64))
            self._graph_used += len(rows)
        self._graph_inputs = []

    # -- lifecycle ------------------------------------------------------------------

    def _check_usable(self, fn: str) -> None:
        if self._closed:
            raise RuntimeError(f"CustomAllreduce.{fn}: closed")
        if self.disabled:
            raise RuntimeError(f"CustomAllreduce.{fn}: disabled ({self.disabled_reason})")

    def close(self) -> None:
        """Free the buffers and the peers' mappings.  Idempotent; local."""
        if self._closed:
            return
        self._closed = True
        was = self.disabled
        self.disabled = True
        if self.disabled_reason is None:
            self.disabled_reason = "closed"
        if not was:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for s in self._shared:
                s.close()
        self._shared = []
        self._graph_keep = []
        self._graph_inputs = []
        if not was and self.device.type == "cuda":
            torch.cuda.ipc_collect()  # blocks the peers no longer map can go now
        for name in ("_data", "_tmp", "_sig", "_cnt", "_graph_ptrs"):
            self.__dict__.pop(name, None)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        state = f"disabled: {self.disabled_reason}" if self.disabled else "enabled"
        return (
            f"<tpcomm.cuda.CustomAllreduce rank={self.rank} world_size={self.world_size} {state}>"
        )


def _as_device(device: Any) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    if isinstance(device, (str, torch.device)):
        return torch.device(device)
    raise TypeError(f"CustomAllreduce: device must be an int, str or torch.device, got {device!r}")


def _triton_dtype(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[
        dtype
    ]
