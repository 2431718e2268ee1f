/*
 * all_to_all with split sizes: the split table every rank publishes in a
 * round of its own (its layout: the 2W splits, then the T_* fields), how a
 * rank reads its splits (alltoall_split_list, table_splits), the verdict on
 * every rank's table (table_verdict: the first thing wrong, named), and the
 * rounds that follow it (alltoall_splits_rounds, then rounds.c's
 * alltoallv_rounds).
 */
#include "tpcomm.h"

/* The split table's fields after the 2W splits (TABLE_FIELDS u64 per rank in all) */
enum { T_ROWS_IN, T_ROWS_OUT, T_ROW_IN, T_ROW_OUT, T_CODE_IN, T_CODE_OUT, T_EXTRA };
#define TABLE_BAD UINT64_MAX /* a rank's splits that are not W sizes >= 0 */
#define TABLE_ARG 0x5A11700000000000ull /* the table round's metadata arg */

/* "[a, b, c]" of n u64 into buf (at most cap bytes) */
static void fmt_list(char *buf, size_t cap, const uint64_t *v, int n)
{
    size_t at = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < n && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, i ? ", %llu" : "%llu", (unsigned long long)v[i]);
    if (at < cap)
        snprintf(buf + at, cap - at, "]");
}

/* The verdict on every rank's table (the same on every rank: they read the
 * same tables): 0, or ST_SPLITS with the reason in buf (cap bytes).  The
 * all_to_all across hosts checks its gathered table with it too
 * (split_table_problem). */
static int table_verdict(int w, const uint64_t *const *t, char *buf, size_t cap)
{
    for (int q = 0; q < w; q++) {
        const uint64_t *s = t[q], *r = t[q] + w, *f = t[q] + 2 * w;
        if (s[0] == TABLE_BAD) {
            snprintf(buf, cap,
                     "rank %d's split sizes are not %d sizes >= 0 (and below 2**63)", q, w);
            return ST_SPLITS;
        }
        /* no split above its tensor's rows: then no sum wraps around */
        uint64_t sum_s = 0, sum_r = 0, over = 0;
        for (int j = 0; j < w; j++) {
            over |= s[j] > f[T_ROWS_IN] || r[j] > f[T_ROWS_OUT];
            sum_s += s[j];
            sum_r += r[j];
        }
        if (over || sum_s != f[T_ROWS_IN] || sum_r != f[T_ROWS_OUT]) {
            char a[120], b[120];
            fmt_list(a, sizeof a, s, w);
            fmt_list(b, sizeof b, r, w);
            snprintf(buf, cap,
                     "rank %d's split sizes %s / %s do not sum to its %llu input / %llu "
                     "output rows", q, a, b, (unsigned long long)f[T_ROWS_IN],
                     (unsigned long long)f[T_ROWS_OUT]);
            return ST_SPLITS;
        }
        if (f[T_CODE_IN] != f[T_CODE_OUT] || f[T_CODE_IN] != t[0][2 * w + T_CODE_IN] ||
            f[T_ROW_IN] != f[T_ROW_OUT] || f[T_ROW_IN] != t[0][2 * w + T_ROW_IN]) {
            snprintf(buf, cap,
                     "rank %d's input and output differ in dtype or row shape", q);
            return ST_SPLITS;
        }
    }
    for (int q = 0; q < w; q++)
        for (int j = 0; j < w; j++)
            if (t[q][j] != t[j][w + q]) {
                snprintf(buf, cap,
                         "rank %d sends %llu rows to rank %d, which expects %llu from it", q,
                         (unsigned long long)t[q][j], j, (unsigned long long)t[j][w + q]);
                return ST_SPLITS;
            }
    return 0;
}

/* all_to_all split sizes as the one-call path takes them: 0 with *list NULL
 * (None or []: even), 0 with *list the list (an exact list of exact ints:
 * the table round checks the rest with the peers), or -1 (anything else:
 * the general path). */
