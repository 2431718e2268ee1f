/*
 * tpcomm._native: the private C core of tpcomm's shared-memory engine.
 *
 * This header is the core's one shared vocabulary: the segment layout and
 * its structs, the codes Python sees (status, dtype, op, collective kind:
 * exported by module.c, owned here), the Engine object, and the functions
 * one file of the core offers another.  One file per concern (docs/ENGINE.md
 * has the map):
 *
 *   kernels.h         the kernels' interface (plain C: they compile and test alone)
 *   kernels.c         portable reduce kernels, the choice of variant, copy-in
 *   kernels_avx2.c    the AVX2 + F16C float-family kernels
 *   kernels_avx512.c  the AVX-512 float-family kernels
 *   kernels_neon.c    the aarch64 NEON float-family kernels
 *   pool.c            a rank's helper threads for large copies and reductions
 *   wait.c            waits, futexes, liveness, aborts, the collective round
 *   allreduce.c       one-shot and two-shot all-reduce, their stores; the plan
 *   zerocopy.c        zero-copy all-reduce; zero copy or the copies, as it runs
 *   rounds.c          gather / broadcast / reduce-scatter / all-to-all rounds
 *   blocks.c          blocked layouts: the copies along a dim other than 0
 *   cma.c             single-copy reads of a peer's memory (process_vm_readv)
 *   p2p.c             point-to-point channels: send, receive head and body
 *   p2p_batch.c       point-to-point operations progressed together
 *   torch.c           the only C that knows torch: all_reduce's one-call
 *                     entry, and the view of tensors the other entries use
 *   coll_tensors.c    the other collectives' one-call entries
 *   p2p_tensors.c     the point-to-point one-call entries
 *   engine.c          the Engine object: life cycle, entering calls, methods
 *   module.c          the module: its functions, constants and init
 *
 * Segment layout, version 8 (offsets from the mapping's base; seg_size()):
 *
 *   +--------------------------+ 0
 *   | header (4 KiB)           |  magic, version, world, slot_bytes, sizes,
 *   |                          |  attach counter, sleeper count, abort word,
 *   |                          |  rank 0's choice of stores, where rounds
 *   |                          |  start to move in the slots (slot_pos)
 *   +--------------------------+ ctrl_off = 4096
 *   | rank 0 control           |  page-rounded (3 + 2W) lines: line 0 pid
 *   | rank 1 control           |  (and where its check word is, cma.c);
 *   | ...                      |  line 1 + 2c + p: channel c parity p
 *   |                          |  {seq, kind, dtype, op, count, arg, addr};
 *   |                          |  P2P_SENT_LINE(d), P2P_DONE_LINE(w, s)
 *   +--------------------------+ slot_off
 *   | rank 0 slot parity 0     |  slot_bytes each, 4 KiB aligned
 *   | rank 0 slot parity 1     |
 *   | rank 1 slot parity 0 ... |
 *   +--------------------------+ p2p_off
 *   | pair (s, d): P2P_RING    |  2 x p2p_bytes per ordered pair s != d, cut
 *   | pieces                   |  into P2P_RING pieces (a ring of chunks)
 *   | ...                      |
 *   +--------------------------+ total
 *
 * Protocol of the collective channel (one-shot all-reduce, barrier):
 *   Every rank keeps a private round counter n (the same on every rank,
 *   because collectives are called in the same order).  Round n uses parity
 *   p = n & 1.  A rank
 *     1. copies its chunk into its slot p (from 8 KiB at an offset that
 *        moves with n: slot_pos),
 *     2. writes the call's metadata into its line p, then stores seq = n with
 *        release semantics (the publish),
 *     3. waits until every peer's line p has seq >= n (acquire),
 *     4. compares the peers' metadata with its own (mismatch -> error on all),
 *     5. reduces all slots p in rank order 0..W-1 into its own tensor.
 *   Slot p of round n is rewritten in round n+2.  A rank reaches round n+2
 *   only after it saw every peer publish round n+1, and a peer publishes n+1
 *   only after it finished reading round n.  So one wait per round suffices.
 *
 * Flag states: seq of line p only ever holds values n with n & 1 == p, and it
 * only grows.  A waiter that sleeps bumps hdr->sleepers first; a publisher
 * that sees sleepers != 0 after its release store futex-wakes its line.
 *
 * Liveness: each rank holds an OFD write lock on byte `rank` of the segment
 * file (its own open file description).  The kernel drops it when the holder
 * exits, however it exits (SIGKILL included, zombies included).  A waiter
 * checks a peer with F_OFD_GETLK every few milliseconds once it stops
 * spinning.  A rank that finds a dead peer, or times out, stores an abort word
 * in the header so that every other rank leaves its wait too.
 */
#ifndef TPCOMM_NATIVE_H
#define TPCOMM_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>

#include "kernels.h"

#if defined(__x86_64__)
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() ((void)0)
#endif

#define MAGIC 0x314d4d4f43505454ULL /* "TTPCOMM1" little endian */
#define VERSION 8u
#define PAGE 4096u
#define LINE 64u
#define NCHAN 1          /* channels per rank: 0 = collectives */
#define MAX_WORLD 4096   /* OFD lock bytes and futex fan-out stay cheap up to here */
#define MAX_SYM 64       /* live symmetric buffers per communicator (Communicator.empty) */
#define P2P_BINARY 0xB1  /* first byte of a binary message header (p2p.c header_*) */
#define P2P_MAX_TENSORS 255
#define P2P_MAX_DIMS 8
#define P2P_RING 64    /* chunks in flight per point-to-point channel (pipelining) */
#define ARG_ZERO_COPY 3  /* all-reduce metadata arg: 1 one-shot, 2 two-shot, 3 + ... zero-copy (ar_plan) */
#define ARG_SINGLE_COPY 4 /* all-reduce metadata arg: single copy (cma.c cma_all_reduce) */
#define RS_FLAT 0x5253   /* flat_key's kind for reduce_scatter layouts (rounds.c) */
#define CMA_MIN_BLOCK 4096u /* smaller blocks of a row layout: the copy path (cma.c) */
/* per-rank control block: pid line, 2 lines per channel, then one "sent to d"
 * and one "consumed from s" line per peer (point-to-point), page rounded */
