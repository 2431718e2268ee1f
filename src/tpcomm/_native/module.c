/*
 * The module: its functions (segment_size, isa, reduce, copy, time_memcpy,
 * touch), the codes it exports, and PyInit.
 */
#include "tpcomm.h"

/* reduce(dtype, op, dst, [src addresses], count[, nthreads]): the kernel alone, for tests */
static PyObject *eng_reduce_kernel(PyObject *self, PyObject *args)
{
    (void)self;
    int dtype, op;
    unsigned long long dst;
    PyObject *srcs;
    long long count;
    int nthreads = 1;
    if (!PyArg_ParseTuple(args, "iiKOL|i", &dtype, &op, &dst, &srcs, &count, &nthreads))
        return NULL;
    if (dtype < 0 || dtype >= DT_COUNT || op < 0 || op >= OP_COUNT || count < 0) {
        PyErr_SetString(PyExc_ValueError, "reduce: bad dtype, op or count");
        return NULL;
    }
    Py_ssize_t w = PySequence_Length(srcs);
    if (w < 1)
        return PyErr_Occurred() ? NULL : (PyErr_SetString(PyExc_ValueError, "reduce: no sources"), NULL);
    void **p = PyMem_Malloc(sizeof(void *) * (size_t)w);
    if (!p)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < w; i++) {
        PyObject *o = PySequence_GetItem(srcs, i);
        p[i] = o ? (void *)(uintptr_t)PyLong_AsUnsignedLongLong(o) : NULL;
        Py_XDECREF(o);
    }
    if (PyErr_Occurred()) {
        PyMem_Free(p);
        return NULL;
    }
    /* nthreads > 1: the helper-thread path of a rank, for tests (one process),
     * split at any size */
    pool_t *P = nthreads > 1 ? pool_new(nthreads, 0) : NULL;
    if (nthreads > 1 && !P) {
        PyMem_Free(p);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    par_reduce(P, dtype, op, (void *)(uintptr_t)dst, p, (int)w, (size_t)count);
    pool_free(P);
    Py_END_ALLOW_THREADS
    PyMem_Free(p);
    Py_RETURN_NONE;
}

static PyObject *mod_segment_size(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned int world;
    unsigned long long slot_bytes;
    if (!PyArg_ParseTuple(args, "IK", &world, &slot_bytes))
        return NULL;
    return PyLong_FromUnsignedLongLong(seg_size(world, slot_bytes));
}

/* time_memcpy(dst, src, nbytes, iters) -> seconds per copy: the physical bound
 * `tpcomm perf` prints next to every row (no Python overhead inside). */
static PyObject *mod_time_memcpy(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long dst, src, n;
    long iters;
    if (!PyArg_ParseTuple(args, "KKKl", &dst, &src, &n, &iters))
        return NULL;
    if (iters < 1) {
        PyErr_SetString(PyExc_ValueError, "time_memcpy: iters must be >= 1");
        return NULL;
    }
    uint64_t t0, t1;
    Py_BEGIN_ALLOW_THREADS
    memcpy((void *)(uintptr_t)dst, (void *)(uintptr_t)src, (size_t)n); /* warm */
    t0 = now_ns();
    for (long i = 0; i < iters; i++) {
        memcpy((void *)(uintptr_t)dst, (void *)(uintptr_t)src, (size_t)n);
        __asm__ __volatile__("" ::: "memory"); /* keep every copy */
    }
    t1 = now_ns();
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble((double)(t1 - t0) / 1e9 / (double)iters);
}

/* touch(addr, nbytes): store back one byte of every cache line, values
 * unchanged: the lines become this core's modified lines, as if a producer
 * had just written new data there (tpcomm perf --fresh). */
static PyObject *mod_touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "touch expects (addr, nbytes)");
        return NULL;
    }
    unsigned long long a = PyLong_AsUnsignedLongLong(args[0]);
    unsigned long long n = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    volatile char *p = (volatile char *)(uintptr_t)a;
    for (unsigned long long i = 0; i < n; i += LINE)
        p[i] = p[i];
    if (n)
        p[n - 1] = p[n - 1];
    Py_RETURN_NONE;
}

/* copy(dst, src, nbytes): memcpy between raw addresses, for what Python
 * moves itself (a received message's tensors; torch's copy_ and slicing cost
 * microseconds each).  The
 * GIL is released for large copies. */
static PyObject *mod_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy expects (dst, src, nbytes)");
        return NULL;
    }
    uintptr_t dst = (uintptr_t)PyLong_AsUnsignedLongLong(args[0]);
    uintptr_t src = (uintptr_t)PyLong_AsUnsignedLongLong(args[1]);
    long long n = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "copy: negative size");
        return NULL;
    }
    if (n >= (long long)GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        memcpy((void *)dst, (const void *)src, (size_t)n);
        Py_END_ALLOW_THREADS
    } else if (n) {
        memcpy((void *)dst, (const void *)src, (size_t)n);
    }
    Py_RETURN_NONE;
}

static PyObject *mod_isa(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyUnicode_FromString(kernel_isa());
}

/* flat_key(kind, n, world): the layout key of a flat, even layout (rounds.c):
 * Python's layout_key calls this, so one definition serves both languages */
