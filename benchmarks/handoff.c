/*
 * handoff: the physical bound of any shared-memory collective on this machine.
 *
 * Two threads pinned to CPUs 0 and 1 hand a buffer back and forth the way a
 * one-shot all-reduce does: the producer copies N bytes into a shared buffer,
 * releases a flag; the consumer acquires it and reads the N bytes from the
 * other core's cache.  Where tpcomm's rounds move in its slots (from 8 KiB,
 * _native/tpcomm.h slot_pos), the buffer is a place that moves the same way
 * through 1 MiB, so its lines were last read long ago; below, one place,
 * which the consumer read in the previous round (every line then needs a
 * read-for-ownership answered by the other core).  Prints the time of one round and its
 * two halves.  `make bench` runs it next to `tpcomm perf`.  BYTES 0 times the
 * flags alone: one cache-line round trip between the two cores.
 *
 * The producer's copy is timed both ways, in turns: plain stores (which must
 * take every line back from the consumer's cache first) and non-temporal ones
 * (which send the lines to memory, where the consumer then reads them).
 * Which costs less changes with the machine's state (docs/DECISIONS.md,
 * "Stores chosen as it runs"), and a library may use either, so the line
 * printed is the faster way's, named in its column.
 *
 * `both`: the exchange of a one-shot all-reduce at two ranks, without its
 * arithmetic.  Each core copies its N bytes into a buffer of its own (one of
 * two, by the round's parity, as tpcomm's slots), releases its flag, waits
 * for the other's and reads the other's N bytes: both directions at once.
 * The round is core 0's; the line ends in "both".  Whatever the two
 * directions share (the fabric between the cores, memory where the stores
 * are non-temporal) is paid twice here and once in the one-way round.
 *
 * usage: handoff BYTES [ITERS] [both]
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
static size_t span = 0, places = 1; /* the moving place: span bytes, one of `places` */
#define RING_BYTES (1u << 20)        /* tpcomm's slot */
#define MOVE_MIN 8192u               /* tpcomm's SLOT_MOVE_MIN */

/* the place of round i (both: of the i-th use of its parity) */
static size_t place(long i) { return (size_t)((unsigned long)i % places) * span; }
static _Alignas(64) _Atomic long produced;
static _Alignas(64) _Atomic long consumed;
static volatile unsigned long long sink;
static long done_rounds;  /* rounds of earlier passes: the flags only grow */
static long total_rounds; /* of every pass: the consumer's, one thread for all */

/* both: each core's source and its two buffers, its flag, the passes' stores */
static char *own_src[2], *own_buf[2][2];
static struct {
    _Alignas(64) _Atomic long v;
} flag[2];
static pthread_barrier_t pass_start;
static int pass_nt[6];

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

/* read n bytes: an integer sum, vectorised, never the bottleneck */
static void read_all(const char *buf, size_t n)
{
    unsigned long long acc = 0;
    const unsigned long long *p = (const unsigned long long *)buf;
    for (size_t k = 0; k < n / 8; k++)
        acc += p[k];
    sink = acc;
}