#define P2P_SENT_LINE(d) (1 + 2 * NCHAN + (d))
#define P2P_DONE_LINE(w, s) (1 + 2 * NCHAN + (w) + (s))
/* below this many bytes, an operation is shorter than a GIL round trip */
#define GIL_RELEASE_BYTES (256u * 1024u)

/* status codes returned to Python (shm/engine.py turns them into exceptions) */
enum { ST_OK = 0, ST_TIMEOUT = 1, ST_PEER_DEAD = 2, ST_MISMATCH = 3, ST_ABORTED = 4,
       ST_INTERRUPTED = 5, ST_CROSSED = 6, ST_BUSY = 7, ST_CLOSED = 8,
       ST_CMA = 9, ST_PROTO = 10, ST_SPLITS = 11 };


/* Collective kinds, published with every round so that ranks calling
 * different collectives are told so instead of corrupting each other. */
enum { KIND_ALL_REDUCE = 1, KIND_BARRIER = 2, KIND_ALL_GATHER = 3, KIND_REDUCE_SCATTER = 4,
       KIND_BROADCAST = 5, KIND_GATHER = 6, KIND_EMPTY = 7, KIND_ALL_TO_ALL = 8,
       KIND_DUP = 9, KIND_REFUSED = 10 /* a rank's own checks refused its arguments */,
       KIND_LAST = KIND_REFUSED };
#define YIELD_LOST_NS 200000ull /* a yield that took this long lost the core (wait.c) */
#define REC_BUCKETS 16 /* the record's lateness histogram: < 1 us ... >= 16 ms */

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t world;
    uint64_t slot_bytes;
    uint64_t total_bytes;
    uint64_t ctrl_off;
    uint64_t slot_off;
    uint64_t nchan;
    uint64_t p2p_bytes;
    uint64_t slot_move_min; /* rank 0's: rounds of this many bytes or more move
                             * in the slots (slot_pos; UINT64_MAX: none) */
    _Alignas(64) _Atomic uint32_t attached; /* ranks that mapped the segment */
    _Alignas(64) _Atomic uint32_t sleepers; /* ranks asleep in futex_wait */
    _Alignas(64) _Atomic uint64_t abort_word; /* (reason << 32) | (rank + 1), 0 = fine */
    _Alignas(64) _Atomic uint32_t stores; /* rank 0's store choice: bit b, bucket b
                                           * non-temporal (allreduce.c) */
    _Alignas(64) _Atomic uint64_t zc_word; /* rank 0's choice of zero copy or the
                                            * copies, agreed by round (zerocopy.c) */
    _Alignas(64) char _end;
} hdr_t;

typedef struct {
    _Atomic uint64_t seq;
    uint32_t kind, dtype, op, _r;
    uint64_t count, arg;
    uint64_t addr; /* single-copy all_gather: where this rank's input is (its own memory) */
    uint64_t stamp; /* now_ns() of the publish, where the record is on (rec.stamp) */
    char _pad[LINE - 56];
} line_t;

_Static_assert(sizeof(line_t) == LINE, "line_t must be one cache line");
_Static_assert(sizeof(hdr_t) <= PAGE, "header must fit one page");

static inline uint64_t round_page(uint64_t n) { return (n + PAGE - 1) / PAGE * PAGE; }

static inline uint64_t ctrl_size(uint32_t world)
{
    return round_page((uint64_t)(1 + 2 * NCHAN + 2 * world) * LINE);
}

/* point-to-point slots: a share of the collective slot, at least 64 KiB, so a
 * world of 16 does not reserve 16 x 15 full slots */
static inline uint64_t p2p_size(uint32_t world, uint64_t slot_bytes)
{
    uint64_t b = round_page(slot_bytes / (world ? world : 1));
    if (b < 65536)
        b = 65536;
    return b > slot_bytes ? slot_bytes : b;
}

static inline uint64_t seg_size(uint32_t world, uint64_t slot_bytes)
{
    return PAGE + (uint64_t)world * ctrl_size(world) + (uint64_t)world * 2 * slot_bytes +
           (uint64_t)world * (world - 1) * 2 * p2p_size(world, slot_bytes);
}

/* A duration in seconds (or microseconds x 1e-6) as nanoseconds, never past
 * NS_FOREVER: 10^18 ns (31 years) stands for "no limit" (an infinite timeout,
 * or a huge one), and adding it to now_ns() cannot overflow. */
#define NS_FOREVER 1000000000000000000ull
static inline uint64_t ns_of(double seconds)
{
    if (!(seconds > 0)) /* negative, zero or NaN */
        return 0;
    return seconds >= 1e9 ? NS_FOREVER : (uint64_t)(seconds * 1e9);
}

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Tests' fault injection: keep this core busy for ns nanoseconds (0: no
 * clock read at all, as on every call outside the tests) */
static inline void spin_for_ns(uint64_t ns)
{
    if (!ns)
        return;
    for (uint64_t until = now_ns() + ns; now_ns() < until;)
        cpu_relax();
}

/* A size's bucket: one per power of two from 2^min_log2 (smaller ones in the
 * first), the last holding everything from its size up */
static inline int size_bucket(size_t bytes, int min_log2, int n)
{
    int b = 63 - __builtin_clzll((unsigned long long)bytes | 1) - min_log2;
    return b < 0 ? 0 : b < n ? b : n - 1;
}

/* A cheap clock of this core for comparing two durations (allreduce.c's
 * stores): the time stamp counter, the virtual counter on ARM, else now_ns */
static inline uint64_t ticks(void)
{
#if defined(__x86_64__)
    return __rdtsc();
#elif defined(__aarch64__)
    uint64_t v;
    __asm__ __volatile__("mrs %0, cntvct_el0" : "=r"(v));
    return v;
#else
    return now_ns();
#endif
}

/* ------------------------------------------------------------------------ */
/* the engine object                                                         */
/* ------------------------------------------------------------------------ */

typedef struct pool pool_t;   /* pool.c */

/* chunks whose stores are chosen as they run (allreduce.c): from 4 KiB, a
 * bucket per power of two up to 1 MiB and more, for one-shot and two-shot */
