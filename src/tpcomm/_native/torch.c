/*
 * The only C of the core that knows torch: all_reduce's one-call entry, and
 * the view of tensors every other one-call entry sees them through
 * (coll_tensors.c: all_gather, gather, broadcast, reduce_scatter,
 * all_to_all; p2p_tensors.c: send, recv, sendrecv): a plain tensor's dtype
 * code, address and size (plain_info), its shape (one_dim, rows_of),
 * tensors described as messages (plain_message) and made for them
 * (new_tensor), the entries' one opening check (fast_ready) and their ends
 * (fast_done, hand_back).  It reads a tensor's dtype, flags, address and
 * size through descriptors resolved once (set_fast_path, set_p2p_dtypes);
 * anything unusual goes back to Python's general path.
 */
#include "tpcomm.h"

/*
 * fast_all_reduce(tensor, op=SUM): the whole of Communicator.all_reduce for
 * the common case, in one C call.  Torch attribute access costs ~100 ns each
 * through Python, so the Python wrapper alone used to cost more than the
 * collective.  Anything unusual (a subclass, another device, a view that is
 * not contiguous, an unknown dtype or op, keywords, an error) goes to the
 * Python fallback set with set_fast_path(), which does the full checks and
 * raises the proper exceptions: fallback(tensor, op); a failed call raises
 * through fast_done.
 */
#define MAX_ANY 32 /* dtypes a point-to-point message may carry */

/* The torch objects an engine's fast paths compare with, and the tensor
 * type's accessors resolved once (set_fast_path, set_p2p_dtypes). */
struct tview {
    PyTypeObject *tensor_type;
    PyObject *ops[OP_COUNT];
    PyObject *dtypes[DT_COUNT];
    /* weakref.WeakMethods to Python's general paths: all_reduce's
     * (call_fallback), all_gather_into_tensor's, reduce_scatter_tensor's
     * (whole_call) and gather's (eng_whole_gather) */
    PyObject *fallback[FB_COUNT];
    PyObject *raiser;   /* one to ShmEngine.raise_status(status, fn) */
    PyObject *d_dtype, *d_is_cpu, *d_is_contiguous, *d_data_ptr, *d_numel, *d_is_neg;
    PyObject *d_is_conj, *d_shape, *d_ndim;
    /* point-to-point fast path: every dtype a message may carry, by code */
    PyObject *any_dtypes[MAX_ANY];
    PyObject *empty_fn, *kw_dtype; /* torch.empty and ("dtype",): new_tensor */
    size_t any_size[MAX_ANY];
    char any_complex[MAX_ANY]; /* only complex tensors can carry the conj bit */
    int n_any;
    uint32_t kind_all_reduce;
};

static PyObject *S_dtype, *S_is_cpu, *S_is_contiguous, *S_data_ptr, *S_numel, *S_is_neg;
static PyObject *S_is_conj, *S_shape, *S_ndim;
/* the public calls the entries serve, as their errors name them */
static PyObject *F_all_reduce;
PyObject *F_all_gather, *F_gather, *F_broadcast, *F_reduce_scatter, *F_all_to_all; /* coll_tensors.c's */
PyObject *F_send, *F_recv, *F_sendrecv; /* p2p_tensors.c's */

/* The attribute names, interned once (module init): 0, or -1 with an exception. */
int torch_init(void)
{
    S_dtype = PyUnicode_InternFromString("dtype");
    S_is_cpu = PyUnicode_InternFromString("is_cpu");
    S_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    S_data_ptr = PyUnicode_InternFromString("data_ptr");
    S_numel = PyUnicode_InternFromString("numel");
    S_is_neg = PyUnicode_InternFromString("is_neg");
    S_is_conj = PyUnicode_InternFromString("is_conj");
    S_shape = PyUnicode_InternFromString("shape");
    S_ndim = PyUnicode_InternFromString("ndim");
    F_all_reduce = PyUnicode_InternFromString("all_reduce");
    F_all_gather = PyUnicode_InternFromString("all_gather_into_tensor");
    F_gather = PyUnicode_InternFromString("gather");
    F_broadcast = PyUnicode_InternFromString("broadcast");
    F_reduce_scatter = PyUnicode_InternFromString("reduce_scatter_tensor");
    F_all_to_all = PyUnicode_InternFromString("all_to_all_single");
    F_send = PyUnicode_InternFromString("send");
    F_recv = PyUnicode_InternFromString("recv");
    F_sendrecv = PyUnicode_InternFromString("sendrecv");
    return S_dtype && S_is_cpu && S_is_contiguous && S_data_ptr && S_numel && S_is_neg &&
                   S_is_conj && S_shape && S_ndim && F_all_reduce && F_all_gather && F_gather && F_broadcast &&
                   F_reduce_scatter && F_all_to_all && F_send && F_recv && F_sendrecv
               ? 0
               : -1;
}

