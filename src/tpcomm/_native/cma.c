/*
 * Single-copy reads of a peer's memory (process_vm_readv): the check at
 * creation (cma_init), the all_gather / all_to_all rounds that read the
 * peers' inputs in place, and messages sent by reference.
 */
#include "tpcomm.h"

/*
 * Single-copy all_gather (cross-memory attach, as Open MPI's shared-memory
 * transport does for large messages): instead of copying its input into its
 * slot for the peers to copy out, every rank publishes where its input is and
 * reads each peer's input straight into its own result with
 * process_vm_readv(2); a second round keeps every input in place until all
 * ranks have read it.  Half the bytes of the two-copy path cross memory.
 * Used when cma_init found that every rank can read every other one (same
 * user, no Yama or seccomp refusal) and the gather moves at least cma_min
 * bytes; the decision depends only on what every rank shares, so all ranks
 * take the same path.
 */

#define CMA_PIECE (4u << 20) /* bytes per process_vm_readv: aborts are seen between */

uint64_t cma_tag(uint64_t pid, int rank)
{
    return (0x747063636d61ull << 16) ^ (pid * 0x9E3779B97F4A7C15ull) ^ (uint64_t)rank;
}

/* Fault injection (tests only, fault_check_delay): sleep where a race can be widened */
void fault_pause(Engine *e)
{
    if (e->fault.check_delay_ns) {
        struct timespec d = {(time_t)(e->fault.check_delay_ns / 1000000000ull),
                             (long)(e->fault.check_delay_ns % 1000000000ull)};
        nanosleep(&d, NULL);
    }
}

#define CMA_IOV 256 /* blocks per process_vm_readv */

/* A process_vm_readv from rank r failed with err: the peer died
 * (ST_PEER_DEAD), or it is alive and its memory could not be read (ST_CMA). */
int cma_failed(Engine *e, int r, int err)
{
    if (take_abort(e))
        return ST_ABORTED;
    /* ESRCH: the process is gone or going (a killed rank is exiting and may
     * still hold its liveness lock for a moment): the peer died */
    if (err == ESRCH || !peer_alive(e, r))
        return fail(e, ST_PEER_DEAD, r, r);
    e->err.errnum = err;
    return fail(e, ST_CMA, r, e->rank);
}

/* Before every read of rank r: ST_OK, or why not (an abort; the peer died) */
static int cma_may_read(Engine *e, int r)
{
    if (take_abort(e))
        return ST_ABORTED;
    fault_pause(e); /* tests: a peer may die meanwhile */
    /* never read a dead rank's pid: it may be another process's by now (the
     * lock is held while the rank lives, and a live pid is not reused) */
    if (!peer_alive(e, r))
        return cma_failed(e, r, ESRCH);
    return ST_OK;
}

/* CMA_IOV iovecs at most, CMA_PIECE bytes at most, from byte `off` of piece
 * i of the (address, length) pairs p[0..2n) on; how many */
static int iov_fill(const uint64_t *p, Py_ssize_t n, Py_ssize_t i, uint64_t off, struct iovec *v)
{
    int k = 0;
    size_t bytes = 0;
    for (; i < n && k < CMA_IOV && bytes < CMA_PIECE; i++, off = 0) {
        uint64_t m = p[2 * i + 1] - off;
        if (!m)
            continue;
        if (m > CMA_PIECE - bytes)
            m = CMA_PIECE - bytes;
        v[k].iov_base = (void *)(uintptr_t)(p[2 * i] + off);
        v[k++].iov_len = (size_t)m;
        bytes += (size_t)m;
    }
    return k;
}

static void iov_skip(const uint64_t *p, Py_ssize_t n, Py_ssize_t *i, uint64_t *off, size_t by)
{
    while (by && *i < n) {
        uint64_t left = p[2 * *i + 1] - *off;
        if (by < left) {
            *off += by;
            return;
        }
        by -= (size_t)left;
        (*i)++;
        *off = 0;
    }
}

