/*
 * The data-moving rounds of the collectives other than all-reduce: sync
 * (one bare round, for Python), gather, broadcast, reduce-scatter and
 * all-to-all, in slots of the collective channel.
 */
#include "tpcomm.h"

static int gather_rounds(Engine *e, uint32_t kind, const char *mine, const size_t *cnt, char *out,
                         char *const *dsts, uint32_t dtype, uint64_t numel, uint64_t arg,
                         size_t outer);

/*
 * The per-round loop every collective of this file shares: for each of
 * j->rounds rounds, put this rank's part k into its slot of the round's
 * parity, one round_sync with the call's metadata, then take part k from the
 * slots of that parity.  j->bytes: what the call moves (call_enter: whether
 * it runs without the GIL).  j->span: the most any rank puts in its slot in
 * a round, which places the round's data in the slots (slot_pos; j->at, the
 * offset, for take: job_slot).  A status, or -1 with an exception.
 */
typedef struct job job_t;
struct job {
    void (*put)(Engine *e, job_t *j, size_t k, char *slot);
    void (*take)(Engine *e, job_t *j, size_t k, int p);
    size_t rounds, bytes;
    uint32_t kind, dtype, op;
    uint64_t count, arg;
    size_t span, at;
    /* the memory the rounds will write, made present first (pages.c), or NULL */
    void (*ready)(Engine *e, job_t *j);
};

/* where rank r's data of the round being taken lies */
static inline const char *job_slot(Engine *e, const job_t *j, int r, int p)
{
    return slot_of(e, r, p) + j->at;
}

static int run_rounds(Engine *e, job_t *j)
{
    PyThreadState *ts = NULL;
    int st = call_enter(e, j->bytes, &ts);
    if (st != 0)
        return st;
    if (j->ready)
        j->ready(e, j);
    for (size_t k = 0; k < j->rounds && st == ST_OK; k++) {
        const uint64_t n = e->round + 1;
        const int p = (int)(n & 1);
        j->at = slot_pos(e, n, j->span);
        j->put(e, j, k, slot_of(e, e->rank, p) + j->at);
        st = round_sync(e, j->kind, j->dtype, j->op, j->count, j->arg, &ts);
        if (st == ST_OK)
            j->take(e, j, k, p);
    }
    return call_end(e, st, ts);
}

/*
 * sync(kind, dtype, op, count, arg) -> status: one collective round with no
 * data of its own (barrier, dup, a refusal, empty()'s exchange): publish this
 * rank's metadata, wait for every peer, compare.  The caller
 * wrote its slot for parity (round + 1) & 1 before, and reads the peers'
 * slots of that parity after.
 */
PyObject *eng_sync(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "sync expects 5 arguments");
        return NULL;
    }
    unsigned long kind = PyLong_AsUnsignedLong(args[0]);
    unsigned long dtype = PyLong_AsUnsignedLong(args[1]);
    unsigned long op = PyLong_AsUnsignedLong(args[2]);
    unsigned long long count = PyLong_AsUnsignedLongLong(args[3]);
    unsigned long long arg = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    PyThreadState *ts = NULL;
    int st = call_enter(e, 0, &ts);
    if (st < 0)
        return NULL;
    if (st > 0)
        return PyLong_FromLong(st);
    st = round_sync(e, (uint32_t)kind, (uint32_t)dtype, (uint32_t)op, count, arg, &ts);
    return PyLong_FromLong(call_end(e, st, ts));
}

/*
 * The data-moving rounds in C (shm/path.py passes addresses and sizes): in
 * Python the loops cost 5-8 us per call on the development VM, more than the
 * copies of a small message.  Each round: copy this rank's part into its slot of parity
 * (round + 1) & 1, publish and compare the metadata (round_sync), copy out of
 * the peers' slots.  Slot p is rewritten only two rounds later, after every
 * peer published the round in between, so it was read by then.  The copies
 * into a slot store as an all_reduce chunk of their size does
 * (allreduce.c slot_stores_nt: plain or non-temporal, as the machine's state
 * makes cheaper); the copies out are plain memcpys (the caller reads next).
 */