#define STORE_MIN_LOG2 12
#define STORE_SIZES 9
#define STORE_BUCKETS (2 * STORE_SIZES)
/* zero copy or the copies (zerocopy.c): sizes by powers of two from 256 KiB */
#define ZC_MIN_LOG2 18
#define ZC_BUCKETS 11 /* bits 0-10 of the agreed state (zerocopy.c) */
typedef struct tview tview_t; /* torch.c: the torch objects the fast paths compare with */

/* The engine: one communicator's mapping of the segment, by concern. */
typedef struct {
    PyObject_HEAD
    /* the mapping and its layout (engine.c) */
    char *base;
    size_t size;
    int fd;
    int rank;
    int world;
    uint64_t slot_bytes;
    size_t ctrl_bytes, slot_off, p2p_off, p2p_bytes, p2p_piece;
    PyObject *mapping; /* the Mapping that owns base */
    int live;          /* on the live_engines list (holds its liveness lock) */
    void *next_live;

    /* who is in (engine.c call_check / call_begin / call_end, hold) */
    int busy;          /* a thread is inside a call that touches the segment */
    int held;          /* hold() depth: a multi-call operation of thread `holder` */
    unsigned long holder;
    int failed;        /* the communicator is unusable after a failure */
    PyObject *pending; /* exception a signal handler raised during a wait */

    /* collectives (rounds.c, allreduce.c, cma.c) */
    uint64_t round;       /* last collective round this rank published */
    void **srcs;          /* scratch: world source pointers */
    uint64_t twoshot_min; /* all-reduces of at least this many bytes go two-shot */
    uint64_t twoshot_min16; /* the same for bfloat16 and float16 (their reduce costs more) */
    uint64_t zc_min, zc_max; /* all-reduces of a symmetric buffer's tensor of zc_min to
                              * zc_max bytes: zero-copy */
    uint64_t chunk_min;   /* all-reduces of at least this many bytes go chunk_bytes at a time */
    uint64_t chunk_bytes; /* (set_chunks; 0: a slot at a time) */
    int cma;              /* all ranks can read each other's memory (cma_init) */
    uint64_t cma_min;     /* all_gathers of at least this many bytes read the peers directly */
    uint64_t cma_ar_min;  /* all-reduces of at least this many bytes too (cma_all_reduce) */
    uint64_t nt_min;      /* copies into a slot of this many bytes: non-temporal stores */
    uint64_t slot_move_min; /* the header's, as rank 0 wrote it (slot_pos) */
    uint64_t populate_min;  /* outputs of this many bytes get their pages first (pages.c) */
    struct { /* per size (a power of two): what the last probe found (pages.c) */
        uint8_t fresh[64];
        uint16_t skip[64];
    } pages;
    /* the upper ends of the windows two-shot, single-copy all-reduce and
     * non-temporal stores take (from their *_min up to here; UINT64_MAX: no
     * end): set_windows */
    uint64_t twoshot_max, twoshot_max16, cma_ar_max, nt_max;
    uint64_t cma_word;    /* the word peers read to check they can (cma_init) */
    pool_t *pool;         /* helper threads, NULL with one thread */
    /* the stores of a chunk's copies into the slots, chosen per algorithm and
     * size as it runs (allreduce.c: plain or non-temporal, whichever costs less) */
    struct {
        int on;                            /* set_stores_auto; off: nt_min decides */
        uint8_t nt[STORE_BUCKETS];         /* in use per size: 1 non-temporal */
        /* ticks per KiB out of the waits (0: unknown), per reduce class
         * (0: float32 and the integers; 1: bfloat16 and float16, whose
         * reduce costs more a byte), bucket and kind */
        float cost[2][STORE_BUCKETS][2];
        uint64_t switches;                 /* changes of mind, for tests and doctor */
        uint64_t followed_nt;              /* other collectives' copies that followed a
                                            * non-temporal choice (slot_stores_nt) */
        uint64_t explored;                 /* chunks that used the other kind */
        /* rank 0's probations (allreduce.c): per bucket, the reduce class on
         * probation + 1 (0: none), its stage (1: the kind it had, timed
         * afresh; 2: the other kind), that kind, chunks still to pass
         * untimed, chunks timed and their ticks per KiB, chunks of the other
         * class seen (STORE_OTHERS), and stage 1's mean;
         * per class and bucket, trials to let pass before the next one of
         * plain stores, and log2 of that wait */
        uint8_t prob[STORE_BUCKETS], prob_stage[STORE_BUCKETS], prob_kind[STORE_BUCKETS];
        uint8_t prob_warm[STORE_BUCKETS], prob_n[STORE_BUCKETS], prob_other[STORE_BUCKETS];
        float prob_sum[STORE_BUCKETS], prob_base[STORE_BUCKETS];
        uint8_t wait[2][STORE_BUCKETS], backoff[2][STORE_BUCKETS];
        uint64_t probations, kept;         /* begun, and ended with the other kind kept */
    } stores;
    /* zero copy or the copies for a comm.empty tensor, chosen as it runs
     * (zerocopy.c): rank 0's costs, [bucket][0 zero copy, 1 the copies on
     * plain stores, 2 on non-temporal ones] */
    struct {
        float cost[ZC_BUCKETS][3];    /* ticks per KiB of a whole call (0: unknown) */
        unsigned want;                /* the state rank 0 wants in force */
        uint32_t calls[ZC_BUCKETS];   /* calls per bucket not on trial */
        uint8_t seen[ZC_BUCKETS];     /* calls on trial so far in a row */
        uint8_t outliers[ZC_BUCKETS]; /* timed calls of the choice over twice its cost
                                       * in a row (zc_sample) */
        float outlier[ZC_BUCKETS];    /* the least of them, while there are any */
        uint8_t confirm[ZC_BUCKETS];  /* calls until the next is timed */
        uint64_t jumps;               /* costs taken at once, ZC_JUMP such calls in a row */
        uint32_t asked;               /* calls since a trial was asked, 0: none */
        uint8_t trials_of[ZC_BUCKETS]; /* 1: a trial of the bucket was asked */
        uint8_t tried[ZC_BUCKETS];    /* the stores of the last trial of the copies + 1
                                       * (1 plain, 2 non-temporal; 0: none yet) */
        int st_bucket, st_had;        /* the stores bucket a trial of the copies set + 1
                                       * (0: none), and its kind before */
        uint64_t switches;            /* changes of mind (rank 0) */
        uint64_t trials;              /* trial calls timed (rank 0) */
        uint64_t copied;              /* calls of a symmetric tensor that copied */
    } zc;
    tview_t *tv;          /* torch.c's, for the one-call fast paths */

    /* how waits wait (wait.c) */
    struct {
        uint64_t timeout_ns;
        uint64_t spin_ns;  /* spin with pause this long before yielding */
        uint64_t yield_ns; /* then sched_yield until this long, then sleep */
        uint64_t crowded_until; /* no yields before this (wait.c: the core is shared) */
        uint64_t lost_ns;  /* a yield this long lost the core (wait.c: YIELD_LOST_NS) */
    } waits;

    /* the record of this rank's rounds and waits (wait.c, eng_record): what a
     * user switches on with TPCOMM_STATS to see where a call's time goes.  The
     * counters always run (a few increments a wait); stamp adds a clock read
     * to every publish so that a waiter can tell how late it saw a peer. */
    struct rec {
        uint64_t rounds[KIND_LAST + 1]; /* collective rounds by kind */
        uint64_t instant;  /* waits whose peer was there already */
        uint64_t waits;    /* waits that had to wait */
        uint64_t ended[3]; /* of those, ended while spinning, yielding, sleeping */
        uint64_t wait_ns;  /* time in those waits */
        uint64_t yields, sleeps; /* sched_yield calls; futex sleeps and naps */
        uint64_t crowded;  /* times the waits stopped yielding (YIELD_LOST_NS) */
        uint64_t lost_max; /* the longest sched_yield (ns) */
        int last;          /* how the last wait ended: 0 at once, 1 spin, 2 yield, 3 sleep */
        int stamp;         /* stamp publishes; measure lateness (set_record) */
        uint64_t late_n[3], late_ns[3], late_max[3]; /* lateness by how the wait ended */
        uint64_t late_hist[REC_BUCKETS]; /* lateness: bucket b < 2^b us (last: more) */
        uint64_t populated, populated_bytes; /* outputs whose pages came first (pages.c) */
    } rec;

    /* details of the last error, for Python's message (error_info): the
     * peer's rank, and on a mismatch what it published and what this rank
     * published */
    struct {
        int rank;
        uint32_t kind, dtype, op;
        uint64_t count, arg;
        uint32_t my_kind, my_dtype, my_op;
        uint64_t my_count, my_arg;
        uint64_t reason;
        int errnum;     /* the errno of a failed process_vm_readv (ST_CMA) */
        char text[320]; /* ST_SPLITS: what is wrong with the ranks' split table */
    } err;

    /* point to point (p2p.c, p2p_batch.c): chunks sent to / received from
     * each rank, and each receiver's count of chunks consumed as last read
     * (a send reads the receiver's line again only when this leaves the
     * ring no room); the sender p2p_wait_any found last (it scans from the
     * next) */
    uint64_t *p2p_sent, *p2p_recvd, *p2p_seen;
    int any_last;
    /* the receive in progress, between p2p_recv_head and p2p_recv_body */
    struct {
        int held; /* its header holds the engine until its body is read */
        int src;
        uint64_t k, pos, total;
        uint64_t dl;   /* a message sent by reference: its data bytes, */
        Py_ssize_t np; /* and how many pieces it lies in (0: sent by value) */
        size_t used, limit;
    } rx;

    /* symmetric buffers (Communicator.empty): this rank's range and every
     * rank's base address of the same buffer, as mapped here */
    int nsym;
    struct sym {
        char *base;
        size_t size;
        char **peers;
        uint64_t id; /* the same on every rank: published by zero-copy calls */
    } sym[MAX_SYM];

    /* tests only (tpcomm._testing) */
    struct {
        uint64_t check_delay_ns; /* sleep before a batch's verdicts */
        int cma_addr;            /* publish an unreadable input address */
        uint64_t store_ns[2];    /* spin this long after a plain / non-temporal copy-in */
        uint64_t leftover_ns;    /* and this long after the first leftover_chunks plain */
        unsigned leftover_chunks; /* ones of a bucket after a non-temporal one */
        uint8_t last_nt[STORE_BUCKETS];   /* per bucket: its last chunk's kind, */
        unsigned since[STORE_BUCKETS];    /* and its chunks since the kind changed */
        uint64_t zc_ns;          /* spin this long in every zero-copy all-reduce */
    } fault;
} Engine;

