/*
 * The Engine object: its set-up over a mapped segment (mapping.c maps it),
 * the liveness lock, entering and leaving a call, holding it, close, fork,
 * the small methods, and the method table.
 */
#include "tpcomm.h"

/* Set in a child made by fork() (see after_fork_child). */
static int forked_child;

PyObject *eng_closed_error(void)
{
    PyErr_SetString(PyExc_RuntimeError,
                    forked_child ? "tpcomm engine is closed, or was inherited through fork(): a "
                                   "child process cannot use its parent's Communicator"
                                 : "tpcomm engine is closed");
    return NULL;
}

/*
 * The one way into a call that touches the segment, and out of it:
 *
 *   call_check   may the call start?  0, -1 (closed: the exception is set),
 *                or a status the call returns at once, nothing touched:
 *                ST_BUSY (another thread is in; the communicator stays
 *                usable) or ST_ABORTED (it failed before)
 *   call_begin   this thread is in (busy); the GIL is released when the
 *                call moves `bytes` or more (*ts), else the waits release it
 *   call_end     the GIL back, busy cleared; returns st
 *   call_enter   call_check, then call_begin when it says go
 *
 * A call that must parse Python arguments after the check (holding the GIL)
 * uses call_check, then call_begin once they are parsed.
 */
int call_check(Engine *e)
{
    if (!e->base) {
        eng_closed_error();
        return -1;
    }
    if (other_thread(e))
        return ST_BUSY;
    return e->failed || take_abort(e) ? ST_ABORTED : 0;
}

void call_begin(Engine *e, size_t bytes, PyThreadState **ts)
{
    e->busy = 1;
    if (bytes >= GIL_RELEASE_BYTES && !*ts)
        *ts = PyEval_SaveThread();
}

int call_end(Engine *e, int st, PyThreadState *ts)
{
    if (ts)
        PyEval_RestoreThread(ts);
    e->busy = 0;
    return st;
}

int call_enter(Engine *e, size_t bytes, PyThreadState **ts)
{
    int st = call_check(e);
    if (st == 0)
        call_begin(e, bytes, ts);
    return st;
}

/* A status as the Python methods return it: NULL (-1, exception) or
 * the status */
PyObject *status_result(int st)
{
    return st < 0 ? NULL : PyLong_FromLong(st);
}

static PyObject *eng_error_info(Engine *e, PyObject *unused)
{
    (void)unused;
    return Py_BuildValue(
        "{s:i,s:I,s:I,s:I,s:K,s:K,s:I,s:I,s:I,s:K,s:K,s:K,s:i,s:s}", "rank", e->err.rank, "kind",
        e->err.kind, "dtype", e->err.dtype, "op", e->err.op, "count",
        (unsigned long long)e->err.count, "arg", (unsigned long long)e->err.arg, "my_kind",
        e->err.my_kind, "my_dtype", e->err.my_dtype, "my_op", e->err.my_op, "my_count",
        (unsigned long long)e->err.my_count, "my_arg", (unsigned long long)e->err.my_arg,
        "reason", (unsigned long long)e->err.reason, "errno", e->err.errnum, "text",
        e->err.text);
}

static PyObject *eng_header(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->base)
        return eng_closed_error();
    hdr_t *h = HDR(e);
    return Py_BuildValue("{s:K,s:K,s:I,s:I,s:K,s:K,s:K,s:K,s:K,s:I,s:K}", "p2p_bytes",
                         (unsigned long long)h->p2p_bytes, "magic",
                         (unsigned long long)h->magic, "version", h->version, "world", h->world,
                         "slot_bytes", (unsigned long long)h->slot_bytes, "total_bytes",
                         (unsigned long long)h->total_bytes, "ctrl_off",
                         (unsigned long long)h->ctrl_off, "slot_off",
                         (unsigned long long)h->slot_off, "nchan", (unsigned long long)h->nchan,
                         "attached", (unsigned)atomic_load(&h->attached), "slot_move_min",
                         (unsigned long long)h->slot_move_min);
}

/* attach() -> number of ranks attached so far, this one included */
static PyObject *eng_attach(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->base)
        return eng_closed_error();
    uint32_t n = atomic_fetch_add(&HDR(e)->attached, 1) + 1;
    return PyLong_FromUnsignedLong(n);
}

static PyObject *eng_reraise(Engine *e, PyObject *unused);

static int attached_poll(Engine *e, waiter_t *w, PyThreadState **ts)
{
    (void)w, (void)ts;
    return atomic_load(&HDR(e)->attached) >= (uint32_t)e->world ? WAIT_DONE : WAIT_IDLE;
}