/* Parse a list of `world` non-negative ints into v (PyMem); -1 with an exception */
static int int_list(Engine *e, PyObject *o, size_t **v, const char *fn)
{
    if (!PyList_Check(o) || PyList_GET_SIZE(o) != e->world) {
        PyErr_Format(PyExc_ValueError, "%s: expected a list of %d sizes", fn, e->world);
        return -1;
    }
    *v = PyMem_Calloc((size_t)e->world + 1, sizeof(size_t));
    if (!*v) {
        PyErr_NoMemory();
        return -1;
    }
    for (int r = 0; r < e->world; r++) {
        long long x = PyLong_AsLongLong(PyList_GET_ITEM(o, r));
        if (x < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%s: negative size", fn);
            PyMem_Free(*v);
            return -1;
        }
        (*v)[r] = (size_t)x;
    }
    return 0;
}

/* The `want` arguments as unsigned 64-bit ints (None and lists read as 0:
 * the caller takes those from args itself); -1 with an exception */
int u64_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *fn,
             unsigned long long *v)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s expects %zd arguments", fn, want);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++)
        v[i] = args[i] == Py_None || PyList_Check(args[i]) ? 0
                                                           : PyLong_AsUnsignedLongLong(args[i]);
    return PyErr_Occurred() ? -1 : 0;
}

/* world copies of v (PyMem), or NULL with MemoryError */
size_t *even_sizes(Engine *e, size_t v)
{
    size_t *a = PyMem_Malloc((size_t)e->world * sizeof(size_t));
    if (!a) {
        PyErr_NoMemory();
        return NULL;
    }
    for (int r = 0; r < e->world; r++)
        a[r] = v;
    return a;
}

/* 0 when outer (> 0) divides every count; else -1 with ValueError */
static int check_outer(Engine *e, const size_t *cnt, unsigned long long outer, const char *fn)
{
    int ok = outer > 0;
    for (int r = 0; ok && r < e->world; r++)
        ok = cnt[r] % outer == 0;
    if (!ok)
        PyErr_Format(PyExc_ValueError, "%s: %llu rows do not divide every rank's part", fn, outer);
    return ok ? 0 : -1;
}

/* gatherv(kind, mine, [bytes per rank], out | [address per rank] | None, dtype, numel,
 * arg, outer) -> status: every rank's bytes, in rank order, at out (None: this
 * rank receives nothing; a list: rank r's bytes at its own address, outer 1);
 * with outer rows (put_blocks), rank r's bytes are outer blocks and row a of
 * out is every rank's block a in rank order */
PyObject *eng_gatherv(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[8];
    size_t *cnt, *at = NULL;
    char **dsts = NULL;
    if (u64_args(args, nargs, 8, "gatherv", v) < 0 || int_list(e, args[2], &cnt, "gatherv") < 0)
        return NULL;
    int st = check_outer(e, cnt, v[7], "gatherv");
    if (st == 0 && PyList_Check(args[3])) {
        st = v[7] == 1 ? int_list(e, args[3], &at, "gatherv") : -1;
        if (v[7] != 1)
            PyErr_SetString(PyExc_ValueError, "gatherv: a list of destinations takes no rows");
        dsts = st == 0 ? PyMem_Calloc((size_t)e->world, sizeof(char *)) : NULL;
        if (st == 0 && !dsts) {
            PyErr_NoMemory();
            st = -1;
        }
        for (int r = 0; st == 0 && r < e->world; r++)
            dsts[r] = (char *)(uintptr_t)at[r];
    }
    if (st == 0)
        st = gather_rounds(e, (uint32_t)v[0], (const char *)(uintptr_t)v[1], cnt,
                           (char *)(uintptr_t)v[3], dsts, (uint32_t)v[4], v[5], v[6],
                           (size_t)v[7]);
    PyMem_Free(cnt);
    PyMem_Free(at);
    PyMem_Free(dsts);
    return status_result(st);
}

/* The key of a flat, even layout: shm/keys.py flat_key, bit for bit */
uint64_t flat_key(uint64_t kind, uint64_t n, uint64_t world)
{
    uint64_t x = kind * 0x100000001B3ull;
    x ^= n * 0x9E3779B97F4A7C15ull;
    x ^= world << 48;
    return x & 0x7FFFFFFFFFFFFFFFull;
}

