/*
 * All-reduce: one-shot and two-shot over the collective channel's slots, the
 * stores of their copies, chosen as they run (with the engine methods that
 * show and set that choice), and the plan of every all-reduce (ar_plan: which
 * algorithm; zero copy itself and its choice against the copies are
 * zerocopy.c's).
 */
#include "tpcomm.h"

/*
 * The stores of a chunk's copies into the slots, chosen as it runs.  A plain
 * store into a slot line the peers read last round must first take the line
 * from their caches; a non-temporal one sends it to memory, and the peers
 * then read it from there.  Which costs less changes with the machine's
 * state, by seconds on a shared VM (benchmarks/oneshot.c: a 16 KiB one-shot
 * 1.2 us with plain stores against 2.9 non-temporal, and minutes later 4.4
 * against 2.5, on the same cores; benchmarks/stores.py).  So rank 0 times
 * the parts of a chunk it does not wait in, its copies and reductions (not
 * the waits: they hold the peers' lateness), on one chunk in 16, with the
 * core's cheap clock (ticks: the time stamp counter), and keeps a moving
 * average per algorithm, size (a bucket per power of two from 4 KiB; the
 * last holds everything from 1 MiB) and store kind.  What it times
 * includes reading the peers' slots, which is what their stores cost it, so
 * every rank must store alike: rank 0 decides and writes its choice into the
 * header, which every rank reads before its copy.  Two chunks in every
 * STORE_EXPLORE rounds use the other kind, on every rank at once (the round
 * numbers are the same everywhere), the second timed.  A trial does not
 * switch by itself: it starts a probation (below), in which the other kind
 * runs and rank 0 times it once settled.  The averages are kept apart for the
 * 16-bit floats, whose reduce costs more a byte (wide_floats: their costs
 * against their own; a trial on a float32 chunk measured against the average
 * of bfloat16 ones would flip the choice for no change of state); the choice
 * itself is one per bucket, the machine's state moving both alike.  A timed
 * part that took more than twice the average counts as twice (a preempted
 * call moves it a little; a change of state moves it sample by sample).
 * Only the copies' speed changes: the bytes, so the bits, are the same
 * either way, and a rank that reads the choice a chunk late is merely slower
 * for a chunk.  Off where an explicit
 * TPCOMM_NT_MIN_BYTES fixes the stores (then nt_min decides), where no
 * non-temporal copy exists (copy_nt_available), and for a chunk that a
 * rank's threads share.
 */
#define STORE_EXPLORE 256u

/*
 * Probation.  A trial's second chunk tells the steady cost of non-temporal
 * stores (they take no line first), but not that of plain ones after
 * non-temporal ones: the lines they write were sent to memory, not left in
 * any cache, and a plain store must first take each back.  That lasts until
 * the copies have gone once round their places in the slots (trial_warm):
 * a 1 MiB two-shot all_reduce on AMD Zen 4 took 84, 79, 79, 63, then 52 us
 * after the switch, and its trials timed plain stores at 2.1-2.8x their
 * steady cost, about what non-temporal ones cost; a run that had chosen
 * non-temporal stores on its first calls (which pay for the segment's first
 * touch) kept them for seconds at 1.65x the time (docs/DECISIONS.md).
 *
 * So a trial of the other kind that costs under 0.8 of the kind in use, or
 * any trial of plain stores once `wait` such trials have passed, puts the
 * bucket on probation: rank 0 times STORE_PROBATION chunks of the kind in
 * use afresh (its average may be of another minute), then flips the
 * bucket's choice, and its chunks run the other kind (every rank stores
 * alike: they follow the header); each time it lets trial_warm chunks pass
 * first (a trial's chunks of the other kind came just before).  The other
 * kind's mean under STORE_KEEP of the first keeps it; over twice the first
 * after two chunks, or not under it after all, and the choice goes back,
 * and the wait before the next probation of plain
 * stores doubles (1, 2, 4 ... 128 trials).  Where non-temporal stores do
 * cost less, by seconds on a shared VM, plain ones can cost 6x them (1 MiB
 * two-shot on AMD Zen 4: 480 against 80 us a call); a probation then ends
 * two timed chunks after its warm-up, and in the long run one comes every
 * 128 x 256 rounds.
 * Non-temporal stores are not tried on probation unless their trial says
 * so: they leave nothing behind that their trial would miss.
 */
#define STORE_PROBATION 8
#define STORE_KEEP 0.9f
#define STORE_BACKOFF_MAX 7 /* wait: uint8_t */
/* chunks of the other reduce class after which a probation is dropped,
 * its choice as it was: where its own class stopped coming, the others
 * would run its trial kind for good, untimed */
#define STORE_OTHERS 64

/* bfloat16 and float16: a reduce that costs more a byte than float32's (the
 * conversions), so their own two-shot switch point and their own costs of
 * the stores */
