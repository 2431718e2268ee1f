/*
 * Point-to-point operations progressed together (torch's batch_isend_irecv,
 * sendrecv): no order of them can deadlock.
 */
#include "tpcomm.h"

/*
 * p2p_batch(ops) -> (status, [(index, header, data), ...]): point-to-point
 * operations progressed together, so that no order of them can deadlock
 * (torch's batch_isend_irecv promises that: two ranks may each send the other
 * a message larger than the ring before receiving).  ops is a list of
 *   (1, dst, pieces)          send: the message's whole byte stream
 *                             ([header length, data length] + header + data)
 *   (0, src, header, pieces)  receive the next message from src, whose header
 *                             must be `header`, its data into the pieces
 * Operations with the same peer and direction run in list order; the others
 * interleave chunk by chunk.  A received message that does not match (another
 * header, or data of another size) is received into a new bytearray instead,
 * so the channel stays in step and nothing is written, and comes back as
 * (index, its header, its data) for Python to judge.  The wait is
 * wait_until's (spin, yield, sleep; liveness, crossed calls, the deadline
 * since the last progress, abort, signals) over every blocked peer.
 */

/* The whole header is in: does the message fit the receive?  If not, its
 * data goes to a new bytearray, which Python gets without another copy (the
 * GIL is taken for that moment).  A receive with a land function first asks
 * it for tensors made from the header.  0, or -1: no memory. */
static int brecv_check(Engine *e, bop_t *o, PyThreadState **ts)
{
    size_t room = 0;
    for (Py_ssize_t i = 0; i < o->pc.n; i++)
        room += o->pc.len[i];
    o->drop = o->hl != o->want_len || memcmp(o->hdr, o->want, o->hl) != 0 || o->dl != room;
    if (!o->drop)
        return 0;
    if (*ts) /* the GIL back for the allocation (a small batch keeps it) */
        PyEval_RestoreThread(*ts);
    Py_ssize_t np = 0;
    if (o->land && (o->made = o->land(e, (const unsigned char *)o->hdr, o->hl, o->dl,
                                      o->made_addr, o->made_len, &np))) {
        o->pc = (pieces_t){o->made_addr, o->made_len, np};
        o->piece = 0;
        o->off = 0;
        o->drop = 0;
    } else
        o->scratch_obj = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)o->dl);
    if (o->scratch_obj)
        o->scratch = PyByteArray_AS_STRING(o->scratch_obj);
    else if (!o->made)
        PyErr_Clear(); /* reported as no memory */
    if (*ts)
        *ts = PyEval_SaveThread();
    return o->scratch_obj || o->made ? 0 : -1;
}

/* Copy n bytes at from (stream offset at) to where the receive puts them.
 * 0, or -1: no memory. */
static int brecv_put(Engine *e, bop_t *o, const char *from, size_t n, size_t at,
                     PyThreadState **ts)
{
    while (n) {
        size_t m;
        if (at < 16 + o->hl) { /* the header */
            m = 16 + o->hl - at < n ? 16 + o->hl - at : n;
            memcpy(o->hdr + (at - 16), from, m);
            o->got += m;
            if (o->got == o->hl && brecv_check(e, o, ts) < 0)
                return -1;
        } else if (o->np) { /* by reference: where the data is, then the data */
            m = n;
            memcpy(o->hdr + (at - 16), from, m);
            if (at + m == o->total) {
                pieces_t into = {&o->scratch, &o->dl, 1};
                o->err = cma_recv(e, o->peer, o->hdr + o->hl, o->np, o->dl,
                                  o->drop ? &into : &o->pc);
                if (o->err)
                    return 0;
            }
        } else { /* the data */
            m = n;
            if (o->drop) {
                memcpy(o->scratch + o->soff, from, m);
                o->soff += m;
            } else {
                size_t left = m;
                const char *f = from;
                while (left) {
                    size_t room = o->pc.len[o->piece] - o->off;
                    size_t c = room < left ? room : left;
                    memcpy(o->pc.addr[o->piece] + o->off, f, c);
                    o->off += c;
                    f += c;
                    left -= c;
                    if (o->off == o->pc.len[o->piece]) {
                        o->piece++;
                        o->off = 0;
                    }
                }
            }
        }
        from += m;
        at += m;
        n -= m;
    }
    return 0;
}