/* The rounds of the one-call gathers: every rank's n elements of dtype code
 * `code` at `mine`, in rank order, at out (NULL: this rank receives nothing),
 * keyed flat_key(kind + tag, n, w) as keys.gather_key keys a flat, even
 * layout (tag: 0 without a root, (root + 1) << 32 with one) */
int flat_gather(Engine *e, uint32_t kind, uint64_t tag, const char *mine, int code, long long n,
                size_t nbytes, char *out)
{
    size_t *cnt = even_sizes(e, nbytes);
    if (!cnt)
        return -1;
    uint64_t key = flat_key((uint64_t)kind + tag, (uint64_t)n, (uint64_t)e->world);
    int st = gather_rounds(e, kind, mine, cnt, out, NULL, (uint32_t)code,
                           (uint64_t)n * (uint64_t)e->world, key, 1);
    PyMem_Free(cnt);
    return st;
}

/* The rounds of a gather: -1 with an exception, or a status.
 * A result that holds this rank's own input exactly where it belongs (torch's
 * in-place all_gather_into_tensor: input = output.chunk(w)[rank]; a list form
 * whose own entry is the input) skips copying it.  A result that overlaps the
 * input anywhere else would overwrite the input before it is all sent: the
 * input is copied aside first, so the result is as if nothing overlapped. */
typedef struct {
    job_t j;
    const char *mine;
    const size_t *cnt;
    char *out;
    char *const *dsts;
    size_t cap, total, outer;
    int in_place;
} gather_job_t;

static void gather_put(Engine *e, job_t *j, size_t k, char *slot)
{
    gather_job_t *g = (gather_job_t *)j;
    size_t lo = k * g->cap, n = part_of(g->cnt[e->rank], lo, g->cap);
    if (n)
        copy_slot(slot, g->mine + lo, n, slot_stores_nt(e, n));
}

static void gather_take(Engine *e, job_t *j, size_t k, int p)
{
    gather_job_t *g = (gather_job_t *)j;
    if (!(g->out || g->dsts))
        return;
    const int me = e->rank;
    size_t lo = k * g->cap, off = 0;
    for (int r = 0; r < e->world; r++) {
        size_t n = part_of(g->cnt[r], lo, g->cap);
        const char *from = r == me ? g->mine + lo : job_slot(e, j, r, p);
        if (r == me && g->in_place)
            ; /* already there */
        else if (n && g->dsts)
            memcpy(g->dsts[r] + lo, from, n);
        else if (n)
            put_blocks(g->out, from, lo, n, g->cnt[r] / g->outer, g->total / g->outer, off);
        off += g->cnt[r] / g->outer;
    }
}

/* what the rounds write: out whole, or where this rank's own input lies in
 * it, every other rank's place; or each destination (gather_ready) */
static void gather_ready(Engine *e, job_t *j)
{
    gather_job_t *g = (gather_job_t *)j;
    span_t s[e->world];
    int k = 0;
    size_t off = 0;
    if (g->out && (g->outer > 1 || !g->in_place))
        s[k++] = (span_t){g->out, g->total};
    else if (g->out || g->dsts)
        for (int r = 0; r < e->world; r++) {
            if (!(r == e->rank && g->in_place))
                s[k++] = (span_t){g->dsts ? g->dsts[r] : g->out + off, g->cnt[r]};
            off += g->cnt[r];
        }
    ready_pages(e, s, k);
}

