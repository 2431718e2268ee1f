/*
 * Waiting: futexes, peer liveness (OFD locks), the abort word, Python's
 * signal handlers during a wait, and round_sync, the one collective round
 * every collective is made of.
 */
#include "tpcomm.h"

void futex_wake_all(_Atomic uint64_t *p)
{
    syscall(SYS_futex, futex_word(p), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Is the peer's liveness lock still held?  1 alive, 0 dead. */
int peer_alive(Engine *e, int r)
{
    struct flock fl = rank_lock(r);
    if (fcntl(e->fd, F_OFD_GETLK, &fl) != 0)
        return 1; /* cannot tell: assume alive, the deadline still holds */
    return fl.l_type != F_UNLCK;
}

void set_abort(Engine *e, uint64_t reason, int rank)
{
    uint64_t want = (reason << 32) | (uint64_t)(rank + 1), zero = 0;
    atomic_compare_exchange_strong(&HDR(e)->abort_word, &zero, want);
    /* wake every sleeper on every line: aborts are rare */
    for (int r = 0; r < e->world; r++)
        for (int c = 0; c < NCHAN; c++)
            for (int p = 0; p < 2; p++)
                futex_wake_all(&line_of(e, r, c, p)->seq);
}

int take_abort(Engine *e)
{
    uint64_t a = atomic_load_explicit(&HDR(e)->abort_word, memory_order_acquire);
    if (!a)
        return 0;
    e->err_reason = a >> 32;
    e->err_rank = (int)(a & 0xffffffffu) - 1;
    e->failed = 1;
    return 1;
}

/* Whether `peer` has entered a collective round this rank has not: it waits
 * there for this rank (its collective line holds a larger round number). */
int peer_ahead(Engine *e, int peer)
{
    uint64_t a = atomic_load_explicit(&line_of(e, peer, 0, 0)->seq, memory_order_acquire);
    uint64_t b = atomic_load_explicit(&line_of(e, peer, 0, 1)->seq, memory_order_acquire);
    return (a > b ? a : b) > e->round;
}

/* Run Python's signal handlers from a wait (GIL released in *ts).  If one
 * raised, keep its exception for Python (reraise), fail the communicator and
 * tell the peers this rank is leaving: 1.  Else 0. */
static int signal_raised(Engine *e, PyThreadState **ts)
{
    PyEval_RestoreThread(*ts);
    int raised = PyErr_CheckSignals() < 0;
    if (raised) {
        Py_CLEAR(e->pending);
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb && value)
            PyException_SetTraceback(value, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        e->pending = value;
    }
    *ts = PyEval_SaveThread();
    if (raised) {
        e->err_rank = e->rank;
        e->failed = 1;
        set_abort(e, ST_INTERRUPTED, e->rank);
    }
    return raised;
}

/* The end of a slow wait's periodic checks: the deadline (over: it passed;
 * peer: the rank waited for), then Python's signal handlers every 50 ms:
 * Ctrl-C (or any handler that raises) must not wait for the timeout.  A
 * status, or ST_OK to go on waiting. */
int deadline_and_signals(Engine *e, int over, int peer, uint64_t t, uint64_t *next_signal,
                                PyThreadState **ts)
{
    if (over) {
        e->err_rank = peer;
        e->failed = 1;
        set_abort(e, ST_TIMEOUT, e->rank);
        return ST_TIMEOUT;
    }
    if (t >= *next_signal) {
        *next_signal = t + 50000000ull;
        if (signal_raised(e, ts))
            return ST_INTERRUPTED;
    }
    return ST_OK;
}

/*
 * Wait until *seq >= n.  Spin (GIL held: most waits end here), then release
 * the GIL and yield, then sleep on the futex.  `peer` is the rank whose
 * liveness decides whether waiting still makes sense.  *ts holds the saved
 * thread state once the GIL has been released (the caller restores it).
 */
static int wait_seq(Engine *e, _Atomic uint64_t *seq, uint64_t n, int peer, PyThreadState **ts)
{
    if (atomic_load_explicit(seq, memory_order_acquire) >= n)
        return ST_OK;
    uint64_t t0 = now_ns(), t = t0;
    uint64_t deadline = t0 + e->timeout_ns;
    while (t - t0 < e->spin_ns) {
        for (int i = 0; i < 64; i++) {
            cpu_relax();
            if (atomic_load_explicit(seq, memory_order_acquire) >= n)
                return ST_OK;
        }
        t = now_ns();
    }
    if (*ts == NULL)
        *ts = PyEval_SaveThread();
    uint64_t next_check = t + 2000000ull; /* liveness every 2 ms */
    uint64_t next_signal = t + 50000000ull; /* Python signal handlers every 50 ms */
    hdr_t *h = HDR(e);
    for (;;) {
        uint64_t v = atomic_load_explicit(seq, memory_order_acquire);
        if (v >= n)
            return ST_OK;
        t = now_ns();
        if (t >= next_check) {
            next_check = t + 2000000ull;
            if (take_abort(e))
                return ST_ABORTED;
            if (!peer_alive(e, peer)) {
                if (atomic_load_explicit(seq, memory_order_acquire) >= n)
                    return ST_OK; /* it published, then left: fine */
                e->err_rank = peer;
                e->failed = 1;
                set_abort(e, ST_PEER_DEAD, peer);
                return ST_PEER_DEAD;
            }
            if (e->in_p2p && peer_ahead(e, peer)) {
                /* this rank waits for the peer in a send or recv while the peer
                 * waits for this rank in a collective: neither can move, so
                 * both (and every rank of the communicator) fail now instead
                 * of at the timeout */
                if (atomic_load_explicit(seq, memory_order_acquire) >= n)
                    return ST_OK;
                e->err_rank = peer;
                e->failed = 1;
                set_abort(e, ST_CROSSED, e->rank);
                return ST_CROSSED;
            }
            int st = deadline_and_signals(e, t >= deadline, peer, t, &next_signal, ts);
            if (st != ST_OK)
                return st;
        }
        if (t - t0 < e->yield_ns) {
            sched_yield();
            continue;
        }
        /* sleep: announce, re-check, wait on the futex (bounded), retract */
        atomic_fetch_add_explicit(&h->sleepers, 1, memory_order_seq_cst);
        v = atomic_load_explicit(seq, memory_order_seq_cst);
        if (v < n && !atomic_load_explicit(&h->abort_word, memory_order_relaxed)) {
            struct timespec to = {0, 2000000}; /* 2 ms: the liveness period */
            syscall(SYS_futex, futex_word(seq), FUTEX_WAIT, (uint32_t)v, &to, NULL, 0);
        }
        atomic_fetch_sub_explicit(&h->sleepers, 1, memory_order_relaxed);
    }
}

/*
 * One round on the collective channel: fill in the metadata, publish, wait
 * for every peer, check they all called the same thing.  Copy-in happens
 * before (the caller writes its slot).  Returns a status code.
 */
/* wait_seq for a point-to-point counter: also notices a peer stuck in a
 * collective (ST_CROSSED) */
int wait_p2p(Engine *e, _Atomic uint64_t *seq, uint64_t n, int peer, PyThreadState **ts)
{
    e->in_p2p = 1;
    int st = wait_seq(e, seq, n, peer, ts);
    e->in_p2p = 0;
    return st;
}

int round_sync(Engine *e, uint32_t kind, uint32_t dtype, uint32_t op, uint64_t count,
                      uint64_t arg, PyThreadState **ts)
{
    uint64_t n = ++e->round;
    int p = (int)(n & 1);
    line_t *mine = line_of(e, e->rank, 0, p);
    mine->kind = kind;
    mine->dtype = dtype;
    mine->op = op;
    mine->count = count;
    mine->arg = arg;
    publish(e, mine, n);
    int mismatch = -1;
    for (int i = 1; i < e->world; i++) {
        int r = (e->rank + i) % e->world; /* stagger: ranks look at different peers first */
        line_t *l = line_of(e, r, 0, p);
        int st = wait_seq(e, &l->seq, n, r, ts);
        if (st != ST_OK)
            return st;
        if (mismatch < 0 && (l->kind != kind || l->dtype != dtype || l->op != op ||
                             l->count != count || l->arg != arg)) {
            mismatch = r;
            e->err_rank = r;
            e->err_kind = l->kind;
            e->err_dtype = l->dtype;
            e->err_op = l->op;
            e->err_count = l->count;
            e->err_arg = l->arg;
            e->err_my_kind = kind;
            e->err_my_dtype = dtype;
            e->err_my_op = op;
            e->err_my_count = count;
            e->err_my_arg = arg;
        }
    }
    return mismatch >= 0 ? ST_MISMATCH : ST_OK;
}