static inline int wide_floats(int dtype)
{
    return dtype == DT_BF16 || dtype == DT_F16;
}

typedef struct {
    int b;          /* bucket, -1: not chosen as it runs (nt_min decides) */
    int cls;        /* reduce class: wide_floats(dtype) */
    int nt;         /* the stores of this chunk (when b >= 0) */
    int timed;      /* rank 0 times this chunk */
    int prob;       /* ... for its bucket's probation */
    uint64_t spent; /* ticks in the timed parts so far */
    uint64_t mark;  /* when the current part began */
} stores_t;

/* rank 0's store choice for bucket b in the header (1: non-temporal) */
int stores_bit(const Engine *e, int b)
{
    return (int)(atomic_load_explicit(&HDR((Engine *)e)->stores, memory_order_relaxed) >> b) & 1;
}

/* The store kind bucket b uses now: rank 0's choice (every rank keeps the
 * last it saw, for stores()) */
static int store_choice(Engine *e, int b)
{
    int nt = stores_bit(e, b);
    if (nt != e->stores.nt[b]) {
        e->stores.nt[b] = (uint8_t)nt;
        e->stores.switches++;
    }
    return nt;
}

/* Where nothing chooses the stores as it runs: non-temporal inside the
 * window nt_min..nt_max (bytes) */
static inline int nt_window(const Engine *e, size_t n)
{
    return n >= e->nt_min && n <= e->nt_max;
}

/* The bucket of a chunk of `bytes` by `algo` (0 one-shot, 1 two-shot) whose
 * stores are chosen as it runs, -1 where nt_min decides them */
static int store_bucket(const Engine *e, size_t bytes, int algo)
{
    if (!e->stores.on || bytes < (1u << STORE_MIN_LOG2) || pool_splits(e->pool, bytes))
        return -1;
    return size_bucket(bytes, STORE_MIN_LOG2, STORE_SIZES) + algo * STORE_SIZES;
}

/* A chunk of `bytes` of dtype by `algo` (0 one-shot, 1 two-shot: `rounds`
 * rounds a chunk) begins: its bucket, reduce class, stores and whether it is
 * timed. */
static void store_probation_drop(Engine *e, int b);

static stores_t store_begin(Engine *e, size_t bytes, int dtype, int algo, unsigned rounds)
{
    stores_t sc = {store_bucket(e, bytes, algo), wide_floats(dtype), 0, 0, 0, 0, 0};
    if (sc.b < 0)
        return sc;
    const unsigned phase = (unsigned)(e->round & (STORE_EXPLORE - 1));
    const int explore = phase < 2 * rounds;
    sc.nt = store_choice(e, sc.b) ^ explore;
    e->stores.explored += (uint64_t)explore;
    if (e->rank == 0 && e->stores.prob[sc.b]) { /* on probation: its class's own chunks */
        sc.timed = sc.prob = !explore && e->stores.prob[sc.b] == sc.cls + 1;
        if (!explore && !sc.prob && ++e->stores.prob_other[sc.b] >= STORE_OTHERS)
            store_probation_drop(e, sc.b);
    } else
        sc.timed = e->rank == 0 &&
                   ((phase >= rounds && phase < 2 * rounds) || (phase / rounds) % 16 == 5);
    if (sc.timed)
        sc.mark = ticks();
    return sc;
}

/* the stores of a copy of n bytes into a slot */
static int store_nt(const Engine *e, const stores_t *sc, size_t n)
{
    return sc->b >= 0 ? sc->nt : nt_window(e, n);
}

/*
 * The stores of the other collectives' copies into a slot (rounds.c, p2p.c):
 * n bytes, a round's copies of this rank, store as an all_reduce chunk of n
 * bytes does now.  Theirs are the same hand-off from one core to another,
 * which the machine's state makes cheaper one way or the other alike
 * (broadcast and all_gather in this VM's slow mode: 2-4x faster with
 * non-temporal stores; in its fast mode 1.5-2.4x slower, docs/DECISIONS.md),
 * and the all_reduce chunks learn which as they run.  They time nothing
 * themselves: a broadcast's root would time only its own stores, which
 * non-temporal ones make cheap while the readers pay.  A size no all_reduce
 * chunk has timed follows the nearest size one has (store_spread), plain
 * stores before any has; where the choice is off, nt_min decides, as for
 * all_reduce.
 */
int slot_stores_nt(Engine *e, size_t n)
{
    const int b = store_bucket(e, n, n >= e->twoshot_min);
    if (b < 0)
        return nt_window(e, n);
    const int nt = stores_bit(e, b);
    e->stores.followed_nt += (uint64_t)nt;
    return nt;
}

static void store_pause(stores_t *sc) /* a wait begins: not timed */
{
    if (sc->timed)
        sc->spent += ticks() - sc->mark;
}