static int gather_rounds(Engine *e, uint32_t kind, const char *mine, const size_t *cnt, char *out,
                         char *const *dsts, uint32_t dtype, uint64_t numel, uint64_t arg,
                         size_t outer)
{
    const int w = e->world, me = e->rank;
    const size_t cap = e->slot_bytes;
    size_t total = 0, rounds = 1, before = 0, span = 0;
    for (int r = 0; r < w; r++) {
        if (r == me)
            before = total;
        total += cnt[r];
        if ((cnt[r] + cap - 1) / cap > rounds)
            rounds = (cnt[r] + cap - 1) / cap;
        span = cnt[r] > span ? (cnt[r] < cap ? cnt[r] : cap) : span;
    }
    int in_place = 0, clash = 0;
    if (dsts) {
        in_place = cnt[me] && dsts[me] == mine;
        for (int r = 0; r < w; r++)
            clash |= !(r == me && in_place) && overlap(dsts[r], cnt[r], mine, cnt[me]);
    } else if (out) {
        in_place = cnt[me] && outer == 1 && out + before == mine;
        clash = !in_place && overlap(out, total, mine, cnt[me]);
    }
    char *aside = NULL;
    if (clash) {
        aside = PyMem_RawMalloc(cnt[me]);
        if (!aside) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(aside, mine, cnt[me]);
        mine = aside;
    }
    /* single copy: large enough in all, and (along a later dim) in blocks of at
     * least CMA_MIN_BLOCK bytes: one iovec per block, and smaller ones lose
     * (docs/COLLECTIVES.md); every rank knows every count, so all decide alike */
    int single = e->cma && kind == KIND_ALL_GATHER && total >= e->cma_min;
    for (int r = 0; single && outer > 1 && r < w; r++)
        single = !cnt[r] || cnt[r] / outer >= CMA_MIN_BLOCK;
    if (single) {
        int st =
            cma_gather(e, kind, mine, cnt, out, dsts, dtype, numel, arg, total, in_place, outer);
        PyMem_RawFree(aside);
        return st;
    }
    gather_job_t g = {{gather_put, gather_take, rounds, total, kind, dtype, 0, numel, arg, span, 0},
                      mine, cnt, out, dsts, cap, total, outer, in_place};
    g.j.ready = gather_ready;
    int st = run_rounds(e, &g.j);
    PyMem_RawFree(aside);
    return st;
}

/* The rounds of a broadcast of `total` bytes at data from rank src: -1 with
 * an exception, or a status */
typedef struct {
    job_t j;
    char *data;
    size_t total, cap;
    int src;
} bcast_job_t;

static void bcast_put(Engine *e, job_t *j, size_t k, char *slot)
{
    bcast_job_t *b = (bcast_job_t *)j;
    size_t lo = k * b->cap, n = part_of(b->total, lo, b->cap);
    if (e->rank == b->src && n)
        copy_slot(slot, b->data + lo, n, slot_stores_nt(e, n));
}

static void bcast_take(Engine *e, job_t *j, size_t k, int p)
{
    bcast_job_t *b = (bcast_job_t *)j;
    size_t lo = k * b->cap, n = part_of(b->total, lo, b->cap);
    if (e->rank != b->src && n)
        memcpy(b->data + lo, job_slot(e, j, b->src, p), n);
}

static void bcast_ready(Engine *e, job_t *j)
{
    bcast_job_t *b = (bcast_job_t *)j;
    span_t s = {b->data, b->total};
    if (e->rank != b->src)
        ready_pages(e, &s, 1);
}

int broadcast_rounds(Engine *e, uint32_t kind, char *data, size_t total, int src,
                        uint32_t dtype, uint64_t numel)
{
    const size_t cap = e->slot_bytes;
    size_t rounds = total ? (total + cap - 1) / cap : 1;
    bcast_job_t b = {{bcast_put, bcast_take, rounds, total, kind, dtype, 0, numel, (uint64_t)src,
                      total < cap ? total : cap, 0},
                     data, total, cap, src};
    b.j.ready = bcast_ready;
    return run_rounds(e, &b.j);
}

/* broadcast(kind, data, nbytes, src, dtype, numel) -> status: src's bytes everywhere */
PyObject *eng_broadcast(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[6];
    if (u64_args(args, nargs, 6, "broadcast", v) < 0)
        return NULL;
    if (v[3] >= (unsigned long long)e->world) {
        PyErr_Format(PyExc_ValueError, "broadcast: src %lld is out of range", (long long)v[3]);
        return NULL;
    }
    return status_result(broadcast_rounds(e, (uint32_t)v[0], (char *)(uintptr_t)v[1], (size_t)v[2],
                                      (int)v[3], (uint32_t)v[4], v[5]));
}