int alltoall_split_list(PyObject *v, PyObject **list)
{
    *list = NULL;
    if (v == Py_None || (PyList_CheckExact(v) && PyList_GET_SIZE(v) == 0))
        return 0;
    if (!PyList_CheckExact(v))
        return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(v); i++)
        if (!PyLong_CheckExact(PyList_GET_ITEM(v, i)))
            return -1;
    *list = v;
    return 0;
}

/* this rank's W split sizes from a list, or TABLE_BAD in the first (not a list
 * of W ints >= 0: every rank says so, not this one alone); NULL: rows cut
 * evenly (rows / W each, as torch does without split sizes) */
static int table_splits(Engine *e, PyObject *o, uint64_t rows, uint64_t *v)
{
    if (!o) {
        for (int r = 0; r < e->world; r++)
            v[r] = rows / (uint64_t)e->world;
        return 0;
    }
    if (!PyList_Check(o) || PyList_GET_SIZE(o) != e->world) {
        v[0] = TABLE_BAD;
        return 0;
    }
    for (int r = 0; r < e->world; r++) {
        long long x = PyLong_AsLongLong(PyList_GET_ITEM(o, r));
        if (x == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                return -1;
            PyErr_Clear(); /* 2**63 or more: bad, and every rank says so */
            x = -1;
        }
        if (x < 0) {
            v[0] = TABLE_BAD;
            return 0;
        }
        v[r] = (uint64_t)x;
    }
    return 0;
}

/*
 * all_to_all_single with split sizes, in one call: ins, outs the rows this
 * rank sends to and receives from each rank (lists, or NULL: even), f the
 * table's fields (rows in, rows out, bytes per row in, out, dtype in, out).
 * Round one carries every rank's table (its splits both ways and f) in its
 * slot; every rank checks all of them (what q sends j must be what j expects
 * from q; splits sum to the rows; one dtype and row shape), so a bad table is
 * ST_SPLITS on every rank (err_text says why) after a completed round: the
 * communicator stays usable.  Then the rounds of alltoallv_rounds, keyed by the
 * largest block (the same on every rank: it comes from the same table).  A
 * status, or -1 with an exception set.
 */
int alltoall_splits_rounds(Engine *e, uint32_t kind, const char *x, PyObject *ins, char *out,
                        PyObject *outs, const uint64_t *f)
{
    const int w = e->world, me = e->rank, tn = 2 * w + T_EXTRA;
    if ((size_t)tn * sizeof(uint64_t) > e->slot_bytes) {
        PyErr_SetString(PyExc_ValueError, "alltoall_splits: the slot is too small for the table");
        return -1;
    }
    uint64_t *mine = PyMem_Calloc((size_t)tn, sizeof(uint64_t));
    size_t *sizes = PyMem_Calloc(4 * (size_t)w + 1, sizeof(size_t));
    const uint64_t **t = PyMem_Calloc((size_t)w, sizeof(uint64_t *));
    if (!mine || !sizes || !t) {
        PyMem_Free(mine);
        PyMem_Free(sizes);
        PyMem_Free(t);
        PyErr_NoMemory();
        return -1;
    }
    int st = table_splits(e, ins, f[T_ROWS_IN], mine);
    if (st == 0)
        st = table_splits(e, outs, f[T_ROWS_OUT], mine + w);
    if (st == 0) {
        if (mine[0] == TABLE_BAD || mine[w] == TABLE_BAD)
            mine[0] = TABLE_BAD;
        for (int i = 0; i < T_EXTRA; i++)
            mine[2 * w + i] = f[i];
    }
    PyThreadState *ts = NULL;
    if (st == 0)
        st = call_enter(e, 0, &ts); /* -1 (closed: the exception is set), a status, or in */
    if (st == 0) {
        /* round one: the table */
        int p = (int)((e->round + 1) & 1);
        memcpy(slot_of(e, me, p), mine, (size_t)tn * sizeof(uint64_t));
        st = round_sync(e, kind, 0, 0, (uint64_t)tn, TABLE_ARG, &ts);
        st = call_end(e, st, ts);
        for (int q = 0; st == ST_OK && q < w; q++)
            t[q] = (const uint64_t *)slot_of(e, q, p);
        if (st == ST_OK)
            st = table_verdict(w, t, e->err.text, sizeof e->err.text);
        if (st == ST_OK) {
            /* bytes and offsets this rank sends and receives; the largest block */
            const uint64_t row = t[0][2 * w + T_ROW_IN];
            size_t *sc = sizes, *so = sizes + w, *rc = sizes + 2 * w, *ro = sizes + 3 * w;
            uint64_t most = 0, at_s = 0, at_r = 0;
            for (int q = 0; q < w; q++)
                for (int j = 0; j < w; j++)
                    if (t[q][j] * row > most)
                        most = t[q][j] * row;
            for (int j = 0; j < w; j++) {
                sc[j] = (size_t)(t[me][j] * row);
                so[j] = (size_t)at_s;
                at_s += sc[j];
                rc[j] = (size_t)(t[j][me] * row);
                ro[j] = (size_t)at_r;
                at_r += rc[j];
            }
            /* the table's slot is read: the next round may overwrite it */
            st = alltoallv_rounds(e, kind, x, sc, so, out, rc, ro, most, (uint32_t)f[T_CODE_IN],
                               most, flat_key(kind, most, (uint64_t)w));
        }
    }
    PyMem_Free(mine);
    PyMem_Free(sizes);
    PyMem_Free(t);
    return st;
}

