/*
 * Point-to-point channels: streaming a message into the ring (send), and
 * receiving it as a header, then a body.
 */
#include "tpcomm.h"

/* 0 when the engine is open and r names another rank; else -1 with the
 * exception set */
int p2p_check_rank(Engine *e, long r, const char *fn)
{
    if (!e->base) {
        eng_closed_error();
        return -1;
    }
    if (r < 0 || r >= e->world || r == e->rank) {
        PyErr_Format(PyExc_ValueError, "%s: rank %ld is not another rank of [0, %d)", fn, r,
                     e->world);
        return -1;
    }
    return 0;
}

/*
 * Point to point.  The channel s -> d: a ring of P2P_RING chunks
 * p2p_slot_of(s, d, k), the sender's line P2P_SENT_LINE(d) counts chunks
 * sent, the receiver's line P2P_DONE_LINE(w, s) counts chunks consumed.
 * Chunk k may be written once chunk k - P2P_RING is consumed.  Chunks are
 * small (p2p_piece: 16 KiB at world 2 with 1 MiB slots), so the receiver
 * copies chunk k out while the sender copies chunk k + 1 in: a message costs
 * about one copy, not two in a row.  The byte stream of a message is
 * [header length, data length] (16 bytes) + header + data (see shm/messages.py).
 */

int parse_pieces(PyObject *list, pieces_t *pc)
{
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "pieces must be a list of (address, nbytes) or bytes");
        return -1;
    }
    pc->n = PyList_GET_SIZE(list);
    pc->addr = PyMem_Calloc((size_t)pc->n + 1, sizeof(char *));
    pc->len = PyMem_Calloc((size_t)pc->n + 1, sizeof(size_t));
    if (!pc->addr || !pc->len) {
        PyMem_Free(pc->addr);
        PyMem_Free(pc->len);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < pc->n; i++) {
        unsigned long long a, l;
        PyObject *item = PyList_GET_ITEM(list, i);
        if (PyBytes_Check(item)) { /* a small header, copied from the bytes object */
            pc->addr[i] = PyBytes_AS_STRING(item);
            pc->len[i] = (size_t)PyBytes_GET_SIZE(item);
            continue;
        }
        if (!PyArg_ParseTuple(item, "KK", &a, &l)) {
            PyMem_Free(pc->addr);
            PyMem_Free(pc->len);
            return -1;
        }
        pc->addr[i] = (char *)(uintptr_t)a;
        pc->len[i] = (size_t)l;
    }
    return 0;
}

/* Push as many chunks as the ring takes; 1 if any moved. */
int bsend_step(Engine *e, bop_t *o)
{
    const size_t cap = e->p2p_piece;
    _Atomic uint64_t *done = &ctrl_line(e, o->peer, P2P_DONE_LINE(e->world, e->rank))->seq;
    line_t *sent = ctrl_line(e, e->rank, P2P_SENT_LINE(o->peer));
    int moved = 0;
    if (!o->started) {
        o->k = e->p2p_sent[o->peer];
        o->started = 1;
    }
    while (o->pos < o->total) {
        uint64_t k = o->k + 1;
        /* room: the receiver's count as last read, read again only when
         * that is short (it is the receiver's line, which each of its reads
         * writes: one transfer between cores saved on most chunks) */
        if (k > P2P_RING && e->p2p_seen[o->peer] < k - P2P_RING &&
            (e->p2p_seen[o->peer] = atomic_load_explicit(done, memory_order_acquire)) <
                k - P2P_RING)
            break;
        char *slot = p2p_slot_of(e, e->rank, o->peer, k);
        size_t fill = 0;
        const int nt = slot_stores_nt(e, o->total - o->pos < cap ? o->total - o->pos : cap);
        while (fill < cap && o->piece < o->pc.n) {
            size_t left = o->pc.len[o->piece] - o->off;
            size_t n = left < cap - fill ? left : cap - fill;
            copy_slot(slot + fill, o->pc.addr[o->piece] + o->off, n, nt);
            fill += n;
            o->off += n;
            if (o->off == o->pc.len[o->piece]) {
                o->piece++;
                o->off = 0;
            }
        }
        publish(e, sent, k);
        o->k = k;
        o->pos += fill;
        moved = 1;
    }
    if (o->pos >= o->total) {
        /* by reference: done once the receiver has read the data (cma_message) */
        if (o->np && atomic_load_explicit(done, memory_order_acquire) < o->k)
            return moved;
        o->done = 1;
        e->p2p_sent[o->peer] = o->k;
    }
    return moved;
}

