"""vLLM CPU, tensor parallel 2: tokens per second with vLLM's own shared
memory, with the tpcomm plugin, and with torch.distributed (gloo).

Each engine runs in a process of its own, in the Python that has vLLM (and
tpcomm, installed as a user installs it: ``make bench-vllm`` makes that
environment).  A small Llama (a ``config.json`` this script writes; random
weights, ``load_format="dummy"``: nothing is fetched) decodes greedily at
batch 1, 16 and 64 and prefills 512 tokens (three new prompts each time, the
median; prefix caching off, so that every prompt is computed whole); rounds
interleave the communicators (their order turns each round), and each ratio
is the median of each round's own ratio to vLLM's.

    python benchmarks/vllm_decode.py --python .venv-vllm/bin/python --rounds 3
    python benchmarks/vllm_decode.py --engine tpcomm --batches 1 --tokens 32  # one engine, JSON
    python benchmarks/vllm_decode.py --switch --calls --modes vllm tpcomm none --batches 64

``--switch`` runs one engine and switches the communicators in its workers
between generate calls; ``--calls`` times every collective call there (per
kind and size, the waits for the peer included).

Communicators (``TPCOMM_VLLM``, read by the plugin in each vLLM process):
``vllm`` 0 (the plugin off: vLLM's ``_CPUSHMDistributed``), ``tpcomm`` 1,
``gloo`` torch (vLLM's shared memory off too: torch.distributed over gloo, as
vLLM runs on every CPU without AVX-512), and ``none``: the bound, the
plugin's calls made to return at once (wrong tokens; the time an exchange of
no time would give).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# prefills timed per round and communicator (their median counts)
PREFILLS = 3

MODES = {"vllm": "0", "tpcomm": "1", "gloo": "torch", "none": "1"}

# mode "none": the bound, an exchange that takes no time.  The plugin serves
# the groups, and this sitecustomize (on PYTHONPATH, so in every vLLM process)
# makes its calls exchange nothing (as NoExchange below): only the time counts.
NO_EXCHANGE = """
try:
    from tpcomm import vllm_plugin as _p
except Exception:
    pass
else:
    _p.VllmModule.all_reduce = lambda self, input, group=None: input.mul_(2)
    def _gather(self, input, gather_list, dst=-1, group=None):
        for t in gather_list or ():
            t.copy_(input)
    _p.VllmModule.gather = _gather
    def _all_gather(self, output, input, group=None):
        output.view(-1, input.numel()).copy_(input.view(1, -1))
    _p.VllmModule.all_gather_into_tensor = _all_gather
"""

# A small Llama: 8 layers (two all_reduces each, plus the logits' gather: 17
# collectives a decoded token), bfloat16
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def model_dir(path: str = "") -> str:
    """A model directory: ``path`` (a new temporary one if empty), given the
    small Llama's config.json unless it has one."""
    path = path or tempfile.mkdtemp(prefix="tpcomm-llama-")
    os.makedirs(path, exist_ok=True)
    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        with open(config, "w") as f:
            json.dump(LLAMA, f)
    return path