static void store_resume(stores_t *sc)
{
    if (sc->timed)
        sc->mark = ticks();
}

/* whether any chunk of bucket b was timed (either reduce class) */
static int store_timed(const Engine *e, int b)
{
    for (int k = 0; k < 2; k++)
        if (e->stores.cost[k][b][0] > 0.0f || e->stores.cost[k][b][1] > 0.0f)
            return 1;
    return 0;
}

/*
 * Rank 0, when a bucket is first timed or changes its mind: every bucket no
 * chunk has timed yet takes the choice of the nearest one that has (by size,
 * its own algorithm's first).  The machine's state moves every size the same
 * way (docs/DECISIONS.md), so a size met for the first time starts from what
 * the others learnt instead of from plain stores, and the other collectives'
 * copies of a size no all_reduce runs follow the nearest that does
 * (slot_stores_nt).  A bucket a zero-copy trial holds non-temporal is left
 * to it.
 */
static void store_spread(Engine *e)
{
    const uint32_t bits = atomic_load_explicit(&HDR(e)->stores, memory_order_relaxed);
    uint32_t want = bits;
    for (int u = 0; u < STORE_BUCKETS; u++) {
        if (store_timed(e, u) || u == e->zc.st_bucket - 1)
            continue;
        int near = -1, dist = 0;
        for (int v = 0; v < STORE_BUCKETS; v++) {
            int d = 2 * abs(u % STORE_SIZES - v % STORE_SIZES) +
                    (u / STORE_SIZES != v / STORE_SIZES); /* the other algorithm: farther */
            if (store_timed(e, v) && (near < 0 || d < dist)) {
                near = v;
                dist = d;
            }
        }
        if (near >= 0)
            want = (want & ~(1u << u)) | (((bits >> near) & 1u) << u);
    }
    if (want != bits)
        atomic_store_explicit(&HDR(e)->stores, want, memory_order_relaxed);
}

/* rank 0: bucket b's choice in the header set to nt (zerocopy.c's trials too) */
void store_set(Engine *e, int b, int nt)
{
    if (nt)
        atomic_fetch_or_explicit(&HDR(e)->stores, 1u << b, memory_order_relaxed);
    else
        atomic_fetch_and_explicit(&HDR(e)->stores, ~(1u << b), memory_order_relaxed);
}

/* rank 0: bucket b goes on probation for the chunks of reduce class cls,
 * `bytes` each, the kind in use `cur` */
static void store_probation_begin(Engine *e, int b, int cls, int cur, size_t bytes)
{
    e->stores.prob[b] = (uint8_t)(cls + 1);
    e->stores.prob_stage[b] = 1;
    e->stores.prob_kind[b] = (uint8_t)cur;
    e->stores.prob_warm[b] = (uint8_t)trial_warm(e, bytes);
    e->stores.prob_n[b] = 0;
    e->stores.prob_other[b] = 0;
    e->stores.prob_sum[b] = 0.0f;
    e->stores.probations++;
}

/* rank 0: bucket b's probation ends undecided, its choice as it was */
static void store_probation_drop(Engine *e, int b)
{
    if (e->stores.prob_stage[b] == 2)
        store_set(e, b, e->stores.prob_kind[b]);
    e->stores.prob[b] = 0;
}

/* rank 0: a timed chunk of bucket b's probation, x ticks per KiB */
static void store_probation(Engine *e, const stores_t *sc, float x, size_t bytes)
{
    const int b = sc->b, cls = sc->cls, had = e->stores.prob_kind[b];
    const int stage = e->stores.prob_stage[b];
    if (sc->nt != (stage == 1 ? had : !had)) { /* a zero-copy trial took the bucket */
        e->stores.prob[b] = 0;
        return;
    }
    if (e->stores.prob_warm[b]) {
        e->stores.prob_warm[b]--;
        return;
    }
    e->stores.prob_sum[b] += x;
    const float mean = e->stores.prob_sum[b] / (float)++e->stores.prob_n[b];
    if (stage == 1) { /* the kind in use, timed afresh: now the other */
        if (e->stores.prob_n[b] < STORE_PROBATION)
            return;
        e->stores.prob_base[b] = mean;
        e->stores.prob_stage[b] = 2;
        e->stores.prob_warm[b] = (uint8_t)trial_warm(e, bytes);
        e->stores.prob_n[b] = 0;
        e->stores.prob_sum[b] = 0.0f;
        store_set(e, b, !had);
        return;
    }
    const float base = e->stores.prob_base[b];
    if (e->stores.prob_n[b] < STORE_PROBATION && !(e->stores.prob_n[b] >= 2 && mean > 2.0f * base))
        return;
    float *c = e->stores.cost[cls][b];
    c[had] = base;
    c[!had] = mean;
    e->stores.prob[b] = 0;
    if (mean < STORE_KEEP * base) {
        e->stores.kept++;
        e->stores.backoff[cls][b] = 0;
        e->stores.wait[cls][b] = 0;
        store_spread(e);
        return;
    }
    store_set(e, b, had);
    if (had) { /* plain stores failed theirs: wait longer for the next */
        if (e->stores.backoff[cls][b] < STORE_BACKOFF_MAX)
            e->stores.backoff[cls][b]++;
        e->stores.wait[cls][b] = (uint8_t)(1u << e->stores.backoff[cls][b]);
    }
}

