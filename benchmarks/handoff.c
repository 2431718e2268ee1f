/*
 * handoff: the physical bound of any shared-memory collective on this machine.
 *
 * Two threads pinned to CPUs 0 and 1 hand a buffer back and forth the way a
 * one-shot all-reduce does: the producer copies N bytes into a shared buffer
 * (which the consumer read in the previous round, so every line needs a
 * read-for-ownership), releases a flag; the consumer acquires it and reads the
 * N bytes from the other core's cache.  Prints the time of one round and its
 * two halves.  `make bench` runs it next to `tpcomm perf`.  BYTES 0 times the
 * flags alone: one cache-line round trip between the two cores.
 *
 * The producer's copy is timed both ways, in turns: plain stores (which must
 * take every line back from the consumer's cache first) and non-temporal ones
 * (which send the lines to memory, where the consumer then reads them).
 * Which costs less changes with the machine's state (docs/DECISIONS.md,
 * "Stores chosen as it runs"), and a library may use either, so the line
 * printed is the faster way's, named in its last column.
 *
 * usage: handoff BYTES [ITERS]
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static size_t nbytes;
static long iters;
static char *shared_buf, *src;
static _Alignas(64) _Atomic long produced;
static _Alignas(64) _Atomic long consumed;
static volatile unsigned long long sink;
static long done_rounds;  /* rounds of earlier passes: the flags only grow */
static long total_rounds; /* of every pass: the consumer's, one thread for all */

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void pin(int cpu)
{
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof s, &s);
}

static void *consumer(void *arg)
{
    (void)arg;
    pin(1);
    for (long i = 1; i <= total_rounds; i++) {
        while (atomic_load_explicit(&produced, memory_order_acquire) < i)
            _mm_pause();
        unsigned long long acc = 0; /* integer sum: vectorised, never the bottleneck */
        const unsigned long long *p = (const unsigned long long *)shared_buf;
        for (size_t k = 0; k < nbytes / 8; k++)
            acc += p[k];
        sink = acc;
        atomic_store_explicit(&consumed, i, memory_order_release);
    }
    return NULL;
}

/* n bytes to dst (32-byte aligned) with non-temporal stores, then a fence */
__attribute__((target("avx2"))) static void copy_nt(char *dst, const char *from, size_t n)
{
    size_t k = 0;
    for (; k + 32 <= n; k += 32)
        _mm256_stream_si256((__m256i *)(dst + k), _mm256_loadu_si256((const __m256i *)(from + k)));
    memcpy(dst + k, from + k, n - k);
    _mm_sfence();
}

/* one pass of iters rounds, the producer's stores plain or non-temporal:
 * seconds per round, and of its copy in *copy */
static double pass(int nt, double *copy)
{
    double spent = 0, t0 = now();
    for (long i = done_rounds + 1; i <= done_rounds + iters; i++) {
        if (nbytes) { /* (the clock reads would double the flags-only round) */
            double c0 = now();
            if (nt)
                copy_nt(shared_buf, src, nbytes);
            else
                memcpy(shared_buf, src, nbytes);
            spent += now() - c0;
        }
        atomic_store_explicit(&produced, i, memory_order_release);
        while (atomic_load_explicit(&consumed, memory_order_acquire) < i)
            _mm_pause();
    }
    double round = (now() - t0) / (double)iters;
    done_rounds += iters;
    *copy = spent / (double)iters;
    return round;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s BYTES [ITERS]\n", argv[0]);
        return 2;
    }
    nbytes = strtoull(argv[1], NULL, 10);
    iters = argc > 2 ? atol(argv[2]) : 300;
    size_t room = nbytes ? (nbytes + 4095) / 4096 * 4096 : 4096;
    shared_buf = aligned_alloc(4096, room);
    src = aligned_alloc(4096, room);
    if (!shared_buf || !src) {
        fprintf(stderr, "%s: cannot allocate %zu bytes\n", argv[0], room);
        return 1;
    }
    memset(shared_buf, 0, room);
    memset(src, 0, room);
    pin(0);
    total_rounds = nbytes ? 6 * iters : iters;
    pthread_t t;
    pthread_create(&t, NULL, consumer, NULL);
    double copy;
    if (!nbytes) {
        double round = pass(0, &copy);
        pthread_join(t, NULL);
        printf("%10zu  %9.3f  (the flags alone: one cache-line round trip)\n", nbytes, round * 1e6);
        return 0;
    }
    /* both ways in turns, 3 passes each: the faster way's median pass */
    double rounds[2][3], copies[2][3];
    for (int k = 0; k < 3; k++)
        for (int nt = 0; nt < 2; nt++) {
            int way = k & 1 ? 1 - nt : nt;
            rounds[way][k] = pass(way, &copies[way][k]);
        }
    pthread_join(t, NULL);
    double med[2], medc[2];
    for (int w = 0; w < 2; w++) { /* the median of three */
        double *r = rounds[w];
        int m = (r[0] <= r[1]) == (r[1] <= r[2]) ? 1 : (r[1] <= r[0]) == (r[0] <= r[2]) ? 0 : 2;
        med[w] = r[m];
        medc[w] = copies[w][m];
    }
    int best = med[1] < med[0];
    double round = med[best], c = medc[best];
    printf("%10zu  %9.2f  %9.2f  %9.2f  %6.1f  %s\n", nbytes, round * 1e6, c * 1e6,
           (round - c) * 1e6, (double)nbytes / (round - c) / 1e9, best ? "nt" : "plain");
    return 0;
}