def engine_env(mode: str) -> dict:
    """The environment of one engine run with communicator ``mode``: a name of
    MODES, and after a colon, settings of its own (``tpcomm:TPCOMM_SPIN_US=50``)."""
    base, _, extra = mode.partition(":")
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in extra.split(",") if kv)
    if base == "none":
        site = tempfile.mkdtemp(prefix="tpcomm-none-")
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(NO_EXCHANGE)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    env.update(
        TPCOMM_VLLM=MODES[base],
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"),
        VLLM_ENABLE_V1_MULTIPROCESSING=env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def prompts(batch: int, length: int, seed: int = 0) -> list:
    import random

    rng = random.Random(seed + batch * 1000 + length)
    return [
        {"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(length)]} for _ in range(batch)
    ]


def run_engine(args: argparse.Namespace) -> dict:
    """One engine (this process; its workers are vLLM's): the timings and tokens."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    out = {"engine": args.engine, "start_s": time.perf_counter() - t0, "decode": {}}
    greedy = SamplingParams(
        temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False
    )
    llm.generate(prompts(1, 16, 99), greedy, use_tqdm=False)  # warm-up
    for b in args.batches:
        ps = prompts(b, 16)
        print(f"# generate batch {b}", flush=True)
        t = time.perf_counter()
        res = llm.generate(ps, greedy, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = [list(r.outputs[0].token_ids) for r in res]
        out["decode"][str(b)] = {"s": dt, "tok_s": sum(map(len, toks)) / dt, "tokens": toks}
    if args.prefill:
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
        llm.generate(prompts(1, args.prefill, 97), one, use_tqdm=False)  # warm-up
        dt, toks = prefills(llm, one, args.prefill)
        out["prefill"] = {"s": dt, "tok_s": args.prefill / dt, "tokens": toks}
    if os.environ.get("TPCOMM_STATS") and os.environ.get("TPCOMM_VLLM") == "1":
        # the workers' records now, while they live: at shutdown vLLM may end
        # a busy worker before its exit handlers run
        llm.collective_rpc(_worker_report)
    return out


def _worker_report(worker) -> bool:
    """In each worker (LLM.collective_rpc): report the tensor-parallel group's
    tpcomm Communicator where TPCOMM_STATS says (tpcomm.stats.finish: once;
    its close or exit then reports nothing more)."""
    from vllm.distributed.parallel_state import get_tp_group

    from tpcomm import stats

    comm = getattr(get_tp_group().device_communicator.dist_module, "comm", None)
    if comm is not None:
        stats.finish(comm)
    return comm is not None


def prefills(llm, one, length: int) -> tuple:
    """The median time of PREFILLS prefills of ``length`` tokens, each prompt
    new (prefix caching is off too: engine_kwargs), and the token each chose."""
    times, toks = [], []
    for i in range(PREFILLS):
        t = time.perf_counter()
        res = llm.generate(prompts(1, length, 1 + i), one, use_tqdm=False)
        times.append(time.perf_counter() - t)
        toks.append(res[0].outputs[0].token_ids[0])
    return statistics.median(times), toks


class NoExchange:
    """A dist_module that exchanges nothing: the bound of an exchange that
    takes no time.  Each call fills its result from this rank's data alone
    (an all_reduce doubles it, a gather repeats it), so the values keep the
    magnitudes of real sums (left alone, they went to NaN and denormals,
    which cost time of their own); the tokens differ from the others'."""

    def all_reduce(self, input, group=None):
        input.mul_(2)

    def gather(self, input, gather_list, dst=-1, group=None):
        for t in gather_list or ():
            t.copy_(input)

    def all_gather_into_tensor(self, output, input, group=None):
        output.view(-1, input.numel()).copy_(input.view(1, -1))


def _worker_use(worker, mode: str, reset: bool = True):
    """In each worker (LLM.collective_rpc): the tensor-parallel group's
    communicator calls ``mode`` from now on (vllm, tpcomm[:SPIN_US,YIELD_US],
    gloo, none); returns the tpcomm Communicator's record since the last
    switch."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators import cpu_communicator as cc
    from vllm.distributed.parallel_state import get_tp_group

    dc = get_tp_group().device_communicator
    mods = dc.__dict__.setdefault("_bench_modules", {"tpcomm": dc.dist_module})
    base, _, waits = mode.partition(":")
    if base == "vllm" and "vllm" not in mods:
        if not hasattr(torch.ops._C, "init_shm_manager"):
            raise RuntimeError("vLLM's CPU library here has no shared memory (no AVX-512)")
        mods["vllm"] = cc._CPUSHMDistributed(dc)  # collective: every worker is here
    ours = mods["tpcomm"]
    rec = ours.comm.stats(reset=reset)
    engine = ours.comm._shm.engine
    if base == "tpcomm":
        from tpcomm import _env

        given = [float(x) for x in waits.split(",")] if waits else []
        engine.set_waits(*given, *[_env.spin_us(), _env.yield_us(), 200.0][len(given) :])
    dc.dist_module = {
        "tpcomm": ours, "gloo": dist, "none": NoExchange(), "vllm": mods.get("vllm"),
    }[base]  # fmt: skip
    return rec


class Timed:
    """A dist_module that times every call of the one it wraps (``--calls``):
    per call kind and size, the count and the seconds, inside the worker."""

    def __init__(self, inner):
        self.inner, self.acc = inner, {}

    def _run(self, name, x, fn, *a, **kw):
        t = time.perf_counter()
        fn(*a, **kw)
        c = self.acc.setdefault(f"{name} {x.numel() * x.element_size() >> 10} KiB", [0, 0.0])
        c[0] += 1
        c[1] += time.perf_counter() - t

    def all_reduce(self, input, group=None):
        self._run("all_reduce", input, self.inner.all_reduce, input, group=group)

    def gather(self, input, gather_list, dst=-1, group=None):
        self._run("gather", input, self.inner.gather, input, gather_list, dst=dst, group=group)

    def all_gather_into_tensor(self, output, input, group=None):
        fn = self.inner.all_gather_into_tensor
        self._run("all_gather", input, fn, output, input, group=group)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _worker_calls(worker, on: bool):
    """In each worker: time the group's collective calls from now on (on), or
    stop and return {kind and size: [count, seconds]} since they started."""
    from vllm.distributed.parallel_state import get_tp_group

    dc = get_tp_group().device_communicator
    mod = dc.dist_module
    if isinstance(mod, Timed):
        dc.dist_module = mod.inner
    if on:
        dc.dist_module = Timed(dc.dist_module)
        return None
    return mod.acc if isinstance(mod, Timed) else {}


def calls_line(m: str, b: int, per_worker: list) -> str:
    """The calls of one generate: per worker, each kind's count x mean time."""
    parts = []
    for w, acc in enumerate(per_worker):
        total = sum(v[1] for v in acc.values())
        kinds = " ".join(
            f"{k}: {v[0]}x{v[1] / v[0] * 1e6:.0f}us"
            for k, v in sorted(acc.items(), key=lambda kv: -kv[1][1])[:4]
        )
        parts.append(f"worker {w} {total * 1e3:.0f} ms in calls ({kinds})")
    return f"#   {m} b{b}: " + "; ".join(parts)


def run_switch(args: argparse.Namespace) -> dict:
    """One engine (the plugin on), the communicators switched between generate
    calls in every worker, rounds interleaved: no engine start, process
    placement or machine state between two communicators' numbers."""
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    greedy = SamplingParams(
        temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False
    )
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate(prompts(1, 16, 99), greedy, use_tqdm=False)  # warm-up
    if args.prefill:
        llm.generate(prompts(1, args.prefill, 97), one, use_tqdm=False)
    rounds = []
    for r in range(args.rounds):
        order = args.modes[r % len(args.modes) :] + args.modes[: r % len(args.modes)]
        got = {}
        for m in order:
            llm.collective_rpc(_worker_use, args=(m,))
            llm.generate(prompts(1, 16, 98), greedy, use_tqdm=False)  # settle
            llm.collective_rpc(_worker_use, args=(m,))  # records from here
            cells = {}
            for b in args.batches:
                if args.calls:
                    llm.collective_rpc(_worker_calls, args=(True,))
                t = time.perf_counter()
                res = llm.generate(prompts(b, 16), greedy, use_tqdm=False)
                dt = time.perf_counter() - t
                toks = [list(x.outputs[0].token_ids) for x in res]
                cells[str(b)] = {"s": dt, "tok_s": sum(map(len, toks)) / dt, "tokens": toks}
                if args.calls:
                    cells[str(b)]["calls"] = llm.collective_rpc(_worker_calls, args=(False,))
                    print(calls_line(m, b, cells[str(b)]["calls"]), flush=True)
            recs = llm.collective_rpc(_worker_use, args=(m,))
            got[m] = {"decode": cells, "records": recs if m.startswith("tpcomm") else None}
            if args.prefill:
                dt, toks = prefills(llm, one, args.prefill)
                got[m]["prefill"] = {"s": dt, "tok_s": args.prefill / dt, "tokens": toks}
        rounds.append(got)
        print(round_line(args, r, got), flush=True)
    llm.collective_rpc(_worker_use, args=("tpcomm",))
    return {"rounds": rounds}


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        dtype="bfloat16",
        enforce_eager=True,
        distributed_executor_backend="mp",
        max_model_len=1024,
        max_num_seqs=max(args.batches + [1]),
        max_num_batched_tokens=max(1024, args.prefill),
        # every prompt computed whole: with prefix caching on (vLLM's default
        # for Llama), a prompt seen before costs its last block only
        enable_prefix_caching=False,
        seed=0,
    )


def spawn(args: argparse.Namespace, mode: str, model: str) -> dict:
    """One engine in a child process of ``args.python``; its JSON result."""
    cmd = [
        args.python, os.path.abspath(__file__), "--engine", mode, "--model", model,
        "--tokens", str(args.tokens), "--prefill", str(args.prefill),
        "--tp", str(args.tp), "--pp", str(args.pp),
        "--batches", *map(str, args.batches),
    ]  # fmt: skip
    with tempfile.TemporaryFile("w+") as log:
        p = subprocess.run(
            cmd, env=engine_env(mode), stdout=subprocess.PIPE, stderr=log, text=True,
            timeout=args.timeout,
        )  # fmt: skip
        if p.returncode != 0:
            log.seek(0)
            sys.stderr.write(log.read()[-6000:])
            raise SystemExit(f"# engine {mode} failed with exit code {p.returncode}")
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"# engine {mode} printed no result")


