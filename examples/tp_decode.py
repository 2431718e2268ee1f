"""End-to-end tensor-parallel decode of a small Llama-style model over local ranks.

The model (random weights from a seed: RMSNorm, rotary attention with a KV
cache, SiLU-gated MLP) is sharded Megatron-style over N ranks started with
``tpcomm.launch``: QKV and gate/up projections column-parallel (heads and
hidden units split), the attention output and down projections row-parallel,
so each layer needs one all_reduce after attention and one after the MLP.
Every rank decodes the same token sequence; the logits are checked against
the same model run in one process, and the time per token is measured with
tpcomm's all_reduce and with torch.distributed's gloo on the same ranks.

    python examples/tp_decode.py --ranks 2 --dtype bfloat16 --layers 4 --steps 32
"""

from __future__ import annotations

import argparse
import math
import socket
import time

import torch
import torch.distributed as dist

import tpcomm


def make_weights(cfg: dict, dtype: torch.dtype) -> dict:
    """The full model's weights, the same in every process (seeded)."""
    g = torch.Generator().manual_seed(cfg["seed"])
    h, f, v = cfg["hidden"], cfg["ffn"], cfg["vocab"]

    def w(*shape, scale=None):
        scale = scale or 1.0 / math.sqrt(shape[-1])
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    layers = []
    for _ in range(cfg["layers"]):
        layers.append(
            {
                "ln1": torch.ones(h, dtype=dtype),
                "ln2": torch.ones(h, dtype=dtype),
                "wq": w(h, h),
                "wk": w(h, h),
                "wv": w(h, h),
                "wo": w(h, h),
                "gate": w(f, h),
                "up": w(f, h),
                "down": w(h, f),
            }
        )
    return {
        "embed": w(v, h, scale=1.0),
        "norm": torch.ones(h, dtype=dtype),
        "lm_head": w(v, h),
        "layers": layers,
    }


def shard(weights: dict, cfg: dict, rank: int, world: int) -> dict:
    """This rank's part: heads and MLP units split; embeddings replicated."""
    hd = cfg["hidden"] // cfg["heads"]
    heads = cfg["heads"] // world
    cols = slice(rank * heads * hd, (rank + 1) * heads * hd)
    units = cfg["ffn"] // world
    rows = slice(rank * units, (rank + 1) * units)
    out = {k: weights[k] for k in ("embed", "norm", "lm_head")}
    out["layers"] = [
        {
            "ln1": lw["ln1"],
            "ln2": lw["ln2"],
            "wq": lw["wq"][cols].contiguous(),
            "wk": lw["wk"][cols].contiguous(),
            "wv": lw["wv"][cols].contiguous(),
            "wo": lw["wo"][:, cols].contiguous(),
            "gate": lw["gate"][rows].contiguous(),
            "up": lw["up"][rows].contiguous(),
            "down": lw["down"][:, rows].contiguous(),
        }
        for lw in weights["layers"]
    ]
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def rope(x: torch.Tensor, pos: int) -> torch.Tensor:
    """Rotary embedding for one position; x: (heads, head_dim)."""
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos * inv
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)
    return out.to(x.dtype)


class Decoder:
    """One rank's shard (or the whole model with world=1); all_reduce is pluggable."""

    def __init__(self, w: dict, cfg: dict, world: int, all_reduce):
        self.w, self.cfg, self.all_reduce = w, cfg, all_reduce
        self.hd = cfg["hidden"] // cfg["heads"]
        self.heads = cfg["heads"] // world
        self.cache = [([], []) for _ in w["layers"]]

    def step(self, token: int, pos: int) -> torch.Tensor:
        x = self.w["embed"][token]
        for lw, (ks, vs) in zip(self.w["layers"], self.cache):
            h = rms_norm(x, lw["ln1"])
            q = rope((lw["wq"] @ h).view(self.heads, self.hd), pos)
            ks.append(rope((lw["wk"] @ h).view(self.heads, self.hd), pos))
            vs.append((lw["wv"] @ h).view(self.heads, self.hd))
            k, v = torch.stack(ks, 1), torch.stack(vs, 1)  # (heads, t, hd)
            att = torch.softmax(
                (k.float() @ q.float().unsqueeze(-1)).squeeze(-1) / math.sqrt(self.hd), -1
            )
            o = (att.unsqueeze(1) @ v.float()).squeeze(1).to(x.dtype).reshape(-1)
            x = x + self.all_reduce(lw["wo"] @ o)  # row-parallel: partial sums
            h = rms_norm(x, lw["ln2"])
            m = torch.nn.functional.silu(lw["gate"] @ h) * (lw["up"] @ h)
            x = x + self.all_reduce(lw["down"] @ m)
        return (self.w["lm_head"] @ rms_norm(x, self.w["norm"])).float()