/* Take every chunk that has arrived; 1 if any did. -1: no memory. */
static int brecv_step(Engine *e, bop_t *o, PyThreadState **ts)
{
    const size_t cap = e->p2p_piece;
    _Atomic uint64_t *sent = &ctrl_line(e, o->peer, P2P_SENT_LINE(e->rank))->seq;
    line_t *done = ctrl_line(e, e->rank, P2P_DONE_LINE(e->world, o->peer));
    int moved = 0;
    if (!o->started) {
        o->k = e->p2p_recvd[o->peer] + 1;
        if (atomic_load_explicit(sent, memory_order_acquire) < o->k)
            return 0;
        uint64_t lens[2];
        memcpy(lens, p2p_slot_of(e, o->peer, e->rank, o->k), sizeof lens);
        if ((o->err = p2p_malformed(e, o->peer, lens[0], lens[1])) != ST_OK)
            return 0;
        o->hl = (size_t)P2P_HL(lens[0]);
        o->np = P2P_NP(lens[0]);
        o->dl = (size_t)lens[1];
        /* by reference, the stream after the header is where the data lies */
        o->total = 16 + o->hl + (o->np ? 16 * (size_t)o->np : o->dl);
        o->hdr = PyMem_RawMalloc(o->hl + 16 * (size_t)o->np + 1);
        if (!o->hdr)
            return -1;
        if (o->dl >= GIL_RELEASE_BYTES && !*ts) /* a large receive: as call_begin */
            *ts = PyEval_SaveThread();
        o->pos = 0;
        o->used = 16;
        o->limit = o->total < cap ? o->total : cap;
        o->started = 1;
        moved = 1;
        if (o->hl == 0 && brecv_check(e, o, ts) < 0) /* an empty header: decide now */
            return -1;
    }
    for (;;) {
        if (o->need) {
            if (atomic_load_explicit(sent, memory_order_acquire) < o->k)
                return moved;
            o->need = 0;
            o->used = 0;
            o->limit = o->total - o->pos < cap ? o->total - o->pos : cap;
        }
        if (o->used < o->limit) {
            const char *slot = p2p_slot_of(e, o->peer, e->rank, o->k);
            if (brecv_put(e, o, slot + o->used, o->limit - o->used, o->pos + o->used, ts) < 0)
                return -1;
            if (o->err) /* a read by reference failed */
                return 0;
            o->used = o->limit;
            moved = 1;
        }
        publish(e, done, o->k); /* chunk k is consumed */
        o->pos += o->limit;
        if (o->pos >= o->total) {
            e->p2p_recvd[o->peer] = o->k;
            o->done = 1;
            return 1;
        }
        o->k++;
        o->need = 1;
    }
}

/* The counter a blocked operation waits on, and the value it needs. */
static _Atomic uint64_t *bop_waits_on(Engine *e, bop_t *o, uint64_t *n)
{
    if (o->send) { /* room in the ring, or (by reference, all sent) the receiver's read */
        *n = o->np && o->pos >= o->total ? o->k : o->k + 1 - P2P_RING;
        return &ctrl_line(e, o->peer, P2P_DONE_LINE(e->world, e->rank))->seq;
    }
    *n = o->started ? o->k : e->p2p_recvd[o->peer] + 1;
    return &ctrl_line(e, o->peer, P2P_SENT_LINE(e->rank))->seq;
}

/* A batch as wait_until sees it: every operation stepped in each poll */
typedef struct {
    waiter_t w;
    bop_t *ops;
    Py_ssize_t n;
    bop_t *first; /* the first blocked operation: the one to sleep on */
} batch_wait_t;

static int batch_poll(Engine *e, waiter_t *w, PyThreadState **ts)
{
    batch_wait_t *b = (batch_wait_t *)w;
    int moved = 0, pending = 0;
    b->first = NULL;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        bop_t *o = &b->ops[i];
        if (o->done)
            continue;
        pending = 1;
        int behind = 0; /* an earlier one, same peer and direction, is not done */
        for (Py_ssize_t j = 0; j < i && !behind; j++)
            behind = !b->ops[j].done && b->ops[j].send == o->send && b->ops[j].peer == o->peer;
        if (behind)
            continue;
        int m = o->send ? bsend_step(e, o) : brecv_step(e, o, ts);
        if (m < 0)
            return -1;
        if (o->err)
            return o->err;
        moved |= m;
        if (!o->done && !b->first)
            b->first = o;
    }
    w->peer = b->first ? b->first->peer : -1;
    return !pending ? WAIT_DONE : moved ? WAIT_MOVED : WAIT_IDLE;
}

/* the first operation not done whose peer died or is crossed (see wait_p2p) */
static int batch_verdict(Engine *e, waiter_t *w, int *who)
{
    batch_wait_t *b = (batch_wait_t *)w;
    fault_pause(e); /* tests: widen the race the recheck closes */
    for (Py_ssize_t i = 0; i < b->n; i++) {
        bop_t *o = &b->ops[i];
        if (o->done)
            continue;
        *who = o->peer;
        if (!peer_alive(e, o->peer))
            return ST_PEER_DEAD;
        if (peer_ahead(e, o->peer))
            return ST_CROSSED;
    }
    return ST_OK;
}

