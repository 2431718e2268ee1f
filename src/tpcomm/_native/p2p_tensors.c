/*
 * The point-to-point one-call entries of plain tensors: Communicator.send,
 * recv and sendrecv in one C call each (shm/path.py binds them as
 * fast_send, fast_recv, fast_sendrecv).  They see tensors only through
 * torch.c: plain_message describes them as a message of the binary protocol
 * (p2p.c header_*), new_tensor makes the ones a message names; the streams
 * are p2p.c's and p2p_batch.c's.  Each opens with torch.c's entry check
 * (fast_ready) and ends with its status handling (fast_done).
 */
#include "tpcomm.h"

/* A valid peer rank given as an exact int, or -1 */
static int peer_arg(Engine *e, PyObject *v)
{
    int r = rank_arg(e, v);
    return r != e->rank ? r : -1;
}

/* The (peer, tensors) arguments of the point-to-point fast paths (the
 * caller asked fast_ready): the tensors' items (and *peer, *n), or NULL when
 * the call is not for them (nothing is set as an error: the general path
 * checks and reports). */
static PyObject **p2p_args(Engine *e, PyObject *const *args, Py_ssize_t nargs, int *peer,
                           Py_ssize_t *n)
{
    if (nargs != 2)
        return NULL;
    *peer = peer_arg(e, args[0]);
    PyObject *seq = args[1];
    if (*peer < 0 || !(PyList_CheckExact(seq) || PyTuple_CheckExact(seq)))
        return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    if (*n > P2P_MAX_TENSORS)
        return NULL;
    return PySequence_Fast_ITEMS(seq);
}

/*
 * p2p_send_tensors(dst, tensors): Communicator.send's common case in one C
 * call (the Python steps cost ~5 us per message on the development VM).  It
 * builds the binary header p2p.c defines.  None means nothing was sent and
 * the general path in Python must run: an argument it would reject or
 * report, more than 255 tensors or 8 dims, a tensor that is not plain (see
 * plain_code), a closed or failed engine.
 */
PyObject *eng_p2p_send_tensors(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    int dst;
    Py_ssize_t n, np;
    PyObject **items = fast_ready(e) ? p2p_args(e, args, nargs, &dst, &n) : NULL;
    if (!items)
        Py_RETURN_NONE;
    char head[P2P_HEAD_BYTES];
    char *addr[P2P_MAX_TENSORS + 1];
    size_t len[P2P_MAX_TENSORS + 1];
    if (plain_message(e, items, n, head, addr, len, &np) < 0)
        Py_RETURN_NONE;
    pieces_t pc = {addr, len, np};
    return fast_done(e, send_pieces(e, dst, &pc), F_send);
}

/* The next message's header from src, for the one-call receives: the header
 * bytes (*h, *hl: their bytes and length); or NULL, *res being what the call
 * returns (NULL with an exception: fast_done's for a status). */
static PyObject *fast_head(Engine *e, int src, PyObject **res, const unsigned char **h,
                           size_t *hl)
{
    int st;
    PyObject *hdr = recv_head(e, src, &st);
    if (hdr && st == ST_OK) {
        *h = (const unsigned char *)PyBytes_AS_STRING(hdr);
        *hl = (size_t)PyBytes_GET_SIZE(hdr);
        return hdr;
    }
    Py_XDECREF(hdr);
    *res = hdr ? fast_done(e, st, F_recv) : NULL;
    return NULL;
}

/*
 * recv with out= (the caller asked fast_ready; src checked): the next
 * message's header is consumed; when it is binary and describes exactly
 * out's plain tensors (same count, dtypes and shapes), the body lands in them
 * and the answer is list(out); else the header bytes, and
 * shm/messages.py recv_rest finishes the receive (it reports the mismatch).
 * None: nothing was received (out is not plain: the general path checks it).
 */
static PyObject *recv_into(Engine *e, int src, PyObject *out)
{
    if (!(PyList_CheckExact(out) || PyTuple_CheckExact(out)))
        Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(out), np;
    if (n > P2P_MAX_TENSORS)
        Py_RETURN_NONE;
    PyObject **items = PySequence_Fast_ITEMS(out);
    /* the header a message for exactly these tensors has (as sendrecv and
     * p2p_batch match it), and where their bytes go */
    char want[P2P_HEAD_BYTES];
    char *addr[P2P_MAX_TENSORS + 1];
    size_t len[P2P_MAX_TENSORS + 1];
    if (plain_message(e, items, n, want, addr, len, &np) < 0)
        Py_RETURN_NONE; /* the general path checks these before receiving */
    const unsigned char *h;
    size_t hl;
    PyObject *res, *hdr = fast_head(e, src, &res, &h, &hl);
    if (!hdr)
        return res;
    uint64_t lens[2]; /* out's: the header's and the data's */
    memcpy(lens, want, sizeof lens);
    /* another header, or data of another size than it says: Python reports it */
    if (hl != lens[0] || memcmp(h, want + 16, hl) != 0 || rx_left(e) != lens[1])
        return hdr;
    pieces_t pc = {addr + 1, len + 1, np - 1};
    int st = recv_body(e, &pc);
    Py_DECREF(hdr);
    return st == ST_OK ? PySequence_List(out) : fast_done(e, st, F_recv);
}

