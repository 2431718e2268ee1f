/*
 * oneshot: where the time of a small one-shot all-reduce goes, and what the
 * protocol choices of the shared-memory libraries change there.
 *
 * Two threads pinned to CPUs 0 and 1 play two ranks: each call, a rank copies
 * its float32 tensor into its slot (parity i & 1, as tpcomm's rounds), says
 * so, waits until the peer did, and sums both slots into its tensor in rank
 * order (its own part read from the tensor).  Timed per phase with the time
 * stamp counter: the copy, the flag (publish + wait), the reduce.  Variants,
 * run in turns (the order turning every round, medians over the rounds):
 *   stores:  plain (memcpy), nt (non-temporal stores into the slot, as vLLM's
 *            memcpy_to_shm)
 *   flags:   pull (a rank writes its own line, the peer polls it: tpcomm),
 *            push (a rank writes into the peer's line, polls its own: vLLM's
 *            set_thread_stat / wait_for_all)
 *   loads:   plain, stream (MOVNTDQA for the peer's slot, as vLLM's "stream
 *            load from shm"; a plain load on write-back memory on most CPUs)
 * Prints per variant and size the time of a call (slower rank) and its three
 * phases, in ns.  AVX2 (every x86 tpcomm runs on); elsewhere it says so.
 *
 * usage: oneshot [ROUNDS] [ITERS]
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#include <x86intrin.h>

#define MAXB (64u << 10)
enum { STORES_NT = 1, FLAGS_PUSH = 2, LOADS_STREAM = 4, VARIANTS = 8 };
static const size_t SIZES[] = {1024, 4096, 16384, 65536};
#define NSIZES (sizeof SIZES / sizeof SIZES[0])

struct line {
    _Alignas(64) _Atomic long v;
    char pad[56];
};
static struct line flag[2]; /* pull: rank r's own; push: written by the peer */
static float *slot[2][2];   /* [rank][parity] */
static float *tensor[2];
static pthread_barrier_t start;
static long iters;
static int variant;
static size_t nbytes;
static long round_no; /* the calls so far: flags only grow */
static double ns_per_tick;
static uint64_t phase[2][3]; /* per rank: copy, flag, reduce ticks */

static void pin(int cpu)
{
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof s, &s);
}

__attribute__((target("avx2"))) static void copy_nt(float *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i += 8)
        _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
    _mm_sfence();
}

/* t = first + second in rank order, `peer` loaded plainly or streamed */
__attribute__((target("avx2"))) static void reduce(float *t, const float *peer, int me, size_t n,
                                                     int stream)
{
    for (size_t i = 0; i < n; i += 8) {
        __m256 mine = _mm256_loadu_ps(t + i);
        __m256 other = stream ? _mm256_castsi256_ps(_mm256_stream_load_si256((const void *)(peer + i)))
                              : _mm256_load_ps(peer + i);
        _mm256_storeu_ps(t + i, me == 0 ? _mm256_add_ps(mine, other) : _mm256_add_ps(other, mine));
    }
}

static void *rank_main(void *arg)
{
    const int me = (int)(intptr_t)arg, peer = 1 - me;
    pin(me);
    const size_t n = nbytes / sizeof(float);
    pthread_barrier_wait(&start);
    uint64_t acc[3] = {0, 0, 0};
    for (long k = 1; k <= iters; k++) {
        const long call = round_no + k;
        const int p = (int)(call & 1);
        uint64_t t0 = __rdtsc();
        if (variant & STORES_NT)
            copy_nt(slot[me][p], tensor[me], n);
        else
            memcpy(slot[me][p], tensor[me], nbytes);
        uint64_t t1 = __rdtsc();
        if (variant & FLAGS_PUSH) { /* into the peer's line; wait on this rank's own */
            atomic_store_explicit(&flag[peer].v, call, memory_order_release);
            while (atomic_load_explicit(&flag[me].v, memory_order_acquire) < call)
                _mm_pause();
        } else {
            atomic_store_explicit(&flag[me].v, call, memory_order_release);
            while (atomic_load_explicit(&flag[peer].v, memory_order_acquire) < call)
                _mm_pause();
        }
        uint64_t t2 = __rdtsc();
        reduce(tensor[me], slot[peer][p], me, n, variant & LOADS_STREAM);
        uint64_t t3 = __rdtsc();
        acc[0] += t1 - t0;
        acc[1] += t2 - t1;
        acc[2] += t3 - t2;
    }
    memcpy(phase[me], acc, sizeof acc);
    return NULL;
}