/* An engine's empty view (eng_new): 0, or -1 with MemoryError. */
int tview_new(Engine *e)
{
    e->tv = PyMem_Calloc(1, sizeof(tview_t));
    return e->tv ? 0 : (PyErr_NoMemory(), -1);
}

/* Drop an engine's view (eng_dealloc). */
void tview_free(Engine *e)
{
    tview_t *v = e->tv;
    if (!v)
        return;
    Py_CLEAR(v->tensor_type);
    for (int i = 0; i < FB_COUNT; i++)
        Py_CLEAR(v->fallback[i]);
    Py_CLEAR(v->raiser);
    Py_CLEAR(v->d_dtype);
    Py_CLEAR(v->d_is_cpu);
    Py_CLEAR(v->d_is_contiguous);
    Py_CLEAR(v->d_data_ptr);
    Py_CLEAR(v->d_numel);
    Py_CLEAR(v->d_is_neg);
    Py_CLEAR(v->d_is_conj);
    Py_CLEAR(v->d_shape);
    Py_CLEAR(v->d_ndim);
    for (int i = 0; i < v->n_any; i++)
        Py_CLEAR(v->any_dtypes[i]);
    Py_CLEAR(v->empty_fn);
    Py_CLEAR(v->kw_dtype);
    for (int i = 0; i < OP_COUNT; i++)
        Py_CLEAR(v->ops[i]);
    for (int i = 0; i < DT_COUNT; i++)
        Py_CLEAR(v->dtypes[i]);
    PyMem_Free(v);
    e->tv = NULL;
}

/* Call a descriptor resolved on the tensor type once (see set_fast_path):
 * skips the per-call attribute lookup and bound-method object. */
static inline PyObject *descr_get(PyObject *descr, PyObject *t)
{
    return Py_TYPE(descr)->tp_descr_get(descr, t, (PyObject *)Py_TYPE(t));
}

static inline PyObject *descr_call(PyObject *descr, PyObject *t)
{
    return PyObject_Vectorcall(descr, &t, 1, NULL);
}

/* The object a weakref.WeakMethod set by Python points at (a new reference),
 * or NULL with RuntimeError when it is gone or was never set. */
static PyObject *weak_target(PyObject *wm)
{
    if (!wm) {
        PyErr_SetString(PyExc_RuntimeError, "tpcomm: the fast path is not armed");
        return NULL;
    }
    PyObject *target = PyObject_CallNoArgs(wm);
    if (target == Py_None) {
        Py_DECREF(target);
        PyErr_SetString(PyExc_RuntimeError, "tpcomm: the Communicator is gone");
        return NULL;
    }
    return target;
}

/* A call a whole-call entry does not take, handed with its arguments to
 * Python's general method fallback[which] */
PyObject *hand_back(Engine *e, int which, PyObject *const *args, Py_ssize_t nargs,
                    PyObject *kwnames)
{
    PyObject *target = weak_target(e->tv->fallback[which]);
    if (!target)
        return NULL;
    PyObject *res = PyObject_Vectorcall(target, args, (size_t)nargs, kwnames);
    Py_DECREF(target);
    return res;
}

/* Python's general all_reduce, fallback(tensor, op): every call the one-call
 * entry does not take */
static PyObject *call_fallback(Engine *e, PyObject *t, PyObject *op)
{
    PyObject *target = weak_target(e->tv->fallback[FB_ALL_REDUCE]);
    if (!target)
        return NULL;
    PyObject *res = PyObject_CallFunctionObjArgs(target, t, op, NULL);
    Py_DECREF(target);
    return res;
}