/* Stream the pieces to dst: bsend_step while the ring has room, wait_p2p
 * for room in between.  Called and returns with the GIL held. */
int send_pieces(Engine *e, int dst, const pieces_t *pc)
{
    bop_t o;
    memset(&o, 0, sizeof o);
    o.send = 1;
    o.peer = dst;
    o.pc = *pc;
    for (Py_ssize_t i = 0; i < pc->n; i++)
        o.total += pc->len[i];
    _Atomic uint64_t *done = &ctrl_line(e, dst, P2P_DONE_LINE(e->world, e->rank))->seq;
    PyThreadState *ts = NULL;
    call_begin(e, o.total, &ts);
    int st = ST_OK;
    for (;;) {
        bsend_step(e, &o);
        if (o.done)
            break;
        if ((st = wait_p2p(e, done, o.k + 1 - P2P_RING, dst, &ts)) != ST_OK)
            break;
    }
    return call_end(e, st, ts);
}

/* p2p_send(dst, [(address, nbytes), ...], only_if_room=False) -> status: stream
 * the pieces; with only_if_room, None (nothing sent) if it would have to wait */
PyObject *eng_p2p_send(Engine *e, PyObject *args)
{
    int dst, only_if_room = 0;
    PyObject *list;
    pieces_t pc;
    if (!PyArg_ParseTuple(args, "iO|p", &dst, &list, &only_if_room) ||
        p2p_check_rank(e, dst, "p2p_send") < 0)
        return NULL;
    int no = call_check(e);
    if (no < 0)
        return NULL;
    if (no)
        return PyLong_FromLong(no);
    if (parse_pieces(list, &pc) < 0)
        return NULL;
    if (only_if_room) { /* None (nothing sent) unless the ring takes it all now */
        size_t total = 0;
        for (Py_ssize_t i = 0; i < pc.n; i++)
            total += pc.len[i];
        uint64_t chunks = total ? (total + e->p2p_piece - 1) / e->p2p_piece : 1;
        uint64_t need = e->p2p_sent[dst] + chunks; /* the receiver's count as bsend_step reads it */
        if (need > e->p2p_seen[dst] + P2P_RING &&
            need > (e->p2p_seen[dst] = atomic_load_explicit(
                        &ctrl_line(e, dst, P2P_DONE_LINE(e->world, e->rank))->seq,
                        memory_order_acquire)) +
                       P2P_RING) {
            PyMem_Free(pc.addr);
            PyMem_Free(pc.len);
            Py_RETURN_NONE;
        }
    }
    int st = send_pieces(e, dst, &pc);
    PyMem_Free(pc.addr);
    PyMem_Free(pc.len);
    return PyLong_FromLong(st);
}

/* the next chunk of the receive in progress is consumed: say so, wait for the
 * following one */
static int rx_next(Engine *e, PyThreadState **ts)
{
    publish(e, ctrl_line(e, e->rank, P2P_DONE_LINE(e->world, e->rx.src)), e->rx.k);
    e->rx.pos += e->rx.limit;
    if (e->rx.pos >= e->rx.total)
        return ST_OK;
    e->rx.k++;
    int st = wait_p2p(e, &ctrl_line(e, e->rx.src, P2P_SENT_LINE(e->rank))->seq, e->rx.k,
                      e->rx.src, ts);
    e->rx.used = 0;
    e->rx.limit = e->rx.total - e->rx.pos < e->p2p_piece ? e->rx.total - e->rx.pos : e->p2p_piece;
    return st;
}

/* copy n bytes of the stream into dst, crossing chunks as needed */
static int rx_copy(Engine *e, char *dst, size_t n, PyThreadState **ts)
{
    while (n) {
        if (e->rx.used == e->rx.limit) {
            int st = rx_next(e, ts);
            if (st != ST_OK)
                return st;
        }
        char *slot = p2p_slot_of(e, e->rx.src, e->rank, e->rx.k);
        size_t m = e->rx.limit - e->rx.used < n ? e->rx.limit - e->rx.used : n;
        memcpy(dst, slot + e->rx.used, m);
        e->rx.used += m;
        dst += m;
        n -= m;
    }
    return ST_OK;
}

/* Wait for the next message from src and read its header: a new bytes
 * object (NULL with an exception set), *st the status (the bytes are empty
 * unless it is ST_OK). */