static inline hdr_t *HDR(Engine *e) { return (hdr_t *)e->base; }

/* Settings that a running collective reads (threads, the choices made as
 * calls run) change only between calls: 0, or -1 with RuntimeError set */
static inline int refuse_if_busy(const Engine *e, const char *fn)
{
    if (!e->busy)
        return 0;
    PyErr_Format(PyExc_RuntimeError, "%s: a collective is running", fn);
    return -1;
}

static inline char *ctrl_of(Engine *e, int r) { return e->base + PAGE + (size_t)r * e->ctrl_bytes; }

static inline line_t *line_of(Engine *e, int r, int chan, int parity)
{
    return (line_t *)(ctrl_of(e, r) + LINE * (1 + 2 * chan + parity));
}

static inline line_t *ctrl_line(Engine *e, int owner, long line)
{
    return (line_t *)(ctrl_of(e, owner) + LINE * (size_t)line);
}

/* The liveness lock of rank r: a write lock on byte r of the segment file
 * (wait.c peer_alive tests it, engine.c eng_init takes it). */
static inline struct flock rank_lock(int r)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = r;
    fl.l_len = 1;
    return fl;
}

static inline int peer_pid(Engine *e, int r) { return (int)*(uint64_t *)ctrl_of(e, r); }

/* Where rank j's shard of an all-reduce of m elements starts (two-shot,
 * zero-copy, single copy): shards of m / w rounded up to 32 elements, the
 * last ones short or empty; rank j's is [shard_start(m, w, j),
 * shard_start(m, w, j + 1)). */