/* One tensor a binary header names */
typedef struct {
    int code, nd;
    long long dims[P2P_MAX_DIMS];
} tspec_t;

/* The tensors a binary header h of hl bytes names, into spec (their count:
 * *n), checked to hold dl bytes together: 0, or -1, no exception, for a
 * header these receives leave to Python (pickled, a code or dims this reader
 * does not know, sizes that do not add up to dl).  Nothing is made yet. */
static int header_specs(Engine *e, const unsigned char *h, size_t hl, size_t dl, int codes,
                        tspec_t *spec, int *n)
{
    *n = header_count(h, hl);
    if (!codes || *n < 0 || *n > P2P_MAX_TENSORS)
        return -1;
    size_t at = 2, sum = 0;
    for (int i = 0; i < *n; i++) {
        tspec_t *s = &spec[i];
        if (header_get(h, hl, &at, codes, &s->code, &s->nd, s->dims) < 0)
            return -1;
        size_t bytes = code_size(e, s->code);
        for (int j = 0; j < s->nd; j++) {
            if (s->dims[j] < 0 || (s->dims[j] && bytes > (size_t)P2P_MAX_DATA / (size_t)s->dims[j]))
                return -1;
            bytes *= (size_t)s->dims[j];
        }
        sum += bytes;
        if (sum > dl)
            return -1;
    }
    return at == hl && sum == dl ? 0 : -1;
}

/* The n tensors of spec, made (new_tensor), as a new list; their data's
 * pieces in addr/len (*np of them: empty tensors have none).  NULL with an
 * exception (no memory). */
static PyObject *make_tensors(Engine *e, const tspec_t *spec, int n, char **addr, size_t *len,
                              Py_ssize_t *np)
{
    PyObject *list = PyList_New(n);
    *np = 0;
    for (int i = 0; list && i < n; i++) {
        size_t nbytes;
        PyObject *t = new_tensor(e, spec[i].code, spec[i].dims, spec[i].nd, &addr[*np], &nbytes);
        if (!t) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, t);
        if (nbytes)
            len[(*np)++] = nbytes;
    }
    return list;
}

/*
 * p2p_recv(src, out=None) -> [tensors] | header bytes | None:
 * Communicator.recv in one C call (its Python steps cost ~17 us per message
 * on the development VM).  With out, recv_into.  Without, the next message's
 * binary header is read, a tensor of each dtype and shape it names is made
 * (torch.empty), and the body lands in them.  None: nothing was received (an
 * argument the general path must check, a closed or failed engine); header
 * bytes: a header this path leaves to shm/messages.py recv_rest (pickled: a
 * dict's values, or one that does not match out).
 */
PyObject *eng_p2p_recv(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    int src = nargs >= 1 && nargs <= 2 && fast_ready(e) ? peer_arg(e, args[0]) : -1;
    const int codes = src < 0 ? 0 : tensor_codes(e);
    if (!codes)
        Py_RETURN_NONE;
    if (nargs == 2 && args[1] != Py_None)
        return recv_into(e, src, args[1]);
    const unsigned char *h;
    size_t hl;
    PyObject *res, *hdr = fast_head(e, src, &res, &h, &hl);
    if (!hdr)
        return res;
    tspec_t spec[P2P_MAX_TENSORS];
    int n;
    if (header_specs(e, h, hl, rx_left(e), codes, spec, &n) < 0)
        return hdr; /* Python receives the rest and reports what is wrong */
    Py_DECREF(hdr);
    char *addr[P2P_MAX_TENSORS];
    size_t len[P2P_MAX_TENSORS];
    Py_ssize_t np;
    PyObject *list = make_tensors(e, spec, n, addr, len, &np);
    if (!list) { /* no memory: the message stays half read, as in Python */
        rx_release(e);
        return NULL;
    }
    pieces_t pc = {addr, len, np};
    int st = recv_body(e, &pc);
    if (st != ST_OK) {
        Py_DECREF(list);
        return fast_done(e, st, F_recv);
    }
    return list;
}