/* The end of a wait of this process's own (wait_until, w->until): 1 done,
 * 0 timed out, -1 with the exception of a signal handler that raised */
static int own_wait(Engine *e, waiter_t *w)
{
    PyThreadState *ts = NULL;
    int st = wait_until(e, w, &ts);
    if (ts)
        PyEval_RestoreThread(ts);
    if (st == ST_INTERRUPTED) { /* the handler's exception (eng_reraise) */
        Py_XDECREF(eng_reraise(e, NULL));
        return -1;
    }
    return st == ST_OK;
}

/* wait_attached(timeout_s) -> True when every rank attached, False on timeout */
static PyObject *eng_wait_attached(Engine *e, PyObject *arg)
{
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (!e->base)
        return eng_closed_error();
    waiter_t w = {attached_poll, NULL, NULL, 200000, -1, now_ns() + ns_of(timeout)};
    int ok = own_wait(e, &w);
    return ok < 0 ? NULL : PyBool_FromLong(ok);
}

static PyObject *eng_peer_pids(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->base)
        return eng_closed_error();
    PyObject *l = PyList_New(e->world);
    if (!l)
        return NULL;
    for (int r = 0; r < e->world; r++)
        PyList_SET_ITEM(l, r, PyLong_FromUnsignedLongLong(*(uint64_t *)ctrl_of(e, r)));
    return l;
}

/* abort(reason): fail this communicator and tell the peers this rank left
 * (fail: the one way to fail, which records the rank) */
static PyObject *eng_abort(Engine *e, PyObject *arg)
{
    long reason = PyLong_AsLong(arg);
    if (reason == -1 && PyErr_Occurred())
        return NULL;
    if (e->base)
        fail(e, (int)reason, e->rank, e->rank);
    e->failed = 1;
    Py_RETURN_NONE;
}

/*
 * Engines whose liveness lock this process holds.  A child made by fork()
 * (without exec: the descriptor is close-on-exec) inherits the descriptor,
 * which refers to the parent's open file description: while the child lives
 * the parent's lock stays held after the parent dies, and the peers would
 * wait out the timeout instead of raising PeerFailedError (a DataLoader
 * worker, a tokenizer process).  after_fork_child closes the child's copies
 * (the parent keeps its lock: it holds its own reference) and leaves the
 * engines unusable there.  It runs in the child before anything else, with
 * only the forking thread: plain stores and close(), no Python, no locks.
 */
static Engine *live_engines;

static void live_add(Engine *e)
{
    e->next_live = live_engines;
    live_engines = e;
    e->live = 1;
}

static void live_remove(Engine *e)
{
    if (!e->live)
        return;
    for (Engine **p = &live_engines; *p; p = (Engine **)&(*p)->next_live)
        if (*p == e) {
            *p = (Engine *)e->next_live;
            break;
        }
    e->live = 0;
}

void after_fork_child(void)
{
    for (Engine *e = live_engines; e; e = (Engine *)e->next_live) {
        if (e->fd >= 0)
            close(e->fd);
        e->fd = -1;
        e->base = NULL;  /* every call now fails; the mapping stays (tensors of empty()) */
        e->pool = NULL;  /* its threads are the parent's: never join them here */
        e->busy = e->held = e->rx.held = 0; /* close() must not abort the parent's */
        e->live = 0;
    }
    live_engines = NULL;
    forked_child = 1;
}

static void eng_unmap(Engine *e)
{
    live_remove(e);
    pool_free(e->pool);
    e->pool = NULL;
    e->base = NULL;
    Py_CLEAR(e->mapping); /* unmaps once no tensor views it */
    if (e->fd >= 0) {
        close(e->fd); /* drops the liveness lock */
        e->fd = -1;
    }
}

static int left_poll(Engine *e, waiter_t *w, PyThreadState **ts)
{
    (void)w, (void)ts;
    return other_thread(e) ? WAIT_IDLE : WAIT_DONE;
}

/* close(wait_s): unmap.  If another thread is inside a call, or holds the
 * engine between calls, the communicator is aborted first (reason ST_CLOSED:
 * that call returns at its next check, within ms, and the peers learn that
 * this rank closed it) and close waits up to wait_s seconds, GIL released, for
 * the thread to leave; RuntimeError (nothing unmapped) if it does not. */