static inline size_t shard_start(size_t m, int w, int j)
{
    size_t shard = ((m + (size_t)w - 1) / (size_t)w + 31) & ~(size_t)31;
    return (size_t)j * shard < m ? (size_t)j * shard : m;
}

static inline char *slot_of(Engine *e, int r, int parity)
{
    return e->base + e->slot_off + ((size_t)r * 2 + parity) * e->slot_bytes;
}

/*
 * Where in the slots the data of round n lies, for a round that puts `span`
 * bytes or less in each rank's slot (all_reduce's chunks, and every round of
 * rounds.c, whose layouts shrink to what the call needs).  From
 * slot_move_min bytes (SLOT_MOVE_MIN, or none where rank 0 said so in the
 * header: ranks that outnumber the cores, shm/setup.py), an offset that
 * moves on by the span (rounded up to whole pages) each time the parity
 * comes back, across the slot and round again; below, the slot's start.
 *
 * The lines a rank writes were then last read by its peers a whole slot of
 * that parity ago and have left the peers' caches: the writes take them
 * without first taking them back from another core.  On a VM where that
 * costs more than the rest of the call, all_reduce of 8-512 KiB took
 * 0.42-0.64 of the time of the fixed place; all_gather, broadcast and
 * reduce_scatter of 64-256 KiB 0.50-0.63 (docs/DECISIONS.md, "Slot
 * positions that move").  Whole pages, because the hardware prefetchers stop
 * at a page's end: a reader does not fetch the next place's lines ahead.
 * Not under 8 KiB: there the moving place measured no faster at world 2
 * (1 KiB slower in some runs: a few lines filled from memory cost what their
 * transfer did), and ranks that share a core (8 on 2 here) find the fixed
 * place in their own cache.
 *
 * Safe at any offset: round n - 2's data in the same slot was read before
 * the peers published n - 1.  Every rank computes the same offset, from the
 * round number and a span fixed by sizes every rank knows.
 */
#define SLOT_MOVE_MIN (8u * 1024u)
static inline size_t slot_pos(const Engine *e, uint64_t n, size_t span)
{
    span = (span + PAGE - 1) & ~(size_t)(PAGE - 1);
    const uint64_t k = span >= e->slot_move_min ? e->slot_bytes / span : 0;
    return k > 1 ? (size_t)((n >> 1) % k) * span : 0;
}

/*
 * The calls of copies of `span` bytes a trial of other stores (allreduce.c's
 * probation) or of the copies (zerocopy.c) lets pass before it times one:
 * one more than their places in a slot (slot_pos), from 3 to 8.  Until the
 * copies have gone once round those places, their stores meet lines that the
 * last way left behind (non-temporal ones: in memory, not in this core's
 * cache; zero copy's: read by the peers more recently than a round of places
 * ago), and they cost 1.5-3x their steady time (docs/DECISIONS.md).
 */
static inline unsigned trial_warm(const Engine *e, size_t span)
{
    span = (span + PAGE - 1) & ~(size_t)(PAGE - 1);
    const size_t places = span >= e->slot_move_min ? e->slot_bytes / span : 1;
    return places + 1 < 3 ? 3 : places + 1 > 8 ? 8 : (unsigned)places + 1;
}

/* where chunk k of the channel from rank s to rank d goes: piece k % P2P_RING
 * of the pair's 2 x p2p_bytes, each piece p2p_piece bytes */
static inline char *p2p_slot_of(Engine *e, int s, int d, uint64_t k)
{
    size_t pair = (size_t)s * (size_t)(e->world - 1) + (size_t)(d < s ? d : d - 1);
    return e->base + e->p2p_off + pair * 2 * e->p2p_bytes + (size_t)(k % P2P_RING) * e->p2p_piece;
}

static inline uint32_t *futex_word(_Atomic uint64_t *p)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return (uint32_t *)p;
#else
    return (uint32_t *)p + 1;
#endif
}

void futex_wake_all(_Atomic uint64_t *p);

/*
 * Publish round n on line l.  No full fence between the release store and the
 * sleeper check: that fence (an RFO stall of ~100 ns on every call) would only
 * close the race with a waiter that is falling asleep at this very moment, and
 * such a waiter sleeps at most one futex period (2 ms) before it looks again.
 * A rank only sleeps after waiting 1 ms already, so the race costs little and
 * the hot path pays nothing.
 */
static inline void publish(Engine *e, line_t *l, uint64_t n)
{
    if (e->rec.stamp)
        l->stamp = now_ns();
    atomic_store_explicit(&l->seq, n, memory_order_release);
    if (atomic_load_explicit(&HDR(e)->sleepers, memory_order_relaxed))
        futex_wake_all(&l->seq);
}

/* Whether a call of this thread must wait its turn: another thread is inside
 * a call, or holds the engine across several (hold(), a received header).  A
 * Communicator serves one thread at a time (docs/ENGINE.md, "Threads"). */
static inline int other_thread(Engine *e)
{
    return e->busy || (e->held && e->holder != PyThread_get_thread_ident());
}

int take_abort(Engine *e);

/* how much of `have` bytes round k (starting at lo, cap bytes a round) moves */
static inline size_t part_of(size_t have, size_t lo, size_t cap)
{
    return have > lo ? (have - lo < cap ? have - lo : cap) : 0;
}

/* whether [a, a + na) and [b, b + nb) share a byte */
static inline int overlap(const char *a, size_t na, const char *b, size_t nb)
{
    return na && nb && a < b + nb && b < a + na;
}

/* ------------------------------------------------------------------------ */
/* point-to-point messages                                                   */
/* ------------------------------------------------------------------------ */

/* A message as pieces of memory: n (address, length) pairs. */
typedef struct {
    char **addr;
    size_t *len;
    Py_ssize_t n;
} pieces_t;

/* Messages sent by reference (cma.c, cma_message): the header-length word
 * carries P2P_BYREF and the number of pieces. */
#define P2P_BYREF (1ull << 63)
/* from 1.5 rings (1.5 MiB at world 2): an exchange at world 2, fresh data,
 * by reference / by value: 1.125 MiB 484-644 / 411-489 us, 1.5 MiB 473-518 /
 * 565-1573 us, 2.5 MiB 709-892 / 1091-1304 us (docs/COLLECTIVES.md) */