/* reduce_scatterv(kind, x, dtype, [elements per rank], out, op, arg) -> status: out
 * gets the reduction of shard `rank` of every rank's x (W shards, in order) */

PyObject *eng_reduce_scatterv(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[8];
    if (u64_args(args, nargs, 8, "reduce_scatterv", v) < 0)
        return NULL;
    if (v[7] == 0) {
        PyErr_SetString(PyExc_ValueError, "reduce_scatterv: no rows");
        return NULL;
    }
    if (v[2] >= DT_COUNT || v[5] >= OP_COUNT) {
        PyErr_SetString(PyExc_ValueError, "reduce_scatterv: bad dtype or op");
        return NULL;
    }
    size_t *sizes;
    if (int_list(e, args[3], &sizes, "reduce_scatterv") < 0)
        return NULL;
    int st = reduce_scatter_rounds(e, (uint32_t)v[0], (const char *)(uintptr_t)v[1], (int)v[2], sizes,
                       (char *)(uintptr_t)v[4], (int)v[5], v[6], (size_t)v[7]);
    PyMem_Free(sizes);
    return status_result(st);
}

/* The rounds of a reduce-scatter: -1 with an exception, or a status */
typedef struct {
    job_t j;
    const char *x;
    const size_t *sizes, *offs;
    char *out;
    void **srcs;
    size_t per, es, row, outer;
    int dtype, op;
} rs_job_t;

/* shard j's part of round k to its place in the slot (take_blocks) */
static void rs_put(Engine *e, job_t *j, size_t k, char *slot)
{
    rs_job_t *r = (rs_job_t *)j;
    const int w = e->world, me = e->rank;
    const size_t lo = k * r->per, es = r->es;
    size_t in = 0; /* this round's bytes into the slot */
    for (int q = 0; q < w; q++)
        in += q == me ? 0 : part_of(r->outer * r->sizes[q], lo, r->per) * es;
    const int nt = slot_stores_nt(e, in);
    for (int q = 0; q < w; q++) {
        size_t n = part_of(r->outer * r->sizes[q], lo, r->per);
        if (n && q != me)
            take_blocks(slot + (size_t)q * r->per * es, r->x, lo * es, n * es, r->sizes[q] * es,
                        r->row, r->offs[q] * es, nt);
    }
}

/* this rank's own part is read where it is: one reduction per piece of a
 * row's block (one piece in all without rows) */
static void rs_take(Engine *e, job_t *j, size_t k, int p)
{
    rs_job_t *r = (rs_job_t *)j;
    const int w = e->world, me = e->rank;
    const size_t lo = k * r->per, es = r->es, mine = r->sizes[me];
    size_t n = part_of(r->outer * mine, lo, r->per);
    for (size_t q = lo, end = lo + n; q < end;) {
        size_t a = q / mine, in = q % mine;
        size_t m = mine - in < end - q ? mine - in : end - q;
        for (int s = 0; s < w; s++)
            r->srcs[s] = s == me ? (void *)(r->x + a * r->row + (r->offs[me] + in) * es)
                                 : (void *)(job_slot(e, j, s, p) + ((size_t)me * r->per + q - lo) * es);
        par_reduce(e->pool, r->dtype, r->op, r->out + q * es, r->srcs, w, m);
        q += m;
    }
}

static void rs_ready(Engine *e, job_t *j)
{
    rs_job_t *r = (rs_job_t *)j;
    span_t s = {r->out, r->outer * r->sizes[e->rank] * r->es};
    ready_pages(e, &s, 1);
}