static PyObject *mod_flat_key(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long kind, n, world;
    if (!PyArg_ParseTuple(args, "KKK", &kind, &n, &world))
        return NULL;
    return PyLong_FromUnsignedLongLong(flat_key(kind, n, world));
}

/* set_isa(name): run the kernel variant `name` ("auto", "scalar", "avx2",
 * "avx512", "neon"); ValueError naming what this CPU has if it lacks it */
static PyObject *mod_set_isa(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    int isa = ISA_COUNT;
    if (strcmp(name, "auto") == 0)
        isa = ISA_AUTO;
    for (int i = 0; i < ISA_COUNT; i++)
        if (strcmp(name, kernel_isa_name(i)) == 0)
            isa = i;
    if (isa != ISA_COUNT && kernel_set_isa(isa) == 0)
        Py_RETURN_NONE;
    char have[64] = "auto";
    for (int i = 0; i < ISA_COUNT; i++)
        if (kernel_has_isa(i)) {
            strcat(have, ", ");
            strcat(have, kernel_isa_name(i));
        }
    PyErr_Format(PyExc_ValueError,
                 isa == ISA_COUNT ? "TPCOMM_ISA=%R: no such kernel variant (expected one of %s)"
                                  : "TPCOMM_ISA=%R: this CPU (or build) cannot run it (it can: %s)",
                 arg, have);
    return NULL;
}

/* isa_variants() -> the variants this CPU can run */
static PyObject *mod_isa_variants(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    PyObject *l = PyList_New(0);
    for (int i = 0; l && i < ISA_COUNT; i++) {
        if (!kernel_has_isa(i))
            continue;
        PyObject *s = PyUnicode_FromString(kernel_isa_name(i));
        if (!s || PyList_Append(l, s) < 0)
            Py_CLEAR(l);
        Py_XDECREF(s);
    }
    return l;
}

static PyMethodDef mod_methods[] = {
    {"set_isa", mod_set_isa, METH_O, NULL},
    {"isa_variants", mod_isa_variants, METH_NOARGS, NULL},
    {"flat_key", mod_flat_key, METH_VARARGS, NULL},
    {"split_table_problem", mod_split_table_problem, METH_VARARGS, NULL},
    {"segment_size", mod_segment_size, METH_VARARGS, NULL},
    {"reduce", eng_reduce_kernel, METH_VARARGS, NULL},
    {"isa", mod_isa, METH_NOARGS, NULL},
    {"copy", (PyCFunction)(void (*)(void))mod_copy, METH_FASTCALL, NULL},
    {"time_memcpy", mod_time_memcpy, METH_VARARGS, NULL},
    {"touch", (PyCFunction)(void (*)(void))mod_touch, METH_FASTCALL, NULL},
    {"parse_header", mod_parse_header, METH_VARARGS,
     "parse_header(header, ncodes) -> [(dtype code, shape), ...] | None: a binary "
     "message header read back (p2p.c)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "tpcomm._native", NULL, -1, mod_methods,
                                 NULL, NULL, NULL, NULL};

/* The codes Python shares with the core: defined once, in tpcomm.h. */
static const struct {
    const char *name;
    long long value;
} constants[] = {
#define C(x) {#x, (long long)(x)}
    C(ST_OK), C(ST_TIMEOUT), C(ST_PEER_DEAD), C(ST_MISMATCH), C(ST_ABORTED),
    C(ST_INTERRUPTED), C(ST_CROSSED), C(ST_BUSY), C(ST_CLOSED), C(ST_CMA), C(ST_PROTO),
    C(ST_SPLITS),
    C(DT_F32), C(DT_BF16), C(DT_F16), C(DT_I32), C(DT_I64),
    C(OP_SUM), C(OP_AVG), C(OP_MAX), C(OP_MIN),
    C(KIND_ALL_REDUCE), C(KIND_BARRIER), C(KIND_ALL_GATHER), C(KIND_REDUCE_SCATTER),
    C(KIND_BROADCAST), C(KIND_GATHER), C(KIND_EMPTY), C(KIND_ALL_TO_ALL), C(KIND_DUP),
    C(KIND_REFUSED),
    C(ARG_ZERO_COPY), C(ARG_SINGLE_COPY), C(RS_FLAT), C(P2P_BINARY), C(P2P_MAX_TENSORS), C(P2P_MAX_DIMS),
    C(P2P_RING), C(VERSION), C(SLOT_MOVE_MIN), C(PAGE), C(NCHAN), C(MAX_WORLD), C(MAX_SYM),
#undef C
};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = PyModule_Create(&mod);
    if (!m)
        return NULL;
    if (pthread_atfork(NULL, NULL, after_fork_child) != 0) {
        Py_DECREF(m);
        PyErr_SetString(PyExc_RuntimeError, "tpcomm: pthread_atfork failed");
        return NULL;
    }
    int bad = torch_init() < 0 || engine_add_types(m) < 0 ||
              PyModule_AddObject(m, "MAGIC", PyLong_FromUnsignedLongLong(MAGIC)) < 0;
    for (size_t i = 0; !bad && i < sizeof constants / sizeof constants[0]; i++)
        bad = PyModule_AddIntConstant(m, constants[i].name, (long)constants[i].value) < 0;
    if (bad) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