#define P2P_BYREF_MIN(e) (3 * (e)->p2p_bytes)
#define P2P_HL(w) ((w) & P2P_BYREF ? (w) & 0xffffffffull : (w))
#define P2P_NP(w) ((w) & P2P_BYREF ? (Py_ssize_t)(((w) >> 32) & 0x7fffffffull) : 0)
/* What a message's lengths may say (read from shared memory, so checked
 * before use: a peer's bug or a hostile write must not wrap a size) */
#define P2P_MAX_HEADER (1ull << 30)
#define P2P_MAX_DATA (1ull << 56)
#define P2P_MAX_PIECES (1ll << 24)

/* One send or receive in progress: a message streamed chunk by chunk
 * (send_pieces in p2p.c, and the batches of p2p_batch.c). */
typedef struct {
    int send, peer, started, done, drop, need;
    pieces_t pc;
    Py_ssize_t piece;      /* position in pc */
    size_t off;
    uint64_t k;            /* the chunk last published (send) / being read (recv) */
    size_t total, pos;     /* message bytes; send: pushed; recv: before chunk k */
    size_t used, limit;    /* recv: read of chunk k, and its size */
    const char *want;      /* recv: the expected header */
    size_t want_len, hl, dl, got;
    char *hdr;             /* recv: the header as it arrives */
    PyObject *scratch_obj; /* recv: a bytearray for the data of a message that */
    char *scratch;         /* does not match (Python judges it) */
    size_t soff;
    Py_ssize_t np;         /* sent by reference (cma_message): its data pieces */
    char *rbuf;            /* send by reference: the stream (lengths, header, where) */
    pieces_t own;          /* the pieces arrays p2p_batch allocated (bops_free) */
    char *by_addr[1];      /* send by reference: pc's one piece */
    size_t by_len[1];
    int err;               /* recv: the status of a failed read by reference */
    /* recv without tensors to land in (p2p_tensors.c's sendrecv without out=):
     * makes them from the header (NULL, no exception: received aside as a
     * message that does not match), their data's pieces into made_addr and
     * made_len (the caller's arrays, P2P_MAX_TENSORS long), their count into
     * the last argument */
    PyObject *(*land)(Engine *e, const unsigned char *h, size_t hl, size_t dl, char **addr,
                      size_t *len, Py_ssize_t *np);
    PyObject *made;        /* the tensors land made (a list) */
    char **made_addr;
    size_t *made_len;
} bop_t;

/* ------------------------------------------------------------------------ */
/* what one file offers the others                                           */
/* ------------------------------------------------------------------------ */

/* kernels.c */
void do_reduce(int dtype, int op, void *dst, void *const *srcs, int w, size_t n);

const char *kernel_isa(void);

/* kernels_avx512.c */
int avx512_level(void);
int reduce_avx512(int dtype, int op, void *dst, void *const *srcs, int w, size_t n);

/* pool.c */
void pool_free(pool_t *P);
pool_t *pool_new(int nthreads, size_t min_bytes);
void par_copy(pool_t *P, char *dst, const char *src, size_t n, int nt); /* into a slot */
void par_copy_out(pool_t *P, char *dst, const char *src, size_t n); /* out of one */
void par_reduce(pool_t *P, int dtype, int op, void *dst, void *const *srcs, int w, size_t n);
int pool_threads(const pool_t *P);
int pool_splits(const pool_t *P, size_t n);
int par_read(pool_t *P, pid_t pid, char *dst, uint64_t from, size_t n);

/* wait.c: the one waiting loop (wait_until) and what it needs */
enum { WAIT_IDLE = -100, WAIT_MOVED = -101, WAIT_DONE = -102 }; /* a poll's answers */
typedef struct waiter waiter_t;
struct waiter {
    /* WAIT_DONE, WAIT_MOVED, WAIT_IDLE, or a status / -1 (exception) to return */
    int (*poll)(Engine *e, waiter_t *w, PyThreadState **ts);
    /* ST_OK, or ST_PEER_DEAD / ST_CROSSED naming the rank in *who; NULL: none */
    int (*verdict)(Engine *e, waiter_t *w, int *who);
    /* the futex word to sleep on and the value awaited; NULL (or none): a nap */
    _Atomic uint64_t *(*sleep_on)(Engine *e, waiter_t *w, uint64_t *want);
    uint64_t sleep_ns; /* the longest sleep (< 1 s) */
    int peer;          /* the rank waited for: a timeout names it */
    /* 0: a wait for a peer.  Else a wait of this process's own (the ranks
     * attaching at set-up, another thread leaving at close): it ends at this
     * time (now_ns) with ST_TIMEOUT and fails nothing; no abort word, no
     * verdict, not in the record (rec) */
    uint64_t until;
};
/* mapping.c: Mapping owns a segment's mmap (unmapped when the last
 * reference, the engine's or a tensor's, goes) */
typedef struct {
    PyObject_HEAD
    char *base;
    size_t size;
} Mapping;
extern PyTypeObject MappingType;
Mapping *map_segment(int fd, size_t size, int rank, int *myfd_out);
void set_layout(Engine *e, void *p, size_t size, int rank, int world, uint64_t slot_bytes,
                double timeout, double spin_us, double yield_us);
void write_header(Engine *e, uint64_t need);
int wait_until(Engine *e, waiter_t *w, PyThreadState **ts);
void waits_set(Engine *e, double spin_us, double yield_us, double lost_us);
int eng_hold(Engine *e);
void eng_release(Engine *e);
int fail(Engine *e, int st, int err_rank, int blame);
int peer_alive(Engine *e, int r);
void set_abort(Engine *e, uint64_t reason, int rank);
int take_abort(Engine *e);
int peer_ahead(Engine *e, int peer);
int wait_p2p(Engine *e, _Atomic uint64_t *seq, uint64_t n, int peer, PyThreadState **ts);
int round_sync(Engine *e, uint32_t kind, uint32_t dtype, uint32_t op, uint64_t count, uint64_t arg, PyThreadState **ts);