/* n bytes from rank r's memory, at the (address, length) pairs rem[0..2 nrem),
 * to this process's pairs loc[0..2 nloc), as many as one process_vm_readv
 * takes at a time (CMA_IOV iovecs a side, CMA_PIECE bytes).  A status. */
static int cma_copy(Engine *e, int r, const uint64_t *loc, Py_ssize_t nloc, const uint64_t *rem,
                    Py_ssize_t nrem, size_t n)
{
    Py_ssize_t li = 0, ri = 0;
    uint64_t lo = 0, ro = 0;
    struct iovec lv[CMA_IOV], rv[CMA_IOV];
    for (size_t done = 0; done < n;) {
        int st = cma_may_read(e, r);
        if (st != ST_OK)
            return st;
        int nl = iov_fill(loc, nloc, li, lo, lv), nr = iov_fill(rem, nrem, ri, ro, rv);
        ssize_t got = process_vm_readv(peer_pid(e, r), lv, (unsigned long)nl, rv,
                                       (unsigned long)nr, 0);
        if (got > 0) {
            done += (size_t)got;
            iov_skip(loc, nloc, &li, &lo, (size_t)got);
            iov_skip(rem, nrem, &ri, &ro, (size_t)got);
        } else if (!(got < 0 && errno == EINTR)) {
            return cma_failed(e, r, got < 0 ? errno : EFAULT);
        }
    }
    return ST_OK;
}

/* n bytes at `remote` in rank r's memory (contiguous) to `local`, laid out as
 * put_blocks lays a contribution out: blocks of blk bytes, `row` bytes apart
 * (blk == n: one block).  A status. */
static int cma_read(Engine *e, int r, char *local, size_t blk, size_t row, uint64_t remote,
                    size_t n)
{
    size_t blocks = (n + blk - 1) / blk;
    uint64_t *loc = PyMem_RawMalloc(16 * blocks), rem[2] = {remote, n};
    if (!loc)
        return cma_failed(e, r, ENOMEM);
    for (size_t a = 0; a < blocks; a++) {
        loc[2 * a] = (uint64_t)(uintptr_t)(local + a * row);
        loc[2 * a + 1] = a + 1 < blocks ? blk : n - a * blk;
    }
    int st = cma_copy(e, r, loc, (Py_ssize_t)blocks, rem, 1, n);
    PyMem_RawFree(loc);
    return st;
}

/* The rounds of a single-copy exchange (all_gather, all_to_all): this rank
 * publishes its input's address (and, with `offs`, where in it each rank's
 * part starts, in its slot), syncs, places its own part (from `own`; NULL:
 * already in place), reads every peer's part straight into the result, and
 * syncs again so that nobody's input is read after it returns.  Rank r's part
 * is n[r] bytes that land at dst[r] in blocks of blk[r] bytes, row[r] apart
 * (put_blocks' layout; blk == n: one block).  A status, or -1. */
int cma_rounds(Engine *e, uint32_t kind, uint32_t dtype, uint64_t numel, uint64_t arg,
                      size_t total, const char *mine, const uint64_t *offs, const char *own,
                      char *const *dst, const size_t *blk, const size_t *row, const size_t *n)
{
    const int w = e->world, me = e->rank;
    PyThreadState *ts = NULL;
    int st = call_enter(e, total, &ts);
    if (st != 0)
        return st;
    span_t land[w]; /* where it lands, present first (pages.c) */
    for (int r = 0; r < w; r++)
        land[r] = (span_t){r != me || own ? dst[r] : NULL,
                           !blk[r] || blk[r] >= n[r] ? n[r] : (n[r] / blk[r] - 1) * row[r] + blk[r]};
    ready_pages(e, land, w);
    const int p = (int)((e->round + 1) & 1);
    if (offs)
        memcpy(slot_of(e, me, p), offs, (size_t)w * sizeof(uint64_t));
    line_of(e, me, 0, p)->addr = e->fault.cma_addr ? 4096u : (uint64_t)(uintptr_t)mine;
    st = round_sync(e, kind, dtype, 0, numel, arg, &ts);
    if (st == ST_OK && own && n[me])
        put_blocks(dst[me], own, 0, n[me], blk[me], row[me], 0);
    for (int i = 1; i < w && st == ST_OK; i++) {
        int r = (me + i) % w;
        uint64_t at = line_of(e, r, 0, p)->addr;
        if (offs)
            at += ((const uint64_t *)slot_of(e, r, p))[me];
        if (n[r])
            st = cma_read(e, r, dst[r], blk[r], row[r], at, n[r]);
    }
    if (st == ST_OK) /* nobody reads this rank's input after this round */
        st = round_sync(e, kind, dtype, 0, numel, arg, &ts);
    return call_end(e, st, ts);
}