/* One block: iters calls of this variant and size; per rank's phases in ns per call */
static void block(int v, size_t bytes, double out[2][3])
{
    variant = v;
    nbytes = bytes;
    pthread_t th[2];
    pthread_barrier_init(&start, NULL, 2);
    for (int r = 0; r < 2; r++)
        pthread_create(&th[r], NULL, rank_main, (void *)(intptr_t)r);
    for (int r = 0; r < 2; r++)
        pthread_join(th[r], NULL);
    pthread_barrier_destroy(&start);
    round_no += iters;
    /* the flags are left set past this block: the next one starts above them */
    for (int r = 0; r < 2; r++)
        for (int k = 0; k < 3; k++)
            out[r][k] = (double)phase[r][k] * ns_per_tick / (double)iters;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static double calibrate(void)
{
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    uint64_t t0 = __rdtsc();
    do
        clock_gettime(CLOCK_MONOTONIC, &b);
    while ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec) < 2e8);
    uint64_t t1 = __rdtsc();
    return ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / (double)(t1 - t0);
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 7;
    iters = argc > 2 ? atol(argv[2]) : 20000;
    if (rounds < 1 || iters < 1) {
        fprintf(stderr, "usage: oneshot [ROUNDS >= 1] [ITERS >= 1]\n");
        return 2;
    }
    if (!__builtin_cpu_supports("avx2")) {
        printf("# oneshot: this CPU has no AVX2: nothing measured\n");
        return 0;
    }
    for (int r = 0; r < 2; r++) {
        tensor[r] = aligned_alloc(4096, MAXB);
        for (int p = 0; p < 2; p++)
            slot[r][p] = aligned_alloc(4096, MAXB);
        if (!tensor[r] || !slot[r][0] || !slot[r][1])
            return 1;
        for (size_t i = 0; i < MAXB / sizeof(float); i++)
            tensor[r][i] = 0.0f; /* sums of zeros: no overflow, no denormals */
        memset(slot[r][0], 0, MAXB);
        memset(slot[r][1], 0, MAXB);
    }
    ns_per_tick = calibrate();
    static double total[NSIZES][VARIANTS][64], part[NSIZES][VARIANTS][3][64];
    if (rounds > 64)
        rounds = 64;
    for (int k = 0; k < rounds; k++)
        for (size_t s = 0; s < NSIZES; s++)
            for (int j = 0; j < VARIANTS; j++) {
                int v = (j + k) % VARIANTS; /* the order turns every round */
                double ph[2][3];
                block(v, SIZES[s], ph);
                double t[2] = {ph[0][0] + ph[0][1] + ph[0][2], ph[1][0] + ph[1][1] + ph[1][2]};
                total[s][v][k] = t[0] > t[1] ? t[0] : t[1];
                for (int q = 0; q < 3; q++) /* the phases of the rank that took longer */
                    part[s][v][q][k] = ph[t[0] > t[1] ? 0 : 1][q];
            }
    printf("# one-shot all-reduce of float32, 2 threads pinned to CPUs 0 and 1, %ld calls a "
           "block, median of %d rounds; ns per call and its phases (the slower rank)\n",
           iters, rounds);
    printf("# %8s  %-6s %-5s %-7s %9s %9s %9s %9s\n", "bytes", "stores", "flags", "loads", "call",
           "copy", "flag", "reduce");
    for (size_t s = 0; s < NSIZES; s++)
        for (int v = 0; v < VARIANTS; v++) {
            double m[3];
            for (int q = 0; q < 3; q++)
                m[q] = median(part[s][v][q], rounds);
            printf("  %8zu  %-6s %-5s %-7s %9.0f %9.0f %9.0f %9.0f\n", SIZES[s],
                   v & STORES_NT ? "nt" : "plain", v & FLAGS_PUSH ? "push" : "pull",
                   v & LOADS_STREAM ? "stream" : "plain", median(total[s][v], rounds), m[0], m[1],
                   m[2]);
        }
    return 0;
}
#else
int main(void)
{
    printf("# oneshot: x86-64 only: nothing measured\n");
    return 0;
}
#endif
