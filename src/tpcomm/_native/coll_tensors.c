/*
 * The one-call entries of the collectives other than all_reduce that take
 * tensors: all_gather_into_tensor, gather, broadcast, reduce_scatter_tensor,
 * all_to_all_single, and the whole-call entries the Communicator stores on
 * its instance (all_gather_into_tensor, reduce_scatter_tensor, gather).  They
 * see tensors only through torch.c (plain_info, one_dim, rows_of, new_tensor,
 * the codes of its view), open with its fast_ready and end with its
 * fast_done or hand_back, then run the byte-level rounds of rounds.c.
 * all_reduce's entry, the hottest, stays in torch.c beside the descriptors
 * it reads inline.
 */
#include "tpcomm.h"

/* For the one-call paths of the torch-style collectives: big and small are
 * plain tensors of one dtype (*code) with big = world x small elements; their
 * addresses and small's element count.  -1 (no exception): not that case. */
static int flat_pair(Engine *e, PyObject *big, PyObject *small, int *code, char **abig,
                     char **asmall, long long *nsmall)
{
    int cb;
    long long nb;
    if (plain_info(e, big, &cb, abig, &nb) < 0 || plain_info(e, small, code, asmall, nsmall) < 0 ||
        cb != *code || nb != *nsmall * e->world)
        return -1;
    return 0;
}

/*
 * Every entry below answers True when it did the call, None when the call is
 * not its case (the general road runs, which checks and reports), or raises
 * (fast_done).  Each starts with fast_ready.
 *
 * fast_all_gather(output, input[, fn]): the torch-style
 * all_gather_into_tensor's common case in one call (plain tensors of one
 * dtype, output = world x input elements); errors name fn (default
 * all_gather_into_tensor).  The metadata is the general path's (its layout
 * key is keys.flat_key for this layout).
 */
PyObject *eng_fast_all_gather(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3 || !fast_ready(e))
        Py_RETURN_NONE;
    int ci;
    char *ai, *ao;
    long long ni;
    if (flat_pair(e, args[0], args[1], &ci, &ao, &ai, &ni) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    int st = flat_gather(e, KIND_ALL_GATHER, 0, ai, ci, ni, (size_t)ni * code_size(e, ci), ao);
    return fast_done(e, st, nargs == 3 ? args[2] : F_all_gather);
}

/*
 * gather's one-call case (dst a rank, as rank_arg gives it): input a plain
 * tensor; on dst, out a plain tensor of the same dtype with world x its
 * elements or, when out is NULL and made is not, one made here (new_tensor,
 * *made).  Py_True: done; None: not its case
 * (nothing touched); NULL: raised.  The key is keys.gather_key's for a flat,
 * even layout with a root: flat_key(KIND_GATHER + ((dst + 1) << 32), n, w).
 */
static PyObject *gather_plain(Engine *e, PyObject *input, PyObject *out, int dst, PyObject **made)
{
    int ci, co;
    char *ai, *ao = NULL;
    long long ni, no;
    if (plain_info(e, input, &ci, &ai, &ni) < 0 ||
        (dst == e->rank && (out ? plain_info(e, out, &co, &ao, &no) < 0 || co != ci || no != ni * e->world
                                : !made || !can_make(e)))) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (dst == e->rank && !out) {
        const long long total = ni * e->world;
        size_t nb;
        if (!(*made = new_tensor(e, ci, &total, 1, &ao, &nb)))
            return NULL;
    }
    int st = flat_gather(e, KIND_GATHER, (uint64_t)(dst + 1) << 32, ai, ci, ni,
                         (size_t)ni * code_size(e, ci), dst == e->rank ? ao : NULL);
    if (st != ST_OK && made)
        Py_CLEAR(*made);
    return fast_done(e, st, F_gather);
}

/*
 * fast_gather(input, out | None, dst): gather's common case in one call (a
 * plain 1-d input; on dst a plain out of the same dtype with world x its
 * elements; the caller checks the dims).  None: the general path.
 */
PyObject *eng_fast_gather(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    int dst = nargs == 3 && fast_ready(e) ? rank_arg(e, args[2]) : -1;
    if (dst < 0)
        Py_RETURN_NONE;
    return gather_plain(e, args[0], args[1] == Py_None ? NULL : args[1], dst, NULL);
}