static void *consumer(void *arg)
{
    (void)arg;
    pin(1);
    for (long i = 1; i <= total_rounds; i++) {
        while (atomic_load_explicit(&produced, memory_order_acquire) < i)
            _mm_pause();
        read_all(shared_buf + place(i), nbytes);
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

/* n bytes from `from` to dst, plain or non-temporal stores */
static void copy_in(char *dst, const char *from, size_t n, int nt)
{
    if (nt)
        copy_nt(dst, from, n);
    else
        memcpy(dst, from, n);
}

/* both: core `me`'s pass number k of iters rounds (the two start together);
 * seconds per round, and of its copy in *copy */
static double exchange_pass(int me, int k, double *copy)
{
    const long first = (long)k * iters + 1;
    double spent = 0;
    pthread_barrier_wait(&pass_start);
    double t0 = now();
    for (long i = first; i < first + iters; i++) {
        char *mine = own_buf[me][i & 1] + place(i >> 1);
        double c0 = now();
        copy_in(mine, own_src[me], nbytes, pass_nt[k]);
        spent += now() - c0;
        atomic_store_explicit(&flag[me].v, i, memory_order_release);
        while (atomic_load_explicit(&flag[1 - me].v, memory_order_acquire) < i)
            _mm_pause();
        read_all(own_buf[1 - me][i & 1] + place(i >> 1), nbytes);
    }
    *copy = spent / (double)iters;
    return (now() - t0) / (double)iters;
}

static void *exchange_peer(void *arg)
{
    (void)arg;
    pin(1);
    double copy;
    for (int k = 0; k < 6; k++)
        exchange_pass(1, k, &copy);
    return NULL;
}

/* one pass of iters rounds, the producer's stores plain or non-temporal:
 * seconds per round, and of its copy in *copy */
static double pass(int nt, double *copy)
{
    double spent = 0, t0 = now();
    for (long i = done_rounds + 1; i <= done_rounds + iters; i++) {
        if (nbytes) { /* (the clock reads would double the flags-only round) */
            double c0 = now();
            copy_in(shared_buf + place(i), src, nbytes, nt);
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

/* the median of three */
static int median3(const double *r)
{
    return (r[0] <= r[1]) == (r[1] <= r[2]) ? 1 : (r[1] <= r[0]) == (r[0] <= r[2]) ? 0 : 2;
}

/* both ways in turns, 3 passes each (pass k's stores: nt_of(k)), the faster
 * way's median pass: its line */
static int nt_of(int k) { return k & 2 ? 1 - (k & 1) : k & 1; }

static void report(double rounds[2][3], double copies[2][3], const char *tail)
{
    double med[2], medc[2];
    for (int w = 0; w < 2; w++) {
        int m = median3(rounds[w]);
        med[w] = rounds[w][m];
        medc[w] = copies[w][m];
    }
    int best = med[1] < med[0];
    double round = med[best], c = medc[best];
    printf("%10zu  %9.2f  %9.2f  %9.2f  %6.1f  %s%s\n", nbytes, round * 1e6, c * 1e6,
           (round - c) * 1e6, (double)nbytes / (round - c) / 1e9, best ? "nt" : "plain", tail);
}

static char *pages(size_t room)
{
    char *p = aligned_alloc(4096, room);
    if (p)
        memset(p, 0, room);
    return p;
}

int main(int argc, char **argv)
{
    const int both = argc > 3 && strcmp(argv[3], "both") == 0;
    if (argc < 2 || (argc > 3 && !both)) {
        fprintf(stderr, "usage: %s BYTES [ITERS] [both]\n", argv[0]);
        return 2;
    }
    nbytes = strtoull(argv[1], NULL, 10);
    iters = argc > 2 ? atol(argv[2]) : 300;
    size_t room = nbytes ? (nbytes + 4095) / 4096 * 4096 : 4096;
    span = room;
    if (nbytes >= MOVE_MIN && room <= RING_BYTES / 2)
        places = RING_BYTES / room;
    shared_buf = pages(room * places);
    src = pages(room);
    for (int r = 0; both && r < 2; r++) {
        own_src[r] = pages(room);
        own_buf[r][0] = pages(room * places);
        own_buf[r][1] = pages(room * places);
        if (!own_src[r] || !own_buf[r][0] || !own_buf[r][1])
            shared_buf = NULL;
    }
    if (!shared_buf || !src) {
        fprintf(stderr, "%s: cannot allocate %zu bytes\n", argv[0], room);
        return 1;
    }
    if (both && !nbytes) {
        fprintf(stderr, "%s: both needs BYTES > 0\n", argv[0]);
        return 2;
    }
    pin(0);
    double rounds[2][3], copies[2][3];
    pthread_t t;
    if (both) {
        for (int k = 0; k < 6; k++)
            pass_nt[k] = nt_of(k);
        pthread_barrier_init(&pass_start, NULL, 2);
        pthread_create(&t, NULL, exchange_peer, NULL);
        for (int k = 0; k < 6; k++)
            rounds[pass_nt[k]][k / 2] = exchange_pass(0, k, &copies[pass_nt[k]][k / 2]);
        pthread_join(t, NULL);
        report(rounds, copies, "  both");
        return 0;
    }
    total_rounds = nbytes ? 6 * iters : iters;
    pthread_create(&t, NULL, consumer, NULL);
    double copy;
    if (!nbytes) {
        double round = pass(0, &copy);
        pthread_join(t, NULL);
        printf("%10zu  %9.3f  (the flags alone: one cache-line round trip)\n", nbytes, round * 1e6);
        return 0;
    }
    for (int k = 0; k < 6; k++)
        rounds[nt_of(k)][k / 2] = pass(nt_of(k), &copies[nt_of(k)][k / 2]);
    pthread_join(t, NULL);
    report(rounds, copies, "");
    return 0;
}