/*
 * The binary message header, written and read here only (torch.c and
 * p2p_tensors.c's one-call paths and, through them, Python's shm/messages.py use these):
 *   P2P_BINARY, n (the tensor count), then per tensor: its dtype code, its
 *   ndim, and its dims as little-endian int64s (Python's struct "<BB{nd}q").
 * A header that starts otherwise is pickled (Python's).
 */
size_t header_begin(char *h, int n)
{
    h[0] = (char)P2P_BINARY;
    h[1] = (char)n;
    return 2;
}

size_t header_put(char *p, int code, int nd, const long long *dims)
{
    p[0] = (char)code;
    p[1] = (char)nd;
    memcpy(p + 2, dims, 8 * (size_t)nd);
    return 2 + 8 * (size_t)nd;
}

/* The tensor count of a binary header of hl bytes, or -1 (not one). */
int header_count(const unsigned char *h, size_t hl)
{
    return hl >= 2 && h[0] == P2P_BINARY ? h[1] : -1;
}

/* The entry at *at (moved past it): its code (< ncodes), ndim and dims; 0,
 * or -1 when the bytes are not an entry this reader knows. */
int header_get(const unsigned char *h, size_t hl, size_t *at, int ncodes, int *code, int *nd,
               long long *dims)
{
    if (*at + 2 > hl)
        return -1;
    *code = h[*at];
    *nd = h[*at + 1];
    if (*code >= ncodes || *nd > P2P_MAX_DIMS || *at + 2 + 8 * (size_t)*nd > hl)
        return -1;
    memcpy(dims, h + *at + 2, 8 * (size_t)*nd);
    *at += 2 + 8 * (size_t)*nd;
    return 0;
}

/* dims as a new tuple of ints, or NULL (exception set) */
PyObject *shape_tuple(const long long *dims, int nd)
{
    PyObject *shape = PyTuple_New(nd);
    for (int j = 0; shape && j < nd; j++) {
        PyObject *d = PyLong_FromLongLong(dims[j]);
        if (!d)
            Py_CLEAR(shape);
        else
            PyTuple_SET_ITEM(shape, j, d);
    }
    return shape;
}

/* parse_header(header, ncodes) -> [(dtype code, shape), ...] | None: a
 * binary header read back (None: not a binary header, or not one this
 * reader knows: a code of ncodes or more, too many dims, cut short) */
PyObject *mod_parse_header(PyObject *self, PyObject *args)
{
    (void)self;
    const unsigned char *h;
    Py_ssize_t n_bytes;
    int ncodes;
    if (!PyArg_ParseTuple(args, "y#i", &h, &n_bytes, &ncodes))
        return NULL;
    size_t hl = (size_t)n_bytes, at = 2;
    int n = header_count(h, hl);
    if (n < 0)
        Py_RETURN_NONE;
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        int code, nd;
        long long dims[P2P_MAX_DIMS];
        if (header_get(h, hl, &at, ncodes, &code, &nd, dims) < 0) {
            Py_DECREF(list);
            Py_RETURN_NONE;
        }
        PyObject *shape = shape_tuple(dims, nd);
        PyObject *item = shape ? Py_BuildValue("(iN)", code, shape) : NULL;
        if (!item)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, item);
    }
    if (list && at != hl) {
        Py_DECREF(list);
        Py_RETURN_NONE;
    }
    return list;
}

/* A message from src whose lengths (header word w0, data bytes dl) cannot be
 * right: ST_PROTO, and every rank learns that src sent it (the sender's next
 * wait fails too); else 0. */
int p2p_malformed(Engine *e, int src, uint64_t w0, uint64_t dl)
{
    if (P2P_HL(w0) <= P2P_MAX_HEADER && dl <= P2P_MAX_DATA && P2P_NP(w0) <= P2P_MAX_PIECES)
        return 0;
    return fail(e, ST_PROTO, src, src);
}

