/*
 * All-reduce: one-shot, two-shot and zero-copy (symmetric buffers), over
 * the collective channel's slots.
 */
#include "tpcomm.h"

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
                         uint64_t count, PyThreadState **ts)
{
    const size_t es = dt_size[dtype];
    const int w = e->world, me = e->rank;
    const size_t lo = shard_start(m, w, me), hi = shard_start(m, w, me + 1);
    int p = (int)((e->round + 1) & 1);
    char *in = slot_of(e, me, p);
    par_copy(e->pool, in, src, lo * es);
    par_copy(e->pool, in + hi * es, src + hi * es, (m - hi) * es);
    int st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, 2, ts);
    if (st != ST_OK)
        return st;
    for (int r = 0; r < w; r++)
        e->srcs[r] = r == me ? (void *)(src + lo * es) : (void *)(slot_of(e, r, p) + lo * es);
    par_reduce(e->pool, dtype, op, src + lo * es, e->srcs, w, hi - lo);
    par_copy(e->pool, slot_of(e, me, 1 - p) + lo * es, src + lo * es, (hi - lo) * es);
    st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, 2, ts);
    if (st != ST_OK)
        return st;
    for (int i = 1; i < w; i++) {
        int j = (me + i) % w;
        size_t jlo = shard_start(m, w, j), jhi = shard_start(m, w, j + 1);
        par_copy_out(e->pool, src + jlo * es, slot_of(e, j, 1 - p) + jlo * es, (jhi - jlo) * es);
    }
    return ST_OK;
}

/*
 * Zero-copy all-reduce of a tensor that lives in a symmetric buffer: every
 * rank reads its peers' tensors where they are, so nothing is copied in.
 *   round 1: everyone's data is ready;
 *   rank r reduces shard r of every rank's tensor, in rank order, into shard r
 *   of its own (only rank r ever reads shard r of anyone, so writing it in
 *   place is safe);
 *   round 2: every shard is reduced; each rank copies the other shards from
 *   their owners' tensors into its own;
 *   round 3: nobody reads this rank's tensor any more: the caller may change it.
 * The metadata arg carries the buffer and offset, so ranks whose tensors are
 * not at the same place in the same buffer get a mismatch error.
 */
static int zero_copy_all_reduce(Engine *e, struct sym *sb, size_t off, size_t count, int dtype,
                                int op, uint32_t kind, uint64_t arg, PyThreadState **ts)
{
    const size_t es = dt_size[dtype];
    const int w = e->world, me = e->rank;
    int st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, arg, ts);
    if (st != ST_OK)
        return st;
    const size_t lo = shard_start(count, w, me), hi = shard_start(count, w, me + 1);
    for (int r = 0; r < w; r++)
        e->srcs[r] = sb->peers[r] + off + lo * es;
    par_reduce(e->pool, dtype, op, sb->base + off + lo * es, e->srcs, w, hi - lo);
    st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, arg, ts);
    if (st != ST_OK)
        return st;
    for (int i = 1; i < w; i++) {
        int j = (me + i) % w;
        size_t jlo = shard_start(count, w, j), jhi = shard_start(count, w, j + 1);
        par_copy_out(e->pool, sb->base + off + jlo * es, sb->peers[j] + off + jlo * es,
                 (jhi - jlo) * es);
    }
    return round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, arg, ts);
}

static struct sym *find_sym(Engine *e, const char *t, size_t bytes)
{
    for (int i = 0; i < e->nsym; i++)
        if (t >= e->sym[i].base && t + bytes <= e->sym[i].base + e->sym[i].size)
            return &e->sym[i];
    return NULL;
}

/*
 * The all-reduce of `count` elements at t, in place: zero-copy when t lies in
 * a symmetric buffer, single copy (cma.c) from cma_ar_min bytes, else chunked:
 * one-shot (every rank reduces the whole chunk: one round) below twoshot_min
 * bytes (twoshot_min16 for bfloat16 and float16), two-shot (two rounds) from
 * there.  The choice travels in the
 * metadata (arg 1, 2, ARG_ZERO_COPY + where, ARG_SINGLE_COPY), so ranks
 * configured differently get a mismatch error, not garbage.  Runs
 * inside a begun call (call_begin: *tsp the GIL's saved state, if released).
 */
int all_reduce_rounds(Engine *e, char *t, size_t count, int dtype, int op, uint32_t kind,
                   PyThreadState **tsp)
{
    const size_t es = dt_size[dtype];
    const size_t chunk = e->slot_bytes / es;
    const uint64_t two_min = dtype == DT_BF16 || dtype == DT_F16 ? e->twoshot_min16 : e->twoshot_min;
    const int two = count * es >= two_min;
    PyThreadState *ts = *tsp;
    int st = ST_OK;
    size_t done = 0;
    struct sym *sb = e->nsym && two ? find_sym(e, t, count * es) : NULL;
    int whole = 1; /* one algorithm takes the whole tensor in its rounds */
    if (sb) {
        size_t off = (size_t)(t - sb->base);
        uint64_t arg = ARG_ZERO_COPY | ((sb->id & 0xFFFF) << 8) | ((uint64_t)off << 24);
        st = zero_copy_all_reduce(e, sb, off, count, dtype, op, kind, arg, &ts);
    } else if (e->cma && e->world > 1 && count * es >= e->cma_ar_min) {
        st = cma_all_reduce(e, t, count, dtype, op, kind, &ts);
    } else {
        whole = 0; /* the chunks, a slot at a time */
    }
    for (int first = 1; !whole && (first || done < count); first = 0) {
        size_t m = count - done < chunk ? count - done : chunk;
        char *src = t + done * es;
        if (two) {
            st = twoshot_chunk(e, src, m, dtype, op, kind, (uint64_t)count, &ts);
        } else {
            int p = (int)((e->round + 1) & 1);
            par_copy(e->pool, slot_of(e, e->rank, p), src, m * es);
            st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, (uint64_t)count, 1, &ts);
            if (st == ST_OK) {
                for (int r = 0; r < e->world; r++)
                    e->srcs[r] = r == e->rank ? (void *)src : (void *)slot_of(e, r, p);
                par_reduce(e->pool, dtype, op, src, e->srcs, e->world, m);
            }
        }
        if (st != ST_OK)
            break;
        done += m;
    }
    *tsp = ts;
    return st;
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