/*
 * Single-copy all-reduce of `count` elements at t, in place (2026-12-04): the
 * zero-copy algorithm of zerocopy.c with the peers' tensors read by
 * process_vm_readv instead of mapped.
 *   round 1: every rank publishes where its tensor is;
 *   rank r reads shard r of every peer's tensor, a piece at a time, into its
 *   own slot (which nobody reads in these rounds), and reduces the piece in
 *   rank order into shard r of its own tensor: the same order, so the same
 *   bits, as one-shot and two-shot (only rank r touches shard r of anyone's
 *   tensor until round 2);
 *   round 2: every shard is reduced; each rank reads the other shards from
 *   their owners' tensors straight into its own;
 *   round 3: nobody reads this rank's tensor any more.
 * Per rank (W-1)/W of the tensor crosses once to be reduced and (W-1)/W once
 * as the result, against two-shot's copy in, copy of the result and copy out.
 * A rank with helper threads splits its reads and reductions between them.
 * Used from cma_ar_min bytes where cma_init agreed single copy (off unless
 * TPCOMM_CMA_ALLREDUCE_MIN_BYTES or a tuned profile sets it); the choice
 * travels in the metadata (ARG_SINGLE_COPY) like the other algorithms'.
 */
/* n bytes at `remote` in rank r's memory to `local`, split between this
 * rank's threads where it has them (pool.c par_read) CMA_PIECE bytes at a
 * time, checked between the pieces as cma_copy checks.  A status. */
static int cma_read_par(Engine *e, int r, char *local, uint64_t remote, size_t n)
{
    for (size_t done = 0; done < n;) {
        size_t k = n - done < CMA_PIECE ? n - done : CMA_PIECE;
        int st = cma_may_read(e, r);
        if (st != ST_OK)
            return st;
        int err = par_read(e->pool, peer_pid(e, r), local + done, remote + done, k);
        if (err)
            return cma_failed(e, r, err);
        done += k;
    }
    return ST_OK;
}

int cma_all_reduce(Engine *e, char *t, size_t count, int dtype, int op, uint32_t kind,
                   PyThreadState **ts)
{
    const size_t es = dt_size[dtype];
    const int w = e->world, me = e->rank;
    const int p = (int)((e->round + 1) & 1);
    /* a piece of every peer fits the slot, and stays in the caches while
     * reduced: 256 KiB a thread */
    size_t piece = e->slot_bytes / (size_t)(w - 1) / es;
    const size_t most = (256u << 10) * (size_t)pool_threads(e->pool);
    if (piece * es > most)
        piece = most / es;
    char *scratch = slot_of(e, me, p);
    line_of(e, me, 0, p)->addr = e->fault.cma_addr ? 4096u : (uint64_t)(uintptr_t)t;
    int st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, ARG_SINGLE_COPY, ts);
    const size_t lo = shard_start(count, w, me), hi = shard_start(count, w, me + 1);
    for (size_t a = lo; st == ST_OK && a < hi; a += piece) {
        size_t n = hi - a < piece ? hi - a : piece;
        for (int r = 0, k = 0; st == ST_OK && r < w; r++) {
            if (r == me) {
                e->srcs[r] = t + a * es;
                continue;
            }
            char *into = scratch + (size_t)k++ * piece * es;
            st = cma_read_par(e, r, into, line_of(e, r, 0, p)->addr + a * es, n * es);
            e->srcs[r] = into;
        }
        if (st == ST_OK)
            par_reduce(e->pool, dtype, op, t + a * es, e->srcs, w, n);
    }
    if (st == ST_OK)
        st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, ARG_SINGLE_COPY, ts);
    for (int i = 1; i < w && st == ST_OK; i++) {
        int j = (me + i) % w;
        size_t jlo = shard_start(count, w, j), jhi = shard_start(count, w, j + 1);
        if (jhi > jlo)
            st = cma_read_par(e, j, t + jlo * es, line_of(e, j, 0, p)->addr + jlo * es,
                              (jhi - jlo) * es);
    }
    if (st == ST_OK) /* nobody reads this rank's tensor after this round */
        st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, ARG_SINGLE_COPY, ts);
    return st;
}