PyObject *recv_head(Engine *e, int src, int *st)
{
    PyThreadState *ts = NULL;
    call_begin(e, 0, &ts);
    e->rx.src = src;
    e->rx.k = e->p2p_recvd[src] + 1;
    *st = wait_p2p(e, &ctrl_line(e, src, P2P_SENT_LINE(e->rank))->seq, e->rx.k, src, &ts);
    if (ts) { /* the GIL back (still in the call): the header's bytes object */
        PyEval_RestoreThread(ts);
        ts = NULL;
    }
    uint64_t lens[2] = {0, 0};
    if (*st == ST_OK) {
        memcpy(lens, p2p_slot_of(e, src, e->rank, e->rx.k), sizeof lens);
        *st = p2p_malformed(e, src, lens[0], lens[1]);
    }
    if (*st != ST_OK) {
        call_end(e, *st, NULL);
        return PyBytes_FromStringAndSize("", 0);
    }
    uint64_t hl = P2P_HL(lens[0]);
    e->rx.np = P2P_NP(lens[0]);
    e->rx.dl = lens[1];
    /* by reference, the stream after the header is where the data lies */
    e->rx.total = 16 + hl + (e->rx.np ? 16 * (uint64_t)e->rx.np : lens[1]);
    e->rx.pos = 0;
    e->rx.used = 16;
    e->rx.limit = e->rx.total < e->p2p_piece ? e->rx.total : e->p2p_piece;
    PyObject *hdr = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)hl);
    if (!hdr) {
        call_end(e, ST_OK, NULL);
        return NULL;
    }
    *st = rx_copy(e, PyBytes_AS_STRING(hdr), (size_t)hl, &ts);
    call_end(e, *st, ts);
    /* until the body is read (recv_body, or rx_release when Python gives up
     * on it), the channel is mid-message: no other thread may come in (this
     * thread was in, so the hold is granted) */
    if (*st == ST_OK && !e->rx.held && eng_hold(e) == ST_OK)
        e->rx.held = 1;
    return hdr;
}

/* p2p_recv_head(src) -> (status, header bytes): the next message's header */
PyObject *eng_p2p_recv_head(Engine *e, PyObject *arg)
{
    long src = PyLong_AsLong(arg);
    if ((src == -1 && PyErr_Occurred()) || p2p_check_rank(e, src, "p2p_recv_head") < 0)
        return NULL;
    int no = call_check(e);
    if (no < 0)
        return NULL;
    if (no)
        return Py_BuildValue("(iy#)", no, "", (Py_ssize_t)0);
    int st;
    PyObject *hdr = recv_head(e, (int)src, &st);
    return hdr ? Py_BuildValue("(iN)", st, hdr) : NULL;
}

/* The first peer with a message to this rank that is not received yet,
 * scanning from the one after the last found (no sender starves); -1 if none */
static int any_pending(Engine *e)
{
    const int w = e->world;
    for (int i = 1; i <= w; i++) {
        int s = (e->any_last + i) % w;
        if (s != e->rank &&
            atomic_load_explicit(&ctrl_line(e, s, P2P_SENT_LINE(e->rank))->seq,
                                 memory_order_acquire) > e->p2p_recvd[s])
            return s;
    }
    return -1;
}

/* recv_any's wait: some peer's next message to this rank has begun */
typedef struct {
    waiter_t w;
    int src;
} any_wait_t;

static int any_poll(Engine *e, waiter_t *w, PyThreadState **ts)
{
    (void)ts;
    any_wait_t *a = (any_wait_t *)w;
    a->src = any_pending(e);
    return a->src >= 0 ? WAIT_DONE : WAIT_IDLE;
}

/* any peer that died: every one may be the sender */
static int any_verdict(Engine *e, waiter_t *w, int *who)
{
    (void)w;
    for (int r = 0; r < e->world; r++)
        if (r != e->rank && !peer_alive(e, r)) {
            *who = r;
            return ST_PEER_DEAD;
        }
    return ST_OK;
}

/* p2p_wait_any() -> (status, src): wait until some peer's next message to
 * this rank has begun to arrive (receive it with the src-given calls); src is
 * -1 unless the status is ST_OK.  Several channels cannot share one futex:
 * wait_until naps 50 us at a time once it would sleep. */
PyObject *eng_p2p_wait_any(Engine *e, PyObject *unused)
{
    (void)unused;
    PyThreadState *ts = NULL;
    int st = call_enter(e, 0, &ts);
    if (st < 0)
        return NULL;
    if (st > 0)
        return Py_BuildValue("(ii)", st, -1);
    any_wait_t a = {{any_poll, any_verdict, NULL, 50000, e->rank}, -1};
    st = wait_until(e, &a.w, &ts);
    st = call_end(e, st, ts);
    if (st == ST_OK)
        e->any_last = a.src;
    return Py_BuildValue("(ii)", st, st == ST_OK ? a.src : -1);
}