/*
 * The one check every one-call entry makes first: may it take the call?  The
 * engine open, this thread's turn (no other thread inside a call or holding
 * the engine, no receive of its own half done), not failed nor aborted by a
 * peer (take_abort records who), and the torch view armed (set_fast_path,
 * set_p2p_dtypes).  No: the general road runs, which checks the same states
 * and reports them (call_check).
 */
int fast_ready(Engine *e)
{
    return e->base && !other_thread(e) && !e->failed && e->rx.src < 0 && e->tv->n_any &&
           e->tv->d_shape && !take_abort(e);
}

/*
 * The one way an entry ends: Py_True when status st says the call is done;
 * else NULL with the exception the engine's raise_status makes for a call of
 * fn (the same words as the general road's); st < 0: the exception already
 * set.
 */
PyObject *fast_done(Engine *e, int st, PyObject *fn)
{
    if (st == ST_OK)
        Py_RETURN_TRUE;
    if (st < 0)
        return NULL;
    PyObject *target = weak_target(e->tv->raiser);
    if (!target)
        return NULL;
    PyObject *code = PyLong_FromLong(st);
    PyObject *res = code ? PyObject_CallFunctionObjArgs(target, code, fn, NULL) : NULL;
    Py_XDECREF(code);
    Py_DECREF(target);
    if (res) { /* raise_status always raises */
        Py_DECREF(res);
        PyErr_Format(PyExc_RuntimeError, "tpcomm: status %d raised nothing", st);
    }
    return NULL;
}

/* Is t.<descr> (called when `call`) the object `want` (Py_True or Py_False)?
 * An error counts as no. */
static int attr_is(PyObject *t, PyObject *descr, int call, PyObject *want)
{
    PyObject *v = call ? descr_call(descr, t) : descr_get(descr, t);
    if (!v) {
        PyErr_Clear();
        return 0;
    }
    int r = v == want;
    Py_DECREF(v);
    return r;
}

PyObject *eng_fast_all_reduce(Engine *e, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw < 1 || nargs + nkw > 2) {
        PyErr_Format(PyExc_TypeError, "all_reduce() takes 1 or 2 arguments (%zd given)",
                     nargs + nkw);
        return NULL;
    }
    PyObject *t = nargs > 0 ? args[0] : NULL;
    PyObject *op = nargs > 1 ? args[1] : NULL;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_CompareWithASCIIString(k, "tensor") == 0 && !t)
            t = args[nargs + i];
        else if (PyUnicode_CompareWithASCIIString(k, "op") == 0 && !op)
            op = args[nargs + i];
        else {
            PyErr_Format(PyExc_TypeError, "all_reduce() got an unexpected keyword argument %R", k);
            return NULL;
        }
    }
    if (!t) {
        PyErr_SetString(PyExc_TypeError, "all_reduce() missing required argument 'tensor'");
        return NULL;
    }
    if (!op)
        op = e->tv->ops[OP_SUM];
    int dtc = -1;
    if (!fast_ready(e) || Py_TYPE(t) != e->tv->tensor_type)
        return call_fallback(e, t, op);
    const int opc = op_code(e, op);
    PyObject *dt = descr_get(e->tv->d_dtype, t);
    if (!dt)
        return NULL;
    for (int i = 0; i < DT_COUNT; i++)
        if (dt == e->tv->dtypes[i])
            dtc = i;
    Py_DECREF(dt);
    /* a negative view's memory holds the negated values (the reduce dtypes
     * are real, so no conjugate bit): only is_neg() False qualifies */
    if (opc < 0 || dtc < 0 || (opc == OP_AVG && dtc >= DT_I32) ||
        !attr_is(t, e->tv->d_is_cpu, 0, Py_True) || !attr_is(t, e->tv->d_is_contiguous, 1, Py_True) ||
        !attr_is(t, e->tv->d_is_neg, 1, Py_False))
        return call_fallback(e, t, op);
    PyObject *pv = descr_call(e->tv->d_data_ptr, t);
    if (!pv)
        return NULL;
    PyObject *nv = descr_call(e->tv->d_numel, t);
    if (!nv) {
        Py_DECREF(pv);
        return NULL;
    }
    uintptr_t addr = (uintptr_t)PyLong_AsUnsignedLongLong(pv);
    long long count = PyLong_AsLongLong(nv);
    Py_DECREF(pv);
    Py_DECREF(nv);
    if (PyErr_Occurred())
        return NULL;
    PyThreadState *ts = NULL;
    call_begin(e, (size_t)count * dt_size[dtc], &ts); /* checked above, as call_check does */
    int st = all_reduce_rounds(e, (char *)addr, (size_t)count, dtc, opc, e->tv->kind_all_reduce, &ts);
    st = call_end(e, st, ts);
    if (st != ST_OK)
        return fast_done(e, st, F_all_reduce);
    Py_INCREF(t);
    return t;
}