int reduce_scatter_rounds(Engine *e, uint32_t kind, const char *x, int dtype, const size_t *sizes,
                     char *out, int op, uint64_t arg, size_t outer)
{
    const int w = e->world, me = e->rank;
    const size_t es = dt_size[dtype];
    size_t per = e->slot_bytes / es / (size_t)w / 32 * 32; /* elements per shard per round */
    if (per < 32)
        per = 32;
    size_t numel = 0, rounds = 1, *offs = PyMem_Calloc((size_t)w + 1, sizeof(size_t));
    void **srcs = PyMem_Calloc((size_t)w, sizeof(void *));
    if (!offs || !srcs) {
        PyMem_Free(offs);
        PyMem_Free(srcs);
        PyErr_NoMemory();
        return -1;
    }
    size_t most = 0; /* the largest shard: a shard's place in the slot need be no larger */
    for (int r = 0; r < w; r++) {
        offs[r] = numel;
        numel += sizes[r];
        if ((outer * sizes[r] + per - 1) / per > rounds)
            rounds = (outer * sizes[r] + per - 1) / per;
        most = outer * sizes[r] > most ? outer * sizes[r] : most;
    }
    const size_t need = most < 32 ? 32 : (most + 31) / 32 * 32;
    if (need < per)
        per = need;
    const size_t row = numel * es; /* bytes per row (take_blocks) */
    numel *= outer;
    /* The result may be this rank's own block of the input (torch's in-place
     * form: output = input.chunk(w)[rank]; each element is reduced onto
     * itself).  A result that overlaps the input anywhere else would overwrite
     * parts not sent yet: it is reduced aside and copied in at the end. */
    const size_t mine = outer * sizes[me] * es;
    char *aside = NULL, *dest = out;
    if (overlap(out, mine, x, numel * es) && !(outer == 1 && out == x + offs[me] * es)) {
        aside = PyMem_RawMalloc(mine);
        if (!aside) {
            PyMem_Free(offs);
            PyMem_Free(srcs);
            PyErr_NoMemory();
            return -1;
        }
        out = aside;
    }
    rs_job_t r = {{rs_put, rs_take, rounds, numel * es, kind, (uint32_t)dtype, (uint32_t)op, numel,
                   arg, (size_t)w * per * es, 0},
                  x, sizes, offs, out, srcs, per, es, row, outer, dtype, op};
    r.j.ready = rs_ready;
    int st = run_rounds(e, &r.j);
    if (aside && st == ST_OK)
        memcpy(dest, aside, mine);
    PyMem_Free(offs);
    PyMem_Free(srcs);
    PyMem_RawFree(aside);
    return st;
}

/*
 * The rounds of an all to all of bytes: sc[j] bytes at x + so[j] go to rank j,
 * which receives them at its out + ro[this rank] (rc, ro: what this rank
 * receives from each).  The slot is cut in W segments, as for reduce-scatter:
 * in round k every rank copies part k of its block for j into segment j,
 * waits, and copies part k of segment `rank` of every peer's slot (its own
 * block: from x) to its place in out.  `most` is the largest block any rank
 * sends (every rank must pass the same: it sets the number of rounds).  x and
 * out must not overlap.  A status, or -1 with an exception set.
 */
typedef struct {
    job_t j;
    const char *x;
    const size_t *sc, *so;
    char *out;
    const size_t *rc, *ro;
    size_t per;
} a2a_job_t;

/* part k of this rank's block for each rank j into segment j of its slot */
static void a2a_put(Engine *e, job_t *j, size_t k, char *slot)
{
    a2a_job_t *a = (a2a_job_t *)j;
    const int w = e->world, me = e->rank;
    const size_t lo = k * a->per;
    size_t in = 0; /* this round's bytes into the slot */
    for (int q = 0; q < w; q++)
        in += q == me ? 0 : part_of(a->sc[q], lo, a->per);
    const int nt = slot_stores_nt(e, in);
    for (int q = 0; q < w; q++) {
        size_t n = part_of(a->sc[q], lo, a->per);
        if (n && q != me)
            copy_slot(slot + (size_t)q * a->per, a->x + a->so[q] + lo, n, nt);
    }
}

/* part k of segment `rank` of every peer's slot (its own block: from x) to
 * its place in out */
static void a2a_take(Engine *e, job_t *j, size_t k, int p)
{
    a2a_job_t *a = (a2a_job_t *)j;
    const int me = e->rank;
    const size_t lo = k * a->per;
    for (int r = 0; r < e->world; r++) {
        size_t n = part_of(a->rc[r], lo, a->per);
        if (n)
            memcpy(a->out + a->ro[r] + lo,
                   r == me ? a->x + a->so[me] + lo : job_slot(e, j, r, p) + (size_t)me * a->per, n);
    }
}