/* short sleeps: the other blocked operations are not watched meanwhile */
static _Atomic uint64_t *batch_sleep_on(Engine *e, waiter_t *w, uint64_t *want)
{
    batch_wait_t *b = (batch_wait_t *)w;
    return b->first ? bop_waits_on(e, b->first, want) : NULL;
}

/* Run a batch with the GIL released: the one entry of p2p_batch and
 * p2p_sendrecv.  Where the batch also receives, its large sends go by
 * reference (see cma_message): the rule lives here, not in the callers.
 * The status of wait_until. */
int batch_progress(Engine *e, bop_t *ops, Py_ssize_t n)
{
    int receives = 0;
    size_t bytes = 0; /* what the sends move: the GIL is released from GIL_RELEASE_BYTES
                       * as send_pieces does it (a receive: once its header says
                       * so, brecv_step), else when the wait stops spinning */
    for (Py_ssize_t i = 0; i < n; i++) {
        receives |= !ops[i].send;
        bytes += ops[i].send ? ops[i].total : 0;
    }
    for (Py_ssize_t i = 0; receives && i < n; i++) {
        bop_t *o = &ops[i];
        Py_ssize_t pieces = o->pc.n;
        if (o->send && cma_message(e, &o->pc, &o->rbuf, o->by_addr, o->by_len, &o->pc)) {
            o->np = pieces - 1;
            o->total = o->pc.len[0];
        }
    }
    PyThreadState *ts = NULL;
    call_begin(e, bytes, &ts);
    batch_wait_t b = {{batch_poll, batch_verdict, batch_sleep_on, 200000, -1}, ops, n, NULL};
    int st = wait_until(e, &b.w, &ts);
    return call_end(e, st, ts);
}

static void bops_free(bop_t *ops, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyMem_Free(ops[i].own.addr);
        PyMem_Free(ops[i].own.len);
        PyMem_RawFree(ops[i].rbuf);
        PyMem_RawFree(ops[i].hdr);
        Py_XDECREF(ops[i].scratch_obj);
        Py_XDECREF(ops[i].made);
    }
    PyMem_Free(ops);
}

PyObject *eng_p2p_batch(Engine *e, PyObject *list)
{
    if (!e->base)
        return eng_closed_error();
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "p2p_batch: ops must be a list");
        return NULL;
    }
    int no = call_check(e);
    if (no < 0)
        return NULL;
    if (no)
        return Py_BuildValue("(i[])", no);
    if (e->rx.src >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "p2p_batch: a received message is half read");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    bop_t *ops = PyMem_Calloc((size_t)n + 1, sizeof(bop_t));
    if (!ops)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i), *pieces, *want = NULL;
        bop_t *o = &ops[i];
        int ok = PyTuple_Check(item) && PyTuple_GET_SIZE(item) >= 3 &&
                 PyArg_ParseTuple(item, PyTuple_GET_SIZE(item) == 3 ? "iiO" : "iiSO", &o->send,
                                  &o->peer, PyTuple_GET_SIZE(item) == 3 ? &pieces : &want,
                                  &pieces);
        if (!ok || (o->send != (want == NULL))) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError,
                                "p2p_batch: each op is (1, dst, pieces) or (0, src, header, "
                                "pieces)");
            bops_free(ops, i);
            return NULL;
        }
        if (p2p_check_rank(e, o->peer, "p2p_batch") < 0 || parse_pieces(pieces, &o->pc) < 0) {
            bops_free(ops, i);
            return NULL;
        }
        o->own = o->pc;
        if (o->send) {
            for (Py_ssize_t j = 0; j < o->pc.n; j++)
                o->total += o->pc.len[j];
            if (o->total < 16) {
                PyErr_SetString(PyExc_ValueError, "p2p_batch: a message has at least 16 bytes");
                bops_free(ops, i + 1);
                return NULL;
            }
        } else {
            o->want = PyBytes_AS_STRING(want); /* the list keeps the bytes alive */
            o->want_len = (size_t)PyBytes_GET_SIZE(want);
        }
    }
    int st = batch_progress(e, ops, n);
    PyObject *bad = st < 0 ? NULL : PyList_New(0);
    for (Py_ssize_t i = 0; bad && st == ST_OK && i < n; i++) {
        if (ops[i].send || !ops[i].drop)
            continue;
        PyObject *pair =
            Py_BuildValue("(ny#O)", i, ops[i].hdr, (Py_ssize_t)ops[i].hl, ops[i].scratch_obj);
        if (!pair || PyList_Append(bad, pair) < 0)
            Py_CLEAR(bad);
        Py_XDECREF(pair);
    }
    bops_free(ops, n);
    if (st < 0) {
        Py_XDECREF(bad);
        return PyErr_NoMemory();
    }
    return bad ? Py_BuildValue("(iN)", st, bad) : NULL;
}