/* set_fast_path(tensor_type, (ops...), (dtypes...), kind, (fallbacks...),
 * raiser): the fallbacks (FB_COUNT of them, in FB_ order) and raiser are
 * weakref.WeakMethods (call_fallback and whole_call, fast_done) */
PyObject *eng_set_fast_path(Engine *e, PyObject *args)
{
    PyObject *tt, *ops, *dts, *fbs, *raiser;
    unsigned int kind;
    if (!PyArg_ParseTuple(args, "O!O!O!IO!O", &PyType_Type, &tt, &PyTuple_Type, &ops, &PyTuple_Type,
                          &dts, &kind, &PyTuple_Type, &fbs, &raiser))
        return NULL;
    if (PyTuple_GET_SIZE(ops) != OP_COUNT || PyTuple_GET_SIZE(dts) != DT_COUNT ||
        PyTuple_GET_SIZE(fbs) != FB_COUNT) {
        PyErr_SetString(PyExc_ValueError, "set_fast_path: wrong number of ops, dtypes or fallbacks");
        return NULL;
    }
    Py_INCREF(tt);
    Py_XSETREF(e->tv->tensor_type, (PyTypeObject *)tt);
    for (int i = 0; i < OP_COUNT; i++) {
        Py_INCREF(PyTuple_GET_ITEM(ops, i));
        Py_XSETREF(e->tv->ops[i], PyTuple_GET_ITEM(ops, i));
    }
    for (int i = 0; i < DT_COUNT; i++) {
        Py_INCREF(PyTuple_GET_ITEM(dts, i));
        Py_XSETREF(e->tv->dtypes[i], PyTuple_GET_ITEM(dts, i));
    }
    for (int i = 0; i < FB_COUNT; i++) {
        Py_INCREF(PyTuple_GET_ITEM(fbs, i));
        Py_XSETREF(e->tv->fallback[i], PyTuple_GET_ITEM(fbs, i));
    }
    Py_INCREF(raiser);
    Py_XSETREF(e->tv->raiser, raiser);
    /* Resolve the tensor type's accessors once; only C descriptors qualify
     * (a Python override would need the ordinary lookup). */
    PyObject *names[9] = {S_dtype, S_is_cpu, S_is_contiguous, S_data_ptr, S_numel,
                          S_is_neg, S_is_conj, S_shape, S_ndim};
    PyObject **slots[9] = {&e->tv->d_dtype, &e->tv->d_is_cpu, &e->tv->d_is_contiguous,
                           &e->tv->d_data_ptr, &e->tv->d_numel, &e->tv->d_is_neg,
                           &e->tv->d_is_conj, &e->tv->d_shape, &e->tv->d_ndim};
    for (int i = 0; i < 9; i++) {
        PyObject *d = _PyType_Lookup((PyTypeObject *)tt, names[i]);
        if (!d || !(Py_IS_TYPE(d, &PyGetSetDescr_Type) || Py_IS_TYPE(d, &PyMethodDescr_Type))) {
            PyErr_Format(PyExc_TypeError, "set_fast_path: %R.%U is not a C accessor", tt,
                         names[i]);
            return NULL;
        }
        Py_INCREF(d);
        Py_XSETREF(*slots[i], d);
    }
    e->tv->kind_all_reduce = kind;
    Py_RETURN_NONE;
}

/*
 * The view's codes, for coll_tensors.c: the bytes of an element of a
 * message's dtype code; the ReduceOp object of an op code (borrowed) and the
 * op code of one (-1: not a ReduceOp the engine does); the reduce kernels'
 * dtype code of a message's (-1: not one they reduce); whether new_tensor
 * can make tensors (set_p2p_dtypes gave it torch.empty).
 */