static PyObject *eng_close(Engine *e, PyObject *arg)
{
    double wait_s = PyFloat_AsDouble(arg);
    if (wait_s == -1.0 && PyErr_Occurred())
        return NULL;
    if (e->base && other_thread(e)) {
        set_abort(e, ST_CLOSED, e->rank);
        waiter_t w = {left_poll, NULL, NULL, 200000, -1, now_ns() + ns_of(wait_s > 0 ? wait_s : 0)};
        if (own_wait(e, &w) < 0)
            return NULL;
        if (other_thread(e)) {
            PyErr_Format(PyExc_RuntimeError,
                         "close: another thread is still inside a call on this Communicator "
                         "%gs after it was aborted", wait_s);
            return NULL;
        }
    }
    eng_unmap(e);
    Py_RETURN_NONE;
}

/* The one way to hold the engine: keep other threads out across the several
 * calls of one operation (hold() from Python; a received header until its
 * body is read, p2p.c).  ST_OK, or ST_BUSY when another thread is in; nested
 * holds of one thread count, and each eng_release ends one. */
int eng_hold(Engine *e)
{
    if (other_thread(e))
        return ST_BUSY;
    e->held++;
    e->holder = PyThread_get_thread_ident();
    return ST_OK;
}

void eng_release(Engine *e)
{
    if (e->held > 0 && e->holder == PyThread_get_thread_ident())
        e->held--;
}

/* hold() -> status; release(): eng_hold / eng_release for Python (a hold of
 * a received header is not Python's to release: rx_release) */
static PyObject *py_hold(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->base)
        return eng_closed_error();
    return PyLong_FromLong(eng_hold(e));
}

static PyObject *py_release(Engine *e, PyObject *unused)
{
    (void)unused;
    if (e->held > e->rx.held)
        eng_release(e);
    Py_RETURN_NONE;
}

/* rx_release(): give up the hold of a received header whose body will not be
 * read (Python failed between the two); no-op otherwise */
static PyObject *eng_rx_release(Engine *e, PyObject *unused)
{
    (void)unused;
    if (e->holder == PyThread_get_thread_ident())
        rx_release(e);
    Py_RETURN_NONE;
}

/* in_use: whether another thread is inside a call or holds the engine */
static PyObject *eng_get_in_use(Engine *e, void *c)
{
    (void)c;
    return PyBool_FromLong(other_thread(e));
}

static PyObject *eng_get_mapping(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->mapping)
        return eng_closed_error();
    Py_INCREF(e->mapping);
    return e->mapping;
}

static PyObject *eng_address(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->base)
        return eng_closed_error();
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)e->base);
}

/*
 * Engine(fd, size, rank, world, slot_bytes, create, timeout_s, spin_us, yield_us,
 *        slot_move_min)
 * Maps the segment (fd stays owned by the engine: it carries the liveness
 * lock), takes the liveness lock on byte `rank`, and writes the header when
 * `create` is true, with slot_move_min (-1: no round moves in the slots);
 * the other ranks take that from the header.  Header validation on attach
 * is Python's (header()).
 */
static int eng_init(Engine *e, PyObject *args, PyObject *kw)
{
    (void)kw;
    int fd, rank, world, create;
    unsigned long long size, slot_bytes;
    double timeout, spin_us, yield_us;
    long long move_min;
    if (!PyArg_ParseTuple(args, "iKiiKpdddL", &fd, &size, &rank, &world, &slot_bytes, &create,
                          &timeout, &spin_us, &yield_us, &move_min))
        return -1;
    if (world < 2 || rank < 0 || rank >= world || slot_bytes == 0 || slot_bytes % PAGE) {
        PyErr_Format(PyExc_ValueError, "Engine: bad rank %d / world %d / slot_bytes %llu", rank,
                     world, slot_bytes);
        return -1;
    }
    if (world > MAX_WORLD) {
        PyErr_Format(PyExc_ValueError, "Engine: world %d too large", world);
        return -1;
    }
    uint64_t need = seg_size((uint32_t)world, slot_bytes);
    if (size < need) {
        PyErr_Format(PyExc_ValueError, "Engine: segment of %llu bytes, layout needs %llu", size,
                     (unsigned long long)need);
        return -1;
    }
    int myfd;
    Mapping *mp = map_segment(fd, (size_t)size, rank, &myfd);
    if (!mp)
        return -1;
    eng_unmap(e);
    PyMem_Free(e->srcs);
    e->srcs = PyMem_Calloc((size_t)world, sizeof(void *));
    if (!e->srcs) {
        Py_DECREF(mp);
        close(myfd);
        PyErr_NoMemory();
        return -1;
    }
    e->mapping = (PyObject *)mp;
    PyMem_Free(e->p2p_sent);
    e->p2p_sent = PyMem_Calloc((size_t)world * 3, sizeof(uint64_t));
    if (!e->p2p_sent) {
        PyErr_NoMemory();
        return -1;
    }
    e->p2p_recvd = e->p2p_sent + world;
    e->p2p_seen = e->p2p_sent + 2 * world;
    e->fd = myfd;
    live_add(e);
    set_layout(e, mp->base, (size_t)size, rank, world, slot_bytes, timeout, spin_us, yield_us);
    if (create) {
        e->slot_move_min = move_min < 0 ? UINT64_MAX : (uint64_t)move_min;
        write_header(e, need);
    } else {
        e->slot_move_min = HDR(e)->slot_move_min;
    }
    /* who maps it, for `tpcomm doctor` to tell stale segments from live ones,
     * and where the word is that peers read to check single-copy reads work */
    e->cma_word = cma_tag((uint64_t)getpid(), rank);
    *(uint64_t *)ctrl_of(e, rank) = (uint64_t)getpid();
    ((uint64_t *)ctrl_of(e, rank))[1] = (uint64_t)(uintptr_t)&e->cma_word;
    return 0;
}