/* The end of recv_head's hold: the body is read, or Python gave up on it. */
void rx_release(Engine *e)
{
    if (e->rx.held) {
        e->rx.held = 0;
        eng_release(e);
    }
}

/* The data bytes of the message whose header recv_head read */
size_t rx_left(const Engine *e)
{
    return e->rx.np ? e->rx.dl : e->rx.total - e->rx.pos - e->rx.used;
}

/* Receive the rest of the message (the header is read) into the pieces,
 * which must hold exactly its bytes.  -1 with an exception if they do not. */
int recv_body(Engine *e, const pieces_t *pc)
{
    size_t total = 0;
    for (Py_ssize_t i = 0; i < pc->n; i++)
        total += pc->len[i];
    size_t left = rx_left(e);
    if (total != left) {
        PyErr_Format(PyExc_ValueError, "p2p_recv_body: %zu bytes expected, %zu given", left,
                     total);
        return -1;
    }
    int st = ST_OK;
    PyThreadState *ts = NULL;
    call_begin(e, total, &ts);
    span_t land[pc->n ? pc->n : 1]; /* where it lands, present first (pages.c) */
    for (Py_ssize_t i = 0; i < pc->n; i++)
        land[i] = (span_t){pc->addr[i], pc->len[i]};
    ready_pages(e, land, (int)pc->n);
    if (e->rx.np) { /* by reference: where the data is, then the data itself */
        char *desc = PyMem_RawMalloc(16 * (size_t)e->rx.np);
        st = desc ? rx_copy(e, desc, 16 * (size_t)e->rx.np, &ts) : cma_failed(e, e->rx.src, ENOMEM);
        if (st == ST_OK)
            st = cma_recv(e, e->rx.src, desc, e->rx.np, (size_t)e->rx.dl, pc);
        PyMem_RawFree(desc);
    }
    for (Py_ssize_t i = 0; !e->rx.np && i < pc->n && st == ST_OK; i++)
        st = rx_copy(e, pc->addr[i], pc->len[i], &ts);
    if (st == ST_OK) {
        /* the last chunk is consumed too */
        publish(e, ctrl_line(e, e->rank, P2P_DONE_LINE(e->world, e->rx.src)), e->rx.k);
        e->p2p_recvd[e->rx.src] = e->rx.k;
        e->rx.src = -1;
        e->rx.np = 0;
    }
    call_end(e, st, ts);
    rx_release(e);
    return st;
}

/* The rest of the message received into a buffer of its own and dropped:
 * a status, or -1 with an exception (no memory: the message stays unread). */
static int recv_aside(Engine *e)
{
    size_t left = rx_left(e);
    char *aside = PyMem_RawMalloc(left ? left : 1);
    if (!aside) {
        PyErr_NoMemory();
        return -1;
    }
    pieces_t one = {&aside, &left, left ? 1 : 0};
    int st = recv_body(e, &one);
    PyMem_RawFree(aside);
    return st;
}

/* p2p_recv_body([(address, nbytes), ...]) -> status: the rest of the message.
 * Pieces that do not hold exactly its data (a header whose tensors do not
 * add up to it): the data is received aside and dropped, so that the channel
 * stays in step, and ValueError(the pieces' bytes, the data's) says so
 * (shm/messages.py words it). */
PyObject *eng_p2p_recv_body(Engine *e, PyObject *list)
{
    pieces_t pc;
    int st = call_check(e); /* the one way in (engine.c) */
    if (st == ST_ABORTED) /* failed since the header: the message is given up */
        rx_release(e);
    if (st != 0)
        return status_result(st);
    if (e->rx.src < 0) {
        PyErr_SetString(PyExc_RuntimeError, "p2p_recv_body without p2p_recv_head");
        return NULL;
    }
    if (parse_pieces(list, &pc) < 0)
        return NULL;
    size_t total = 0, left = rx_left(e);
    for (Py_ssize_t i = 0; i < pc.n; i++)
        total += pc.len[i];
    if (total == left)
        st = recv_body(e, &pc);
    PyMem_Free(pc.addr);
    PyMem_Free(pc.len);
    if (total != left && (st = recv_aside(e)) == ST_OK) {
        PyObject *sizes = Py_BuildValue("(KK)", (unsigned long long)total, (unsigned long long)left);
        if (sizes) {
            PyErr_SetObject(PyExc_ValueError, sizes);
            Py_DECREF(sizes);
        }
        return NULL;
    }
    return status_result(st);
}