/*
 * gather(tensor, dst=0, dim=0, *, out=None) -> out | a new tensor | None: the
 * whole Communicator method in one call (the Communicator makes this entry
 * its instance attribute, as whole_call's) for its common case: a plain 1-d
 * tensor, dst and dim exact ints (dim 0 or -1), out None or a plain 1-d
 * tensor; on dst the result is out, or a new tensor when out is None.  Any
 * other call (another dim or shape, a wrong argument, a closed engine) goes
 * to Python's gather (fallback[FB_GATHER]) with the same arguments, which
 * checks everything and raises what the method raises.
 */
PyObject *eng_whole_gather(Engine *e, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[4] = {"tensor", "dst", "dim", "out"};
    PyObject *a[4] = {NULL, NULL, NULL, NULL};
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    int ok = nargs <= 3;
    for (Py_ssize_t i = 0; ok && i < nargs; i++)
        a[i] = args[i];
    for (Py_ssize_t i = 0; ok && i < nkw; i++) {
        int j = 0;
        while (j < 4 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, i), names[j]))
            j++;
        ok = j < 4 && !a[j];
        if (ok)
            a[j] = args[nargs + i];
    }
    PyObject *out = a[3] == Py_None ? NULL : a[3];
    const int dst = ok && a[1] ? rank_arg(e, a[1]) : 0;
    long dim = 0;
    ok = ok && a[0] && dst >= 0 && (!a[2] || PyLong_CheckExact(a[2]));
    if (ok && a[2]) {
        dim = PyLong_AsLong(a[2]);
        if (PyErr_Occurred()) { /* too large for a long: not 0 or -1 */
            PyErr_Clear();
            dim = 1;
        }
    }
    ok = ok && (dim == 0 || dim == -1);
    if (ok && fast_ready(e) && one_dim(e, a[0]) && (!out || one_dim(e, out))) {
        PyObject *made = NULL, *r = gather_plain(e, a[0], out, dst, &made);
        if (!r) /* raised */
            return NULL;
        int done = r == Py_True; /* else None: not its case */
        Py_DECREF(r);
        if (done) {
            if (dst != e->rank)
                Py_RETURN_NONE;
            if (made)
                return made;
            Py_INCREF(out);
            return out;
        }
    }
    return hand_back(e, FB_GATHER, args, nargs, kwnames);
}

/*
 * fast_broadcast(t, src): Communicator.broadcast's common case in one call
 * (a plain tensor, an exact int src in range).  The metadata is the general path's (dtype code, element count, src).
 */
PyObject *eng_fast_broadcast(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    int src = nargs == 2 && fast_ready(e) ? rank_arg(e, args[1]) : -1;
    if (src < 0)
        Py_RETURN_NONE;
    int code;
    char *a;
    long long n;
    if (plain_info(e, args[0], &code, &a, &n) < 0)
        Py_RETURN_NONE;
    return fast_done(e,
                     broadcast_rounds(e, KIND_BROADCAST, a, (size_t)n * code_size(e, code),
                                      (int)src, (uint32_t)code, (uint64_t)n),
                     F_broadcast);
}

/*
 * fast_reduce_scatter(output, input, op): the torch-style
 * reduce_scatter_tensor's common case in one call (plain tensors of one
 * reducible dtype, input = world x output elements, a ReduceOp the engine
 * does, AVG on floats only).  The metadata is
 * the general path's (flat_key(RS_FLAT, n, w) for this layout).
 */
PyObject *eng_fast_reduce_scatter(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !fast_ready(e))
        Py_RETURN_NONE;
    int opc = op_code(e, args[2]), dtc, ci;
    char *ai, *ao;
    long long no;
    if (opc < 0 || flat_pair(e, args[1], args[0], &ci, &ai, &ao, &no) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    dtc = reduce_code(e, ci);
    if (dtc < 0 || (opc == OP_AVG && dtc >= DT_I32))
        Py_RETURN_NONE;
    size_t *sizes = even_sizes(e, (size_t)no);
    if (!sizes)
        return NULL;
    int st = reduce_scatter_rounds(e, KIND_REDUCE_SCATTER, ai, dtc, sizes, ao, opc,
                       flat_key(RS_FLAT, (uint64_t)no, (uint64_t)e->world), 1);
    PyMem_Free(sizes);
    return fast_done(e, st, F_reduce_scatter);
}