static PyObject *eng_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)args;
    (void)kw;
    Engine *e = (Engine *)type->tp_alloc(type, 0);
    if (!e)
        return NULL;
    e->fd = -1; /* 0 is stdin: never close it by mistake */
    if (tview_new(e) < 0) {
        Py_DECREF(e);
        return NULL;
    }
    return (PyObject *)e;
}

static void eng_dealloc(Engine *e)
{
    Py_CLEAR(e->pending);
    PyMem_Free(e->p2p_sent);
    for (int i = 0; i < e->nsym; i++)
        PyMem_Free(e->sym[i].peers);
    eng_unmap(e);
    PyMem_Free(e->srcs);
    tview_free(e);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyObject *eng_get_round(Engine *e, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(e->round);
}

static PyObject *eng_get_failed(Engine *e, void *c)
{
    (void)c;
    if (!e->failed && e->base)
        take_abort(e);
    return PyBool_FromLong(e->failed);
}

/* add_symmetric(base, size, [every rank's base], id): register a symmetric
 * buffer; id is the same on every rank (the communicator's count of them) */
static PyObject *eng_add_symmetric(Engine *e, PyObject *args)
{
    unsigned long long base, size, id;
    PyObject *peers;
    if (!PyArg_ParseTuple(args, "KKO!K", &base, &size, &PyList_Type, &peers, &id))
        return NULL;
    if (size >= (1ULL << 40)) { /* its offsets travel in 40 bits (allreduce.c) */
        PyErr_SetString(PyExc_ValueError, "add_symmetric: a buffer of 1 TiB or more");
        return NULL;
    }
    if (PyList_GET_SIZE(peers) != e->world) {
        PyErr_SetString(PyExc_ValueError, "add_symmetric: one base per rank");
        return NULL;
    }
    if (e->nsym >= MAX_SYM) {
        PyErr_Format(PyExc_ValueError, "add_symmetric: at most %d buffers per communicator",
                     MAX_SYM);
        return NULL;
    }
    char **p = PyMem_Calloc((size_t)e->world, sizeof(char *));
    if (!p)
        return PyErr_NoMemory();
    for (int r = 0; r < e->world; r++) {
        p[r] = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(PyList_GET_ITEM(peers, r));
        if (PyErr_Occurred()) {
            PyMem_Free(p);
            return NULL;
        }
    }
    struct sym *sb = &e->sym[e->nsym++];
    sb->base = (char *)(uintptr_t)base;
    sb->size = (size_t)size;
    sb->peers = p;
    sb->id = id;
    Py_RETURN_NONE;
}

/* nsymmetric() -> the symmetric buffers registered */
static PyObject *eng_nsymmetric(Engine *e, PyObject *unused)
{
    (void)unused;
    return PyLong_FromLong(e->nsym);
}

/* remove_symmetric(base) -> bool: forget the buffer at base (its tensors are
 * gone); False, nothing changed, while a call is inside the engine or another
 * thread holds it (a call reads the table with the GIL released): try later */
static PyObject *eng_remove_symmetric(Engine *e, PyObject *arg)
{
    unsigned long long base = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    if (e->busy || other_thread(e))
        Py_RETURN_FALSE;
    for (int i = 0; i < e->nsym; i++) {
        if (e->sym[i].base != (char *)(uintptr_t)base)
            continue;
        PyMem_Free(e->sym[i].peers);
        e->sym[i] = e->sym[--e->nsym]; /* the order means nothing: ids name them */
        break;
    }
    Py_RETURN_TRUE;
}

/* set_threads(n, min_bytes): copies, reductions and single-copy reads of at
 * least min_bytes use n threads (min_bytes -1: one thread) */
static PyObject *eng_set_threads(Engine *e, PyObject *args)
{
    long n;
    long long min_bytes;
    if (!PyArg_ParseTuple(args, "lL", &n, &min_bytes))
        return NULL;
    if (n < 1 || n > 256) {
        PyErr_Format(PyExc_ValueError, "set_threads: %ld threads, expected 1..256", n);
        return NULL;
    }
    if (refuse_if_busy(e, "set_threads") < 0)
        return NULL;
    pool_free(e->pool);
    e->pool = NULL;
    if (n > 1 && min_bytes >= 0 && !(e->pool = pool_new((int)n, (size_t)min_bytes)))
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *eng_get_threads(Engine *e, void *c)
{
    (void)c;
    return PyLong_FromLong(pool_threads(e->pool));
}

/* reraise(): raise the exception a signal handler raised during a wait */
static PyObject *eng_reraise(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->pending) {
        PyErr_SetString(PyExc_RuntimeError, "tpcomm: interrupted");
        return NULL;
    }
    PyObject *v = e->pending;
    e->pending = NULL;
    PyErr_SetObject((PyObject *)Py_TYPE(v), v);
    Py_DECREF(v);
    return NULL;
}

/* A switch point from Python: bytes, -1 = never */
static PyObject *set_switch(uint64_t *into, PyObject *arg)
{
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred())
        return NULL;
    *into = v < 0 ? UINT64_MAX : (uint64_t)v;
    Py_RETURN_NONE;
}