/* engine.c */
PyObject *eng_closed_error(void);
PyObject *eng_layout(Engine *e, PyObject *unused);
PyObject *eng_record(Engine *e, PyObject *args); /* wait.c */
PyObject *eng_set_waits(Engine *e, PyObject *args); /* wait.c */
int call_check(Engine *e);
void call_begin(Engine *e, size_t bytes, PyThreadState **ts);
int call_end(Engine *e, int st, PyThreadState *ts);
int call_enter(Engine *e, size_t bytes, PyThreadState **ts);
PyObject *status_result(int st);
void after_fork_child(void);
int engine_add_types(PyObject *m);

/* allreduce.c */
/* how an all-reduce goes (allreduce.c ar_plan) */
enum { AR_ONESHOT, AR_TWOSHOT, AR_SINGLE_COPY, AR_ZERO_COPY };
typedef struct {
    int algo;     /* AR_* */
    size_t chunk; /* bytes through the slots at a time (zero copy: of each shard; 0 all) */
    uint64_t arg; /* the metadata arg (zero copy: where its tensor is goes on top) */
} ar_plan_t;
ar_plan_t ar_plan(const Engine *e, size_t bytes, int dtype, int symmetric);
/* the first chunk of an all_reduce of `bytes` through the slots, planned as
 * pl (one-shot or two-shot): its bytes */
static inline size_t first_chunk(const ar_plan_t *pl, size_t bytes)
{
    return bytes < pl->chunk ? bytes : pl->chunk;
}
int stores_bit(const Engine *e, int b);
void store_set(Engine *e, int b, int nt);
int plan_store_bucket(const Engine *e, const ar_plan_t *pl, size_t bytes);
int plan_stores_nt(const Engine *e, const ar_plan_t *pl, size_t bytes, int dtype);
int all_reduce_rounds(Engine *e, char *t, size_t count, int dtype, int op, uint32_t kind, PyThreadState **tsp);
PyObject *eng_all_reduce_plan(Engine *e, PyObject *args);
PyObject *eng_set_chunks(Engine *e, PyObject *args);
PyObject *eng_all_reduce(Engine *e, PyObject *const *args, Py_ssize_t nargs);
PyObject *eng_set_stores_auto(Engine *e, PyObject *arg);
PyObject *eng_stores(Engine *e, PyObject *unused);
PyObject *eng_fault_stores(Engine *e, PyObject *args);
int slot_stores_nt(Engine *e, size_t n);

/* zerocopy.c: the zero-copy all-reduce, and rank 0's choice of zero copy or
 * the copies for a comm.empty tensor (agreed by round: zc_agreed) */
#define ZC_ON (1u << 15)   /* in the agreed state: rank 0 chooses at all */
#define ARG_COPIED 0x80u   /* metadata arg: a comm.empty tensor copied by that choice */
struct sym *find_sym(Engine *e, const char *t, size_t bytes);
int zero_copy_all_reduce(Engine *e, struct sym *sb, size_t off, size_t count, size_t piece,
                         int dtype, int op, uint32_t kind, uint64_t arg, PyThreadState **ts);
int zc_bucket(size_t bytes);
unsigned zc_agreed(const Engine *e);
int zc_copies(unsigned bits, int b);
void zc_after_call(Engine *e, unsigned bits, int b, int w, uint64_t dt, size_t bytes, int dtype);
PyObject *eng_set_zero_copy(Engine *e, PyObject *args);
PyObject *eng_set_zero_copy_auto(Engine *e, PyObject *arg);
PyObject *eng_zero_copy_state(Engine *e, PyObject *unused);
PyObject *eng_fault_zero_copy(Engine *e, PyObject *arg);

/* blocks.c */
void put_blocks(char *out, const char *src, size_t q, size_t n, size_t blk, size_t row, size_t off);
void take_blocks(char *dst, const char *x, size_t q, size_t n, size_t blk, size_t row, size_t off,
                 int nt);

/* pages.c: a caller's output made present before a collective writes it
 * (inside a begun call; nothing changes a byte) */
typedef struct {
    char *p;
    size_t n;
} span_t;
void ready_pages(Engine *e, const span_t *s, int k);
PyObject *eng_set_populate_min(Engine *e, PyObject *arg);

/* rounds.c */
PyObject *eng_sync(Engine *e, PyObject *const *args, Py_ssize_t nargs);
size_t *even_sizes(Engine *e, size_t v);
PyObject *eng_gatherv(Engine *e, PyObject *const *args, Py_ssize_t nargs);
uint64_t flat_key(uint64_t kind, uint64_t n, uint64_t world);
int flat_gather(Engine *e, uint32_t kind, uint64_t tag, const char *mine, int code, long long n, size_t nbytes, char *out);
int broadcast_rounds(Engine *e, uint32_t kind, char *data, size_t total, int src, uint32_t dtype, uint64_t numel);
PyObject *eng_broadcast(Engine *e, PyObject *const *args, Py_ssize_t nargs);
PyObject *eng_reduce_scatterv(Engine *e, PyObject *const *args, Py_ssize_t nargs);
int reduce_scatter_rounds(Engine *e, uint32_t kind, const char *x, int dtype, const size_t *sizes, char *out, int op, uint64_t arg, size_t outer);
PyObject *eng_alltoallv(Engine *e, PyObject *const *args, Py_ssize_t nargs);
int alltoallv_rounds(Engine *e, uint32_t kind, const char *x, const size_t *sc, const size_t *so, char *out, const size_t *rc, const size_t *ro, uint64_t most, uint32_t dtype, uint64_t count, uint64_t arg);
int alltoall_even_rounds(Engine *e, uint32_t kind, const char *x, char *out, size_t block, uint32_t code);
int u64_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *fn, unsigned long long *v);