/* all_gather by cma_rounds: rank r's contribution goes to `outer` blocks of
 * cnt[r] / outer bytes, block a at out + a * (total / outer) + off[r]
 * (put_blocks); the list form: to dsts[r] */
int cma_gather(Engine *e, uint32_t kind, const char *mine, const size_t *cnt, char *out,
                      char *const *dsts, uint32_t dtype, uint64_t numel, uint64_t arg,
                      size_t total, int in_place, size_t outer)
{
    const int w = e->world;
    char *dst[w];
    size_t blk[w], row[w], n[w], off = 0;
    for (int r = 0; r < w; r++) {
        dst[r] = dsts ? dsts[r] : out ? out + off : NULL;
        blk[r] = dsts ? cnt[r] : cnt[r] / outer;
        row[r] = dsts ? cnt[r] : total / outer;
        n[r] = out || dsts ? cnt[r] : 0; /* no result: the rounds alone */
        off += cnt[r] / outer;
    }
    return cma_rounds(e, kind, dtype, numel, arg, total, mine, NULL, in_place ? NULL : mine, dst,
                      blk, row, n);
}

/*
 * Messages sent by reference (2026-12-03).  With single-copy reads agreed at
 * creation (cma_init), a message sent by a batch that also receives (sendrecv,
 * batch_isend_irecv) whose data is at least P2P_BYREF_MIN (more than the
 * channel's ring) does not stream its data through the ring:
 * the stream carries the header and where the data lies in the sender (an
 * [address, length] pair per piece, after the header), the receiver reads the
 * data straight from the sender's memory (process_vm_readv, one copy instead
 * of two) and only then consumes the stream's last chunk, which the sender
 * waits for before it returns.  Such a message waited for its receiver chunk
 * by chunk already (it did not fit the ring), so no program that completed
 * before can now wait for ever.  The header-length word carries P2P_BYREF and
 * the number of pieces.  Only where this rank also receives: then both cores
 * are busy either way and the receiver's one copy replaces two (a 4 MiB
 * exchange at world 2: 1.3 ms -> 0.7 ms); a lone send by value keeps the
 * sender copying in while the receiver copies out, which a read by reference
 * would serialise (a 4 MiB ping-pong: 1.3 ms -> 1.9 ms).  Both receive paths
 * read either kind.
 */

/* The stream of message pc ([lengths + header, data pieces...]) sent by
 * reference, when it qualifies: 1 with *out streaming *buf (the caller frees
 * it), else 0. */
int cma_message(Engine *e, const pieces_t *pc, char **buf, char **addr, size_t *len,
                       pieces_t *out)
{
    *buf = NULL;
    if (!e->cma || pc->n < 2 || pc->len[0] < 16)
        return 0;
    uint64_t lens[2];
    memcpy(lens, pc->addr[0], sizeof lens);
    Py_ssize_t np = pc->n - 1;
    if (lens[1] < P2P_BYREF_MIN(e) || lens[0] > 0xffffffffull ||
        pc->len[0] != 16 + lens[0] || np > 0x7fffffff)
        return 0;
    size_t size = 16 + (size_t)lens[0] + 16 * (size_t)np;
    if (!(*buf = PyMem_RawMalloc(size)))
        return 0; /* by value, then */
    uint64_t w0 = lens[0] | P2P_BYREF | ((uint64_t)np << 32);
    memcpy(*buf, &w0, 8);
    memcpy(*buf + 8, &lens[1], 8);
    memcpy(*buf + 16, pc->addr[0] + 16, (size_t)lens[0]);
    char *d = *buf + 16 + lens[0];
    for (Py_ssize_t i = 0; i < np; i++) {
        uint64_t where[2] = {e->fault.cma_addr ? 4096u : (uint64_t)(uintptr_t)pc->addr[i + 1],
                             (uint64_t)pc->len[i + 1]};
        memcpy(d + 16 * i, where, 16);
    }
    addr[0] = *buf;
    len[0] = size;
    *out = (pieces_t){addr, len, 1};
    return 1;
}