/* set_twoshot_min(bytes): -1 = never two-shot */
static PyObject *eng_set_twoshot_min(Engine *e, PyObject *arg)
{
    return set_switch(&e->twoshot_min, arg);
}

/* set_twoshot_min16(bytes): the same for bfloat16 and float16 */
static PyObject *eng_set_twoshot_min16(Engine *e, PyObject *arg)
{
    return set_switch(&e->twoshot_min16, arg);
}

/* set_windows(twoshot_max, twoshot_max16, cma_allreduce_max, nt_max): where
 * the windows of two-shot (float32 and the integers; 16-bit floats),
 * single-copy all-reduce and non-temporal stores end, bytes included (-1:
 * they do not end); each starts at its *_min */
static PyObject *eng_set_windows(Engine *e, PyObject *args)
{
    long long v[4];
    if (!PyArg_ParseTuple(args, "LLLL", &v[0], &v[1], &v[2], &v[3]))
        return NULL;
    uint64_t *into[4] = {&e->twoshot_max, &e->twoshot_max16, &e->cma_ar_max, &e->nt_max};
    for (int i = 0; i < 4; i++)
        *into[i] = v[i] < 0 ? UINT64_MAX : (uint64_t)v[i];
    Py_RETURN_NONE;
}

/* set_nt_min(bytes): copies into a slot of at least this many bytes use
 * non-temporal stores (-1 = never; the all_reduce chunks whose stores are
 * chosen as they run, allreduce.c, decide for themselves) */
static PyObject *eng_set_nt_min(Engine *e, PyObject *arg)
{
    return set_switch(&e->nt_min, arg);
}

/* set_cma_allreduce_min(bytes): all-reduces of at least this many bytes go
 * single-copy where cma_init agreed it (-1 = never) */
static PyObject *eng_set_cma_allreduce_min(Engine *e, PyObject *arg)
{
    return set_switch(&e->cma_ar_min, arg);
}

/* Fault injection for tests: every slow wait of p2p_batch sleeps this long
 * (microseconds) between its last pass and its verdicts (see batch_verdict), and
 * a single-copy all_gather, all_to_all or message read by reference before each
 * read of a peer (cma_read, cma_recv). */
static PyObject *eng_fault_check_delay(Engine *e, PyObject *arg)
{
    double us = PyFloat_AsDouble(arg);
    if (us == -1.0 && PyErr_Occurred())
        return NULL;
    e->fault.check_delay_ns = us > 0 ? (uint64_t)(us * 1e3) : 0;
    Py_RETURN_NONE;
}

/* Fault injection for tests: single-copy all_gathers and all_to_alls, and
 * messages sent by reference, publish an address the peers cannot read (a
 * read error with every rank alive: ST_CMA). */
static PyObject *eng_fault_cma_addr(Engine *e, PyObject *arg)
{
    int v = PyObject_IsTrue(arg);
    if (v < 0)
        return NULL;
    e->fault.cma_addr = v;
    Py_RETURN_NONE;
}