/* The chunk is done (rank 0: learn from it) */
static void store_end(Engine *e, stores_t *sc, size_t bytes)
{
    if (sc->b >= 0) { /* tests (fault_stores): one kind of store made slow */
        uint64_t ns = e->fault.store_ns[sc->nt];
        if (sc->nt != e->fault.last_nt[sc->b])
            e->fault.since[sc->b] = 0;
        e->fault.last_nt[sc->b] = (uint8_t)sc->nt;
        if (!sc->nt && e->fault.since[sc->b]++ < e->fault.leftover_chunks)
            ns += e->fault.leftover_ns;
        spin_for_ns(ns);
    }
    if (!sc->timed)
        return;
    store_pause(sc);
    float x = (float)sc->spent * 1024.0f / (float)bytes, *c = e->stores.cost[sc->cls][sc->b];
    if (sc->prob) {
        store_probation(e, sc, x, bytes);
        return;
    }
    const int b = sc->b, cls = sc->cls, nt = sc->nt, cur = e->stores.nt[b];
    const int first = !store_timed(e, b);
    if (c[nt] > 0.0f && x > 2.0f * c[nt])
        x = 2.0f * c[nt];
    c[nt] = c[nt] == 0.0f ? x : c[nt] + (x - c[nt]) * (nt == cur ? 0.25f : 0.5f);
    if (nt != cur && c[cur] > 0.0f && e->zc.st_bucket - 1 != b) { /* a trial */
        const int wins = c[nt] < 0.8f * c[cur];
        const int due = !nt && !e->stores.wait[cls][b];
        if (!nt && e->stores.wait[cls][b])
            e->stores.wait[cls][b]--;
        if (wins || due)
            store_probation_begin(e, b, cls, cur, bytes);
    }
    if (first)
        store_spread(e);
}

/* round_sync, its wait left out of the chunk's time */
static int sync_untimed(Engine *e, stores_t *sc, uint32_t kind, int dtype, int op, uint64_t count,
                        uint64_t arg, PyThreadState **ts)
{
    store_pause(sc);
    int st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, arg, ts);
    store_resume(sc);
    return st;
}

/* Fault injection for tests: the copies of an all_reduce chunk whose stores
 * are chosen as it runs (allreduce.c) take this many more microseconds,
 * plain and non-temporal ones apart, and the first `chunks` plain ones of a
 * bucket after a non-temporal one `leftover` more (what the lines that
 * non-temporal stores sent to memory cost the plain ones after them). */
PyObject *eng_fault_stores(Engine *e, PyObject *args)
{
    double us[2], left = 0.0;
    unsigned chunks = 0;
    if (!PyArg_ParseTuple(args, "dd|dI", &us[0], &us[1], &left, &chunks))
        return NULL;
    for (int k = 0; k < 2; k++)
        e->fault.store_ns[k] = us[k] > 0 ? (uint64_t)(us[k] * 1e3) : 0;
    e->fault.leftover_ns = left > 0 ? (uint64_t)(left * 1e3) : 0;
    e->fault.leftover_chunks = chunks;
    Py_RETURN_NONE;
}

/* set_stores_auto(on): all_reduce chunks choose their stores as they run
 * (allreduce.c), where a non-temporal copy exists; off: nt_min decides.
 * Turning it on starts from plain stores and nothing learnt. */
PyObject *eng_set_stores_auto(Engine *e, PyObject *arg)
{
    int v = PyObject_IsTrue(arg);
    if (v < 0)
        return NULL;
    if (refuse_if_busy(e, "set_stores_auto") < 0)
        return NULL;
    memset(&e->stores, 0, sizeof e->stores);
    e->stores.on = v && copy_nt_available();
    if (e->rank == 0 && e->base) /* plain stores until rank 0 learns otherwise */
        atomic_store_explicit(&HDR(e)->stores, 0, memory_order_relaxed);
    return PyBool_FromLong(e->stores.on);
}

