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
    e->err.reason = a >> 32;
    e->err.rank = (int)(a & 0xffffffffu) - 1;
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
    if (raised)
        fail(e, ST_INTERRUPTED, e->rank, e->rank);
    return raised;
}

/* Fail the communicator: record the rank the error names (err_rank), tell
 * every peer (the abort word, naming `blame`), return st. */
int fail(Engine *e, int st, int err_rank, int blame)
{
    e->err.rank = err_rank;
    e->failed = 1;
    set_abort(e, (uint64_t)st, blame);
    return st;
}

#define CHECK_NS 2000000ull   /* the periodic checks: liveness, abort, deadline */
#define SIGNAL_NS 50000000ull /* Python's signal handlers */

/*
 * The one waiting loop; every wait of the engine (a collective round, a
 * point-to-point counter, recv_any, a batch) passes its condition in.
 *
 * w->poll says whether the wait is over (WAIT_DONE), moved something
 * (WAIT_MOVED: the deadline and the backoff start again), or not
 * (WAIT_IDLE); anything else is returned as it is (a status, or -1 with an
 * exception set).  Between polls: spin with pause (GIL held: most waits end
 * here), then, GIL released (*ts), sched_yield (cheap when a peer shares the
 * core; skipped for a while once a yield lost the core to a busy process:
 * YIELD_LOST_NS), then sleep: on the futex word w->sleep_on names (announced in the
 * header's sleepers, re-checked, bounded by w->sleep_ns), or a nap of
 * w->sleep_ns where there is none.
 *
 * Every 2 ms: the abort word (ST_ABORTED), then w->verdict: a peer that died
 * (ST_PEER_DEAD) or waits for this rank in a collective while this rank
 * waits for it (ST_CROSSED).  A verdict is given only after one more poll:
 * the peer may have published what this rank waits for and then gone on
 * (into a collective, or out) between the poll and the check; what it
 * published before that, the next poll sees.  Then the deadline (the
 * timeout since the last move; err_rank: w->peer) and, every 50 ms, Python's
 * signal handlers (Ctrl-C must not wait for the timeout).
 */
/* A sched_yield that took this long gave the core to a task that kept it
 * (a rank that waits too yields it back at once): the core is shared with
 * busy processes, and each further yield would lose a time slice to them
 * (2-7 ms per all_reduce beside two CPU-bound processes).  The waits then
 * skip the yields for CROWDED_NS and sleep on the futex after the spin: a
 * woken task gets the core back at once (1 KiB: 2 us there).  Not where the
 * ranks outnumber the cores (no spin): there a yield goes to a peer rank,
 * which may keep the core for its whole reduce, and the yields are what keeps
 * those ranks fast (futex sleeps made world 4 on 2 cores 1.2-2.5x slower). */
/* YIELD_LOST_NS (tpcomm.h): the default of e->waits.lost_ns */
#define CROWDED_NS 1000000000ull

static int wait_loop(Engine *e, waiter_t *w, PyThreadState **ts, uint64_t start);

int wait_until(Engine *e, waiter_t *w, PyThreadState **ts)
{
    if (w->until) { /* this process's own wait: what it does is not the record's */
        struct rec was = e->rec;
        uint64_t crowded = e->waits.crowded_until;
        int st = w->poll(e, w, ts);
        if (st == WAIT_IDLE || st == WAIT_MOVED)
            st = wait_loop(e, w, ts, now_ns());
        e->rec = was;
        e->waits.crowded_until = crowded;
        return st == WAIT_DONE ? ST_OK : st;
    }
    int st = w->poll(e, w, ts);
    if (st == WAIT_DONE) {
        e->rec.instant++;
        e->rec.last = 0;
        return ST_OK;
    }
    if (st != WAIT_IDLE && st != WAIT_MOVED)
        return st;
    uint64_t start = now_ns();
    e->rec.last = 1;
    st = wait_loop(e, w, ts, start);
    e->rec.waits++;
    e->rec.ended[e->rec.last - 1]++;
    e->rec.wait_ns += now_ns() - start;
    return st;
}