size_t code_size(Engine *e, int code)
{
    return e->tv->any_size[code];
}

PyObject *op_object(Engine *e, int op)
{
    return e->tv->ops[op];
}

int op_code(Engine *e, PyObject *op)
{
    for (int i = 0; i < OP_COUNT; i++)
        if (op == e->tv->ops[i])
            return i;
    return -1;
}

int reduce_code(Engine *e, int code)
{
    for (int i = 0; i < DT_COUNT; i++)
        if (e->tv->dtypes[i] == e->tv->any_dtypes[code])
            return i;
    return -1;
}

int can_make(Engine *e)
{
    return e->tv->empty_fn != NULL;
}

/* A rank given as an exact int (a root), or -1 */
int rank_arg(Engine *e, PyObject *v)
{
    if (!PyLong_CheckExact(v))
        return -1;
    long r = PyLong_AsLong(v);
    if (r == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return r >= 0 && r < e->world ? (int)r : -1;
}

/* whether t is a tensor of the type with exactly one dim (t.ndim; an error: no) */
int one_dim(Engine *e, PyObject *t)
{
    if (Py_TYPE(t) != e->tv->tensor_type)
        return 0;
    PyObject *nd = descr_get(e->tv->d_ndim, t);
    int one = nd && PyLong_CheckExact(nd) && PyLong_AsLong(nd) == 1;
    Py_XDECREF(nd);
    PyErr_Clear();
    return one;
}

/* t.shape into dims (at most max of them): the number of dims, or -1 (no
 * exception) when it is not a tuple of ints or has more than max. */
static int shape_of(Engine *e, PyObject *t, long long *dims, int max)
{
    PyObject *sh = descr_get(e->tv->d_shape, t);
    Py_ssize_t nd = sh && PyTuple_Check(sh) ? PyTuple_GET_SIZE(sh) : -1;
    for (Py_ssize_t j = 0; j < nd && nd <= max; j++)
        dims[j] = PyLong_AsLongLong(PyTuple_GET_ITEM(sh, j));
    Py_XDECREF(sh);
    if (PyErr_Occurred() || nd > max) {
        PyErr_Clear();
        return -1;
    }
    return (int)nd;
}

/* A plain tensor's rows along dim 0 (a 0-d one is one row) and bytes per row
 * (es bytes an element): 0, or -1 (no exception) when its shape is unusual. */
int rows_of(Engine *e, PyObject *t, size_t es, uint64_t *rows, uint64_t *row)
{
    long long dims[64];
    int nd = shape_of(e, t, dims, 64);
    if (nd < 0)
        return -1;
    uint64_t per = es;
    for (int d = 0; d < nd; d++) {
        if (dims[d] < 0)
            return -1;
        if (d > 0)
            per *= (uint64_t)dims[d];
    }
    *rows = nd > 0 ? (uint64_t)dims[0] : 1;
    *row = per;
    return 0;
}

/* The dtype code of tensor t for a message, or -1.  Only a plain tensor whose
 * memory holds exactly its values qualifies: the exact tensor type, on the
 * CPU, contiguous, no pending negation or conjugation (docs/COLLECTIVES.md). */
static int plain_code(Engine *e, PyObject *t)
{
    if (Py_TYPE(t) != e->tv->tensor_type)
        return -1;
    PyObject *dt = descr_get(e->tv->d_dtype, t);
    if (!dt) {
        PyErr_Clear();
        return -1;
    }
    int code = -1;
    for (int c = 0; c < e->tv->n_any; c++)
        if (dt == e->tv->any_dtypes[c])
            code = c;
    Py_DECREF(dt);
    if (code < 0 || !attr_is(t, e->tv->d_is_cpu, 0, Py_True) ||
        !attr_is(t, e->tv->d_is_contiguous, 1, Py_True) || !attr_is(t, e->tv->d_is_neg, 1, Py_False) ||
        (e->tv->any_complex[code] && !attr_is(t, e->tv->d_is_conj, 1, Py_False)))
        return -1;
    return code;
}

/* t's data address, or 0 with the error cleared */
static char *data_of(Engine *e, PyObject *t)
{
    PyObject *pv = descr_call(e->tv->d_data_ptr, t);
    if (!pv) {
        PyErr_Clear();
        return NULL;
    }
    char *a = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(pv);
    Py_DECREF(pv);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return NULL;
    }
    return a;
}