/* splits.c: all_to_all with split sizes (the split table round, then alltoallv_rounds) */
int alltoall_split_list(PyObject *v, PyObject **list);
int alltoall_splits_rounds(Engine *e, uint32_t kind, const char *x, PyObject *ins, char *out, PyObject *outs, const uint64_t *f);
PyObject *eng_alltoall_splits(Engine *e, PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_split_table_problem(PyObject *self, PyObject *args);

/* cma.c */
uint64_t cma_tag(uint64_t pid, int rank);
void fault_pause(Engine *e);
int cma_failed(Engine *e, int r, int err);
int cma_rounds(Engine *e, uint32_t kind, uint32_t dtype, uint64_t numel, uint64_t arg, size_t total, const char *mine, const uint64_t *offs, const char *own, char *const *dst, const size_t *blk, const size_t *row, const size_t *n);
int cma_all_reduce(Engine *e, char *t, size_t count, int dtype, int op, uint32_t kind, PyThreadState **ts);
int cma_gather(Engine *e, uint32_t kind, const char *mine, const size_t *cnt, char *out, char *const *dsts, uint32_t dtype, uint64_t numel, uint64_t arg, size_t total, int in_place, size_t outer);
int cma_message(Engine *e, const pieces_t *pc, char **buf, char **addr, size_t *len, pieces_t *out);
PyObject *eng_cma_init(Engine *e, PyObject *args);
int cma_recv(Engine *e, int r, const char *desc, Py_ssize_t np, size_t dl, const pieces_t *dst);

/* p2p.c */
int p2p_check_rank(Engine *e, long r, const char *fn);
int p2p_malformed(Engine *e, int src, uint64_t w0, uint64_t dl);
size_t header_begin(char *h, int n);
size_t header_put(char *p, int code, int nd, const long long *dims);
int header_count(const unsigned char *h, size_t hl);
int header_get(const unsigned char *h, size_t hl, size_t *at, int ncodes, int *code, int *nd, long long *dims);
PyObject *shape_tuple(const long long *dims, int nd);
PyObject *mod_parse_header(PyObject *self, PyObject *args);
int parse_pieces(PyObject *list, pieces_t *pc);
int bsend_step(Engine *e, bop_t *o);
int send_pieces(Engine *e, int dst, const pieces_t *pc);
PyObject *eng_p2p_send(Engine *e, PyObject *args);
PyObject *recv_head(Engine *e, int src, int *st);
PyObject *eng_p2p_recv_head(Engine *e, PyObject *arg);
PyObject *eng_p2p_wait_any(Engine *e, PyObject *unused);
void rx_release(Engine *e);
size_t rx_left(const Engine *e);
int recv_body(Engine *e, const pieces_t *pc);
PyObject *eng_p2p_recv_body(Engine *e, PyObject *list);

/* p2p_batch.c */
int batch_progress(Engine *e, bop_t *ops, Py_ssize_t n);
PyObject *eng_p2p_batch(Engine *e, PyObject *list);

/* torch.c */
int torch_init(void);
int tview_new(Engine *e);
void tview_free(Engine *e);
PyObject *eng_fast_all_reduce(Engine *e, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *eng_set_fast_path(Engine *e, PyObject *args);
PyObject *eng_plain(Engine *e, PyObject *t);
PyObject *eng_set_p2p_dtypes(Engine *e, PyObject *args);
PyObject *eng_message_header(Engine *e, PyObject *seq);
/* torch.c's view of tensors, for coll_tensors.c and p2p_tensors.c */
/* the binary header of n tensors, with the two lengths before it (plain_message) */
#define P2P_HEAD_BYTES (16 + 2 + P2P_MAX_TENSORS * (2 + 8 * P2P_MAX_DIMS))
/* the entries that hand the calls they do not take back to Python (hand_back) */
enum { FB_ALL_REDUCE, FB_ALL_GATHER_INTO_TENSOR, FB_REDUCE_SCATTER_TENSOR, FB_GATHER, FB_COUNT };
/* the public calls the entries serve, as their errors name them */
extern PyObject *F_all_gather, *F_gather, *F_broadcast, *F_reduce_scatter, *F_all_to_all;
extern PyObject *F_send, *F_recv, *F_sendrecv;
int fast_ready(Engine *e);
PyObject *fast_done(Engine *e, int st, PyObject *fn);
PyObject *hand_back(Engine *e, int which, PyObject *const *args, Py_ssize_t nargs,
                    PyObject *kwnames);
int rank_arg(Engine *e, PyObject *v);
int plain_info(Engine *e, PyObject *t, int *code, char **addr, long long *n);
int one_dim(Engine *e, PyObject *t);
int rows_of(Engine *e, PyObject *t, size_t es, uint64_t *rows, uint64_t *row);
size_t code_size(Engine *e, int code);
PyObject *op_object(Engine *e, int op);
int op_code(Engine *e, PyObject *op);
int reduce_code(Engine *e, int code);
int can_make(Engine *e);
int plain_message(Engine *e, PyObject **items, Py_ssize_t n, char *head, char **addr, size_t *len,
                  Py_ssize_t *np);
PyObject *new_tensor(Engine *e, int code, const long long *dims, int nd, char **addr,
                     size_t *nbytes);
int tensor_codes(Engine *e);

/* coll_tensors.c */
PyObject *eng_fast_all_gather(Engine *e, PyObject *const *args, Py_ssize_t nargs);
PyObject *eng_fast_gather(Engine *e, PyObject *const *args, Py_ssize_t nargs);
PyObject *eng_fast_broadcast(Engine *e, PyObject *const *args, Py_ssize_t nargs);
PyObject *eng_fast_reduce_scatter(Engine *e, PyObject *const *args, Py_ssize_t nargs);
PyObject *eng_fast_all_to_all(Engine *e, PyObject *const *args, Py_ssize_t nargs);
PyObject *eng_whole_all_gather_into_tensor(Engine *e, PyObject *const *args, Py_ssize_t nargs,
                                           PyObject *kwnames);
PyObject *eng_whole_reduce_scatter_tensor(Engine *e, PyObject *const *args, Py_ssize_t nargs,
                                          PyObject *kwnames);
PyObject *eng_whole_gather(Engine *e, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);

/* p2p_tensors.c */
PyObject *eng_p2p_send_tensors(Engine *e, PyObject *const *args, Py_ssize_t nargs);
PyObject *eng_p2p_recv(Engine *e, PyObject *const *args, Py_ssize_t nargs);
PyObject *eng_p2p_sendrecv(Engine *e, PyObject *const *args, Py_ssize_t nargs);


#endif /* TPCOMM_NATIVE_H */
