/*
 * Helper threads: a rank's large copies and reductions split across cores.
 */
#include "tpcomm.h"

/*
 * A rank with cores to spare (TPCOMM_THREADS, by default the CPUs it may use
 * divided by the ranks on the host) splits every copy and reduction of at
 * least PAR_MIN bytes into 64-element slices, one per thread.  The slices are
 * elementwise, so results are bitwise the same for any thread count, and the
 * other ranks need not use the same count.  Helpers wait on a private futex.
 */
#define PAR_MIN (256u * 1024u)

struct pool {
    int nhelp;
    pthread_t *th;
    _Atomic uint32_t gen; /* bumped for every job (futex word) */
    _Atomic uint32_t done;
    int stop;
    int kind; /* 0 copy, 1 reduce */
    char *dst;
    const char *src;
    void *const *srcs;
    int w, dtype, op;
    size_t n, es;
};

typedef struct {
    pool_t *pool;
    int index;
} helper_arg;

static void job_slice(pool_t *P, int part, int parts)
{
    size_t per = ((P->n + (size_t)parts - 1) / (size_t)parts + 63) & ~(size_t)63;
    size_t lo = (size_t)part * per, hi = lo + per;
    if (lo >= P->n)
        return;
    if (hi > P->n)
        hi = P->n;
    if (P->kind == 0) {
        copy_in(P->dst + lo, P->src + lo, hi - lo);
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
    free(P);
}

pool_t *pool_new(int nthreads)
{
    pool_t *P = calloc(1, sizeof *P);
    if (!P)
        return NULL;
    P->th = calloc((size_t)nthreads, sizeof(pthread_t));
    if (!P->th) {
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

void par_copy(pool_t *P, char *dst, const char *src, size_t n)
{
    if (!P || n < PAR_MIN) {
        copy_in(dst, src, n);
        return;
    }
    P->kind = 0;
    P->dst = dst;
    P->src = src;
    P->n = n;
    pool_run(P);
}

void par_reduce(pool_t *P, int dtype, int op, void *dst, void *const *srcs, int w,
                       size_t n)
{
    if (!P || n * dt_size[dtype] < PAR_MIN) {
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

/* threads working on a job: the helpers and the caller */
int pool_threads(const pool_t *P) { return P ? P->nhelp + 1 : 1; }