def _decode(model: Decoder, tokens: list[int]) -> tuple[torch.Tensor, float]:
    logits = []
    t0 = time.perf_counter()
    for pos, tok in enumerate(tokens):
        logits.append(model.step(tok, pos))
    return torch.stack(logits), (time.perf_counter() - t0) / len(tokens)


def rank_main(comm: tpcomm.Communicator, cfg: dict, dtype_name: str, port: int):
    torch.set_num_threads(cfg["threads"])
    dtype = getattr(torch, dtype_name)
    w = shard(make_weights(cfg, dtype), cfg, comm.rank, comm.world_size)
    tokens = cfg["tokens"]
    warm = tokens[: min(4, len(tokens))]

    _decode(Decoder(w, cfg, comm.world_size, comm.all_reduce), warm)  # warm-up
    comm.barrier()
    logits, t_tp = _decode(Decoder(w, cfg, comm.world_size, comm.all_reduce), tokens)
    # the same compute with no communication at all (wrong logits): the floor
    comm.barrier()
    _, t_none = _decode(Decoder(w, cfg, comm.world_size, lambda t: t), tokens)

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.world_size
    )
    try:

        def gloo_all_reduce(t):
            dist.all_reduce(t)
            return t

        _decode(Decoder(w, cfg, comm.world_size, gloo_all_reduce), warm)
        dist.barrier()
        logits_gloo, t_gloo = _decode(Decoder(w, cfg, comm.world_size, gloo_all_reduce), tokens)
    finally:
        dist.destroy_process_group()
    return logits, logits_gloo, t_tp, t_gloo, t_none


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    if args.heads % args.ranks or args.ffn % args.ranks:
        p.error("--heads and --ffn must be divisible by --ranks")
    g = torch.Generator().manual_seed(1)
    cfg = {
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "ffn": args.ffn,
        "vocab": args.vocab,
        "seed": 1234,
        "threads": args.threads,
        "tokens": torch.randint(0, args.vocab, (args.steps,), generator=g).tolist(),
    }
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    print(
        f"# tp_decode: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, ffn "
        f"{args.ffn}, vocab {args.vocab}, {args.steps} decode steps, {args.ranks} ranks x "
        f"{args.threads} thread(s); 2 all_reduces per layer per token"
    )
    print(
        f"# {'dtype':>8} {'ms/token tpcomm':>16} {'ms/token gloo':>14} {'speedup':>8} "
        f"{'no-comm floor':>14} {'max |logit diff| vs 1 process':>30} {'same argmax':>12}"
    )
    ok = True
    for dtype_name in dtypes:
        torch.set_num_threads(max(1, args.threads))
        ref, _ = _decode(
            Decoder(make_weights(cfg, getattr(torch, dtype_name)), cfg, 1, lambda t: t),
            cfg["tokens"],
        )
        res = tpcomm.launch(rank_main, args.ranks, args=(cfg, dtype_name, _free_port()))
        logits, logits_gloo, t_tp, t_gloo, _ = res[0]
        # every rank holds the same logits, bitwise (tpcomm's all_reduce is deterministic)
        same_ranks = all(torch.equal(r[0], logits) for r in res)
        diff = (logits - ref).abs().max().item()
        scale = ref.abs().max().item()
        tol = (1e-3 if dtype_name == "float32" else 5e-2) * scale
        argmax = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        t_tp_ms = max(r[2] for r in res) * 1e3
        t_gloo_ms = max(r[3] for r in res) * 1e3
        t_none_ms = max(r[4] for r in res) * 1e3
        print(
            f"  {dtype_name:>8} {t_tp_ms:>16.2f} {t_gloo_ms:>14.2f} "
            f"{t_gloo_ms / t_tp_ms:>7.1f}x {t_none_ms:>14.2f} {diff:>30.3g} {argmax:>11.0%}"
        )
        if not (same_ranks and diff <= tol):
            print(f"# FAILED: ranks identical={same_ranks}, diff {diff:.3g} > tolerance {tol:.3g}")
            ok = False
        if not torch.allclose(logits_gloo, ref, atol=tol, rtol=0):
            print("# FAILED: the gloo run does not match the single-process model either")
            ok = False
    print("# logits match the single-process model" if ok else "# MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