/* stores() -> {"on", "nt": [per bucket], "cost": [[plain, nt] ticks per KiB],
 * "cost16": the same for bfloat16 and float16, "switches", "followed_nt",
 * "min_bytes", "sizes", "nt_copies", "probations", "kept", "trying": the
 * buckets whose probation runs the other kind now (rank 0)}: what the
 * all_reduce chunks learnt; the buckets: one-shot by size (a power of two
 * from min_bytes; `sizes` of them, the last from 1 MiB up), then two-shot the
 * same; followed_nt: the other collectives' copies that followed a
 * non-temporal choice (slot_stores_nt); nt_copies: whether a non-temporal
 * copy exists with the kernels in use (tests, benchmarks, tpcomm perf) */
PyObject *eng_stores(Engine *e, PyObject *unused)
{
    (void)unused;
    PyObject *nt = PyList_New(STORE_BUCKETS), *cost = PyList_New(STORE_BUCKETS);
    PyObject *cost16 = PyList_New(STORE_BUCKETS), *trying = PyList_New(0);
    if (!nt || !cost || !cost16 || !trying) {
        Py_XDECREF(nt);
        Py_XDECREF(cost);
        Py_XDECREF(cost16);
        Py_XDECREF(trying);
        return NULL;
    }
    for (int b = 0; b < STORE_BUCKETS; b++) {
        PyList_SET_ITEM(nt, b, PyLong_FromLong(e->stores.nt[b]));
        const float *c = e->stores.cost[0][b], *c16 = e->stores.cost[1][b];
        PyList_SET_ITEM(cost, b, Py_BuildValue("(dd)", (double)c[0], (double)c[1]));
        PyList_SET_ITEM(cost16, b, Py_BuildValue("(dd)", (double)c16[0], (double)c16[1]));
        PyObject *bo = e->stores.prob[b] && e->stores.prob_stage[b] == 2 ? PyLong_FromLong(b) : NULL;
        if (bo && PyList_Append(trying, bo) < 0) {
            Py_DECREF(bo);
            Py_DECREF(nt);
            Py_DECREF(cost);
            Py_DECREF(cost16);
            Py_DECREF(trying);
            return NULL;
        }
        Py_XDECREF(bo);
    }
    return Py_BuildValue("{s:O,s:N,s:N,s:N,s:K,s:K,s:K,s:i,s:O,s:K,s:K,s:N}", "on",
                         e->stores.on ? Py_True : Py_False, "nt", nt, "cost", cost, "cost16",
                         cost16, "switches",
                         (unsigned long long)e->stores.switches, "followed_nt",
                         (unsigned long long)e->stores.followed_nt, "min_bytes",
                         (unsigned long long)(1u << STORE_MIN_LOG2), "sizes", STORE_SIZES,
                         "nt_copies", copy_nt_available() ? Py_True : Py_False, "probations",
                         (unsigned long long)e->stores.probations, "kept",
                         (unsigned long long)e->stores.kept, "trying", trying);
}

/* Two-shot's reduce with one thread goes REDUCE_BLOCK bytes of the result at
 * a time, each block copied to the slot while it is still in L1, where the
 * whole shard reduced first was copied back out of L2 or memory (AMD Zen 3,
 * world 2, the two forms in turns in the same ranks, 9 rounds: 4 MiB float32
 * 0.90x, 16 MiB 0.94x, 1 MiB 0.96x; 16 KiB blocks 0.90-1.04x). */
#define REDUCE_BLOCK 8192

/* e->srcs: every rank's copy of a chunk's bytes from off on, this rank's in
 * src, the others' in their slot p at `at` (the reduces of both steps) */
static void point_srcs(Engine *e, char *src, int p, size_t at, size_t off)
{
    for (int r = 0; r < e->world; r++)
        e->srcs[r] = r == e->rank ? (void *)(src + off) : (void *)(slot_of(e, r, p) + at + off);
}

/*
 * Two-shot step for one chunk of m elements at src: the chunk is cut into W
 * shards (32-element aligned); rank r reduces shard r only.
 *   round n   (slot p):   every rank copies in all shards but its own, publishes;
 *                         rank r reduces shard r from everyone's slot p (its own
 *                         part from src) into src, and copies it to its slot 1-p
 *   round n+1 (slot 1-p): publish; every rank copies the other shards' results
 *                         from their owners' slot 1-p into src.
 * Slot 1-p is free when it is written: it was last read in round n-1, and every
 * peer published round n, so every peer is done with n-1.  Each rank reads
 * 2(W-1)/W of the chunk from its peers instead of (W-1), and reduces 1/W.
 */