/* A plain tensor's dtype code, data address (NULL when empty: an empty tensor
 * may have none) and element count: 0, or -1 (no exception) if not plain */
int plain_info(Engine *e, PyObject *t, int *code, char **addr, long long *n)
{
    *code = plain_code(e, t);
    if (*code < 0)
        return -1;
    PyObject *nv = descr_call(e->tv->d_numel, t);
    *n = nv ? PyLong_AsLongLong(nv) : -1;
    Py_XDECREF(nv);
    *addr = *n > 0 ? data_of(e, t) : NULL;
    if (*n < 0 || (*n > 0 && !*addr)) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* The binary header of n plain tensors into h (p2p.c header_*), and each
 * tensor's data bytes into nbytes: the header's length, or -1 (no exception)
 * when a tensor is not plain or has too many dims (the general path takes
 * it). */
static Py_ssize_t plain_header(Engine *e, PyObject **items, Py_ssize_t n, char *h, size_t *nbytes)
{
    size_t hl = header_begin(h, (int)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        int code = plain_code(e, items[i]);
        long long dims[P2P_MAX_DIMS], numel = 1;
        int nd = code < 0 ? -1 : shape_of(e, items[i], dims, P2P_MAX_DIMS);
        if (nd < 0)
            return -1;
        for (int j = 0; j < nd; j++)
            numel *= dims[j];
        hl += header_put(h + hl, code, nd, dims);
        nbytes[i] = (size_t)numel * e->tv->any_size[code];
    }
    return (Py_ssize_t)hl;
}

/* A message of n plain tensors as the binary protocol lays it out: head gets
 * the two lengths (header, data) and then the header (plain_header),
 * addr[0]/len[0] point at it, addr[1..]/len[1..] at the tensors' data (empty
 * ones left out); *np pieces in all.  0, or -1 when a tensor is not plain or
 * has too many dims (no exception: the general path takes it). */
int plain_message(Engine *e, PyObject **items, Py_ssize_t n, char *head, char **addr, size_t *len,
                  Py_ssize_t *np)
{
    size_t nbytes[P2P_MAX_TENSORS], total = 0;
    Py_ssize_t hl = plain_header(e, items, n, head + 16, nbytes);
    if (hl < 0)
        return -1;
    *np = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!nbytes[i])
            continue;
        if (!(addr[*np] = data_of(e, items[i])))
            return -1;
        len[(*np)++] = nbytes[i];
        total += nbytes[i];
    }
    uint64_t lens[2] = {(uint64_t)hl, total};
    memcpy(head, lens, sizeof lens);
    addr[0] = head;
    len[0] = 16 + (size_t)hl;
    return 0;
}

/*
 * plain(t) -> (dtype code, data address, numel) or None: the checks and
 * accessors of a torch-style collective's tensor in one call (each costs
 * 0.1-0.2 us through Python here).  None: not plain (plain_code), or the
 * engine is closed or failed; the caller takes the general path.
 */