/* wait_until's loop once the first poll found nothing; e->rec.last says how
 * far it went: 1 spin, 2 yield, 3 sleep */
static int wait_loop(Engine *e, waiter_t *w, PyThreadState **ts, uint64_t start)
{
    int st;
    uint64_t last = start, t = last;
    uint64_t next_check = last + CHECK_NS, next_signal = last + SIGNAL_NS;
    hdr_t *h = HDR(e);
    int recheck = 0;
    for (;;) {
        t = now_ns();
        if (t - last < e->waits.spin_ns) {
            for (int i = 0; i < 64; i++) {
                cpu_relax();
                if ((st = w->poll(e, w, ts)) != WAIT_IDLE)
                    break;
            }
        } else {
            if (*ts == NULL)
                *ts = PyEval_SaveThread();
            st = w->poll(e, w, ts);
        }
        if (st == WAIT_DONE)
            return ST_OK;
        if (st == WAIT_MOVED) {
            last = now_ns();
            recheck = 0;
            continue;
        }
        if (st != WAIT_IDLE)
            return st;
        if (t - last < e->waits.spin_ns)
            continue;
        if (w->until && t >= w->until)
            return ST_TIMEOUT;
        if ((t >= next_check || recheck) && w->until) { /* own wait: signals only */
            next_check = t + CHECK_NS;
            if (t >= next_signal) {
                next_signal = t + SIGNAL_NS;
                if (signal_raised(e, ts))
                    return ST_INTERRUPTED;
            }
        } else if (t >= next_check || recheck) {
            next_check = t + CHECK_NS;
            if (take_abort(e))
                return ST_ABORTED;
            int who = -1, verdict = w->verdict ? w->verdict(e, w, &who) : ST_OK;
            if (verdict != ST_OK && !recheck) {
                recheck = 1; /* one more poll first (above) */
                continue;
            }
            recheck = 0;
            if (verdict != ST_OK)
                return fail(e, verdict, who, verdict == ST_PEER_DEAD ? who : e->rank);
            if (t - last >= e->waits.timeout_ns)
                return fail(e, ST_TIMEOUT, w->peer, e->rank);
            if (t >= next_signal) {
                next_signal = t + SIGNAL_NS;
                if (signal_raised(e, ts))
                    return ST_INTERRUPTED;
            }
        }
        if (t - last < e->waits.yield_ns && t >= e->waits.crowded_until) {
            sched_yield();
            e->rec.yields++;
            if (e->rec.last < 2)
                e->rec.last = 2;
            uint64_t back = now_ns();
            if (back - t > e->rec.lost_max)
                e->rec.lost_max = back - t;
            if (back - t > e->waits.lost_ns && e->waits.spin_ns) {
                e->waits.crowded_until = back + CROWDED_NS;
                e->rec.crowded++;
            }
            continue;
        }
        e->rec.sleeps++;
        e->rec.last = 3;
        uint64_t want = 0;
        _Atomic uint64_t *word = w->sleep_on ? w->sleep_on(e, w, &want) : NULL;
        struct timespec to = {0, (long)w->sleep_ns};
        if (!word) {
            nanosleep(&to, NULL);
            continue;
        }
        atomic_fetch_add_explicit(&h->sleepers, 1, memory_order_seq_cst);
        uint64_t v = atomic_load_explicit(word, memory_order_seq_cst);
        if (v < want && !atomic_load_explicit(&h->abort_word, memory_order_relaxed))
            syscall(SYS_futex, futex_word(word), FUTEX_WAIT, (uint32_t)v, &to, NULL, 0);
        atomic_fetch_sub_explicit(&h->sleepers, 1, memory_order_relaxed);
    }
}

/* A wait for one counter of one peer: *seq >= n. */
typedef struct {
    waiter_t w;
    _Atomic uint64_t *seq;
    uint64_t n;
    int p2p; /* a point-to-point wait: a peer stuck in a collective is a verdict */
} seq_wait_t;