static void a2a_ready(Engine *e, job_t *j)
{
    a2a_job_t *a = (a2a_job_t *)j;
    span_t s[e->world];
    for (int r = 0; r < e->world; r++)
        s[r] = (span_t){a->out + a->ro[r], a->rc[r]};
    ready_pages(e, s, e->world);
}

int alltoallv_rounds(Engine *e, uint32_t kind, const char *x, const size_t *sc, const size_t *so,
                     char *out, const size_t *rc, const size_t *ro, uint64_t most, uint32_t dtype,
                     uint64_t count, uint64_t arg)
{
    const int w = e->world, me = e->rank;
    size_t per = e->slot_bytes / (size_t)w / 64 * 64;
    if (per == 0) {
        PyErr_SetString(PyExc_ValueError, "alltoallv: the slot is too small for this world size");
        return -1;
    }
    if (sc[me] != rc[me]) {
        PyErr_SetString(PyExc_ValueError, "alltoallv: this rank's block to itself differs in size");
        return -1;
    }
    size_t rounds = most ? (size_t)((most + per - 1) / per) : 1, total = 0;
    const size_t need = most < 64 ? 64 : (size_t)(most + 63) / 64 * 64;
    if (need < per) /* a block's place in the slot need be no larger */
        per = need;
    for (int r = 0; r < w; r++)
        total += sc[r] + rc[r];
    /* single copy (see cma_gather): every rank publishes its input's address
     * and, in its slot, where its block for each rank starts; each rank reads
     * its block from every peer straight into out.  Decided on `most`, which
     * every rank shares. */
    if (e->cma && most * (uint64_t)w >= e->cma_min &&
        (size_t)w * sizeof(uint64_t) <= e->slot_bytes) {
        char *dst[w];
        uint64_t offs[w];
        for (int r = 0; r < w; r++) {
            dst[r] = out + ro[r];
            offs[r] = so[r];
        }
        return cma_rounds(e, kind, dtype, count, arg, total, x, offs, x + so[me], dst, rc, rc, rc);
    }
    a2a_job_t a = {{a2a_put, a2a_take, rounds, total, kind, dtype, 0, count, arg, (size_t)w * per, 0},
                   x, sc, so, out, rc, ro, per};
    a.j.ready = a2a_ready;
    return run_rounds(e, &a.j);
}

/*
 * alltoallv(kind, x, [bytes to each rank], [their offsets in x], out, [bytes from
 * each rank], [their offsets in out], most, dtype, count, arg) -> status: the
 * rounds of alltoallv_rounds, for blocks every rank has checked already.
 */
PyObject *eng_alltoallv(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[11];
    size_t *sc = NULL, *so = NULL, *rc = NULL, *ro = NULL;
    if (u64_args(args, nargs, 11, "alltoallv", v) < 0 || int_list(e, args[2], &sc, "alltoallv") < 0)
        return NULL;
    int st = int_list(e, args[3], &so, "alltoallv");
    if (st == 0)
        st = int_list(e, args[5], &rc, "alltoallv");
    if (st == 0)
        st = int_list(e, args[6], &ro, "alltoallv");
    if (st == 0)
        st = alltoallv_rounds(e, (uint32_t)v[0], (const char *)(uintptr_t)v[1], sc, so,
                           (char *)(uintptr_t)v[4], rc, ro, v[7], (uint32_t)v[8], v[9], v[10]);
    PyMem_Free(sc);
    PyMem_Free(so);
    PyMem_Free(rc);
    PyMem_Free(ro);
    return status_result(st);
}

/*
 * all_to_all_single without split sizes: W blocks of `block` bytes each way
 * (the dtype's code `code`), every rank's the same size (checked by the
 * rounds' metadata, which carries it).  A status, or -1 with an exception.
 */
int alltoall_even_rounds(Engine *e, uint32_t kind, const char *x, char *out, size_t block,
                      uint32_t code)
{
    const int w = e->world;
    size_t sz[w], at[w];
    for (int j = 0; j < w; j++) {
        sz[j] = block;
        at[j] = (size_t)j * block;
    }
    return alltoallv_rounds(e, kind, x, sz, at, out, sz, at, block, code, block,
                         flat_key(kind, block, (uint64_t)w));
}