static int twoshot_chunk(Engine *e, char *src, size_t m, int dtype, int op, uint32_t kind,
                         uint64_t count, uint64_t arg, PyThreadState **ts)
{
    const size_t es = dt_size[dtype];
    const int w = e->world, me = e->rank;
    const size_t lo = shard_start(m, w, me), hi = shard_start(m, w, me + 1);
    const uint64_t n = e->round + 1; /* the round of the copies in; n + 1: of the shards */
    const int p = (int)(n & 1);
    const size_t in_at = slot_pos(e, n, m * es), out_at = slot_pos(e, n + 1, m * es);
    char *in = slot_of(e, me, p) + in_at;
    stores_t sc = store_begin(e, m * es, dtype, 1, 2);
    par_copy(e->pool, in, src, lo * es, store_nt(e, &sc, lo * es));
    par_copy(e->pool, in + hi * es, src + hi * es, (m - hi) * es, store_nt(e, &sc, (m - hi) * es));
    int st = sync_untimed(e, &sc, kind, dtype, op, count, arg, ts);
    if (st != ST_OK)
        return st;
    char *out = slot_of(e, me, 1 - p) + out_at;
    const int nt = store_nt(e, &sc, (hi - lo) * es);
    if (pool_splits(e->pool, (hi - lo) * es)) {
        point_srcs(e, src, p, in_at, lo * es);
        par_reduce(e->pool, dtype, op, src + lo * es, e->srcs, w, hi - lo);
        par_copy(e->pool, out + lo * es, src + lo * es, (hi - lo) * es, nt);
    } else {
        /* one thread: each block copied to the slot while it is in L1 */
        const size_t blk = REDUCE_BLOCK / es;
        for (size_t b = lo; b < hi; b += blk) {
            const size_t k = hi - b < blk ? hi - b : blk;
            point_srcs(e, src, p, in_at, b * es);
            do_reduce_copy(dtype, op, src + b * es, out + b * es, e->srcs, w, k, nt);
        }
    }
    st = sync_untimed(e, &sc, kind, dtype, op, count, arg, ts);
    if (st != ST_OK)
        return st;
    for (int i = 1; i < w; i++) {
        int j = (me + i) % w;
        size_t jlo = shard_start(m, w, j), jhi = shard_start(m, w, j + 1);
        par_copy_out(e->pool, src + jlo * es, slot_of(e, j, 1 - p) + out_at + jlo * es,
                     (jhi - jlo) * es);
    }
    store_end(e, &sc, m * es);
    return ST_OK;
}

/* One-shot step for one chunk of m elements at src: copy it into this rank's
 * slot p, publish, reduce every rank's slot (its own part from src) into src. */
static int oneshot_chunk(Engine *e, char *src, size_t m, int dtype, int op, uint32_t kind,
                         uint64_t count, uint64_t arg, PyThreadState **ts)
{
    const size_t bytes = m * dt_size[dtype];
    const uint64_t n = e->round + 1;
    const int p = (int)(n & 1);
    const size_t at = slot_pos(e, n, bytes);
    stores_t sc = store_begin(e, bytes, dtype, 0, 1);
    par_copy(e->pool, slot_of(e, e->rank, p) + at, src, bytes, store_nt(e, &sc, bytes));
    int st = sync_untimed(e, &sc, kind, dtype, op, count, arg, ts);
    if (st != ST_OK)
        return st;
    point_srcs(e, src, p, at, 0);
    par_reduce(e->pool, dtype, op, src, e->srcs, e->world, m);
    store_end(e, &sc, bytes);
    return ST_OK;
}

/* The stores bucket of the copies of an all_reduce of `bytes` planned as pl
 * (its first chunk's; -1: none chooses them as it runs) */
int plan_store_bucket(const Engine *e, const ar_plan_t *pl, size_t bytes)
{
    if (pl->algo != AR_ONESHOT && pl->algo != AR_TWOSHOT)
        return -1;
    return store_bucket(e, first_chunk(pl, bytes), pl->algo == AR_TWOSHOT);
}

/* Whether the copies into the slots of an all_reduce of `bytes` of dtype,
 * planned as pl, store non-temporal now: as its chunks chose them so far,
 * or as nt_min fixes them (the copies of its first chunk: a whole chunk, or
 * two-shot's shards of the peers, the first of which is the smallest) */
int plan_stores_nt(const Engine *e, const ar_plan_t *pl, size_t bytes, int dtype)
{
    const int b = plan_store_bucket(e, pl, bytes);
    if (b >= 0)
        return stores_bit(e, b);
    const size_t chunk = first_chunk(pl, bytes), es = dt_size[dtype];
    const size_t copy = pl->algo == AR_TWOSHOT ? shard_start(chunk / es, e->world, 1) * es : chunk;
    return copy_nt_available() && nt_window(e, copy);
}