static int seq_poll(Engine *e, waiter_t *w, PyThreadState **ts)
{
    (void)e, (void)ts;
    seq_wait_t *s = (seq_wait_t *)w;
    return atomic_load_explicit(s->seq, memory_order_acquire) >= s->n ? WAIT_DONE : WAIT_IDLE;
}

static int seq_verdict(Engine *e, waiter_t *w, int *who)
{
    seq_wait_t *s = (seq_wait_t *)w;
    *who = w->peer;
    if (!peer_alive(e, w->peer))
        return ST_PEER_DEAD;
    /* this rank waits for the peer in a send or recv while the peer waits for
     * this rank in a collective: neither can move, so both (and every rank of
     * the communicator) fail now instead of at the timeout */
    if (s->p2p && peer_ahead(e, w->peer))
        return ST_CROSSED;
    return ST_OK;
}

static _Atomic uint64_t *seq_sleep_on(Engine *e, waiter_t *w, uint64_t *want)
{
    (void)e;
    seq_wait_t *s = (seq_wait_t *)w;
    *want = s->n;
    return s->seq;
}

/* Wait until *seq >= n, `peer` being the rank whose liveness decides
 * whether waiting still makes sense.  *ts holds the saved thread state once
 * the GIL has been released (the caller restores it). */
static int wait_seq(Engine *e, _Atomic uint64_t *seq, uint64_t n, int peer, int p2p,
                    PyThreadState **ts)
{
    if (atomic_load_explicit(seq, memory_order_acquire) >= n) {
        e->rec.instant++;
        e->rec.last = 0;
        return ST_OK;
    }
    seq_wait_t s = {{seq_poll, seq_verdict, seq_sleep_on, CHECK_NS, peer}, seq, n, p2p};
    return wait_until(e, &s.w, ts);
}

/* wait_seq for a point-to-point counter: also notices a peer stuck in a
 * collective (ST_CROSSED) */
int wait_p2p(Engine *e, _Atomic uint64_t *seq, uint64_t n, int peer, PyThreadState **ts)
{
    return wait_seq(e, seq, n, peer, 1, ts);
}

/* The record: how late this rank saw peer line l's publish (a wait that had
 * to wait, just ended: e->rec.last) */
static void note_late(Engine *e, line_t *l)
{
    uint64_t now = now_ns(), at = l->stamp;
    if (at == 0 || at > now)
        return; /* the peer does not stamp (yet) */
    uint64_t late = now - at, us = late / 1000;
    int k = e->rec.last - 1, b = 0;
    while (b < REC_BUCKETS - 1 && us >= (1ull << b))
        b++;
    e->rec.late_hist[b]++;
    e->rec.late_n[k]++;
    e->rec.late_ns[k] += late;
    if (late > e->rec.late_max[k])
        e->rec.late_max[k] = late;
}

/* record(reset) -> dict: the record of rounds and waits (see Engine.rec);
 * reset clears it after reading */
PyObject *eng_record(Engine *e, PyObject *args)
{
    int reset = 0, stamp = -1;
    if (!PyArg_ParseTuple(args, "|pi", &reset, &stamp))
        return NULL;
    PyObject *rounds = PyList_New(KIND_LAST + 1), *hist = PyList_New(REC_BUCKETS);
    if (!rounds || !hist)
        goto fail;
    for (int k = 0; k <= KIND_LAST; k++)
        PyList_SET_ITEM(rounds, k, PyLong_FromUnsignedLongLong(e->rec.rounds[k]));
    for (int b = 0; b < REC_BUCKETS; b++)
        PyList_SET_ITEM(hist, b, PyLong_FromUnsignedLongLong(e->rec.late_hist[b]));
    PyObject *d = Py_BuildValue(
        "{s:N,s:K,s:K,s:(KKK),s:K,s:K,s:K,s:K,s:(KKK),s:(KKK),s:(KKK),s:N,s:i,s:K,s:K,s:K}",
        "rounds", rounds, "instant", e->rec.instant, "waits", e->rec.waits,
        "ended", e->rec.ended[0], e->rec.ended[1], e->rec.ended[2],
        "wait_ns", e->rec.wait_ns, "yields", e->rec.yields, "sleeps", e->rec.sleeps,
        "crowded", e->rec.crowded,
        "late_n", e->rec.late_n[0], e->rec.late_n[1], e->rec.late_n[2],
        "late_ns", e->rec.late_ns[0], e->rec.late_ns[1], e->rec.late_ns[2],
        "late_max", e->rec.late_max[0], e->rec.late_max[1], e->rec.late_max[2],
        "late_hist", hist, "stamp", e->rec.stamp, "lost_max", e->rec.lost_max, "populated",
        e->rec.populated, "populated_bytes", e->rec.populated_bytes);
    if (!d)
        return NULL;
    if (reset) {
        int keep = e->rec.stamp;
        memset(&e->rec, 0, sizeof e->rec);
        e->rec.stamp = keep;
    }
    if (stamp >= 0)
        e->rec.stamp = stamp;
    return d;
fail:
    Py_XDECREF(rounds);
    Py_XDECREF(hist);
    return NULL;
}