PyObject *eng_plain(Engine *e, PyObject *t)
{
    int code;
    char *a;
    long long n;
    if (!fast_ready(e) || plain_info(e, t, &code, &a, &n) < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(iKL)", code, (unsigned long long)(uintptr_t)a, n);
}

/* A new tensor (torch.empty) of dtype code and shape dims[0..nd): the
 * tensor, its data address (*addr, NULL when it holds no bytes) and its bytes
 * (*nbytes); NULL with an exception.  The sizes go as separate ints,
 * torch.empty(d0, d1, ..., dtype=dt): torch parses those 0.5 us faster than
 * one tuple (1.0 against 1.5 us a call, torch 2.13, AMD Zen 4); a 0-d
 * tensor's (no sizes) as the empty tuple. */
PyObject *new_tensor(Engine *e, int code, const long long *dims, int nd, char **addr,
                     size_t *nbytes)
{
    PyObject *argv[P2P_MAX_DIMS + 1], *t = NULL;
    const int tuple = nd == 0 || nd > P2P_MAX_DIMS, want = tuple ? 1 : nd;
    int made = 0; /* the size arguments made so far */
    if (tuple)
        made = (argv[0] = shape_tuple(dims, nd)) != NULL;
    else
        while (made < nd && (argv[made] = PyLong_FromLongLong(dims[made])))
            made++;
    if (made == want) {
        argv[want] = e->tv->any_dtypes[code];
        t = PyObject_Vectorcall(e->tv->empty_fn, argv, (size_t)want, e->tv->kw_dtype);
    }
    for (int j = 0; j < made; j++)
        Py_DECREF(argv[j]);
    if (!t)
        return NULL;
    long long numel = 1;
    for (int j = 0; j < nd; j++)
        numel *= dims[j];
    *nbytes = (size_t)numel * e->tv->any_size[code];
    *addr = NULL;
    if (*nbytes && !(*addr = data_of(e, t))) {
        Py_DECREF(t);
        PyErr_SetString(PyExc_RuntimeError, "tpcomm: a new tensor has no address");
        return NULL;
    }
    return t;
}

/* The dtype codes a message's tensors may have, 0 until set_p2p_dtypes gave
 * them with the allocator (new_tensor) */
int tensor_codes(Engine *e)
{
    return e->tv->empty_fn ? e->tv->n_any : 0;
}

/* set_p2p_dtypes((dtype, ...), (itemsize, ...), empty=None): the dtypes of
 * messages, by code, and the allocator p2p_recv_new calls (torch.empty) */
PyObject *eng_set_p2p_dtypes(Engine *e, PyObject *args)
{
    PyObject *dts, *sizes, *empty = Py_None;
    if (!PyArg_ParseTuple(args, "O!O!|O", &PyTuple_Type, &dts, &PyTuple_Type, &sizes, &empty))
        return NULL;
    if (empty != Py_None) {
        if (!e->tv->kw_dtype && !(e->tv->kw_dtype = Py_BuildValue("(s)", "dtype")))
            return NULL;
        Py_INCREF(empty);
        Py_XSETREF(e->tv->empty_fn, empty);
    }
    Py_ssize_t n = PyTuple_GET_SIZE(dts);
    if (n > MAX_ANY || PyTuple_GET_SIZE(sizes) != n) {
        PyErr_SetString(PyExc_ValueError, "set_p2p_dtypes: too many dtypes, or sizes differ");
        return NULL;
    }
    for (int i = 0; i < e->tv->n_any; i++)
        Py_CLEAR(e->tv->any_dtypes[i]);
    e->tv->n_any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t sz = PyLong_AsSize_t(PyTuple_GET_ITEM(sizes, i));
        if (sz == (size_t)-1 && PyErr_Occurred())
            return NULL;
        PyObject *cx = PyObject_GetAttrString(PyTuple_GET_ITEM(dts, i), "is_complex");
        if (!cx)
            return NULL;
        int is_cx = PyObject_IsTrue(cx);
        Py_DECREF(cx);
        if (is_cx < 0)
            return NULL;
        Py_INCREF(PyTuple_GET_ITEM(dts, i));
        e->tv->any_dtypes[i] = PyTuple_GET_ITEM(dts, i);
        e->tv->any_size[i] = sz;
        e->tv->any_complex[i] = (char)is_cx;
        e->tv->n_any = (int)i + 1;
    }
    Py_RETURN_NONE;
}

/* message_header(tensors) -> bytes | None: the binary header a message of
 * these plain tensors carries (None: not plain, or too many of them) */
PyObject *eng_message_header(Engine *e, PyObject *seq)
{
    Py_ssize_t n = PyList_CheckExact(seq) || PyTuple_CheckExact(seq) ? PySequence_Fast_GET_SIZE(seq) : -1;
    char h[P2P_HEAD_BYTES];
    size_t nbytes[P2P_MAX_TENSORS];
    Py_ssize_t hl = n < 0 || n > P2P_MAX_TENSORS || !e->tv->n_any || !e->tv->d_shape
                        ? -1 : plain_header(e, PySequence_Fast_ITEMS(seq), n, h, nbytes);
    if (hl < 0)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(h, hl);
}