/*
 * How an all-reduce of `bytes` of dtype goes (symmetric: its tensor lies in a
 * symmetric buffer): zero-copy from zc_min to zc_max bytes of a symmetric
 * buffer's tensor, single copy (cma.c) from cma_ar_min bytes, else through
 * the slots: one-shot (every rank reduces the whole chunk: one round) below
 * twoshot_min bytes (twoshot_min16 for bfloat16 and float16), two-shot (two
 * rounds) from there; a chunk is a slot, or chunk_bytes from chunk_min bytes.
 * Zero copy goes in pieces of chunk_bytes of every shard from chunk_min bytes
 * too.  The choice travels in the metadata (arg: 1 or 2 plus the chunk's
 * pages << 8 where it is not a slot; ARG_SINGLE_COPY; ARG_ZERO_COPY plus the
 * piece's pages << 16, and where its tensor is: the buffer's id & 0xFF << 8,
 * the offset's low 32 bits << 32), so ranks configured differently get a
 * mismatch error, not garbage.
 * all_reduce_rounds runs what this says, and all_reduce_plan shows it:
 * one function, so what tpcomm perf names is what runs.
 */
ar_plan_t ar_plan(const Engine *e, size_t bytes, int dtype, int symmetric)
{
    ar_plan_t pl = {AR_ONESHOT, e->slot_bytes, 1};
    const int small = bytes >= e->chunk_min && e->chunk_bytes && e->chunk_bytes < e->slot_bytes;
    if (symmetric && bytes >= e->zc_min && bytes <= e->zc_max) {
        pl.algo = AR_ZERO_COPY; /* each shard chunk_bytes at a time, or whole */
        pl.chunk = small ? e->chunk_bytes : 0;
        pl.arg = ARG_ZERO_COPY | ((pl.chunk >> 12) & 0xFFFF) << 16;
    } else if (e->cma && e->world > 1 && bytes >= e->cma_ar_min && bytes <= e->cma_ar_max) {
        pl.algo = AR_SINGLE_COPY;
        pl.chunk = 0;
        pl.arg = ARG_SINGLE_COPY;
    } else {
        const int wide = wide_floats(dtype);
        const uint64_t two_min = wide ? e->twoshot_min16 : e->twoshot_min;
        const uint64_t two_max = wide ? e->twoshot_max16 : e->twoshot_max;
        pl.algo = bytes >= two_min && bytes <= two_max ? AR_TWOSHOT : AR_ONESHOT;
        pl.chunk = small ? e->chunk_bytes : e->slot_bytes;
        pl.arg = (pl.algo == AR_TWOSHOT ? 2u : 1u) | (small ? (e->chunk_bytes >> 12) << 8 : 0);
    }
    return pl;
}

/* set_chunks(min_bytes, chunk_bytes): all-reduces through the slots of at
 * least min_bytes (-1: none) go chunk_bytes at a time (a multiple of 4 KiB,
 * at most a slot) instead of a slot at a time (ar_plan) */
PyObject *eng_set_chunks(Engine *e, PyObject *args)
{
    long long min_bytes, bytes;
    if (!PyArg_ParseTuple(args, "LL", &min_bytes, &bytes))
        return NULL;
    if (bytes < 4096 || bytes % 4096 || (uint64_t)bytes > e->slot_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "set_chunks: %lld bytes, expected a multiple of 4096 up to the slot (%llu)",
                     bytes, (unsigned long long)e->slot_bytes);
        return NULL;
    }
    e->chunk_min = min_bytes < 0 ? UINT64_MAX : (uint64_t)min_bytes;
    e->chunk_bytes = (uint64_t)bytes;
    Py_RETURN_NONE;
}

/*
 * The all-reduce of `count` elements at t, in place, as ar_plan says.  Runs
 * inside a begun call (call_begin: *tsp the GIL's saved state, if released).
 */