/* How this rank's waits wait from now on (eng_init, set_waits): spin for
 * spin_us (capped: spinning holds the GIL and checks nothing, so at most one
 * liveness period, 2 ms), yield until yield_us, then sleep; a yield longer
 * than lost_us lost the core (0: never counted so). */
void waits_set(Engine *e, double spin_us, double yield_us, double lost_us)
{
    uint64_t spin = ns_of(spin_us * 1e-6);
    e->waits.spin_ns = spin < CHECK_NS ? spin : CHECK_NS;
    e->waits.yield_ns = ns_of(yield_us * 1e-6);
    e->waits.lost_ns = lost_us > 0 ? ns_of(lost_us * 1e-6) : 0;
    e->waits.crowded_until = 0;
}

/* set_waits(spin_us, yield_us, lost_us=200): waits_set from Python (a rank's
 * own: the peers need not agree) */
PyObject *eng_set_waits(Engine *e, PyObject *args)
{
    double spin_us, yield_us, lost_us = YIELD_LOST_NS / 1e3;
    if (!PyArg_ParseTuple(args, "dd|d", &spin_us, &yield_us, &lost_us))
        return NULL;
    if (!(spin_us >= 0 && spin_us <= 2000 && yield_us >= 0 && yield_us <= 1e6)) {
        PyErr_Format(PyExc_ValueError,
                     "set_waits: spin_us must be in [0, 2000] and yield_us in [0, 1e6], got %g, %g",
                     spin_us, yield_us);
        return NULL;
    }
    waits_set(e, spin_us, yield_us, lost_us);
    Py_RETURN_NONE;
}

/*
 * One round on the collective channel: fill in the metadata, publish, wait
 * for every peer, check they all called the same thing.  Copy-in happens
 * before (the caller writes its slot).  Returns a status code.
 */
int round_sync(Engine *e, uint32_t kind, uint32_t dtype, uint32_t op, uint64_t count,
                      uint64_t arg, PyThreadState **ts)
{
    uint64_t n = ++e->round;
    int p = (int)(n & 1);
    e->rec.rounds[kind <= KIND_LAST ? kind : 0]++;
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
        int st = wait_seq(e, &l->seq, n, r, 0, ts);
        if (st != ST_OK)
            return st;
        if (e->rec.stamp && e->rec.last)
            note_late(e, l);
        if (mismatch < 0 && (l->kind != kind || l->dtype != dtype || l->op != op ||
                             l->count != count || l->arg != arg)) {
            mismatch = r;
            e->err.rank = r;
            e->err.kind = l->kind;
            e->err.dtype = l->dtype;
            e->err.op = l->op;
            e->err.count = l->count;
            e->err.arg = l->arg;
            e->err.my_kind = kind;
            e->err.my_dtype = dtype;
            e->err.my_op = op;
            e->err.my_count = count;
            e->err.my_arg = arg;
        }
    }
    return mismatch >= 0 ? ST_MISMATCH : ST_OK;
}