/*
 * A batch receive's land function (bop_t): the tensors a binary header h of
 * hl bytes names (header_specs, so only once their bytes add up to the
 * message's dl), made as a new list, their data's pieces in addr/len (*np of
 * them).  NULL, no exception: a header this path leaves to Python, or no
 * memory: the batch receives the message aside instead, and Python judges
 * it, as before.
 */
static PyObject *land_tensors(Engine *e, const unsigned char *h, size_t hl, size_t dl,
                              char **addr, size_t *len, Py_ssize_t *np)
{
    tspec_t spec[P2P_MAX_TENSORS];
    int n;
    if (header_specs(e, h, hl, dl, tensor_codes(e), spec, &n) < 0)
        return NULL;
    PyObject *list = make_tensors(e, spec, n, addr, len, np);
    if (!list)
        PyErr_Clear();
    return list;
}

/*
 * p2p_sendrecv(dst, tensors, src, out) -> list(out) | (header, data) | None:
 * Communicator.sendrecv with plain tensors in one C call (its Python steps
 * cost ~30 us per call on the development VM, ten times the exchange).  With
 * out=None the receive expects no header, so the one that arrives does not
 * match and its land function (land_tensors) makes the tensors it names,
 * into which the data lands: the answer is their list, as with out.
 * The send and the receive progress together (batch_progress).  None: nothing was
 * sent or received (a tensor that is not plain, an out that overlaps what is
 * sent, a closed or failed engine...): the general path runs.  (header, data):
 * the message did not match out and was received whole into data (a
 * bytearray), as p2p_batch reports it; out is untouched.
 */
PyObject *eng_p2p_sendrecv(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    int dst, src;
    Py_ssize_t ns, nr = 0, nps, npr;
    if (nargs != 4 || !fast_ready(e))
        Py_RETURN_NONE;
    PyObject **sitems = p2p_args(e, args, 2, &dst, &ns), **ritems = NULL;
    int into = args[3] != Py_None; /* else new tensors, made as the header arrives */
    if (!sitems)
        Py_RETURN_NONE;
    if (into ? !(ritems = p2p_args(e, args + 2, 2, &src, &nr)) : (src = peer_arg(e, args[2])) < 0)
        Py_RETURN_NONE;
    char shead[P2P_HEAD_BYTES], rhead[P2P_HEAD_BYTES];
    char *saddr[P2P_MAX_TENSORS + 1], *raddr[P2P_MAX_TENSORS + 1];
    size_t slen[P2P_MAX_TENSORS + 1], rlen[P2P_MAX_TENSORS + 1];
    if (plain_message(e, sitems, ns, shead, saddr, slen, &nps) < 0 ||
        (into && plain_message(e, ritems, nr, rhead, raddr, rlen, &npr) < 0))
        Py_RETURN_NONE;
    if (!into) { /* an expected header no message has: received whole, aside */
        npr = 1;
        rlen[0] = 16;
    }
    for (Py_ssize_t i = 1; i < nps; i++) /* receiving into what is sent: Python copies it */
        for (Py_ssize_t j = 1; j < npr; j++)
            if (overlap(saddr[i], slen[i], raddr[j], rlen[j]))
                Py_RETURN_NONE;
    bop_t ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].send = 1;
    ops[0].peer = dst;
    ops[0].pc = (pieces_t){saddr, slen, nps};
    for (Py_ssize_t i = 0; i < nps; i++)
        ops[0].total += slen[i];
    ops[1].peer = src;
    ops[1].pc = (pieces_t){raddr + 1, rlen + 1, npr - 1};
    ops[1].want = rhead + 16;
    ops[1].want_len = rlen[0] - 16;
    if (!into) { /* new tensors: made from the header as it arrives, their
                  * pieces in raddr/rlen (unused else) */
        ops[1].land = land_tensors;
        ops[1].made_addr = raddr;
        ops[1].made_len = rlen;
    }
    int st = batch_progress(e, ops, 2);
    PyObject *res;
    if (st < 0)
        res = PyErr_NoMemory();
    else if (st == ST_OK && ops[1].made) {
        res = ops[1].made;
        ops[1].made = NULL;
    } else if (st == ST_OK && ops[1].drop)
        res = Py_BuildValue("(y#O)", ops[1].hdr, (Py_ssize_t)ops[1].hl, ops[1].scratch_obj);
    else if (st == ST_OK)
        res = PySequence_List(args[3]);
    else
        res = fast_done(e, st, F_sendrecv);
    PyMem_RawFree(ops[0].rbuf);
    PyMem_RawFree(ops[1].hdr);
    Py_XDECREF(ops[1].scratch_obj);
    Py_XDECREF(ops[1].made);
    return res;
}