/*
 * The whole of a Communicator method in one call, as fast_all_reduce is
 * all_reduce's (the Communicator makes these entries its instance
 * attributes): a positional call of its case goes by the fast entry (which
 * answers True: args[0], the output, is returned); anything else (keywords,
 * another count, a tensor that is not plain, a closed engine) goes to
 * Python's general method fallback[which] with the same arguments, which
 * checks everything and raises what the method raises.  `fast` takes n
 * positional arguments; `dflt`, when not NULL, is the last one's default.
 */
static PyObject *whole_call(Engine *e, int which,
                            PyObject *(*fast)(Engine *, PyObject *const *, Py_ssize_t),
                            Py_ssize_t n, PyObject *dflt, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    if (!kwnames && (nargs == n || (dflt && nargs == n - 1))) {
        PyObject *full[3];
        for (Py_ssize_t i = 0; i < nargs; i++)
            full[i] = args[i];
        if (nargs < n)
            full[n - 1] = dflt;
        PyObject *r = fast(e, full, n);
        if (!r) /* raised */
            return NULL;
        int done = r == Py_True; /* else None: not its case */
        Py_DECREF(r);
        if (done) {
            Py_INCREF(args[0]);
            return args[0];
        }
    }
    return hand_back(e, which, args, nargs, kwnames);
}

/* all_gather_into_tensor(output, input) -> output (whole_call) */
PyObject *eng_whole_all_gather_into_tensor(Engine *e, PyObject *const *args, Py_ssize_t nargs,
                                           PyObject *kwnames)
{
    return whole_call(e, FB_ALL_GATHER_INTO_TENSOR, eng_fast_all_gather, 2, NULL, args, nargs,
                      kwnames);
}

/* reduce_scatter_tensor(output, input, op=SUM) -> output (whole_call) */
PyObject *eng_whole_reduce_scatter_tensor(Engine *e, PyObject *const *args, Py_ssize_t nargs,
                                          PyObject *kwnames)
{
    return whole_call(e, FB_REDUCE_SCATTER_TENSOR, eng_fast_reduce_scatter, 3, op_object(e, OP_SUM),
                      args, nargs, kwnames);
}

/*
 * fast_all_to_all(output, input, output_split_sizes, input_split_sizes):
 * all_to_all_single's common case in one call (plain tensors of one dtype
 * that share no memory; split sizes None, [] or lists of ints).  Without split
 * sizes the general path's even rounds (the block size in the metadata,
 * alltoall_even_rounds), else its split table and rounds (alltoall_splits_rounds):
 * ranks on either path meet the same rounds.
 */
PyObject *eng_fast_all_to_all(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !fast_ready(e))
        Py_RETURN_NONE;
    PyObject *outs, *ins;
    int co, ci;
    char *ao, *ai;
    long long n_out, n_in;
    uint64_t f[6]; /* rows in, rows out, row bytes in, out, dtype in, out (rounds.c's table) */
    if (alltoall_split_list(args[2], &outs) < 0 || alltoall_split_list(args[3], &ins) < 0 ||
        plain_info(e, args[0], &co, &ao, &n_out) < 0 ||
        plain_info(e, args[1], &ci, &ai, &n_in) < 0 || co != ci)
        goto general;
    size_t es = code_size(e, ci);
    if (rows_of(e, args[1], es, &f[0], &f[2]) < 0 || rows_of(e, args[0], es, &f[1], &f[3]) < 0)
        goto general;
    size_t bi = (size_t)n_in * es, bo = (size_t)n_out * es;
    if (bi && bo && ai < ao + bo && ao < ai + bi) /* overlapping: the general path copies */
        goto general;
    f[4] = f[5] = (uint64_t)ci;
    if (!ins && !outs) {
        const uint64_t w = (uint64_t)e->world;
        if (f[0] % w || f[1] != f[0] || f[3] != f[2]) /* the general path's ValueError */
            goto general;
        return fast_done(e,
                         alltoall_even_rounds(e, KIND_ALL_TO_ALL, ai, ao, (size_t)(f[0] / w * f[2]),
                                              (uint32_t)ci),
                         F_all_to_all);
    }
    return fast_done(e, alltoall_splits_rounds(e, KIND_ALL_TO_ALL, ai, ins, ao, outs, f),
                     F_all_to_all);
general:
    PyErr_Clear();
    Py_RETURN_NONE;
}