int all_reduce_rounds(Engine *e, char *t, size_t count, int dtype, int op, uint32_t kind,
                   PyThreadState **tsp)
{
    const size_t es = dt_size[dtype], bytes = count * es;
    /* a symmetric buffer's tensor, looked for only where zero copy could take it */
    struct sym *sb = e->nsym && bytes >= e->zc_min && bytes <= e->zc_max ? find_sym(e, t, bytes)
                                                                          : NULL;
    /* zero copy or the copies (agreed by round: see zc_bits) */
    unsigned bits = 0;
    int copied = 0, b = 0;
    uint64_t t0 = 0;
    if (sb) {
        bits = zc_agreed(e);
        b = zc_bucket(bytes);
        copied = zc_copies(bits, b);
        if (e->rank == 0 && (bits & ZC_ON))
            t0 = ticks();
    }
    ar_plan_t pl = ar_plan(e, bytes, dtype, sb && !copied);
    if (copied && pl.algo != AR_SINGLE_COPY)
        pl.arg |= ARG_COPIED;
    /* rank 0 timing it: the way it goes (zc_learn), and whether any chunk
     * of it used the other stores (store_begin): then not that way */
    const int way = t0 && copied ? 1 + plan_stores_nt(e, &pl, bytes, dtype) : 0;
    const uint64_t explored = e->stores.explored;
    PyThreadState *ts = *tsp;
    int st = ST_OK;
    if (pl.algo == AR_ZERO_COPY) { /* the piece's pages in bits 16-31 of arg */
        size_t off = (size_t)(t - sb->base), piece = pl.chunk / es & ~(size_t)31;
        uint64_t arg = pl.arg | ((sb->id & 0xFF) << 8) | ((uint64_t)(off & 0xFFFFFFFFu) << 32);
        st = zero_copy_all_reduce(e, sb, off, count, piece, dtype, op, kind, arg, &ts);
    } else if (pl.algo == AR_SINGLE_COPY) {
        st = cma_all_reduce(e, t, count, dtype, op, kind, &ts);
    } else {
        const size_t chunk = pl.chunk / es;
        for (size_t done = 0, first = 1; first || done < count; first = 0) {
            size_t m = count - done < chunk ? count - done : chunk;
            char *src = t + done * es;
            if (pl.algo == AR_TWOSHOT)
                st = twoshot_chunk(e, src, m, dtype, op, kind, (uint64_t)count, pl.arg, &ts);
            else
                st = oneshot_chunk(e, src, m, dtype, op, kind, (uint64_t)count, pl.arg, &ts);
            if (st != ST_OK)
                break;
            done += m;
        }
    }
    if (sb && e->rank == 0 && st == ST_OK && (bits & ZC_ON)) {
        if (!copied) /* tests (fault_zero_copy): zero copy made slow, as rank 0 times it */
            spin_for_ns(e->fault.zc_ns);
        const int w = e->stores.explored != explored ? -1 : way;
        zc_after_call(e, bits, b, w, ticks() - t0, bytes, dtype);
    }
    e->zc.copied += (uint64_t)copied;
    *tsp = ts;
    return st;
}

/* all_reduce_plan(nbytes, dtype, symmetric) -> (algorithm, chunk bytes,
 * stores): how a plain all_reduce of nbytes goes now (ar_plan): "one-shot",
 * "two-shot", "single-copy" or "zero-copy"; the bytes it moves through the
 * slots at a time (zero copy: of every shard; 0: all at once); the stores of
 * its copies into the slots, "nt" (non-temporal) or "plain", as its chunks
 * chose them so far or nt_min fixes them ("": no copies into the slots).
 * What tpcomm perf names. */
PyObject *eng_all_reduce_plan(Engine *e, PyObject *args)
{
    static const char *const names[] = {"one-shot", "two-shot", "single-copy", "zero-copy"};
    unsigned long long nbytes;
    int dtype, symmetric;
    if (!PyArg_ParseTuple(args, "Kip", &nbytes, &dtype, &symmetric))
        return NULL;
    if (dtype < 0 || dtype >= DT_COUNT) {
        PyErr_SetString(PyExc_ValueError, "all_reduce_plan: bad dtype code");
        return NULL;
    }
    /* a comm.empty tensor: zero copy or the copies, as agreed now */
    if (symmetric && nbytes >= e->zc_min && nbytes <= e->zc_max && e->base)
        symmetric = !zc_copies(zc_agreed(e), zc_bucket(nbytes));
    const ar_plan_t pl = ar_plan(e, nbytes, dtype, symmetric);
    if (pl.algo != AR_ONESHOT && pl.algo != AR_TWOSHOT)
        return Py_BuildValue("(sKs)", names[pl.algo], (unsigned long long)pl.chunk, "");
    const int nt = plan_stores_nt(e, &pl, nbytes, dtype);
    return Py_BuildValue("(sKs)", names[pl.algo], (unsigned long long)pl.chunk, nt ? "nt" : "plain");
}

/* all_reduce(ptr, count, dtype, op, kind) -> status */
PyObject *eng_all_reduce(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "all_reduce expects 5 arguments");
        return NULL;
    }
    unsigned long long addr = PyLong_AsUnsignedLongLong(args[0]);
    long long count = PyLong_AsLongLong(args[1]);
    long dtype = PyLong_AsLong(args[2]);
    long op = PyLong_AsLong(args[3]);
    long kind = PyLong_AsLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (dtype < 0 || dtype >= DT_COUNT || op < 0 || op >= OP_COUNT || count < 0) {
        PyErr_SetString(PyExc_ValueError, "all_reduce: bad dtype, op or count code");
        return NULL;
    }
    PyThreadState *ts = NULL;
    int st = call_enter(e, (size_t)count * dt_size[dtype], &ts);
    if (st < 0)
        return NULL;
    if (st == 0) {
        st = all_reduce_rounds(e, (char *)(uintptr_t)addr, (size_t)count, (int)dtype, (int)op,
                            (uint32_t)kind, &ts);
        st = call_end(e, st, ts); /* ts is set by all_reduce_rounds: two statements */
    }
    return PyLong_FromLong(st);
}