/* alltoall_splits(kind, x, [rows to each rank], out, [rows from each rank],
 * rows_in, rows_out, row_in, row_out, dtype_in, dtype_out) -> status:
 * alltoall_splits_rounds */
PyObject *eng_alltoall_splits(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[11];
    if (u64_args(args, nargs, 11, "alltoall_splits", v) < 0)
        return NULL;
    uint64_t f[T_EXTRA];
    for (int i = 0; i < T_EXTRA; i++)
        f[i] = v[5 + i];
    return status_result(alltoall_splits_rounds(e, (uint32_t)v[0], (const char *)(uintptr_t)v[1],
                                             args[2], (char *)(uintptr_t)v[3], args[4], f));
}

/* split_table_problem(world, [every rank's 2W + 6 table entries, rank after
 * rank]) -> why the table is wrong, or None (table_verdict, for the
 * all_to_all that gathers its table instead of running alltoall_splits) */
PyObject *mod_split_table_problem(PyObject *self, PyObject *args)
{
    (void)self;
    int w;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "iO!", &w, &PyList_Type, &list))
        return NULL;
    const Py_ssize_t tn = 2 * (Py_ssize_t)w + T_EXTRA;
    if (w < 1 || w > MAX_WORLD || PyList_GET_SIZE(list) != w * tn) {
        PyErr_SetString(PyExc_ValueError, "split_table_problem: world * (2 world + 6) entries");
        return NULL;
    }
    uint64_t *v = PyMem_Calloc((size_t)(w * tn), sizeof(uint64_t));
    const uint64_t **t = PyMem_Calloc((size_t)w, sizeof(uint64_t *));
    if (!v || !t) {
        PyMem_Free(v);
        PyMem_Free(t);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < w * tn; i++) /* -1 (a rank's bad splits): TABLE_BAD */
        v[i] = (uint64_t)PyLong_AsLongLong(PyList_GET_ITEM(list, i));
    for (int q = 0; q < w; q++)
        t[q] = v + (size_t)q * (size_t)tn;
    char buf[320];
    PyObject *res = NULL;
    if (!PyErr_Occurred())
        res = table_verdict(w, t, buf, sizeof buf) ? PyUnicode_FromString(buf)
                                                   : Py_NewRef(Py_None);
    PyMem_Free(v);
    PyMem_Free(t);
    return res;
}