NO_SHM = (
    "vLLM's shared memory is not in its build for this CPU (x86 without AVX-512F: its _C_AVX2 "
    "library has no shm ops), so vLLM runs tensor parallelism over gloo here: gloo is the "
    "baseline, there is no separate vllm mode"
)


def vllm_without_shm() -> bool:
    """Whether vLLM's CPU wheel runs this CPU without its shared memory: x86
    without AVX-512F loads its _C_AVX2 library, which has no shm ops (the same
    rule as tpcomm perf's vLLM peer, tpcomm.perf.peers)."""
    import platform

    if platform.machine() != "x86_64":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512f" not in line.split()
    except OSError:
        pass
    return False


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable, help="the Python that has vLLM")
    ap.add_argument("--engine", help="run one engine here (a mode), print JSON")
    ap.add_argument("--model", help="model directory (default: a config written to a temp dir)")
    ap.add_argument(
        "--modes",
        nargs="+",
        help="communicators (MODES), each optionally with settings: tpcomm:TPCOMM_SPIN_US=50 "
        "(default: vllm tpcomm gloo; gloo tpcomm where vLLM has no shared memory: NO_SHM)",
    )
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=96, help="tokens decoded per sequence")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens prefilled (0: none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per engine")
    ap.add_argument("-J", "--json", help="write every round's results here")
    ap.add_argument(
        "--switch", action="store_true",
        help="one engine, the communicators switched in its workers between generate calls "
        "(modes: vllm, tpcomm[:SPIN_US,YIELD_US,LOST_US], gloo, none)",
    )  # fmt: skip
    ap.add_argument(
        "--calls", action="store_true",
        help="with --switch: time every collective call inside the workers, per kind and size",
    )  # fmt: skip
    ap.add_argument("--report", metavar="JSON", help="print the report of a -J file again")
    args = ap.parse_args()
    if args.modes is None:
        args.modes = ["gloo", "tpcomm"] if vllm_without_shm() else ["vllm", "tpcomm", "gloo"]
        if args.modes[0] == "gloo" and not args.engine:
            print(f"# {NO_SHM}", flush=True)
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        args.__dict__.update({k: v for k, v in saved["args"].items() if k != "report"})
        for i, got in enumerate(saved["rounds"]):
            print(round_line(args, i, got))
        report(args, saved["rounds"])
        return
    if args.switch:
        args.model = model_dir(args.model)
        os.environ.update(engine_env("tpcomm"))
        # collective_rpc with a function of this script: vLLM pickles it only so
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        res = run_switch(args)
        report(args, res["rounds"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"cpu": cpu_name(), "model": LLAMA, "args": vars(args), **res}, f)
        return
    if args.engine:
        if os.environ.get("TPCOMM_STATS"):  # run_engine's collective_rpc (_worker_report)
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        args.model = model_dir(args.model)
        print(json.dumps(run_engine(args)), flush=True)
        return
    model = model_dir(args.model)
    rounds = []
    for r in range(args.rounds):
        order = args.modes[r % len(args.modes) :] + args.modes[: r % len(args.modes)]
        got = {m: spawn(args, m, model) for m in order}
        rounds.append(got)
        print(round_line(args, r, got), flush=True)
    report(args, rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "model": LLAMA, "args": vars(args), "rounds": rounds}, f)