/* layout() -> the segment offsets and sizes Python needs (shm/engine.py) */
PyObject *eng_layout(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->base)
        return eng_closed_error();
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:i,s:i,s:i}", "slot_off",
                         (unsigned long long)e->slot_off, "slot_bytes",
                         (unsigned long long)e->slot_bytes, "p2p_off",
                         (unsigned long long)e->p2p_off, "p2p_bytes",
                         (unsigned long long)e->p2p_bytes, "p2p_piece",
                         (unsigned long long)e->p2p_piece, "size", (unsigned long long)e->size,
                         "p2p_sent_line", P2P_SENT_LINE(0), "p2p_done_line",
                         P2P_DONE_LINE(e->world, 0), "p2p_ring", P2P_RING);
}

/* The engine's methods, by family; the Python side is shm/engine.py (its
 * one caller), the stubs _native.pyi. */
static PyMethodDef eng_methods[] = {
    /* -- set-up and lifetime (shm/engine.py) */
    {"header", (PyCFunction)eng_header, METH_NOARGS,
     "header() -> dict: the segment header's fields, to validate"},
    {"layout", (PyCFunction)eng_layout, METH_NOARGS,
     "layout() -> dict: the segment's offsets and sizes"},
    {"attach", (PyCFunction)eng_attach, METH_NOARGS,
     "attach(): take this rank's liveness lock and publish its pid"},
    {"wait_attached", (PyCFunction)eng_wait_attached, METH_O,
     "wait_attached(seconds) -> bool: every rank attached"},
    {"address", (PyCFunction)eng_address, METH_NOARGS,
     "address() -> int: where the segment is mapped"},
    {"mapping", (PyCFunction)eng_get_mapping, METH_NOARGS,
     "mapping() -> the object owning the mapping"},
    {"set_threads", (PyCFunction)eng_set_threads, METH_VARARGS,
     "set_threads(n, min_bytes): helper threads for copies of min_bytes and more"},
    {"set_stores_auto", (PyCFunction)eng_set_stores_auto, METH_O,
     "set_stores_auto(on) -> on: all_reduce chunks choose their stores as they run"},
    {"stores", (PyCFunction)eng_stores, METH_NOARGS, "stores() -> what the copy-ins learnt"},
    {"set_waits", (PyCFunction)eng_set_waits, METH_VARARGS,
     "set_waits(spin_us, yield_us, lost_us=200): how this rank's waits wait from now on"},
    {"record", (PyCFunction)eng_record, METH_VARARGS,
     "record(reset=False, stamp=-1) -> dict: the rounds and waits so far (stamp 0/1: "
     "stop/start stamping publishes)"},
    {"set_zero_copy_auto", (PyCFunction)eng_set_zero_copy_auto, METH_O,
     "set_zero_copy_auto(on): rank 0 chooses zero copy or the copies as calls run"},
    {"zero_copy_state", (PyCFunction)eng_zero_copy_state, METH_NOARGS,
     "zero_copy_state() -> what the zero-copy choice learnt"},
    {"fault_zero_copy", (PyCFunction)eng_fault_zero_copy, METH_O,
     "fault_zero_copy(us): tests: zero-copy all-reduces take this much longer"},
    {"all_reduce_plan", (PyCFunction)eng_all_reduce_plan, METH_VARARGS,
     "all_reduce_plan(nbytes, dtype, symmetric) -> (algorithm, chunk, stores)"},
    {"fault_stores", (PyCFunction)eng_fault_stores, METH_VARARGS,
     "fault_stores(plain_us, nt_us, leftover_us=0, chunks=0): copy-ins take this much longer "
     "(tests)"},
    {"set_twoshot_min", (PyCFunction)eng_set_twoshot_min, METH_O,
     "set_twoshot_min(nbytes): the all-reduce switch point"},
    {"set_twoshot_min16", (PyCFunction)eng_set_twoshot_min16, METH_O,
     "set_twoshot_min16(nbytes): the switch point of bfloat16 and float16"},
    {"set_zero_copy", (PyCFunction)eng_set_zero_copy, METH_VARARGS,
     "set_zero_copy(min, max): zero-copy all-reduce of a symmetric tensor of min..max bytes"},
    {"set_populate_min", (PyCFunction)eng_set_populate_min, METH_O,
     "set_populate_min(min_bytes): outputs from min_bytes get their pages first (-1: never)"},
    {"set_chunks", (PyCFunction)eng_set_chunks, METH_VARARGS,
     "set_chunks(min_bytes, chunk_bytes): all-reduces from min_bytes go chunk_bytes at a time"},
    {"set_windows", (PyCFunction)eng_set_windows, METH_VARARGS,
     "set_windows(twoshot_max, twoshot_max16, cma_allreduce_max, nt_max): the windows' ends"},
    {"set_nt_min", (PyCFunction)eng_set_nt_min, METH_O,
     "set_nt_min(nbytes): non-temporal stores into the slots from nbytes (-1: never)"},
    {"set_cma_allreduce_min", (PyCFunction)eng_set_cma_allreduce_min, METH_O,
     "set_cma_allreduce_min(nbytes): single-copy all-reduce from nbytes (-1: never)"},
    {"cma_init", (PyCFunction)eng_cma_init, METH_VARARGS,
     "cma_init(kind, want, min, twoshot) -> (status, on): agree on single copy"},
    {"set_fast_path", (PyCFunction)eng_set_fast_path, METH_VARARGS,
     "set_fast_path(tensor type, ops, dtypes, kind, fallback, raiser)"},
    {"set_p2p_dtypes", (PyCFunction)eng_set_p2p_dtypes, METH_VARARGS,
     "set_p2p_dtypes(dtypes, sizes, empty): the message dtypes"},
    {"hold", (PyCFunction)py_hold, METH_NOARGS,
     "hold() -> status: keep other threads out across several calls"},
    {"release", (PyCFunction)py_release, METH_NOARGS,
     "release(): the end of hold()"},
    {"abort", (PyCFunction)eng_abort, METH_O,
     "abort(reason): fail, and tell the peers"},
    {"close", (PyCFunction)eng_close, METH_O,
     "close(wait_s): abort another thread's call, then unmap"},
    {"error_info", (PyCFunction)eng_error_info, METH_NOARGS,
     "error_info() -> dict: what the last failure recorded"},
    {"reraise", (PyCFunction)eng_reraise, METH_NOARGS,
     "reraise(): the exception a signal handler raised in a wait"},
    {"peer_pids", (PyCFunction)eng_peer_pids, METH_NOARGS,
     "peer_pids() -> list: every rank's pid in the segment"},
    /* -- collectives: the one-call entries (communicator.py via shm/path.py) */
    {"fast_all_reduce", (PyCFunction)(void (*)(void))eng_fast_all_reduce, METH_FASTCALL | METH_KEYWORDS,
     "fast_all_reduce(tensor, op=SUM) -> tensor: all_reduce in one call"},
    {"whole_all_gather_into_tensor", (PyCFunction)(void (*)(void))eng_whole_all_gather_into_tensor,
     METH_FASTCALL | METH_KEYWORDS,
     "whole_all_gather_into_tensor(output, input) -> output: the whole method in one call"},
    {"whole_reduce_scatter_tensor", (PyCFunction)(void (*)(void))eng_whole_reduce_scatter_tensor,
     METH_FASTCALL | METH_KEYWORDS,
     "whole_reduce_scatter_tensor(output, input, op=SUM) -> output: the whole method in one call"},
    {"whole_gather", (PyCFunction)(void (*)(void))eng_whole_gather, METH_FASTCALL | METH_KEYWORDS,
     "whole_gather(tensor, dst=0, dim=0, *, out=None) -> out | tensor | None: the whole method"},
    {"fast_all_gather", (PyCFunction)(void (*)(void))eng_fast_all_gather, METH_FASTCALL,
     "fast_all_gather(output, input[, fn]) -> True | None"},
    {"fast_gather", (PyCFunction)(void (*)(void))eng_fast_gather, METH_FASTCALL,
     "fast_gather(input, out | None, dst) -> True | None"},
    {"fast_reduce_scatter", (PyCFunction)(void (*)(void))eng_fast_reduce_scatter, METH_FASTCALL,
     "fast_reduce_scatter(output, input, op) -> True | None"},
    {"fast_broadcast", (PyCFunction)(void (*)(void))eng_fast_broadcast, METH_FASTCALL,
     "fast_broadcast(tensor, src) -> True | None"},
    {"fast_all_to_all", (PyCFunction)(void (*)(void))eng_fast_all_to_all, METH_FASTCALL,
     "fast_all_to_all(output, input, out_splits, in_splits) -> True | None"},
    {"plain", (PyCFunction)eng_plain, METH_O,
     "plain(tensor) -> (dtype code, address, numel) | None"},
    /* -- collectives: rounds by address (shm/path.py) */
    {"all_reduce", (PyCFunction)(void (*)(void))eng_all_reduce, METH_FASTCALL,
     "all_reduce(addr, count, dtype, op, kind) -> status"},
    {"sync", (PyCFunction)(void (*)(void))eng_sync, METH_FASTCALL,
     "sync(kind, dtype, op, count, arg) -> status: one round"},
    {"gatherv", (PyCFunction)(void (*)(void))eng_gatherv, METH_FASTCALL,
     "gatherv(kind, mine, counts, out, dtype, numel, arg, rows) -> status"},
    {"reduce_scatterv", (PyCFunction)(void (*)(void))eng_reduce_scatterv, METH_FASTCALL,
     "reduce_scatterv(kind, x, dtype, sizes, out, op, arg, rows) -> status"},
    {"broadcast", (PyCFunction)(void (*)(void))eng_broadcast, METH_FASTCALL,
     "broadcast(kind, addr, nbytes, src, dtype, numel) -> status"},
    {"alltoallv", (PyCFunction)(void (*)(void))eng_alltoallv, METH_FASTCALL,
     "alltoallv(kind, x, send, send_at, out, recv, recv_at, most, dtype, count, arg) -> status"},
    {"alltoall_splits", (PyCFunction)(void (*)(void))eng_alltoall_splits, METH_FASTCALL,
     "alltoall_splits(kind, x, ins, out, outs, rows.., dtypes) -> status"},
    {"add_symmetric", (PyCFunction)eng_add_symmetric, METH_VARARGS,
     "add_symmetric(addr, size, peers, id): an empty() buffer"},
    {"remove_symmetric", (PyCFunction)eng_remove_symmetric, METH_O,
     "remove_symmetric(addr) -> bool: forget an empty() buffer"},
    {"nsymmetric", (PyCFunction)eng_nsymmetric, METH_NOARGS,
     "nsymmetric() -> int: the empty() buffers listed"},
    /* -- point to point (shm/messages.py, shm/path.py) */
    {"p2p_send_tensors", (PyCFunction)(void (*)(void))eng_p2p_send_tensors, METH_FASTCALL,
     "p2p_send_tensors(dst, tensors) -> True | None: send in one call"},
    {"p2p_recv", (PyCFunction)(void (*)(void))eng_p2p_recv, METH_FASTCALL,
     "p2p_recv(src, out=None) -> list | header | None: recv in one call"},
    {"p2p_sendrecv", (PyCFunction)(void (*)(void))eng_p2p_sendrecv, METH_FASTCALL,
     "p2p_sendrecv(dst, tensors, src, out) -> list | (header, data) | None"},
    {"p2p_send", (PyCFunction)eng_p2p_send, METH_VARARGS,
     "p2p_send(dst, pieces, if_room=False) -> status | None"},
    {"p2p_recv_head", (PyCFunction)eng_p2p_recv_head, METH_O,
     "p2p_recv_head(src) -> (status, header)"},
    {"p2p_recv_body", (PyCFunction)eng_p2p_recv_body, METH_O,
     "p2p_recv_body(pieces) -> status"},
    {"rx_release", (PyCFunction)eng_rx_release, METH_NOARGS,
     "rx_release(): drop a receive whose body was not read"},
    {"p2p_wait_any", (PyCFunction)eng_p2p_wait_any, METH_NOARGS,
     "p2p_wait_any() -> (status, src): a message from any rank"},
    {"p2p_batch", (PyCFunction)eng_p2p_batch, METH_O,
     "p2p_batch(ops) -> (status, odd): sends and receives together"},
    {"message_header", (PyCFunction)eng_message_header, METH_O,
     "message_header(tensors) -> bytes | None: the binary header of a message of them"},
    /* -- test hooks (tpcomm._testing only) */
    {"fault_check_delay", (PyCFunction)eng_fault_check_delay, METH_O,
     "fault_check_delay(us): sleep before a batch's verdicts"},
    {"fault_cma_addr", (PyCFunction)eng_fault_cma_addr, METH_O,
     "fault_cma_addr(on): publish an unreadable input address"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef eng_getset[] = {
    {"round", (getter)eng_get_round, NULL, NULL, NULL},
    {"threads", (getter)eng_get_threads, NULL, NULL, NULL},
    {"failed", (getter)eng_get_failed, NULL, NULL, NULL},
    {"in_use", (getter)eng_get_in_use, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tpcomm._native.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = eng_new,
    .tp_init = (initproc)eng_init,
    .tp_dealloc = (destructor)eng_dealloc,
    .tp_methods = eng_methods,
    .tp_getset = eng_getset,
};

/* Ready the Engine and Mapping types and add Engine to the module: 0, or -1
 * with an exception. */
int engine_add_types(PyObject *m)
{
    if (PyType_Ready(&EngineType) < 0 || PyType_Ready(&MappingType) < 0)
        return -1;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        return -1;
    }
    return 0;
}