/* Read a message sent by reference from rank r: `desc` holds the np
 * (address, length) pairs of its data in r's memory (dl bytes in all), the
 * data goes to the local pieces dst.  A status (no GIL needed). */
int cma_recv(Engine *e, int r, const char *desc, Py_ssize_t np, size_t dl,
                    const pieces_t *dst)
{
    uint64_t *rem = PyMem_RawMalloc(16 * (size_t)(np + dst->n) + 16);
    if (!rem)
        return cma_failed(e, r, ENOMEM);
    uint64_t *loc = rem + 2 * np, sum = 0, have = 0;
    memcpy(rem, desc, 16 * (size_t)np);
    for (Py_ssize_t i = 0; i < np; i++)
        sum += rem[2 * i + 1];
    for (Py_ssize_t i = 0; i < dst->n; i++) {
        loc[2 * i] = (uint64_t)(uintptr_t)dst->addr[i];
        have += loc[2 * i + 1] = dst->len[i];
    }
    int st = sum != dl || have != dl /* a torn or foreign stream: nothing is read */
                 ? cma_failed(e, r, EPROTO)
                 : cma_copy(e, r, loc, dst->n, rem, np, dl);
    PyMem_RawFree(rem);
    return st;
}

/*
 * cma_init(kind, want, min_bytes, twoshot_min) -> (status, enabled): collective.
 * The round also compares the switch points every rank must share (min_bytes,
 * twoshot_min: a difference is ST_MISMATCH, both sides in error_info).  Every rank
 * tries to read every peer's check word (cma_tag) with process_vm_readv, then
 * one round (kind: a barrier's) tells every rank what every other found;
 * single-copy all_gathers are on only if every rank can read every peer and
 * wants them (want: 0 from TPCOMM_CMA=0 turns them off everywhere).
 */
PyObject *eng_cma_init(Engine *e, PyObject *args)
{
    unsigned int kind;
    int want;
    unsigned long long min_bytes, twoshot;
    if (!PyArg_ParseTuple(args, "IpKK", &kind, &want, &min_bytes, &twoshot))
        return NULL;
    if (!e->base)
        return eng_closed_error();
    PyThreadState *ts = NULL;
    int en = call_enter(e, 0, &ts);
    if (en < 0)
        return NULL;
    if (en > 0)
        return Py_BuildValue("(iO)", en, Py_False);
    int ok = want;
    for (int r = 0; ok && r < e->world; r++) {
        if (r == e->rank)
            continue;
        uint64_t v = 0, where = ((uint64_t *)ctrl_of(e, r))[1];
        struct iovec l = {&v, sizeof v}, rm = {(void *)(uintptr_t)where, sizeof v};
        ok = process_vm_readv(peer_pid(e, r), &l, 1, &rm, 1, 0) == (ssize_t)sizeof v &&
             v == cma_tag((uint64_t)peer_pid(e, r), r);
    }
    int p = (int)((e->round + 1) & 1);
    line_of(e, e->rank, 0, p)->_r = (uint32_t)ok;
    int st = round_sync(e, kind, 0, 0, twoshot, min_bytes, &ts);
    st = call_end(e, st, ts); /* ts is set by round_sync: two statements */
    int all = st == ST_OK;
    for (int r = 0; all && r < e->world; r++)
        all = line_of(e, r, 0, p)->_r == 1;
    e->cma = all;
    e->cma_min = min_bytes;
    return Py_BuildValue("(iO)", st, all ? Py_True : Py_False);
}