def round_line(args: argparse.Namespace, r: int, got: dict) -> str:
    """Round r's tokens/s, a line per round as the run goes."""
    return f"# round {r + 1}: " + "  ".join(
        f"{m} " + " ".join(f"b{b}={got[m]['decode'][str(b)]['tok_s']:.1f}" for b in args.batches)
        for m in args.modes
    )


def report(args: argparse.Namespace, rounds: list) -> None:
    base = args.modes[0]
    m = LLAMA
    print(
        f"# vLLM CPU, TP={args.tp}, {cpu_name()}; Llama of {m['num_hidden_layers']} layers, "
        f"hidden {m['hidden_size']}, MLP {m['intermediate_size']}, {m['num_attention_heads']} "
        f"heads ({m['num_key_value_heads']} KV), vocabulary {m['vocab_size']}, bfloat16, random "
        f"weights; greedy decode of {args.tokens} tokens a sequence, 16-token prompts"
    )
    print(
        f"# tokens/s (range over {len(rounds)} rounds) and the median of each round's "
        f"ratio to {base}"
    )
    cells = [
        (f"decode batch {b}", lambda g, b=b: g["decode"][str(b)]["tok_s"]) for b in args.batches
    ]
    if args.prefill:
        cells.append((f"prefill {args.prefill}", lambda g: g["prefill"]["tok_s"]))
    print("| cell | " + " | ".join(args.modes) + " |")
    print("|---|" + "---:|" * len(args.modes))
    for name, get in cells:
        row = [name]
        for m in args.modes:
            vals = [get(g[m]) for g in rounds]
            ratio = statistics.median(get(g[m]) / get(g[base]) for g in rounds)
            row.append(f"{ratio:.3f} ({min(vals):.1f}-{max(vals):.1f})")
        print("| " + " | ".join(row) + " |")
    if "gloo" in args.modes:
        for m in args.modes:
            if m != "gloo":
                r = [
                    statistics.median(get(g[m]) / get(g["gloo"]) for g in rounds)
                    for _, get in cells
                ]
                print(f"# {m} / gloo: " + ", ".join(f"{n} {x:.2f}" for (n, _), x in zip(cells, r)))
    for m in args.modes[1:]:
        if m.startswith("none"):
            continue  # no exchange: other tokens, by design
        eq = all(
            g[m]["decode"][str(b)]["tokens"] == g[base]["decode"][str(b)]["tokens"]
            for g in rounds
            for b in args.batches
        ) and all(
            g[m]["prefill"]["tokens"] == g[base]["prefill"]["tokens"]
            for g in rounds
            if args.prefill
        )
        print(f"# {m}: greedy tokens {'identical to' if eq else 'DIFFER from'} {base}'s")


if __name__ == "__main__":
    main()
