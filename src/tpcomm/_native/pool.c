/*
 * Helper threads: a rank's large copies and reductions split across cores.
 */
#include "tpcomm.h"

/*
 * A rank with cores to spare (TPCOMM_THREADS, by default the CPUs it may use
 * divided by the ranks on the host) splits every copy and reduction of at
 * least `min` bytes (TPCOMM_THREADS_MIN_BYTES or a tuned profile, default
 * 256 KiB) into 64-element slices, one per thread, and a single-copy read of a
 * peer (par_read) into page-aligned slices.  The slices are elementwise, so
 * results are bitwise the same for any thread count, and the other ranks need
 * not use the same count.  Helpers wait on a private futex.
 */
struct pool {
    int nhelp;
    size_t min; /* bytes from which a job is split */
    pthread_t *th;
    _Atomic uint32_t gen; /* bumped for every job (futex word) */
    _Atomic uint32_t done;
    int stop;
    int kind; /* 0 copy (into a slot: nt), 1 reduce, 2 read from process pid
               * at address `from` */
    char *dst;
    const char *src;
    int nt; /* kind 0: non-temporal stores (copies into a slot) */
    pid_t pid;
    uint64_t from;
    int *errs; /* kind 2: each part's errno, 0 when it read its slice */
    void *const *srcs;
    int w, dtype, op;
    size_t n, es;
};

typedef struct {
    pool_t *pool;
    int index;
} helper_arg;

/* n bytes of process pid at `from` to dst, read whole (a short read goes on,
 * EINTR is retried): 0, or the errno that stopped it. */
static int read_range(pid_t pid, char *dst, uint64_t from, size_t n)
{
    for (size_t lo = 0; lo < n;) {
        struct iovec lv = {dst + lo, n - lo}, rv = {(void *)(uintptr_t)(from + lo), n - lo};
        ssize_t got = process_vm_readv(pid, &lv, 1, &rv, 1, 0);
        if (got > 0)
            lo += (size_t)got;
        else if (!(got < 0 && errno == EINTR))
            return got < 0 ? errno : EFAULT;
    }
    return 0;
}

static void job_slice(pool_t *P, int part, int parts)
{
    const size_t align = P->kind == 2 ? 4096 : 64; /* a read pins whole pages */
    size_t per = ((P->n + (size_t)parts - 1) / (size_t)parts + align - 1) & ~(align - 1);
    size_t lo = (size_t)part * per, hi = lo + per;
    if (lo >= P->n)
        return;
    if (hi > P->n)
        hi = P->n;
    if (P->kind == 0) {
        copy_slot(P->dst + lo, P->src + lo, hi - lo, P->nt);
        return;
    }
    if (P->kind == 2) {
        P->errs[part] = read_range(P->pid, P->dst + lo, P->from + lo, hi - lo);
        return;
    }
    void *s[P->w];
    for (int r = 0; r < P->w; r++)
        s[r] = (char *)P->srcs[r] + lo * P->es;
    do_reduce(P->dtype, P->op, P->dst + lo * P->es, s, P->w, hi - lo);
}

static void *helper_main(void *arg)
{
    helper_arg *a = arg;
    pool_t *P = a->pool;
    int index = a->index;
    free(a);
    uint32_t seen = 0;
    for (;;) {
        uint32_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&P->gen, memory_order_acquire)) == seen) {
            if (++spins < 4096) {
                cpu_relax();
            } else {
                struct timespec to = {0, 10000000};
                syscall(SYS_futex, (uint32_t *)&P->gen, FUTEX_WAIT_PRIVATE, seen, &to, NULL, 0);
            }
        }
        seen = g;
        if (P->stop)
            return NULL;
        job_slice(P, index, P->nhelp + 1);
        atomic_fetch_add_explicit(&P->done, 1, memory_order_release);
    }
}

static void pool_run(pool_t *P)
{
    atomic_store_explicit(&P->done, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&P->gen, 1, memory_order_release);
    syscall(SYS_futex, (uint32_t *)&P->gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    job_slice(P, 0, P->nhelp + 1);
    while (atomic_load_explicit(&P->done, memory_order_acquire) < (uint32_t)P->nhelp)
        cpu_relax();
}

void pool_free(pool_t *P)
{
    if (!P)
        return;
    P->stop = 1;
    atomic_fetch_add_explicit(&P->gen, 1, memory_order_release);
    syscall(SYS_futex, (uint32_t *)&P->gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    for (int i = 0; i < P->nhelp; i++)
        pthread_join(P->th[i], NULL);
    free(P->th);
    free(P->errs);
    free(P);
}

pool_t *pool_new(int nthreads, size_t min_bytes)
{
    pool_t *P = calloc(1, sizeof *P);
    if (!P)
        return NULL;
    P->min = min_bytes;
    P->th = calloc((size_t)nthreads, sizeof(pthread_t));
    P->errs = calloc((size_t)nthreads, sizeof(int));
    if (!P->th || !P->errs) {
        free(P->th);
        free(P->errs);
        free(P);
        return NULL;
    }
    for (int i = 0; i < nthreads - 1; i++) {
        helper_arg *a = malloc(sizeof *a);
        if (!a) {
            pool_free(P);
            return NULL;
        }
        a->pool = P;
        a->index = i + 1;
        if (pthread_create(&P->th[i], NULL, helper_main, a) != 0) {
            free(a);
            pool_free(P); /* joins the ones started */
            return NULL;
        }
        P->nhelp = i + 1;
    }
    return P;
}

/* n bytes into a slot (kernels.c copy_slot; nt: non-temporal stores) */
void par_copy(pool_t *P, char *dst, const char *src, size_t n, int nt)
{
    if (!P || n < P->min) {
        copy_slot(dst, src, n, nt);
        return;
    }
    P->kind = 0;
    P->nt = nt;
    P->dst = dst;
    P->src = src;
    P->n = n;
    pool_run(P);
}

/* n bytes out of a slot or a peer's buffer into the caller's memory: plain
 * stores (the caller reads them next) */
void par_copy_out(pool_t *P, char *dst, const char *src, size_t n) { par_copy(P, dst, src, n, 0); }

void par_reduce(pool_t *P, int dtype, int op, void *dst, void *const *srcs, int w,
                       size_t n)
{
    if (!P || n * dt_size[dtype] < P->min) {
        do_reduce(dtype, op, dst, srcs, w, n);
        return;
    }
    P->kind = 1;
    P->dst = dst;
    P->srcs = srcs;
    P->w = w;
    P->dtype = dtype;
    P->op = op;
    P->es = dt_size[dtype];
    P->n = n;
    pool_run(P);
}

/* n bytes from process pid at `from` to dst, split between the threads from
 * `min` bytes: 0, or the errno of a slice that failed (the caller names it:
 * cma.c cma_failed).  The caller checked the peer is alive. */
int par_read(pool_t *P, pid_t pid, char *dst, uint64_t from, size_t n)
{
    if (!P || n < P->min)
        return read_range(pid, dst, from, n);
    memset(P->errs, 0, (size_t)(P->nhelp + 1) * sizeof(int));
    P->kind = 2;
    P->dst = dst;
    P->pid = pid;
    P->from = from;
    P->n = n;
    pool_run(P);
    for (int i = 0; i <= P->nhelp; i++)
        if (P->errs[i])
            return P->errs[i];
    return 0;
}

/* whether a job of n bytes is split between threads */
int pool_splits(const pool_t *P, size_t n) { return P && n >= P->min; }

/* threads working on a job: the helpers and the caller */
int pool_threads(const pool_t *P) { return P ? P->nhelp + 1 : 1; }
