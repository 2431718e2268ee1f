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
    for (long i = 1; i <= iters; i++) {
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

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s BYTES [ITERS]\n", argv[0]);
        return 2;
    }
    nbytes = strtoull(argv[1], NULL, 10);
    iters = argc > 2 ? atol(argv[2]) : 300;
    size_t room = (nbytes + 4095) / 4096 * 4096;
    shared_buf = aligned_alloc(4096, room ? room : 4096);
    src = aligned_alloc(4096, room ? room : 4096);
    memset(shared_buf, 0, nbytes);
    memset(src, 0, nbytes);
    pthread_t t;
    pthread_create(&t, NULL, consumer, NULL);
    pin(0);
    double copy = 0, t0 = now();
    for (long i = 1; i <= iters; i++) {
        if (nbytes) { /* (the clock reads would double the flags-only round) */
            double c0 = now();
            memcpy(shared_buf, src, nbytes);
            copy += now() - c0;
        }
        atomic_store_explicit(&produced, i, memory_order_release);
        while (atomic_load_explicit(&consumed, memory_order_acquire) < i)
            _mm_pause();
    }
    double round = (now() - t0) / (double)iters;
    copy /= (double)iters;
    pthread_join(t, NULL);
    if (!nbytes) {
        printf("%10zu  %9.3f  (the flags alone: one cache-line round trip)\n", nbytes, round * 1e6);
        return 0;
    }
    printf("%10zu  %9.2f  %9.2f  %9.2f  %6.1f\n", nbytes, round * 1e6, copy * 1e6,
           (round - copy) * 1e6, (double)nbytes / (round - copy) / 1e9);
    return 0;
}
