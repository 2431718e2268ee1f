/*
 * tpcomm._native: the small private C core of tpcomm's shared-memory engine.
 *
 * It does four things and nothing else: atomic flags, bounded waits, copies
 * and reduce loops (and the loops that drive them for all_reduce and for
 * point-to-point streams, where Python per chunk would cost more than the
 * data).  Everything else (naming, creating and unlinking segments, argument
 * checks, error messages, the other collectives' rounds) is Python.
 *
 * Segment layout, version 2 (offsets from the mapping's base; seg_size()):
 *
 *   +--------------------------+ 0
 *   | header (4 KiB)           |  magic, version, world, slot_bytes, sizes,
 *   |                          |  attach counter, sleeper count, abort word
 *   +--------------------------+ ctrl_off = 4096
 *   | rank 0 control           |  page-rounded (3 + 2W) lines: line 0 pid;
 *   | rank 1 control           |  line 1 + 2c + p: channel c parity p
 *   | ...                      |  {seq, kind, dtype, op, count, arg};
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
 *     1. copies its chunk into its slot p,
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

#if defined(__x86_64__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
/* Runtime dispatch: gcc builds one clone per ISA level and picks at load time
 * (ifunc).  x86-64-v4 = AVX-512, v3 = AVX2 + FMA + F16C. */
#define KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#define KERNEL
#else
#define cpu_relax() ((void)0)
#define KERNEL
#endif

#define MAGIC 0x314d4d4f43505454ULL /* "TTPCOMM1" little endian */
#define VERSION 4u
#define PAGE 4096u
#define LINE 64u
#define NCHAN 1          /* channels per rank: 0 = collectives */
#define MAX_WORLD 4096   /* OFD lock bytes and futex fan-out stay cheap up to here */
#define MAX_SYM 64       /* symmetric buffers per communicator (Communicator.empty) */
#define MAX_ANY 32       /* dtypes a point-to-point message may carry */
#define P2P_BINARY 0xB1  /* first byte of a binary message header (protocols.py) */
#define P2P_MAX_TENSORS 255
#define P2P_MAX_DIMS 8
#define P2P_RING 64    /* chunks in flight per point-to-point channel (pipelining) */
#define ARG_ZERO_COPY 3  /* all-reduce metadata arg: 1 one-shot, 2 two-shot, 3 + ... zero-copy */
/* per-rank control block: pid line, 2 lines per channel, then one "sent to d"
 * and one "consumed from s" line per peer (point-to-point), page rounded */
#define P2P_SENT_LINE(d) (1 + 2 * NCHAN + (d))
#define P2P_DONE_LINE(w, s) (1 + 2 * NCHAN + (w) + (s))

/* status codes returned to Python (see shm/engine.py) */
enum { ST_OK = 0, ST_TIMEOUT = 1, ST_PEER_DEAD = 2, ST_MISMATCH = 3, ST_ABORTED = 4,
       ST_INTERRUPTED = 5, ST_CROSSED = 6, ST_BUSY = 7, ST_CLOSED = 8,
       ST_CMA = 9 };

/* dtype and op codes shared with Python */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_I32 = 3, DT_I64 = 4, DT_COUNT };
enum { OP_SUM = 0, OP_AVG = 1, OP_MAX = 2, OP_MIN = 3, OP_COUNT };
static const size_t dt_size[DT_COUNT] = {4, 2, 2, 4, 8};

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
    _Alignas(64) _Atomic uint32_t attached; /* ranks that mapped the segment */
    _Alignas(64) _Atomic uint32_t sleepers; /* ranks asleep in futex_wait */
    _Alignas(64) _Atomic uint64_t abort_word; /* (reason << 32) | (rank + 1), 0 = fine */
    _Alignas(64) char _end;
} hdr_t;

typedef struct {
    _Atomic uint64_t seq;
    uint32_t kind, dtype, op, _r;
    uint64_t count, arg;
    uint64_t addr; /* single-copy all_gather: where this rank's input is (its own memory) */
    char _pad[LINE - 48];
} line_t;

_Static_assert(sizeof(line_t) == LINE, "line_t must be one cache line");
_Static_assert(sizeof(hdr_t) <= PAGE, "header must fit one page");

static uint64_t round_page(uint64_t n) { return (n + PAGE - 1) / PAGE * PAGE; }

static uint64_t ctrl_size(uint32_t world) { return round_page((uint64_t)(1 + 2 * NCHAN + 2 * world) * LINE); }

/* point-to-point slots: a share of the collective slot, at least 64 KiB, so a
 * world of 16 does not reserve 16 x 15 full slots */
static uint64_t p2p_size(uint32_t world, uint64_t slot_bytes)
{
    uint64_t b = round_page(slot_bytes / (world ? world : 1));
    if (b < 65536)
        b = 65536;
    return b > slot_bytes ? slot_bytes : b;
}

static uint64_t seg_size(uint32_t world, uint64_t slot_bytes)
{
    return PAGE + (uint64_t)world * ctrl_size(world) + (uint64_t)world * 2 * slot_bytes +
           (uint64_t)world * (world - 1) * 2 * p2p_size(world, slot_bytes);
}

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------------ */
/* reduce kernels                                                            */
/* ------------------------------------------------------------------------ */

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet, keep the sign */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#define BLK 512 /* elements per accumulator block: 2 KiB of floats, stays in L1 */

/* NaN-propagating max/min, the same as torch.maximum / torch.minimum. */
#define FMAX(a, b) (((a) != (a)) ? (a) : (((b) > (a) || (b) != (b)) ? (b) : (a)))
#define FMIN(a, b) (((a) != (a)) ? (a) : (((b) < (a) || (b) != (b)) ? (b) : (a)))
#define IMAX(a, b) ((b) > (a) ? (b) : (a))
#define IMIN(a, b) ((b) < (a) ? (b) : (a))

/*
 * Float family: load every source as float32, combine in rank order, store
 * once.  srcs[0..w-1] are in rank order; dst may alias any source (the
 * caller's own tensor is both its source and the destination).
 */
#define DEF_FLOAT_REDUCE(NAME, T, LOAD, STORE)                                    \
    KERNEL static void NAME(void *dst_, void *const *srcs_, int w, size_t n,      \
                            int op)                                               \
    {                                                                             \
        T *dst = (T *)dst_;                                                       \
        const T *const *srcs = (const T *const *)srcs_;                           \
        float acc[BLK];                                                           \
        const float inv = 1.0f / (float)w;                                        \
        (void)inv;                                                                \
        for (size_t i0 = 0; i0 < n; i0 += BLK) {                                  \
            size_t m = n - i0 < BLK ? n - i0 : BLK;                               \
            const T *s0 = srcs[0] + i0;                                           \
            for (size_t i = 0; i < m; i++)                                        \
                acc[i] = LOAD(s0[i]);                                             \
            for (int r = 1; r < w; r++) {                                         \
                const T *s = srcs[r] + i0;                                        \
                if (op == OP_SUM || op == OP_AVG) {                               \
                    for (size_t i = 0; i < m; i++)                                \
                        acc[i] += LOAD(s[i]);                                     \
                } else if (op == OP_MAX) {                                        \
                    for (size_t i = 0; i < m; i++) {                              \
                        float b = LOAD(s[i]);                                     \
                        acc[i] = FMAX(acc[i], b);                                 \
                    }                                                             \
                } else {                                                          \
                    for (size_t i = 0; i < m; i++) {                              \
                        float b = LOAD(s[i]);                                     \
                        acc[i] = FMIN(acc[i], b);                                 \
                    }                                                             \
                }                                                                 \
            }                                                                     \
            T *d = dst + i0;                                                      \
            if (op == OP_AVG) {                                                   \
                const float fw = (float)w;                                        \
                for (size_t i = 0; i < m; i++)                                    \
                    d[i] = STORE(acc[i] / fw);                                    \
            } else {                                                              \
                for (size_t i = 0; i < m; i++)                                    \
                    d[i] = STORE(acc[i]);                                         \
            }                                                                     \
        }                                                                         \
    }

#define ID(x) (x)
#if defined(__FLT16_MAX__)
#define F16_LOAD(x) ((float)(x))
#define F16_STORE(x) ((_Float16)(x))
DEF_FLOAT_REDUCE(reduce_f16, _Float16, F16_LOAD, F16_STORE)
#else
#error "tpcomm needs a compiler with _Float16 (gcc >= 12 or clang >= 15)"
#endif
DEF_FLOAT_REDUCE(reduce_f32, float, ID, ID)
DEF_FLOAT_REDUCE(reduce_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* Integer family: sums wrap modulo 2^bits like torch (computed unsigned,
 * so no undefined behaviour); AVG is refused in Python. */
#define DEF_INT_REDUCE(NAME, T, U)                                                \
    KERNEL static void NAME(void *dst_, void *const *srcs_, int w, size_t n,      \
                            int op)                                               \
    {                                                                             \
        T *dst = (T *)dst_;                                                       \
        const T *const *srcs = (const T *const *)srcs_;                           \
        T acc[BLK];                                                               \
        for (size_t i0 = 0; i0 < n; i0 += BLK) {                                  \
            size_t m = n - i0 < BLK ? n - i0 : BLK;                               \
            const T *s0 = srcs[0] + i0;                                           \
            for (size_t i = 0; i < m; i++)                                        \
                acc[i] = s0[i];                                                   \
            for (int r = 1; r < w; r++) {                                         \
                const T *s = srcs[r] + i0;                                        \
                if (op == OP_SUM) {                                               \
                    for (size_t i = 0; i < m; i++)                                \
                        acc[i] = (T)((U)acc[i] + (U)s[i]);                        \
                } else if (op == OP_MAX) {                                        \
                    for (size_t i = 0; i < m; i++)                                \
                        acc[i] = IMAX(acc[i], s[i]);                              \
                } else {                                                          \
                    for (size_t i = 0; i < m; i++)                                \
                        acc[i] = IMIN(acc[i], s[i]);                              \
                }                                                                 \
            }                                                                     \
            memcpy(dst + i0, acc, m * sizeof(T));                                 \
        }                                                                         \
    }

DEF_INT_REDUCE(reduce_i32, int32_t, uint32_t)
DEF_INT_REDUCE(reduce_i64, int64_t, uint64_t)

typedef void (*reduce_fn)(void *, void *const *, int, size_t, int);
static const reduce_fn reducers[DT_COUNT] = {reduce_f32, reduce_bf16, reduce_f16,
                                             reduce_i32, reduce_i64};

/* Two sources are the hot case at world size 2: one fused pass, no block
 * buffer.  Same arithmetic, same rounding as the general kernel. */
KERNEL static void sum2_f32(float *d, const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        d[i] = a[i] + b[i];
}

KERNEL static void sum2_bf16(uint16_t *d, const uint16_t *a, const uint16_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        d[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

/*
 * Copy into this rank's slot.  Above nt_min bytes the copy uses non-temporal
 * stores: the lines go to memory/L3 instead of this core's L2, so the peers
 * read them without snooping a modified line out of another core, and the
 * stores need no read-for-ownership of lines the peers still hold shared.
 * The slot is page aligned; the source may be anything.  AVX-512 machines
 * only (elsewhere it is a plain memcpy).  Measured slower on the development
 * machine, so off by default (docs/PERFORMANCE.md).
 */
#if defined(__x86_64__)
__attribute__((target("avx512f"))) static void copy_nt_avx512(char *dst, const char *src, size_t n)
{
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        __m512i a = _mm512_loadu_si512((const void *)(src + i));
        __m512i b = _mm512_loadu_si512((const void *)(src + i + 64));
        __m512i c = _mm512_loadu_si512((const void *)(src + i + 128));
        __m512i d = _mm512_loadu_si512((const void *)(src + i + 192));
        _mm512_stream_si512((void *)(dst + i), a);
        _mm512_stream_si512((void *)(dst + i + 64), b);
        _mm512_stream_si512((void *)(dst + i + 128), c);
        _mm512_stream_si512((void *)(dst + i + 192), d);
    }
    for (; i + 64 <= n; i += 64)
        _mm512_stream_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
    if (i < n)
        memcpy(dst + i, src + i, n - i);
}

static int nt_level(void)
{
    static int level = -1;
    if (level < 0) {
        __builtin_cpu_init();
        level = __builtin_cpu_supports("avx512f") ? 2 : 0;
    }
    return level;
}
#endif

static size_t nt_min = (size_t)-1; /* set by set_tuning(); (size_t)-1 = never */

static void copy_in(char *dst, const char *src, size_t n)
{
#if defined(__x86_64__)
    if (n >= nt_min) {
        int lv = nt_level();
        if (lv == 2) {
            copy_nt_avx512(dst, src, n);
            _mm_sfence();
            return;
        }
    }
#endif
    memcpy(dst, src, n);
}

#if defined(__x86_64__)
/*
 * AVX-512 kernels for the float family, written with intrinsics because gcc
 * does not vectorise the _Float16 conversions and keeps the bfloat16 rounding
 * partly scalar.  Same arithmetic as the portable kernels above, lane by lane:
 * load as float32, combine in rank order, round once (bfloat16: integer
 * round-to-nearest-even, NaN quieted, denormals kept, exactly like torch and
 * f32_to_bf16; float16: vcvtps2ph with round-to-nearest-even).  Tails use
 * masked loads and stores, which never touch memory past the end.
 */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))

AVX512 static inline __m512 ld16(int dtype, const void *p, size_t i, __mmask16 k)
{
    if (dtype == DT_F32)
        return _mm512_maskz_loadu_ps(k, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i);
    if (dtype == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

AVX512 static inline void st16(int dtype, void *p, size_t i, __m512 x, __mmask16 k)
{
    if (dtype == DT_F32) {
        _mm512_mask_storeu_ps((float *)p + i, k, x);
        return;
    }
    __m256i h;
    if (dtype == DT_BF16) {
        __m512i u = _mm512_castps_si512(x);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        __mmask16 isnan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        r = _mm512_mask_blend_epi32(isnan, _mm512_srli_epi32(r, 16), nan);
        h = _mm512_cvtepi32_epi16(r);
    } else {
        h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_mask_storeu_epi16((uint16_t *)p + i, k, h);
}

AVX512 static inline __m512 vmax(__m512 a, __m512 b)
{
    __mmask16 take_b = _mm512_cmp_ps_mask(b, a, _CMP_GT_OQ) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    __m512 r = _mm512_mask_blend_ps(take_b, a, b);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), r, a);
}

AVX512 static inline __m512 vmin(__m512 a, __m512 b)
{
    __mmask16 take_b = _mm512_cmp_ps_mask(b, a, _CMP_LT_OQ) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    __m512 r = _mm512_mask_blend_ps(take_b, a, b);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), r, a);
}

AVX512 static inline __m512 combine16(int dtype, int op, void *const *srcs, int w, size_t i,
                                      __mmask16 k)
{
    __m512 acc = ld16(dtype, srcs[0], i, k);
    for (int r = 1; r < w; r++) {
        __m512 b = ld16(dtype, srcs[r], i, k);
        if (op == OP_SUM || op == OP_AVG)
            acc = _mm512_add_ps(acc, b);
        else if (op == OP_MAX)
            acc = vmax(acc, b);
        else
            acc = vmin(acc, b);
    }
    if (op == OP_AVG)
        acc = _mm512_div_ps(acc, _mm512_set1_ps((float)w));
    return acc;
}

/* bfloat16 round-to-nearest-even of two vectors at once: the rounded
 * high halves are packed with one vpackusdw and put back in order with one
 * vpermq (cheaper than two vpmovdw). */
AVX512 static inline __m512i bf16_round32(__m512 x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, nan);
}

static int have_bf16_insn = -1; /* AVX512_BF16 (and DQ) present and not switched off */

/* One instance per (dtype, op) so the branches above fold away. */
#define DEF_AVX512(NAME, DT, OP)                                                                \
    AVX512 static void NAME(void *dst, void *const *srcs, int w, size_t n)                      \
    {                                                                                           \
        size_t i = 0;                                                                           \
        for (; i + 32 <= n; i += 32) {                                                          \
            __m512 a = combine16(DT, OP, srcs, w, i, 0xffff);                                   \
            __m512 b = combine16(DT, OP, srcs, w, i + 16, 0xffff);                              \
            st16(DT, dst, i, a, 0xffff);                                                        \
            st16(DT, dst, i + 16, b, 0xffff);                                                   \
        }                                                                                       \
        for (; i < n; i += 16) {                                                                \
            __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);             \
            st16(DT, dst, i, combine16(DT, OP, srcs, w, i, k), k);                              \
        }                                                                                       \
    }
#define DEF_AVX512_OPS(D, DT)                                                                   \
    DEF_AVX512(avx512_##D##_sum, DT, OP_SUM)                                                    \
    DEF_AVX512(avx512_##D##_avg, DT, OP_AVG)                                                    \
    DEF_AVX512(avx512_##D##_max, DT, OP_MAX)                                                    \
    DEF_AVX512(avx512_##D##_min, DT, OP_MIN)
DEF_AVX512_OPS(f32, DT_F32)
DEF_AVX512_OPS(f16, DT_F16)

/*
 * bfloat16 with AVX512_BF16, 32 values per step: one 512-bit load per source
 * holds them all; as float32 the even ones are the low halves shifted up and
 * the odd ones the high halves masked (2 single-cycle ops, where widening two
 * halves costs 2 shuffles and 2 shifts).  Even and odd sums round together in
 * one vcvtne2ps2bf16 and one vpermw puts them back in order.  A step whose
 * sums hold a denormal (vfpclassps) rounds with the integer rule instead:
 * the instruction flushes them, torch keeps them.  Same arithmetic per
 * element as every other kernel, so the results are bitwise the same.
 */
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,avx512dq,avx512bf16")))

AVX512 static inline __m512 bf16_even(__m512i v)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

AVX512 static inline __m512 bf16_odd(__m512i v)
{
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

AVX512 static inline __m512 bf16_op(int op, __m512 a, __m512 b)
{
    if (op == OP_SUM || op == OP_AVG)
        return _mm512_add_ps(a, b);
    return op == OP_MAX ? vmax(a, b) : vmin(a, b);
}

#define DEF_BF16_PAIRS(NAME, OP, NATIVE, TARGET)                                                \
    TARGET static void NAME(void *dst, void *const *srcs, int w, size_t n)                  \
    {                                                                                           \
        const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,  \
                                               25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19,   \
                                               3, 18, 2, 17, 1, 16, 0);                         \
        size_t i = 0;                                                                           \
        for (; i + 32 <= n; i += 32) {                                                          \
            __m512i v = _mm512_loadu_si512((const uint16_t *)srcs[0] + i);                      \
            __m512 e = bf16_even(v), o = bf16_odd(v);                                           \
            for (int r = 1; r < w; r++) {                                                       \
                v = _mm512_loadu_si512((const uint16_t *)srcs[r] + i);                          \
                e = bf16_op(OP, e, bf16_even(v));                                               \
                o = bf16_op(OP, o, bf16_odd(v));                                                \
            }                                                                                   \
            if (OP == OP_AVG) {                                                                 \
                e = _mm512_div_ps(e, _mm512_set1_ps((float)w));                                 \
                o = _mm512_div_ps(o, _mm512_set1_ps((float)w));                                 \
            }                                                                                   \
            __m512i out;                                                                        \
            if (NATIVE && !(_mm512_fpclass_ps_mask(e, 0x20) | _mm512_fpclass_ps_mask(o, 0x20)))  \
                out = _mm512_permutexvar_epi16(order, (__m512i)BF16_CVT2(o, e));               \
            else                                                                                \
                out = _mm512_or_si512(bf16_round32(e), _mm512_slli_epi32(bf16_round32(o), 16)); \
            _mm512_storeu_si512((void *)((uint16_t *)dst + i), out);                            \
        }                                                                                       \
        for (; i < n; i += 16) {                                                                \
            __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);             \
            st16(DT_BF16, dst, i, combine16(DT_BF16, OP, srcs, w, i, k), k);                    \
        }                                                                                       \
    }
#define BF16_CVT2(o, e) _mm512_cvtne2ps_pbh(o, e)
DEF_BF16_PAIRS(bf16n_sum, OP_SUM, 1, AVX512BF16)
DEF_BF16_PAIRS(bf16n_avg, OP_AVG, 1, AVX512BF16)
DEF_BF16_PAIRS(bf16n_max, OP_MAX, 1, AVX512BF16)
DEF_BF16_PAIRS(bf16n_min, OP_MIN, 1, AVX512BF16)
#undef BF16_CVT2
#define BF16_CVT2(o, e) _mm512_castps_si512(o) /* not reached: NATIVE is 0 */
DEF_BF16_PAIRS(bf16i_sum, OP_SUM, 0, AVX512)
DEF_BF16_PAIRS(bf16i_avg, OP_AVG, 0, AVX512)
DEF_BF16_PAIRS(bf16i_max, OP_MAX, 0, AVX512)
DEF_BF16_PAIRS(bf16i_min, OP_MIN, 0, AVX512)
#undef BF16_CVT2

typedef void (*avx512_fn)(void *, void *const *, int, size_t);
static const avx512_fn avx512_kernels[3][OP_COUNT] = {
    {avx512_f32_sum, avx512_f32_avg, avx512_f32_max, avx512_f32_min},
    {bf16i_sum, bf16i_avg, bf16i_max, bf16i_min}, /* without AVX512_BF16 */
    {avx512_f16_sum, avx512_f16_avg, avx512_f16_max, avx512_f16_min},
};
static const avx512_fn bf16n_kernels[OP_COUNT] = {bf16n_sum, bf16n_avg, bf16n_max, bf16n_min};

static int have_avx512(void)
{
    static int v = -1;
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
            !getenv("TPCOMM_NO_AVX512");
        have_bf16_insn = __builtin_cpu_supports("avx512bf16") &&
                         __builtin_cpu_supports("avx512dq") && !getenv("TPCOMM_NO_AVX512BF16");
    }
    return v;
}
#endif

static void do_reduce(int dtype, int op, void *dst, void *const *srcs, int w, size_t n)
{
#if defined(__x86_64__)
    if (dtype <= DT_F16 && have_avx512()) {
        (dtype == DT_BF16 && have_bf16_insn ? bf16n_kernels : avx512_kernels[dtype])[op](dst, srcs,
                                                                                        w, n);
        return;
    }
#endif
    if (w == 2 && op == OP_SUM) {
        if (dtype == DT_F32) {
            sum2_f32(dst, srcs[0], srcs[1], n);
            return;
        }
        if (dtype == DT_BF16) {
            sum2_bf16(dst, srcs[0], srcs[1], n);
            return;
        }
    }
    reducers[dtype](dst, srcs, w, n, op);
}

/* ------------------------------------------------------------------------ */
/* helper threads: a rank's large copies and reductions split across cores   */
/* ------------------------------------------------------------------------ */

/*
 * A rank with cores to spare (TPCOMM_THREADS, by default the CPUs it may use
 * divided by the ranks on the host) splits every copy and reduction of at
 * least PAR_MIN bytes into 64-element slices, one per thread.  The slices are
 * elementwise, so results are bitwise the same for any thread count, and the
 * other ranks need not use the same count.  Helpers wait on a private futex.
 */
#define PAR_MIN (256u * 1024u)

typedef struct {
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
} pool_t;

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

static void pool_free(pool_t *P)
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

static pool_t *pool_new(int nthreads)
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

static void par_copy(pool_t *P, char *dst, const char *src, size_t n)
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

static void par_reduce(pool_t *P, int dtype, int op, void *dst, void *const *srcs, int w,
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

/*
 * Mapping owns the mmap of a segment: it unmaps in its destructor.  The
 * engine holds one reference, and torch.frombuffer(mapping) tensors hold
 * others, so memory a tensor views stays mapped as long as the tensor lives,
 * even after close() (which drops the engine's reference and the liveness
 * lock).
 */
typedef struct {
    PyObject_HEAD
    char *base;
    size_t size;
} Mapping;

static int map_getbuffer(Mapping *m, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)m, m->base, (Py_ssize_t)m->size, 0, flags);
}

static PyBufferProcs map_as_buffer = {(getbufferproc)map_getbuffer, NULL};

static void map_dealloc(Mapping *m)
{
    if (m->base)
        munmap(m->base, m->size);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tpcomm._native.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)map_dealloc,
    .tp_as_buffer = &map_as_buffer,
};

/* ------------------------------------------------------------------------ */
/* the engine object                                                         */
/* ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    char *base;
    size_t size;
    int fd;
    int rank;
    int world;
    uint64_t slot_bytes;
    size_t ctrl_bytes, slot_off, p2p_off, p2p_bytes, p2p_piece;
    uint64_t round;   /* last collective round this rank published */
    uint64_t timeout_ns;
    uint64_t spin_ns;  /* spin with pause this long before yielding */
    uint64_t yield_ns; /* then sched_yield until this long, then futex */
    int busy;        /* a thread is inside a call that touches the segment */
    int held;        /* hold() depth: a multi-call operation of thread `holder` */
    int rx_held;     /* a received header holds the engine until its body is read */
    unsigned long holder;
    int live;        /* on the live_engines list (holds its liveness lock) */
    void *next_live;
    int failed;      /* the communicator is unusable after a failure */
    int in_p2p;      /* inside a point-to-point wait (wait_p2p) */
    uint64_t fault_check_delay_ns; /* tests only: sleep before a slow wait's verdicts */
    int fault_cma_addr;            /* tests only: publish an unreadable input address */
    /* details of the last error, for Python's message */
    int err_rank;
    uint32_t err_kind, err_dtype, err_op;
    uint64_t err_count, err_arg, err_my_arg;
    uint64_t err_reason;
    void **srcs; /* scratch: world source pointers */
    /* fast path (see fast_all_reduce) */
    PyTypeObject *tensor_type;
    PyObject *ops[OP_COUNT];
    PyObject *dtypes[DT_COUNT];
    PyObject *fallback;
    PyObject *d_dtype, *d_is_cpu, *d_is_contiguous, *d_data_ptr, *d_numel, *d_is_neg;
    PyObject *d_is_conj, *d_shape;
    /* point-to-point fast path: every dtype a message may carry, by code */
    PyObject *any_dtypes[MAX_ANY];
    PyObject *empty_fn, *kw_dtype; /* torch.empty and ("dtype",): p2p_recv_new */
    size_t any_size[MAX_ANY];
    char any_complex[MAX_ANY]; /* only complex tensors can carry the conj bit */
    int n_any;
    uint32_t kind_all_reduce;
    PyObject *mapping; /* the Mapping that owns base */
    PyObject *pending; /* exception a signal handler raised during a wait */
    uint64_t twoshot_min; /* all-reduces of at least this many bytes go two-shot */
    int cma;              /* all ranks can read each other's memory (cma_init) */
    int err_errno;        /* the errno of a failed process_vm_readv (ST_CMA) */
    uint64_t cma_min;     /* all_gathers of at least this many bytes read the peers directly */
    uint64_t cma_word;    /* the word peers read to check they can (cma_init) */
    /* symmetric buffers (Communicator.empty): this rank's range and every
     * rank's base address of the same buffer, as mapped here */
    pool_t *pool; /* helper threads, NULL with one thread */
    /* point to point: chunks sent to / received from each rank, and the
     * receive in progress (between p2p_recv_head and p2p_recv_body) */
    uint64_t *p2p_sent, *p2p_recvd;
    uint64_t rx_k, rx_pos, rx_total;
    uint64_t rx_dl;  /* a message sent by reference: its data bytes, */
    Py_ssize_t rx_np; /* and how many pieces it lies in (0: sent by value) */
    size_t rx_used, rx_limit;
    int rx_src;
    int nsym;
    struct sym {
        char *base;
        size_t size;
        char **peers;
    } sym[MAX_SYM];
} Engine;

static inline hdr_t *HDR(Engine *e) { return (hdr_t *)e->base; }

static inline char *ctrl_of(Engine *e, int r) { return e->base + PAGE + (size_t)r * e->ctrl_bytes; }

static inline line_t *line_of(Engine *e, int r, int chan, int parity)
{
    return (line_t *)(ctrl_of(e, r) + LINE * (1 + 2 * chan + parity));
}

static inline char *slot_of(Engine *e, int r, int parity)
{
    return e->base + e->slot_off + ((size_t)r * 2 + parity) * e->slot_bytes;
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

static void futex_wake_all(_Atomic uint64_t *p)
{
    syscall(SYS_futex, futex_word(p), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Is the peer's liveness lock still held?  1 alive, 0 dead. */
static int peer_alive(Engine *e, int r)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = r;
    fl.l_len = 1;
    if (fcntl(e->fd, F_OFD_GETLK, &fl) != 0)
        return 1; /* cannot tell: assume alive, the deadline still holds */
    return fl.l_type != F_UNLCK;
}

static void set_abort(Engine *e, uint64_t reason, int rank)
{
    uint64_t want = (reason << 32) | (uint64_t)(rank + 1), zero = 0;
    atomic_compare_exchange_strong(&HDR(e)->abort_word, &zero, want);
    /* wake every sleeper on every line: aborts are rare */
    for (int r = 0; r < e->world; r++)
        for (int c = 0; c < NCHAN; c++)
            for (int p = 0; p < 2; p++)
                futex_wake_all(&line_of(e, r, c, p)->seq);
}

static int take_abort(Engine *e)
{
    uint64_t a = atomic_load_explicit(&HDR(e)->abort_word, memory_order_acquire);
    if (!a)
        return 0;
    e->err_reason = a >> 32;
    e->err_rank = (int)(a & 0xffffffffu) - 1;
    e->failed = 1;
    return 1;
}

/* Whether `peer` has entered a collective round this rank has not: it waits
 * there for this rank (its collective line holds a larger round number). */
static int peer_ahead(Engine *e, int peer)
{
    uint64_t a = atomic_load_explicit(&line_of(e, peer, 0, 0)->seq, memory_order_acquire);
    uint64_t b = atomic_load_explicit(&line_of(e, peer, 0, 1)->seq, memory_order_acquire);
    return (a > b ? a : b) > e->round;
}

/* Run Python's signal handlers from a wait (GIL released in *ts).  If one
 * raised, keep its exception for Python (reraise), fail the communicator and
 * tell the peers this rank is leaving: 1.  Else 0. */
static int signal_raised(Engine *e, PyThreadState **ts)
{
    PyEval_RestoreThread(*ts);
    int raised = PyErr_CheckSignals() < 0;
    if (raised) {
        Py_CLEAR(e->pending);
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb && value)
            PyException_SetTraceback(value, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        e->pending = value;
    }
    *ts = PyEval_SaveThread();
    if (raised) {
        e->err_rank = e->rank;
        e->failed = 1;
        set_abort(e, ST_INTERRUPTED, e->rank);
    }
    return raised;
}

/* The end of a slow wait's periodic checks: the deadline (over: it passed;
 * peer: the rank waited for), then Python's signal handlers every 50 ms:
 * Ctrl-C (or any handler that raises) must not wait for the timeout.  A
 * status, or ST_OK to go on waiting. */
static int deadline_and_signals(Engine *e, int over, int peer, uint64_t t, uint64_t *next_signal,
                                PyThreadState **ts)
{
    if (over) {
        e->err_rank = peer;
        e->failed = 1;
        set_abort(e, ST_TIMEOUT, e->rank);
        return ST_TIMEOUT;
    }
    if (t >= *next_signal) {
        *next_signal = t + 50000000ull;
        if (signal_raised(e, ts))
            return ST_INTERRUPTED;
    }
    return ST_OK;
}

/*
 * Wait until *seq >= n.  Spin (GIL held: most waits end here), then release
 * the GIL and yield, then sleep on the futex.  `peer` is the rank whose
 * liveness decides whether waiting still makes sense.  *ts holds the saved
 * thread state once the GIL has been released (the caller restores it).
 */
static int wait_seq(Engine *e, _Atomic uint64_t *seq, uint64_t n, int peer, PyThreadState **ts)
{
    if (atomic_load_explicit(seq, memory_order_acquire) >= n)
        return ST_OK;
    uint64_t t0 = now_ns(), t = t0;
    uint64_t deadline = t0 + e->timeout_ns;
    while (t - t0 < e->spin_ns) {
        for (int i = 0; i < 64; i++) {
            cpu_relax();
            if (atomic_load_explicit(seq, memory_order_acquire) >= n)
                return ST_OK;
        }
        t = now_ns();
    }
    if (*ts == NULL)
        *ts = PyEval_SaveThread();
    uint64_t next_check = t + 2000000ull; /* liveness every 2 ms */
    uint64_t next_signal = t + 50000000ull; /* Python signal handlers every 50 ms */
    hdr_t *h = HDR(e);
    for (;;) {
        uint64_t v = atomic_load_explicit(seq, memory_order_acquire);
        if (v >= n)
            return ST_OK;
        t = now_ns();
        if (t >= next_check) {
            next_check = t + 2000000ull;
            if (take_abort(e))
                return ST_ABORTED;
            if (!peer_alive(e, peer)) {
                if (atomic_load_explicit(seq, memory_order_acquire) >= n)
                    return ST_OK; /* it published, then left: fine */
                e->err_rank = peer;
                e->failed = 1;
                set_abort(e, ST_PEER_DEAD, peer);
                return ST_PEER_DEAD;
            }
            if (e->in_p2p && peer_ahead(e, peer)) {
                /* this rank waits for the peer in a send or recv while the peer
                 * waits for this rank in a collective: neither can move, so
                 * both (and every rank of the communicator) fail now instead
                 * of at the timeout */
                if (atomic_load_explicit(seq, memory_order_acquire) >= n)
                    return ST_OK;
                e->err_rank = peer;
                e->failed = 1;
                set_abort(e, ST_CROSSED, e->rank);
                return ST_CROSSED;
            }
            int st = deadline_and_signals(e, t >= deadline, peer, t, &next_signal, ts);
            if (st != ST_OK)
                return st;
        }
        if (t - t0 < e->yield_ns) {
            sched_yield();
            continue;
        }
        /* sleep: announce, re-check, wait on the futex (bounded), retract */
        atomic_fetch_add_explicit(&h->sleepers, 1, memory_order_seq_cst);
        v = atomic_load_explicit(seq, memory_order_seq_cst);
        if (v < n && !atomic_load_explicit(&h->abort_word, memory_order_relaxed)) {
            struct timespec to = {0, 2000000}; /* 2 ms: the liveness period */
            syscall(SYS_futex, futex_word(seq), FUTEX_WAIT, (uint32_t)v, &to, NULL, 0);
        }
        atomic_fetch_sub_explicit(&h->sleepers, 1, memory_order_relaxed);
    }
}

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
    atomic_store_explicit(&l->seq, n, memory_order_release);
    if (atomic_load_explicit(&HDR(e)->sleepers, memory_order_relaxed))
        futex_wake_all(&l->seq);
}

/*
 * One round on the collective channel: fill in the metadata, publish, wait
 * for every peer, check they all called the same thing.  Copy-in happens
 * before (the caller writes its slot).  Returns a status code.
 */
/* wait_seq for a point-to-point counter: also notices a peer stuck in a
 * collective (ST_CROSSED) */
static int wait_p2p(Engine *e, _Atomic uint64_t *seq, uint64_t n, int peer, PyThreadState **ts)
{
    e->in_p2p = 1;
    int st = wait_seq(e, seq, n, peer, ts);
    e->in_p2p = 0;
    return st;
}

static int round_sync(Engine *e, uint32_t kind, uint32_t dtype, uint32_t op, uint64_t count,
                      uint64_t arg, PyThreadState **ts)
{
    uint64_t n = ++e->round;
    int p = (int)(n & 1);
    line_t *mine = line_of(e, e->rank, 0, p);
    mine->kind = kind;
    mine->dtype = dtype;
    mine->op = op;
    mine->count = count;
    mine->arg = arg;
    publish(e, mine, n);
    int mismatch = -1;
    for (int i = 1; i < e->world; i++) {
        int r = (e->rank + i) % e->world; /* stagger: ranks look at different peers first */
        line_t *l = line_of(e, r, 0, p);
        int st = wait_seq(e, &l->seq, n, r, ts);
        if (st != ST_OK)
            return st;
        if (mismatch < 0 && (l->kind != kind || l->dtype != dtype || l->op != op ||
                             l->count != count || l->arg != arg)) {
            mismatch = r;
            e->err_rank = r;
            e->err_kind = l->kind;
            e->err_dtype = l->dtype;
            e->err_op = l->op;
            e->err_count = l->count;
            e->err_arg = l->arg;
            e->err_my_arg = arg;
        }
    }
    return mismatch >= 0 ? ST_MISMATCH : ST_OK;
}

/* ------------------------------------------------------------------------ */
/* Python methods                                                            */
/* ------------------------------------------------------------------------ */

#define GIL_RELEASE_BYTES (256u * 1024u) /* below this, the op is shorter than the GIL round trip matters */

/* Set in a child made by fork() (see after_fork_child). */
static int forked_child;

static PyObject *eng_closed_error(void)
{
    PyErr_SetString(PyExc_RuntimeError,
                    forked_child ? "tpcomm engine is closed, or was inherited through fork(): a "
                                   "child process cannot use its parent's Communicator"
                                 : "tpcomm engine is closed");
    return NULL;
}

/* Whether a call of this thread must wait its turn: another thread is inside
 * a call, or holds the engine across several (hold(), a received header).  A
 * Communicator serves one thread at a time (docs/ENGINE.md, "Threads"). */
static inline int other_thread(Engine *e)
{
    return e->busy || (e->held && e->holder != PyThread_get_thread_ident());
}

/* Start a call: 0 go (busy is set), -1 error, or a status: ST_BUSY (another
 * thread is in; nothing touched, the communicator stays usable) or
 * ST_ABORTED. */
static int enter(Engine *e)
{
    if (!e->base) {
        eng_closed_error();
        return -1;
    }
    if (other_thread(e))
        return ST_BUSY;
    if (e->failed || take_abort(e))
        return ST_ABORTED;
    e->busy = 1;
    return 0;
}

/* The status a call that skipped enter() returns before starting, or 0. */
static inline int refuse(Engine *e)
{
    if (other_thread(e))
        return ST_BUSY;
    return e->failed || take_abort(e) ? ST_ABORTED : 0;
}

/*
 * Two-shot step for one chunk of m elements at src: the chunk is cut into W
 * shards (32-element aligned); rank r reduces shard r only.
 *   round n   (slot p):   every rank copies in all shards but its own, publishes;
 *                         rank r reduces shard r from everyone's slot p (its own
 *                         part from src) into src, and copies it to its slot 1-p
 *   round n+1 (slot 1-p): publish; every rank copies the other shards' results
 *                         from their owners' slot 1-p into src.
 * Slot 1-p is free when it is written: it was last read in round n-1, and every
 * peer published round n, so every peer is done with n-1.  Each rank reads
 * 2(W-1)/W of the chunk from its peers instead of (W-1), and reduces 1/W.
 */
static int twoshot_chunk(Engine *e, char *src, size_t m, int dtype, int op, uint32_t kind,
                         uint64_t count, PyThreadState **ts)
{
    const size_t es = dt_size[dtype];
    const int w = e->world, me = e->rank;
    size_t shard = ((m + (size_t)w - 1) / (size_t)w + 31) & ~(size_t)31;
#define SHARD_LO(j) ((size_t)(j) * shard < m ? (size_t)(j) * shard : m)
    const size_t lo = SHARD_LO(me), hi = SHARD_LO(me + 1);
    int p = (int)((e->round + 1) & 1);
    char *in = slot_of(e, me, p);
    par_copy(e->pool, in, src, lo * es);
    par_copy(e->pool, in + hi * es, src + hi * es, (m - hi) * es);
    int st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, 2, ts);
    if (st != ST_OK)
        return st;
    for (int r = 0; r < w; r++)
        e->srcs[r] = r == me ? (void *)(src + lo * es) : (void *)(slot_of(e, r, p) + lo * es);
    par_reduce(e->pool, dtype, op, src + lo * es, e->srcs, w, hi - lo);
    par_copy(e->pool, slot_of(e, me, 1 - p) + lo * es, src + lo * es, (hi - lo) * es);
    st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, 2, ts);
    if (st != ST_OK)
        return st;
    for (int i = 1; i < w; i++) {
        int j = (me + i) % w;
        size_t jlo = SHARD_LO(j), jhi = SHARD_LO(j + 1);
        par_copy(e->pool, src + jlo * es, slot_of(e, j, 1 - p) + jlo * es, (jhi - jlo) * es);
    }
#undef SHARD_LO
    return ST_OK;
}

/*
 * Zero-copy all-reduce of a tensor that lives in a symmetric buffer: every
 * rank reads its peers' tensors where they are, so nothing is copied in.
 *   round 1: everyone's data is ready;
 *   rank r reduces shard r of every rank's tensor, in rank order, into shard r
 *   of its own (only rank r ever reads shard r of anyone, so writing it in
 *   place is safe);
 *   round 2: every shard is reduced; each rank copies the other shards from
 *   their owners' tensors into its own;
 *   round 3: nobody reads this rank's tensor any more: the caller may change it.
 * The metadata arg carries the buffer and offset, so ranks whose tensors are
 * not at the same place in the same buffer get a mismatch error.
 */
static int zero_copy_all_reduce(Engine *e, struct sym *sb, size_t off, size_t count, int dtype,
                                int op, uint32_t kind, uint64_t arg, PyThreadState **ts)
{
    const size_t es = dt_size[dtype];
    const int w = e->world, me = e->rank;
    size_t shard = ((count + (size_t)w - 1) / (size_t)w + 31) & ~(size_t)31;
#define ZC_LO(j) ((size_t)(j) * shard < count ? (size_t)(j) * shard : count)
    int st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, arg, ts);
    if (st != ST_OK)
        return st;
    const size_t lo = ZC_LO(me), hi = ZC_LO(me + 1);
    for (int r = 0; r < w; r++)
        e->srcs[r] = sb->peers[r] + off + lo * es;
    par_reduce(e->pool, dtype, op, sb->base + off + lo * es, e->srcs, w, hi - lo);
    st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, arg, ts);
    if (st != ST_OK)
        return st;
    for (int i = 1; i < w; i++) {
        int j = (me + i) % w;
        size_t jlo = ZC_LO(j), jhi = ZC_LO(j + 1);
        par_copy(e->pool, sb->base + off + jlo * es, sb->peers[j] + off + jlo * es,
                 (jhi - jlo) * es);
    }
#undef ZC_LO
    return round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, arg, ts);
}

static struct sym *find_sym(Engine *e, const char *t, size_t bytes)
{
    for (int i = 0; i < e->nsym; i++)
        if (t >= e->sym[i].base && t + bytes <= e->sym[i].base + e->sym[i].size)
            return &e->sym[i];
    return NULL;
}

/*
 * The chunked all-reduce of `count` elements at t, in place: one-shot (every
 * rank reduces the whole chunk: one round) below twoshot_min bytes, two-shot
 * (two rounds) from there.  The choice travels in the metadata (arg 1 or 2),
 * so ranks configured differently get a mismatch error, not garbage.
 */
static int run_all_reduce(Engine *e, char *t, size_t count, int dtype, int op, uint32_t kind)
{
    const size_t es = dt_size[dtype];
    const size_t chunk = e->slot_bytes / es;
    const int two = count * es >= e->twoshot_min;
    PyThreadState *ts = NULL;
    if (count * es >= GIL_RELEASE_BYTES)
        ts = PyEval_SaveThread();
    int st = ST_OK;
    size_t done = 0;
    e->busy = 1;
    struct sym *sb = e->nsym && count * es >= e->twoshot_min ? find_sym(e, t, count * es) : NULL;
    if (sb) {
        size_t off = (size_t)(t - sb->base);
        uint64_t arg = ARG_ZERO_COPY | ((uint64_t)(sb - e->sym) << 8) | ((uint64_t)off << 16);
        st = zero_copy_all_reduce(e, sb, off, count, dtype, op, kind, arg, &ts);
        count = 0; /* done */
    }
    for (int first = !sb; first || done < count; first = 0) {
        size_t m = count - done < chunk ? count - done : chunk;
        char *src = t + done * es;
        if (two) {
            st = twoshot_chunk(e, src, m, dtype, op, kind, (uint64_t)count, &ts);
        } else {
            int p = (int)((e->round + 1) & 1);
            par_copy(e->pool, slot_of(e, e->rank, p), src, m * es);
            st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, (uint64_t)count, 1, &ts);
            if (st == ST_OK) {
                for (int r = 0; r < e->world; r++)
                    e->srcs[r] = r == e->rank ? (void *)src : (void *)slot_of(e, r, p);
                par_reduce(e->pool, dtype, op, src, e->srcs, e->world, m);
            }
        }
        if (st != ST_OK)
            break;
        done += m;
    }
    if (ts)
        PyEval_RestoreThread(ts);
    e->busy = 0;
    return st;
}

/* all_reduce(ptr, count, dtype, op, kind) -> status */
static PyObject *eng_all_reduce(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "all_reduce expects 5 arguments");
        return NULL;
    }
    unsigned long long addr = PyLong_AsUnsignedLongLong(args[0]);
    long long count = PyLong_AsLongLong(args[1]);
    long dtype = PyLong_AsLong(args[2]);
    long op = PyLong_AsLong(args[3]);
    long kind = PyLong_AsLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (dtype < 0 || dtype >= DT_COUNT || op < 0 || op >= OP_COUNT || count < 0) {
        PyErr_SetString(PyExc_ValueError, "all_reduce: bad dtype, op or count code");
        return NULL;
    }
    int en = enter(e);
    if (en < 0)
        return NULL;
    if (en > 0)
        return PyLong_FromLong(en);
    int st = run_all_reduce(e, (char *)(uintptr_t)addr, (size_t)count, (int)dtype, (int)op,
                            (uint32_t)kind);
    return PyLong_FromLong(st);
}

/*
 * fast_all_reduce(tensor, op=SUM): the whole of Communicator.all_reduce for
 * the common case, in one C call.  Torch attribute access costs ~100 ns each
 * through Python, so the Python wrapper alone used to cost more than the
 * collective.  Anything unusual (a subclass, another device, a view that is
 * not contiguous, an unknown dtype or op, keywords, an error) goes to the
 * Python fallback set with set_fast_path(), which does the full checks and
 * raises the proper exceptions: fallback(tensor, op, status).
 */
static PyObject *S_dtype, *S_is_cpu, *S_is_contiguous, *S_data_ptr, *S_numel, *S_is_neg;
static PyObject *S_is_conj, *S_shape;

/* Call a descriptor resolved on the tensor type once (see set_fast_path):
 * skips the per-call attribute lookup and bound-method object. */
static inline PyObject *descr_get(PyObject *descr, PyObject *t)
{
    return Py_TYPE(descr)->tp_descr_get(descr, t, (PyObject *)Py_TYPE(t));
}

static inline PyObject *descr_call(PyObject *descr, PyObject *t)
{
    return PyObject_Vectorcall(descr, &t, 1, NULL);
}

static PyObject *call_fallback(Engine *e, PyObject *t, PyObject *op, int status)
{
    if (!e->fallback) {
        PyErr_SetString(PyExc_RuntimeError, "tpcomm: the fast path has no fallback");
        return NULL;
    }
    PyObject *target = PyObject_CallNoArgs(e->fallback); /* a weakref.WeakMethod */
    if (!target)
        return NULL;
    if (target == Py_None) {
        Py_DECREF(target);
        PyErr_SetString(PyExc_RuntimeError, "tpcomm: the Communicator is gone");
        return NULL;
    }
    PyObject *st = PyLong_FromLong(status);
    PyObject *res = st ? PyObject_CallFunctionObjArgs(target, t, op, st, NULL) : NULL;
    Py_XDECREF(st);
    Py_DECREF(target);
    return res;
}

/* Is t.<descr> (called when `call`) the object `want` (Py_True or Py_False)?
 * An error counts as no. */
static int attr_is(PyObject *t, PyObject *descr, int call, PyObject *want)
{
    PyObject *v = call ? descr_call(descr, t) : descr_get(descr, t);
    if (!v) {
        PyErr_Clear();
        return 0;
    }
    int r = v == want;
    Py_DECREF(v);
    return r;
}

static PyObject *eng_fast_all_reduce(Engine *e, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw < 1 || nargs + nkw > 2) {
        PyErr_Format(PyExc_TypeError, "all_reduce() takes 1 or 2 arguments (%zd given)",
                     nargs + nkw);
        return NULL;
    }
    PyObject *t = nargs > 0 ? args[0] : NULL;
    PyObject *op = nargs > 1 ? args[1] : NULL;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_CompareWithASCIIString(k, "tensor") == 0 && !t)
            t = args[nargs + i];
        else if (PyUnicode_CompareWithASCIIString(k, "op") == 0 && !op)
            op = args[nargs + i];
        else {
            PyErr_Format(PyExc_TypeError, "all_reduce() got an unexpected keyword argument %R", k);
            return NULL;
        }
    }
    if (!t) {
        PyErr_SetString(PyExc_TypeError, "all_reduce() missing required argument 'tensor'");
        return NULL;
    }
    if (!op)
        op = e->ops[OP_SUM];
    int opc = -1, dtc = -1;
    if (!e->base || other_thread(e) || e->failed || Py_TYPE(t) != e->tensor_type)
        return call_fallback(e, t, op, 0);
    for (int i = 0; i < OP_COUNT; i++)
        if (op == e->ops[i])
            opc = i;
    PyObject *dt = descr_get(e->d_dtype, t);
    if (!dt)
        return NULL;
    for (int i = 0; i < DT_COUNT; i++)
        if (dt == e->dtypes[i])
            dtc = i;
    Py_DECREF(dt);
    /* a negative view's memory holds the negated values (the reduce dtypes
     * are real, so no conjugate bit): only is_neg() False qualifies */
    if (opc < 0 || dtc < 0 || (opc == OP_AVG && dtc >= DT_I32) ||
        !attr_is(t, e->d_is_cpu, 0, Py_True) || !attr_is(t, e->d_is_contiguous, 1, Py_True) ||
        !attr_is(t, e->d_is_neg, 1, Py_False))
        return call_fallback(e, t, op, 0);
    PyObject *pv = descr_call(e->d_data_ptr, t);
    if (!pv)
        return NULL;
    PyObject *nv = descr_call(e->d_numel, t);
    if (!nv) {
        Py_DECREF(pv);
        return NULL;
    }
    uintptr_t addr = (uintptr_t)PyLong_AsUnsignedLongLong(pv);
    long long count = PyLong_AsLongLong(nv);
    Py_DECREF(pv);
    Py_DECREF(nv);
    if (PyErr_Occurred())
        return NULL;
    if (take_abort(e))
        return call_fallback(e, t, op, ST_ABORTED);
    int st = run_all_reduce(e, (char *)addr, (size_t)count, dtc, opc, e->kind_all_reduce);
    if (st != ST_OK)
        return call_fallback(e, t, op, st);
    Py_INCREF(t);
    return t;
}

/* set_fast_path(tensor_type, (ops...), (dtypes...), kind, fallback) */
static PyObject *eng_set_fast_path(Engine *e, PyObject *args)
{
    PyObject *tt, *ops, *dts, *fb;
    unsigned int kind;
    if (!PyArg_ParseTuple(args, "O!O!O!IO", &PyType_Type, &tt, &PyTuple_Type, &ops, &PyTuple_Type,
                          &dts, &kind, &fb))
        return NULL;
    if (PyTuple_GET_SIZE(ops) != OP_COUNT || PyTuple_GET_SIZE(dts) != DT_COUNT) {
        PyErr_SetString(PyExc_ValueError, "set_fast_path: wrong number of ops or dtypes");
        return NULL;
    }
    Py_INCREF(tt);
    Py_XSETREF(e->tensor_type, (PyTypeObject *)tt);
    for (int i = 0; i < OP_COUNT; i++) {
        Py_INCREF(PyTuple_GET_ITEM(ops, i));
        Py_XSETREF(e->ops[i], PyTuple_GET_ITEM(ops, i));
    }
    for (int i = 0; i < DT_COUNT; i++) {
        Py_INCREF(PyTuple_GET_ITEM(dts, i));
        Py_XSETREF(e->dtypes[i], PyTuple_GET_ITEM(dts, i));
    }
    Py_INCREF(fb);
    Py_XSETREF(e->fallback, fb);
    /* Resolve the tensor type's accessors once; only C descriptors qualify
     * (a Python override would need the ordinary lookup). */
    PyObject *names[8] = {S_dtype, S_is_cpu, S_is_contiguous, S_data_ptr,
                          S_numel, S_is_neg, S_is_conj,       S_shape};
    PyObject **slots[8] = {&e->d_dtype, &e->d_is_cpu, &e->d_is_contiguous, &e->d_data_ptr,
                           &e->d_numel, &e->d_is_neg, &e->d_is_conj,       &e->d_shape};
    for (int i = 0; i < 8; i++) {
        PyObject *d = _PyType_Lookup((PyTypeObject *)tt, names[i]);
        if (!d || !(Py_IS_TYPE(d, &PyGetSetDescr_Type) || Py_IS_TYPE(d, &PyMethodDescr_Type))) {
            PyErr_Format(PyExc_TypeError, "set_fast_path: %R.%U is not a C accessor", tt,
                         names[i]);
            return NULL;
        }
        Py_INCREF(d);
        Py_XSETREF(*slots[i], d);
    }
    e->kind_all_reduce = kind;
    Py_RETURN_NONE;
}


/*
 * sync(kind, dtype, op, count, arg) -> status: one collective round for the
 * protocols written in Python (barrier, all_gather, reduce_scatter, ...):
 * publish this rank's metadata, wait for every peer, compare.  The caller
 * wrote its slot for parity (round + 1) & 1 before, and reads the peers'
 * slots of that parity after.
 */
static PyObject *eng_sync(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "sync expects 5 arguments");
        return NULL;
    }
    unsigned long kind = PyLong_AsUnsignedLong(args[0]);
    unsigned long dtype = PyLong_AsUnsignedLong(args[1]);
    unsigned long op = PyLong_AsUnsignedLong(args[2]);
    unsigned long long count = PyLong_AsUnsignedLongLong(args[3]);
    unsigned long long arg = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    int en = enter(e);
    if (en < 0)
        return NULL;
    if (en > 0)
        return PyLong_FromLong(en);
    PyThreadState *ts = NULL;
    int st = round_sync(e, (uint32_t)kind, (uint32_t)dtype, (uint32_t)op, count, arg, &ts);
    if (ts)
        PyEval_RestoreThread(ts);
    e->busy = 0;
    return PyLong_FromLong(st);
}

/*
 * The data-moving rounds of protocols.py in C: the loops there cost 5-8 us of
 * Python per call on the development VM, more than the copies of a small
 * message.  Each round: copy this rank's part into its slot of parity
 * (round + 1) & 1, publish and compare the metadata (round_sync), copy out of
 * the peers' slots.  Slot p is rewritten only two rounds later, after every
 * peer published the round in between, so it was read by then.  Plain
 * memcpy both ways, as the Python loops they replace did: the non-temporal
 * copy_in made no difference that stood out of the noise (16 MiB gather,
 * world 2: 4.4-4.7 ms with it, 3.3-4.9 ms without, three runs each).
 */

/* Parse a list of `world` non-negative ints into v (PyMem); -1 with an exception */
static int int_list(Engine *e, PyObject *o, size_t **v, const char *fn)
{
    if (!PyList_Check(o) || PyList_GET_SIZE(o) != e->world) {
        PyErr_Format(PyExc_ValueError, "%s: expected a list of %d sizes", fn, e->world);
        return -1;
    }
    *v = PyMem_Calloc((size_t)e->world + 1, sizeof(size_t));
    if (!*v) {
        PyErr_NoMemory();
        return -1;
    }
    for (int r = 0; r < e->world; r++) {
        long long x = PyLong_AsLongLong(PyList_GET_ITEM(o, r));
        if (x < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%s: negative size", fn);
            PyMem_Free(*v);
            return -1;
        }
        (*v)[r] = (size_t)x;
    }
    return 0;
}

/* The `want` arguments as unsigned 64-bit ints (None and lists read as 0:
 * the caller takes those from args itself); -1 with an exception */
static int u64_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *fn,
                    unsigned long long *v)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s expects %zd arguments", fn, want);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++)
        v[i] = args[i] == Py_None || PyList_Check(args[i]) ? 0
                                                           : PyLong_AsUnsignedLongLong(args[i]);
    return PyErr_Occurred() ? -1 : 0;
}

static inline size_t part_of(size_t have, size_t lo, size_t cap)
{
    return have > lo ? (have - lo < cap ? have - lo : cap) : 0;
}

/*
 * Blocked layouts (a collective along a dim other than 0): a tensor of `outer`
 * rows, each row the ranks' blocks side by side.  Rank r's contribution (or
 * shard) is its blocks, one per row, of blk bytes at byte offset off of every
 * row of row bytes; counted in that order, byte q of it is byte q % blk of
 * block q / blk.  With outer 1 the contribution is the contiguous range at off.
 */
static void put_blocks(char *out, const char *src, size_t q, size_t n, size_t blk, size_t row,
                       size_t off)
{
    while (n) {
        size_t a = q / blk, in = q % blk, m = blk - in < n ? blk - in : n;
        memcpy(out + a * row + off + in, src, m);
        src += m;
        q += m;
        n -= m;
    }
}

/* the inverse of put_blocks: n bytes of the contribution, from byte q on, to dst */
static void take_blocks(char *dst, const char *x, size_t q, size_t n, size_t blk, size_t row,
                        size_t off)
{
    while (n) {
        size_t a = q / blk, in = q % blk, m = blk - in < n ? blk - in : n;
        memcpy(dst, x + a * row + off + in, m);
        dst += m;
        q += m;
        n -= m;
    }
}

static int plain_info(Engine *e, PyObject *t, int *code, char **addr, long long *n);

/* enter() for the collectives below: 0 go, 1 aborted (status), -1 error */
static int enter_data(Engine *e, size_t bytes, PyThreadState **ts)
{
    int en = enter(e);
    if (en == 0 && bytes >= GIL_RELEASE_BYTES)
        *ts = PyEval_SaveThread();
    return en;
}

/* the end of what enter_data began; returns st */
static int leave_data(Engine *e, int st, PyThreadState *ts)
{
    if (ts)
        PyEval_RestoreThread(ts);
    e->busy = 0;
    return st;
}

/* A status as the Python methods return it: NULL (-1, exception) or
 * the status */
static PyObject *status_result(int st)
{
    return st < 0 ? NULL : PyLong_FromLong(st);
}

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

/* world copies of v (PyMem), or NULL with MemoryError */
static size_t *even_sizes(Engine *e, size_t v)
{
    size_t *a = PyMem_Malloc((size_t)e->world * sizeof(size_t));
    if (!a) {
        PyErr_NoMemory();
        return NULL;
    }
    for (int r = 0; r < e->world; r++)
        a[r] = v;
    return a;
}

static int gather_rounds(Engine *e, uint32_t kind, const char *mine, const size_t *cnt, char *out,
                         char *const *dsts, uint32_t dtype, uint64_t numel, uint64_t arg,
                         size_t outer);

/* 0 when outer (> 0) divides every count; else -1 with ValueError */
static int check_outer(Engine *e, const size_t *cnt, unsigned long long outer, const char *fn)
{
    int ok = outer > 0;
    for (int r = 0; ok && r < e->world; r++)
        ok = cnt[r] % outer == 0;
    if (!ok)
        PyErr_Format(PyExc_ValueError, "%s: %llu rows do not divide every rank's part", fn, outer);
    return ok ? 0 : -1;
}

/* gatherv(kind, mine, [bytes per rank], out | [address per rank] | None, dtype, numel,
 * arg, outer) -> status: every rank's bytes, in rank order, at out (None: this
 * rank receives nothing; a list: rank r's bytes at its own address, outer 1);
 * with outer rows (put_blocks), rank r's bytes are outer blocks and row a of
 * out is every rank's block a in rank order */
static PyObject *eng_gatherv(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[8];
    size_t *cnt, *at = NULL;
    char **dsts = NULL;
    if (u64_args(args, nargs, 8, "gatherv", v) < 0 || int_list(e, args[2], &cnt, "gatherv") < 0)
        return NULL;
    int st = check_outer(e, cnt, v[7], "gatherv");
    if (st == 0 && PyList_Check(args[3])) {
        st = v[7] == 1 ? int_list(e, args[3], &at, "gatherv") : -1;
        if (v[7] != 1)
            PyErr_SetString(PyExc_ValueError, "gatherv: a list of destinations takes no rows");
        dsts = st == 0 ? PyMem_Calloc((size_t)e->world, sizeof(char *)) : NULL;
        if (st == 0 && !dsts) {
            PyErr_NoMemory();
            st = -1;
        }
        for (int r = 0; st == 0 && r < e->world; r++)
            dsts[r] = (char *)(uintptr_t)at[r];
    }
    if (st == 0)
        st = gather_rounds(e, (uint32_t)v[0], (const char *)(uintptr_t)v[1], cnt,
                           (char *)(uintptr_t)v[3], dsts, (uint32_t)v[4], v[5], v[6],
                           (size_t)v[7]);
    PyMem_Free(cnt);
    PyMem_Free(at);
    PyMem_Free(dsts);
    return status_result(st);
}

/* The key of a flat, even layout: protocols.flat_key, bit for bit */
static uint64_t flat_key(uint64_t kind, uint64_t n, uint64_t world)
{
    uint64_t x = kind * 0x100000001B3ull;
    x ^= n * 0x9E3779B97F4A7C15ull;
    x ^= world << 48;
    return x & 0x7FFFFFFFFFFFFFFFull;
}

/* The rounds of the one-call gathers: every rank's n elements of dtype code
 * `code` at `mine`, in rank order, at out (NULL: this rank receives nothing),
 * keyed flat_key(kind + tag, n, w) as protocols.layout_key keys a flat, even
 * layout (tag: 0 without a root, (root + 1) << 32 with one) */
static PyObject *flat_gather(Engine *e, uint32_t kind, uint64_t tag, const char *mine, int code,
                             long long n, char *out)
{
    size_t *cnt = even_sizes(e, (size_t)n * e->any_size[code]);
    if (!cnt)
        return NULL;
    uint64_t key = flat_key((uint64_t)kind + tag, (uint64_t)n, (uint64_t)e->world);
    int st = gather_rounds(e, kind, mine, cnt, out, NULL, (uint32_t)code,
                           (uint64_t)n * (uint64_t)e->world, key, 1);
    PyMem_Free(cnt);
    return status_result(st);
}

/*
 * fast_all_gather(output, input, kind) -> status, or None: the torch-style
 * all_gather_into_tensor's common case in one call (plain tensors of one
 * dtype, output = world x input elements); None sends the caller down the
 * general path.  The metadata is the general path's (its layout key is
 * protocols.flat_key for this layout).
 */
static PyObject *eng_fast_all_gather(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !e->base || e->failed || !e->n_any || !e->d_numel ||
        !PyLong_CheckExact(args[2]))
        Py_RETURN_NONE;
    long kind = PyLong_AsLong(args[2]);
    int ci;
    char *ai, *ao;
    long long ni;
    if (kind < 0 || flat_pair(e, args[0], args[1], &ci, &ao, &ai, &ni) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return flat_gather(e, (uint32_t)kind, 0, ai, ci, ni, ao);
}

/*
 * fast_gather(input, out | None, dst, kind) -> status, or None: gather's
 * common case in one call (a plain 1-d input; on dst a plain out of the same
 * dtype with world x its elements; the caller checks the dims).  None: the
 * general path.  The key is protocols.layout_key's for a flat, even layout with
 * a root: flat_key(kind + ((dst + 1) << 32), n, w).
 */
static PyObject *eng_fast_gather(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !e->base || e->failed || !e->n_any || !e->d_numel ||
        !PyLong_CheckExact(args[2]) || !PyLong_CheckExact(args[3]))
        Py_RETURN_NONE;
    long dst = PyLong_AsLong(args[2]), kind = PyLong_AsLong(args[3]);
    int ci, co;
    char *ai, *ao = NULL;
    long long ni, no;
    if (dst < 0 || dst >= e->world || kind < 0 || plain_info(e, args[0], &ci, &ai, &ni) < 0 ||
        (dst == e->rank && (args[1] == Py_None || plain_info(e, args[1], &co, &ao, &no) < 0 ||
                            co != ci || no != ni * e->world))) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return flat_gather(e, (uint32_t)kind, (uint64_t)(dst + 1) << 32, ai, ci, ni,
                       dst == e->rank ? ao : NULL);
}

/*
 * Single-copy all_gather (cross-memory attach, as Open MPI's shared-memory
 * transport does for large messages): instead of copying its input into its
 * slot for the peers to copy out, every rank publishes where its input is and
 * reads each peer's input straight into its own result with
 * process_vm_readv(2); a second round keeps every input in place until all
 * ranks have read it.  Half the bytes of the two-copy path cross memory.
 * Used when cma_init found that every rank can read every other one (same
 * user, no Yama or seccomp refusal) and the gather moves at least cma_min
 * bytes; the decision depends only on what every rank shares, so all ranks
 * take the same path.
 */
#define KIND_ALL_GATHER 3u /* shm/engine.py KIND_ALL_GATHER (checked by a test) */
#define CMA_PIECE (4u << 20) /* bytes per process_vm_readv: aborts are seen between */

static uint64_t cma_tag(uint64_t pid, int rank)
{
    return (0x747063636d61ull << 16) ^ (pid * 0x9E3779B97F4A7C15ull) ^ (uint64_t)rank;
}

static inline int peer_pid(Engine *e, int r) { return (int)*(uint64_t *)ctrl_of(e, r); }

/* Fault injection (tests only, fault_check_delay): sleep where a race can be widened */
static void fault_pause(Engine *e)
{
    if (e->fault_check_delay_ns) {
        struct timespec d = {(time_t)(e->fault_check_delay_ns / 1000000000ull),
                             (long)(e->fault_check_delay_ns % 1000000000ull)};
        nanosleep(&d, NULL);
    }
}

#define CMA_IOV 256 /* blocks per process_vm_readv */
#define CMA_MIN_BLOCK 4096u /* smaller blocks of a row layout: the copy path */

/* A process_vm_readv from rank r failed with err: the peer died
 * (ST_PEER_DEAD), or it is alive and its memory could not be read (ST_CMA). */
static int cma_failed(Engine *e, int r, int err)
{
    if (take_abort(e))
        return ST_ABORTED;
    e->err_rank = r;
    e->failed = 1;
    if (!peer_alive(e, r)) {
        set_abort(e, ST_PEER_DEAD, r);
        return ST_PEER_DEAD;
    }
    e->err_errno = err;
    set_abort(e, ST_CMA, e->rank);
    return ST_CMA;
}

/* CMA_IOV iovecs at most, CMA_PIECE bytes at most, from byte `off` of piece
 * i of the (address, length) pairs p[0..2n) on; how many */
static int iov_fill(const uint64_t *p, Py_ssize_t n, Py_ssize_t i, uint64_t off, struct iovec *v)
{
    int k = 0;
    size_t bytes = 0;
    for (; i < n && k < CMA_IOV && bytes < CMA_PIECE; i++, off = 0) {
        uint64_t m = p[2 * i + 1] - off;
        if (!m)
            continue;
        if (m > CMA_PIECE - bytes)
            m = CMA_PIECE - bytes;
        v[k].iov_base = (void *)(uintptr_t)(p[2 * i] + off);
        v[k++].iov_len = (size_t)m;
        bytes += (size_t)m;
    }
    return k;
}

static void iov_skip(const uint64_t *p, Py_ssize_t n, Py_ssize_t *i, uint64_t *off, size_t by)
{
    while (by && *i < n) {
        uint64_t left = p[2 * *i + 1] - *off;
        if (by < left) {
            *off += by;
            return;
        }
        by -= (size_t)left;
        (*i)++;
        *off = 0;
    }
}

/* n bytes from rank r's memory, at the (address, length) pairs rem[0..2 nrem),
 * to this process's pairs loc[0..2 nloc), as many as one process_vm_readv
 * takes at a time (CMA_IOV iovecs a side, CMA_PIECE bytes).  A status. */
static int cma_copy(Engine *e, int r, const uint64_t *loc, Py_ssize_t nloc, const uint64_t *rem,
                    Py_ssize_t nrem, size_t n)
{
    Py_ssize_t li = 0, ri = 0;
    uint64_t lo = 0, ro = 0;
    struct iovec lv[CMA_IOV], rv[CMA_IOV];
    for (size_t done = 0; done < n;) {
        if (take_abort(e))
            return ST_ABORTED;
        fault_pause(e); /* tests: a peer may die meanwhile */
        int nl = iov_fill(loc, nloc, li, lo, lv), nr = iov_fill(rem, nrem, ri, ro, rv);
        ssize_t got = process_vm_readv(peer_pid(e, r), lv, (unsigned long)nl, rv,
                                       (unsigned long)nr, 0);
        if (got > 0) {
            done += (size_t)got;
            iov_skip(loc, nloc, &li, &lo, (size_t)got);
            iov_skip(rem, nrem, &ri, &ro, (size_t)got);
        } else if (!(got < 0 && errno == EINTR)) {
            return cma_failed(e, r, got < 0 ? errno : EFAULT);
        }
    }
    return ST_OK;
}

/* n bytes at `remote` in rank r's memory (contiguous) to `local`, laid out as
 * put_blocks lays a contribution out: blocks of blk bytes, `row` bytes apart
 * (blk == n: one block).  A status. */
static int cma_read(Engine *e, int r, char *local, size_t blk, size_t row, uint64_t remote,
                    size_t n)
{
    size_t blocks = (n + blk - 1) / blk;
    uint64_t *loc = PyMem_RawMalloc(16 * blocks), rem[2] = {remote, n};
    if (!loc)
        return cma_failed(e, r, ENOMEM);
    for (size_t a = 0; a < blocks; a++) {
        loc[2 * a] = (uint64_t)(uintptr_t)(local + a * row);
        loc[2 * a + 1] = a + 1 < blocks ? blk : n - a * blk;
    }
    int st = cma_copy(e, r, loc, (Py_ssize_t)blocks, rem, 1, n);
    PyMem_RawFree(loc);
    return st;
}

/* The rounds of a single-copy exchange (all_gather, all_to_all): this rank
 * publishes its input's address (and, with `offs`, where in it each rank's
 * part starts, in its slot), syncs, places its own part (from `own`; NULL:
 * already in place), reads every peer's part straight into the result, and
 * syncs again so that nobody's input is read after it returns.  Rank r's part
 * is n[r] bytes that land at dst[r] in blocks of blk[r] bytes, row[r] apart
 * (put_blocks' layout; blk == n: one block).  A status, or -1. */
static int cma_rounds(Engine *e, uint32_t kind, uint32_t dtype, uint64_t numel, uint64_t arg,
                      size_t total, const char *mine, const uint64_t *offs, const char *own,
                      char *const *dst, const size_t *blk, const size_t *row, const size_t *n)
{
    const int w = e->world, me = e->rank;
    PyThreadState *ts = NULL;
    int st = enter_data(e, total, &ts);
    if (st != 0)
        return st;
    const int p = (int)((e->round + 1) & 1);
    if (offs)
        memcpy(slot_of(e, me, p), offs, (size_t)w * sizeof(uint64_t));
    line_of(e, me, 0, p)->addr = e->fault_cma_addr ? 4096u : (uint64_t)(uintptr_t)mine;
    st = round_sync(e, kind, dtype, 0, numel, arg, &ts);
    if (st == ST_OK && own && n[me])
        put_blocks(dst[me], own, 0, n[me], blk[me], row[me], 0);
    for (int i = 1; i < w && st == ST_OK; i++) {
        int r = (me + i) % w;
        uint64_t at = line_of(e, r, 0, p)->addr;
        if (offs)
            at += ((const uint64_t *)slot_of(e, r, p))[me];
        if (n[r])
            st = cma_read(e, r, dst[r], blk[r], row[r], at, n[r]);
    }
    if (st == ST_OK) /* nobody reads this rank's input after this round */
        st = round_sync(e, kind, dtype, 0, numel, arg, &ts);
    return leave_data(e, st, ts);
}

/* all_gather by cma_rounds: rank r's contribution goes to `outer` blocks of
 * cnt[r] / outer bytes, block a at out + a * (total / outer) + off[r]
 * (put_blocks); the list form: to dsts[r] */
static int cma_gather(Engine *e, uint32_t kind, const char *mine, const size_t *cnt, char *out,
                      char *const *dsts, uint32_t dtype, uint64_t numel, uint64_t arg,
                      size_t total, int in_place, size_t outer)
{
    const int w = e->world;
    char *dst[w];
    size_t blk[w], row[w], n[w], off = 0;
    for (int r = 0; r < w; r++) {
        dst[r] = dsts ? dsts[r] : out ? out + off : NULL;
        blk[r] = dsts ? cnt[r] : cnt[r] / outer;
        row[r] = dsts ? cnt[r] : total / outer;
        n[r] = out || dsts ? cnt[r] : 0; /* no result: the rounds alone */
        off += cnt[r] / outer;
    }
    return cma_rounds(e, kind, dtype, numel, arg, total, mine, NULL, in_place ? NULL : mine, dst,
                      blk, row, n);
}

/* whether [a, a + na) and [b, b + nb) share a byte */
static inline int overlap(const char *a, size_t na, const char *b, size_t nb)
{
    return na && nb && a < b + nb && b < a + na;
}

/* The rounds of a gather: -1 with an exception, or a status.
 * A result that holds this rank's own input exactly where it belongs (torch's
 * in-place all_gather_into_tensor: input = output.chunk(w)[rank]; a list form
 * whose own entry is the input) skips copying it.  A result that overlaps the
 * input anywhere else would overwrite the input before it is all sent: the
 * input is copied aside first, so the result is as if nothing overlapped. */
static int gather_rounds(Engine *e, uint32_t kind, const char *mine, const size_t *cnt, char *out,
                         char *const *dsts, uint32_t dtype, uint64_t numel, uint64_t arg,
                         size_t outer)
{
    const int w = e->world, me = e->rank;
    const size_t cap = e->slot_bytes;
    size_t total = 0, rounds = 1, before = 0;
    for (int r = 0; r < w; r++) {
        if (r == me)
            before = total;
        total += cnt[r];
        if ((cnt[r] + cap - 1) / cap > rounds)
            rounds = (cnt[r] + cap - 1) / cap;
    }
    int in_place = 0, clash = 0;
    if (dsts) {
        in_place = cnt[me] && dsts[me] == mine;
        for (int r = 0; r < w; r++)
            clash |= !(r == me && in_place) && overlap(dsts[r], cnt[r], mine, cnt[me]);
    } else if (out) {
        in_place = cnt[me] && outer == 1 && out + before == mine;
        clash = !in_place && overlap(out, total, mine, cnt[me]);
    }
    char *aside = NULL;
    if (clash) {
        aside = PyMem_RawMalloc(cnt[me]);
        if (!aside) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(aside, mine, cnt[me]);
        mine = aside;
    }
    /* single copy: large enough in all, and (along a later dim) in blocks of at
     * least CMA_MIN_BLOCK bytes: one iovec per block, and smaller ones lose
     * (docs/COLLECTIVES.md); every rank knows every count, so all decide alike */
    int single = e->cma && kind == KIND_ALL_GATHER && total >= e->cma_min;
    for (int r = 0; single && outer > 1 && r < w; r++)
        single = !cnt[r] || cnt[r] / outer >= CMA_MIN_BLOCK;
    if (single) {
        int st =
            cma_gather(e, kind, mine, cnt, out, dsts, dtype, numel, arg, total, in_place, outer);
        PyMem_RawFree(aside);
        return st;
    }
    PyThreadState *ts = NULL;
    int st = enter_data(e, total, &ts);
    if (st != 0) {
        PyMem_RawFree(aside);
        return st;
    }
    for (size_t k = 0; k < rounds && st == ST_OK; k++) {
        size_t lo = k * cap, n = part_of(cnt[me], lo, cap);
        int p = (int)((e->round + 1) & 1);
        if (n)
            memcpy(slot_of(e, me, p), mine + lo, n);
        st = round_sync(e, kind, dtype, 0, numel, arg, &ts);
        if (st != ST_OK || !(out || dsts))
            continue;
        size_t off = 0;
        for (int r = 0; r < w; r++) {
            n = part_of(cnt[r], lo, cap);
            const char *from = r == me ? mine + lo : slot_of(e, r, p);
            if (r == me && in_place)
                ; /* already there */
            else if (n && dsts)
                memcpy(dsts[r] + lo, from, n);
            else if (n)
                put_blocks(out, from, lo, n, cnt[r] / outer, total / outer, off);
            off += cnt[r] / outer;
        }
    }
    st = leave_data(e, st, ts);
    PyMem_RawFree(aside);
    return st;
}

/* The rounds of a broadcast of `total` bytes at data from rank src: -1 with
 * an exception, or a status */
static int bcast_rounds(Engine *e, uint32_t kind, char *data, size_t total, int src,
                        uint32_t dtype, uint64_t numel)
{
    const size_t cap = e->slot_bytes;
    size_t rounds = total ? (total + cap - 1) / cap : 1;
    PyThreadState *ts = NULL;
    int st = enter_data(e, total, &ts);
    if (st != 0)
        return st;
    for (size_t k = 0; k < rounds && st == ST_OK; k++) {
        size_t lo = k * cap, n = part_of(total, lo, cap);
        int p = (int)((e->round + 1) & 1);
        if (e->rank == src && n)
            memcpy(slot_of(e, e->rank, p), data + lo, n);
        st = round_sync(e, kind, dtype, 0, numel, (uint64_t)src, &ts);
        if (st == ST_OK && e->rank != src && n)
            memcpy(data + lo, slot_of(e, src, p), n);
    }
    return leave_data(e, st, ts);
}

/* broadcast(kind, data, nbytes, src, dtype, numel) -> status: src's bytes everywhere */
static PyObject *eng_broadcast(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[6];
    if (u64_args(args, nargs, 6, "broadcast", v) < 0)
        return NULL;
    if (v[3] >= (unsigned long long)e->world) {
        PyErr_Format(PyExc_ValueError, "broadcast: src %lld is out of range", (long long)v[3]);
        return NULL;
    }
    return status_result(bcast_rounds(e, (uint32_t)v[0], (char *)(uintptr_t)v[1], (size_t)v[2],
                                      (int)v[3], (uint32_t)v[4], v[5]));
}

/*
 * fast_broadcast(t, src, kind) -> status, or None: Communicator.broadcast's
 * common case in one call (a plain tensor, an exact int src in range); None
 * sends the caller down the general Python path, which checks and reports.
 * The metadata is the general path's (dtype code, element count, src).
 */
static PyObject *eng_fast_broadcast(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !e->base || e->failed || !e->n_any || !e->d_numel ||
        !PyLong_CheckExact(args[1]) || !PyLong_CheckExact(args[2]))
        Py_RETURN_NONE;
    long src = PyLong_AsLong(args[1]);
    long kind = PyLong_AsLong(args[2]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (src < 0 || src >= e->world)
        Py_RETURN_NONE;
    int code;
    char *a;
    long long n;
    if (plain_info(e, args[0], &code, &a, &n) < 0)
        Py_RETURN_NONE;
    return status_result(bcast_rounds(e, (uint32_t)kind, a, (size_t)n * e->any_size[code],
                                      (int)src, (uint32_t)code, (uint64_t)n));
}

/* reduce_scatterv(kind, x, dtype, [elements per rank], out, op, arg) -> status: out
 * gets the reduction of shard `rank` of every rank's x (W shards, in order) */
static int rs_rounds(Engine *e, uint32_t kind, const char *x, int dtype, const size_t *sizes,
                     char *out, int op, uint64_t arg, size_t outer);

static PyObject *eng_reduce_scatterv(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[8];
    if (u64_args(args, nargs, 8, "reduce_scatterv", v) < 0)
        return NULL;
    if (v[7] == 0) {
        PyErr_SetString(PyExc_ValueError, "reduce_scatterv: no rows");
        return NULL;
    }
    if (v[2] >= DT_COUNT || v[5] >= OP_COUNT) {
        PyErr_SetString(PyExc_ValueError, "reduce_scatterv: bad dtype or op");
        return NULL;
    }
    size_t *sizes;
    if (int_list(e, args[3], &sizes, "reduce_scatterv") < 0)
        return NULL;
    int st = rs_rounds(e, (uint32_t)v[0], (const char *)(uintptr_t)v[1], (int)v[2], sizes,
                       (char *)(uintptr_t)v[4], (int)v[5], v[6], (size_t)v[7]);
    PyMem_Free(sizes);
    return status_result(st);
}

#define RS_FLAT 0x5253 /* protocols.RS_FLAT */

/*
 * fast_reduce_scatter(output, input, op, kind) -> status, or None: the
 * torch-style reduce_scatter_tensor's common case in one call (plain tensors
 * of one reducible dtype, input = world x output elements, a ReduceOp the
 * engine does, AVG on floats only); None: the general path.  The metadata is
 * the general path's (flat_key(RS_FLAT, n, w) for this layout).
 */
static PyObject *eng_fast_reduce_scatter(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !e->base || e->failed || !e->n_any || !e->d_numel ||
        !PyLong_CheckExact(args[3]))
        Py_RETURN_NONE;
    int opc = -1, dtc = -1, ci;
    for (int i = 0; i < OP_COUNT; i++)
        if (args[2] == e->ops[i])
            opc = i;
    long kind = PyLong_AsLong(args[3]);
    char *ai, *ao;
    long long no;
    if (opc < 0 || kind < 0 || flat_pair(e, args[1], args[0], &ci, &ai, &ao, &no) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    for (int i = 0; i < DT_COUNT; i++)
        if (e->dtypes[i] == e->any_dtypes[ci])
            dtc = i;
    if (dtc < 0 || (opc == OP_AVG && dtc >= DT_I32))
        Py_RETURN_NONE;
    size_t *sizes = even_sizes(e, (size_t)no);
    if (!sizes)
        return NULL;
    int st = rs_rounds(e, (uint32_t)kind, ai, dtc, sizes, ao, opc,
                       flat_key(RS_FLAT, (uint64_t)no, (uint64_t)e->world), 1);
    PyMem_Free(sizes);
    return status_result(st);
}

/* The rounds of a reduce-scatter: -1 with an exception, or a status */
static int rs_rounds(Engine *e, uint32_t kind, const char *x, int dtype, const size_t *sizes,
                     char *out, int op, uint64_t arg, size_t outer)
{
    const int w = e->world, me = e->rank;
    const size_t es = dt_size[dtype];
    size_t per = e->slot_bytes / es / (size_t)w / 32 * 32; /* elements per shard per round */
    if (per < 32)
        per = 32;
    size_t numel = 0, rounds = 1, *offs = PyMem_Calloc((size_t)w + 1, sizeof(size_t));
    void **srcs = PyMem_Calloc((size_t)w, sizeof(void *));
    if (!offs || !srcs) {
        PyMem_Free(offs);
        PyMem_Free(srcs);
        PyErr_NoMemory();
        return -1;
    }
    for (int r = 0; r < w; r++) {
        offs[r] = numel;
        numel += sizes[r];
        if ((outer * sizes[r] + per - 1) / per > rounds)
            rounds = (outer * sizes[r] + per - 1) / per;
    }
    const size_t row = numel * es; /* bytes per row (take_blocks) */
    numel *= outer;
    /* The result may be this rank's own block of the input (torch's in-place
     * form: output = input.chunk(w)[rank]; each element is reduced onto
     * itself).  A result that overlaps the input anywhere else would overwrite
     * parts not sent yet: it is reduced aside and copied in at the end. */
    const size_t mine = outer * sizes[me] * es;
    char *aside = NULL, *dest = out;
    if (overlap(out, mine, x, numel * es) && !(outer == 1 && out == x + offs[me] * es)) {
        aside = PyMem_RawMalloc(mine);
        if (!aside) {
            PyMem_Free(offs);
            PyMem_Free(srcs);
            PyErr_NoMemory();
            return -1;
        }
        out = aside;
    }
    PyThreadState *ts = NULL;
    int st = enter_data(e, numel * es, &ts);
    if (st != 0) {
        PyMem_Free(offs);
        PyMem_Free(srcs);
        PyMem_RawFree(aside);
        return st;
    }
    for (size_t k = 0; k < rounds && st == ST_OK; k++) {
        size_t lo = k * per;
        int p = (int)((e->round + 1) & 1);
        char *base = slot_of(e, me, p);
        /* shard j's part of this round to its place in the slot (take_blocks) */
        for (int j = 0; j < w; j++) {
            size_t n = part_of(outer * sizes[j], lo, per);
            if (n && j != me)
                take_blocks(base + (size_t)j * per * es, x, lo * es, n * es, sizes[j] * es, row,
                            offs[j] * es);
        }
        st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, numel, arg, &ts);
        size_t n = part_of(outer * sizes[me], lo, per);
        if (st != ST_OK || !n)
            continue;
        /* this rank's own part is read where it is: one reduction per piece
         * of a row's block (one piece in all without rows) */
        for (size_t q = lo, end = lo + n; q < end;) {
            size_t a = q / sizes[me], in = q % sizes[me];
            size_t m = sizes[me] - in < end - q ? sizes[me] - in : end - q;
            for (int r = 0; r < w; r++)
                srcs[r] = r == me ? (void *)(x + a * row + (offs[me] + in) * es)
                                  : (void *)(slot_of(e, r, p) + ((size_t)me * per + q - lo) * es);
            par_reduce(e->pool, dtype, op, out + q * es, srcs, w, m);
            q += m;
        }
    }
    if (aside && st == ST_OK)
        memcpy(dest, aside, mine);
    PyMem_Free(offs);
    PyMem_Free(srcs);
    st = leave_data(e, st, ts);
    PyMem_RawFree(aside);
    return st;
}

/*
 * alltoallv(kind, x, [bytes to each rank], [their offsets in x], out, [bytes from
 * each rank], [their offsets in out], most, dtype, count, arg) -> status: the
 * block this rank sends rank j goes to rank j's out.  The slot is cut in W
 * segments, as for reduce-scatter: in round k every rank copies part k of its
 * block for j into segment j, waits, and copies part k of segment `rank` of
 * every peer's slot (its own block: from x) to its place in out.  `most` is
 * the largest block any rank sends (every rank must pass the same: it sets
 * the number of rounds).  x and out must not overlap.
 */
static PyObject *eng_alltoallv(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long v[11];
    size_t *sc = NULL, *so = NULL, *rc = NULL, *ro = NULL;
    if (u64_args(args, nargs, 11, "alltoallv", v) < 0 || int_list(e, args[2], &sc, "alltoallv") < 0)
        return NULL;
    int st = int_list(e, args[3], &so, "alltoallv");
    if (st == 0)
        st = int_list(e, args[5], &rc, "alltoallv");
    if (st == 0)
        st = int_list(e, args[6], &ro, "alltoallv");
    const int w = e->world, me = e->rank;
    const size_t per = e->slot_bytes / (size_t)w / 64 * 64;
    if (st == 0 && per == 0) {
        PyErr_SetString(PyExc_ValueError, "alltoallv: the slot is too small for this world size");
        st = -1;
    }
    if (st == 0 && sc[me] != rc[me]) {
        PyErr_SetString(PyExc_ValueError, "alltoallv: this rank's block to itself differs in size");
        st = -1;
    }
    const char *x = (const char *)(uintptr_t)v[1];
    char *out = (char *)(uintptr_t)v[4];
    size_t rounds = v[7] ? (size_t)((v[7] + per - 1) / per) : 1, total = 0;
    PyThreadState *ts = NULL;
    for (int r = 0; st == 0 && r < w; r++)
        total += sc[r] + rc[r];
    /* single copy (see cma_gather): every rank publishes its input's address
     * and, in its slot, where its block for each rank starts; each rank reads
     * its block from every peer straight into out.  Decided on `most`, which
     * every rank shares. */
    if (st == 0 && e->cma && v[7] * (uint64_t)w >= e->cma_min &&
        (size_t)w * sizeof(uint64_t) <= e->slot_bytes) {
        char *dst[w];
        uint64_t offs[w];
        for (int r = 0; r < w; r++) {
            dst[r] = out + ro[r];
            offs[r] = so[r];
        }
        st = cma_rounds(e, (uint32_t)v[0], (uint32_t)v[8], v[9], v[10], total, x, offs,
                        x + so[me], dst, rc, rc, rc);
    } else if (st == 0) {
        int en = enter_data(e, total, &ts);
        st = en;
        for (size_t k = 0; en == 0 && k < rounds && st == ST_OK; k++) {
            size_t lo = k * per;
            int p = (int)((e->round + 1) & 1);
            char *base = slot_of(e, me, p);
            for (int j = 0; j < w; j++) {
                size_t n = part_of(sc[j], lo, per);
                if (n && j != me)
                    memcpy(base + (size_t)j * per, x + so[j] + lo, n);
            }
            st = round_sync(e, (uint32_t)v[0], (uint32_t)v[8], 0, v[9], v[10], &ts);
            for (int r = 0; st == ST_OK && r < w; r++) {
                size_t n = part_of(rc[r], lo, per);
                if (n)
                    memcpy(out + ro[r] + lo,
                           r == me ? x + so[me] + lo : slot_of(e, r, p) + (size_t)me * per, n);
            }
        }
        if (en == 0)
            leave_data(e, st, ts);
    }
    PyMem_Free(sc);
    PyMem_Free(so);
    PyMem_Free(rc);
    PyMem_Free(ro);
    return status_result(st);
}

/* 0 when the engine is open and r names another rank; else -1 with the
 * exception set */
static int check_rank(Engine *e, long r, const char *fn)
{
    if (!e->base) {
        eng_closed_error();
        return -1;
    }
    if (r < 0 || r >= e->world || r == e->rank) {
        PyErr_Format(PyExc_ValueError, "%s: rank %ld is not another rank of [0, %d)", fn, r,
                     e->world);
        return -1;
    }
    return 0;
}

static line_t *ctrl_line(Engine *e, int owner, long line)
{
    return (line_t *)(ctrl_of(e, owner) + LINE * (size_t)line);
}

/* layout() -> offsets the Python protocols need */
static PyObject *eng_layout(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->base)
        return eng_closed_error();
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:i,s:i,s:i}", "slot_off",
                         (unsigned long long)e->slot_off, "slot_bytes",
                         (unsigned long long)e->slot_bytes, "p2p_off",
                         (unsigned long long)e->p2p_off, "p2p_bytes",
                         (unsigned long long)e->p2p_bytes, "p2p_piece",
                         (unsigned long long)e->p2p_piece, "size", (unsigned long long)e->size,
                         "p2p_sent_line", P2P_SENT_LINE(0), "p2p_done_line",
                         P2P_DONE_LINE(e->world, 0), "p2p_ring", P2P_RING);
}

/*
 * Point to point.  The channel s -> d: a ring of P2P_RING chunks
 * p2p_slot_of(s, d, k), the sender's line P2P_SENT_LINE(d) counts chunks
 * sent, the receiver's line P2P_DONE_LINE(w, s) counts chunks consumed.
 * Chunk k may be written once chunk k - P2P_RING is consumed.  Chunks are
 * small (p2p_piece: 64 KiB at world 2), so the receiver copies chunk k out
 * while the sender copies chunk k + 1 in: a message costs about one copy, not
 * two in a row.  The byte stream of a message is
 * [header length, data length] (16 bytes) + header + data (see protocols.py).
 */
typedef struct {
    char **addr;
    size_t *len;
    Py_ssize_t n;
} pieces_t;

static int parse_pieces(PyObject *list, pieces_t *pc)
{
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "pieces must be a list of (address, nbytes) or bytes");
        return -1;
    }
    pc->n = PyList_GET_SIZE(list);
    pc->addr = PyMem_Calloc((size_t)pc->n + 1, sizeof(char *));
    pc->len = PyMem_Calloc((size_t)pc->n + 1, sizeof(size_t));
    if (!pc->addr || !pc->len) {
        PyMem_Free(pc->addr);
        PyMem_Free(pc->len);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < pc->n; i++) {
        unsigned long long a, l;
        PyObject *item = PyList_GET_ITEM(list, i);
        if (PyBytes_Check(item)) { /* a small header, copied from the bytes object */
            pc->addr[i] = PyBytes_AS_STRING(item);
            pc->len[i] = (size_t)PyBytes_GET_SIZE(item);
            continue;
        }
        if (!PyArg_ParseTuple(item, "KK", &a, &l)) {
            PyMem_Free(pc->addr);
            PyMem_Free(pc->len);
            return -1;
        }
        pc->addr[i] = (char *)(uintptr_t)a;
        pc->len[i] = (size_t)l;
    }
    return 0;
}

/*
 * Messages sent by reference (2026-12-03).  With single-copy reads agreed at
 * creation (cma_init), a message sent by a batch that also receives (sendrecv,
 * batch_isend_irecv) whose data is at least P2P_BYREF_MIN (more than the
 * channel's ring) does not stream its data through the ring:
 * the stream carries the header and where the data lies in the sender (an
 * [address, length] pair per piece, after the header), the receiver reads the
 * data straight from the sender's memory (process_vm_readv, one copy instead
 * of two) and only then consumes the stream's last chunk, which the sender
 * waits for before it returns.  Such a message waited for its receiver chunk
 * by chunk already (it did not fit the ring), so no program that completed
 * before can now wait for ever.  The header-length word carries P2P_BYREF and
 * the number of pieces.  Only where this rank also receives: then both cores
 * are busy either way and the receiver's one copy replaces two (a 4 MiB
 * exchange at world 2: 1.3 ms -> 0.7 ms); a lone send by value keeps the
 * sender copying in while the receiver copies out, which a read by reference
 * would serialise (a 4 MiB ping-pong: 1.3 ms -> 1.9 ms).  Both receive paths
 * read either kind.
 */
#define P2P_BYREF (1ull << 63)
/* from 1.5 rings (1.5 MiB at world 2): an exchange at world 2, fresh data,
 * by reference / by value: 1.125 MiB 484-644 / 411-489 us, 1.5 MiB 473-518 /
 * 565-1573 us, 2.5 MiB 709-892 / 1091-1304 us (docs/COLLECTIVES.md) */
#define P2P_BYREF_MIN(e) (3 * (e)->p2p_bytes)
#define P2P_HL(w) ((w) & P2P_BYREF ? (w) & 0xffffffffull : (w))
#define P2P_NP(w) ((w) & P2P_BYREF ? (Py_ssize_t)(((w) >> 32) & 0x7fffffffull) : 0)

/* The stream of message pc ([lengths + header, data pieces...]) sent by
 * reference, when it qualifies: 1 with *out streaming *buf (the caller frees
 * it), else 0. */
static int cma_message(Engine *e, const pieces_t *pc, char **buf, char **addr, size_t *len,
                       pieces_t *out)
{
    *buf = NULL;
    if (!e->cma || pc->n < 2 || pc->len[0] < 16)
        return 0;
    uint64_t lens[2];
    memcpy(lens, pc->addr[0], sizeof lens);
    Py_ssize_t np = pc->n - 1;
    if (lens[1] < P2P_BYREF_MIN(e) || lens[0] > 0xffffffffull ||
        pc->len[0] != 16 + lens[0] || np > 0x7fffffff)
        return 0;
    size_t size = 16 + (size_t)lens[0] + 16 * (size_t)np;
    if (!(*buf = PyMem_RawMalloc(size)))
        return 0; /* by value, then */
    uint64_t w0 = lens[0] | P2P_BYREF | ((uint64_t)np << 32);
    memcpy(*buf, &w0, 8);
    memcpy(*buf + 8, &lens[1], 8);
    memcpy(*buf + 16, pc->addr[0] + 16, (size_t)lens[0]);
    char *d = *buf + 16 + lens[0];
    for (Py_ssize_t i = 0; i < np; i++) {
        uint64_t where[2] = {e->fault_cma_addr ? 4096u : (uint64_t)(uintptr_t)pc->addr[i + 1],
                             (uint64_t)pc->len[i + 1]};
        memcpy(d + 16 * i, where, 16);
    }
    addr[0] = *buf;
    len[0] = size;
    *out = (pieces_t){addr, len, 1};
    return 1;
}

/* Read a message sent by reference from rank r: `desc` holds the np
 * (address, length) pairs of its data in r's memory (dl bytes in all), the
 * data goes to the local pieces dst.  A status (no GIL needed). */
static int cma_recv(Engine *e, int r, const char *desc, Py_ssize_t np, size_t dl,
                    const pieces_t *dst)
{
    uint64_t *rem = PyMem_RawMalloc(16 * (size_t)(np + dst->n) + 16);
    if (!rem)
        return cma_failed(e, r, ENOMEM);
    uint64_t *loc = rem + 2 * np, sum = 0, have = 0;
    memcpy(rem, desc, 16 * (size_t)np);
    for (Py_ssize_t i = 0; i < np; i++)
        sum += rem[2 * i + 1];
    for (Py_ssize_t i = 0; i < dst->n; i++) {
        loc[2 * i] = (uint64_t)(uintptr_t)dst->addr[i];
        have += loc[2 * i + 1] = dst->len[i];
    }
    int st = sum != dl || have != dl /* a torn or foreign stream: nothing is read */
                 ? cma_failed(e, r, EPROTO)
                 : cma_copy(e, r, loc, dst->n, rem, np, dl);
    PyMem_RawFree(rem);
    return st;
}

/* One send or receive in progress: a message streamed chunk by chunk
 * (send_pieces, and p2p_batch below). */
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
} bop_t;

/* Push as many chunks as the ring takes; 1 if any moved. */
static int bsend_step(Engine *e, bop_t *o)
{
    const size_t cap = e->p2p_piece;
    _Atomic uint64_t *done = &ctrl_line(e, o->peer, P2P_DONE_LINE(e->world, e->rank))->seq;
    line_t *sent = ctrl_line(e, e->rank, P2P_SENT_LINE(o->peer));
    int moved = 0;
    if (!o->started) {
        o->k = e->p2p_sent[o->peer];
        o->started = 1;
    }
    while (o->pos < o->total) {
        uint64_t k = o->k + 1;
        if (k > P2P_RING && atomic_load_explicit(done, memory_order_acquire) < k - P2P_RING)
            break;
        char *slot = p2p_slot_of(e, e->rank, o->peer, k);
        size_t fill = 0;
        while (fill < cap && o->piece < o->pc.n) {
            size_t left = o->pc.len[o->piece] - o->off;
            size_t n = left < cap - fill ? left : cap - fill;
            memcpy(slot + fill, o->pc.addr[o->piece] + o->off, n);
            fill += n;
            o->off += n;
            if (o->off == o->pc.len[o->piece]) {
                o->piece++;
                o->off = 0;
            }
        }
        publish(e, sent, k);
        o->k = k;
        o->pos += fill;
        moved = 1;
    }
    if (o->pos >= o->total) {
        /* by reference: done once the receiver has read the data (cma_message) */
        if (o->np && atomic_load_explicit(done, memory_order_acquire) < o->k)
            return moved;
        o->done = 1;
        e->p2p_sent[o->peer] = o->k;
    }
    return moved;
}

/* Stream the pieces to dst: bsend_step while the ring has room, wait_p2p
 * for room in between.  Called and returns with the GIL held. */
static int send_pieces(Engine *e, int dst, const pieces_t *pc)
{
    bop_t o;
    memset(&o, 0, sizeof o);
    o.send = 1;
    o.peer = dst;
    o.pc = *pc;
    for (Py_ssize_t i = 0; i < pc->n; i++)
        o.total += pc->len[i];
    _Atomic uint64_t *done = &ctrl_line(e, dst, P2P_DONE_LINE(e->world, e->rank))->seq;
    e->busy = 1;
    PyThreadState *ts = o.total >= GIL_RELEASE_BYTES ? PyEval_SaveThread() : NULL;
    int st = ST_OK;
    for (;;) {
        bsend_step(e, &o);
        if (o.done)
            break;
        if ((st = wait_p2p(e, done, o.k + 1 - P2P_RING, dst, &ts)) != ST_OK)
            break;
    }
    if (ts)
        PyEval_RestoreThread(ts);
    e->busy = 0;
    return st;
}

/* p2p_send(dst, [(address, nbytes), ...], only_if_room=False) -> status: stream
 * the pieces; with only_if_room, None (nothing sent) if it would have to wait */
static PyObject *eng_p2p_send(Engine *e, PyObject *args)
{
    int dst, only_if_room = 0;
    PyObject *list;
    pieces_t pc;
    if (!PyArg_ParseTuple(args, "iO|p", &dst, &list, &only_if_room) ||
        check_rank(e, dst, "p2p_send") < 0)
        return NULL;
    int no = refuse(e);
    if (no)
        return PyLong_FromLong(no);
    if (parse_pieces(list, &pc) < 0)
        return NULL;
    if (only_if_room) { /* None (nothing sent) unless the ring takes it all now */
        size_t total = 0;
        for (Py_ssize_t i = 0; i < pc.n; i++)
            total += pc.len[i];
        uint64_t chunks = total ? (total + e->p2p_piece - 1) / e->p2p_piece : 1;
        uint64_t done = atomic_load_explicit(
            &ctrl_line(e, dst, P2P_DONE_LINE(e->world, e->rank))->seq, memory_order_acquire);
        if (e->p2p_sent[dst] + chunks > done + P2P_RING) {
            PyMem_Free(pc.addr);
            PyMem_Free(pc.len);
            Py_RETURN_NONE;
        }
    }
    int st = send_pieces(e, dst, &pc);
    PyMem_Free(pc.addr);
    PyMem_Free(pc.len);
    return PyLong_FromLong(st);
}

/* The dtype code of tensor t for a message, or -1.  Only a plain tensor whose
 * memory holds exactly its values qualifies: the exact tensor type, on the
 * CPU, contiguous, no pending negation or conjugation (docs/COLLECTIVES.md). */
static int plain_code(Engine *e, PyObject *t)
{
    if (Py_TYPE(t) != e->tensor_type)
        return -1;
    PyObject *dt = descr_get(e->d_dtype, t);
    if (!dt) {
        PyErr_Clear();
        return -1;
    }
    int code = -1;
    for (int c = 0; c < e->n_any; c++)
        if (dt == e->any_dtypes[c])
            code = c;
    Py_DECREF(dt);
    if (code < 0 || !attr_is(t, e->d_is_cpu, 0, Py_True) ||
        !attr_is(t, e->d_is_contiguous, 1, Py_True) || !attr_is(t, e->d_is_neg, 1, Py_False) ||
        (e->any_complex[code] && !attr_is(t, e->d_is_conj, 1, Py_False)))
        return -1;
    return code;
}

/* t's data address, or 0 with the error cleared */
static char *data_of(Engine *e, PyObject *t)
{
    PyObject *pv = descr_call(e->d_data_ptr, t);
    if (!pv) {
        PyErr_Clear();
        return NULL;
    }
    char *a = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(pv);
    Py_DECREF(pv);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return NULL;
    }
    return a;
}

/* A plain tensor's dtype code, data address (NULL when empty: an empty tensor
 * may have none) and element count: 0, or -1 (no exception) if not plain */
static int plain_info(Engine *e, PyObject *t, int *code, char **addr, long long *n)
{
    *code = plain_code(e, t);
    if (*code < 0)
        return -1;
    PyObject *nv = descr_call(e->d_numel, t);
    *n = nv ? PyLong_AsLongLong(nv) : -1;
    Py_XDECREF(nv);
    *addr = *n > 0 ? data_of(e, t) : NULL;
    if (*n < 0 || (*n > 0 && !*addr)) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* A valid peer rank given as an exact int, or -1 */
static int peer_arg(Engine *e, PyObject *v)
{
    if (!PyLong_CheckExact(v))
        return -1;
    long r = PyLong_AsLong(v);
    if (r == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return r >= 0 && r < e->world && r != e->rank ? (int)r : -1;
}

/* The (peer, tensors) arguments of the point-to-point fast paths: the
 * tensors' items (and *peer, *n), or NULL when the call is not for them
 * (nothing is set as an error: the general path checks and reports). */
static PyObject **p2p_args(Engine *e, PyObject *const *args, Py_ssize_t nargs, int *peer,
                           Py_ssize_t *n)
{
    if (nargs != 2 || !e->base || other_thread(e) || e->failed || !e->n_any || !e->d_shape)
        return NULL;
    *peer = peer_arg(e, args[0]);
    PyObject *seq = args[1];
    if (*peer < 0 || !(PyList_CheckExact(seq) || PyTuple_CheckExact(seq)))
        return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    if (*n > P2P_MAX_TENSORS)
        return NULL;
    return PySequence_Fast_ITEMS(seq);
}

/*
 * p2p_send_tensors(dst, tensors) -> status, or None: Communicator.send's
 * common case in one C call (the Python steps cost ~5 us per message on the
 * development VM).  It builds the same binary header as protocols.send.
 * None means nothing was sent and the general path in Python must run: an
 * argument it would reject or report, more than 255 tensors or 8 dims, a
 * tensor that is not plain (see plain_code), a closed or failed engine.
 */
#define P2P_HEAD_BYTES (16 + 2 + P2P_MAX_TENSORS * (2 + 8 * P2P_MAX_DIMS))

/* A message of n plain tensors as the binary protocol lays it out: head gets
 * the two lengths (header, data) and then the header (protocols._binary_header),
 * addr[0]/len[0] point at it, addr[1..]/len[1..] at the tensors' data (empty
 * ones left out); *np pieces in all.  0, or -1 when a tensor is not plain or
 * has too many dims (no exception: the general path takes it). */
static int plain_message(Engine *e, PyObject **items, Py_ssize_t n, char *head, char **addr,
                         size_t *len, Py_ssize_t *np)
{
    size_t hl = 2, total = 0;
    *np = 1;
    head[16] = (char)P2P_BINARY;
    head[17] = (char)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = items[i];
        int code = plain_code(e, t);
        if (code < 0)
            return -1;
        PyObject *shape = descr_get(e->d_shape, t);
        if (!shape) {
            PyErr_Clear();
            return -1;
        }
        Py_ssize_t nd = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : P2P_MAX_DIMS + 1;
        if (nd > P2P_MAX_DIMS) {
            Py_DECREF(shape);
            return -1;
        }
        char *p = head + 16 + hl;
        p[0] = (char)code;
        p[1] = (char)nd;
        long long numel = 1;
        for (Py_ssize_t j = 0; j < nd; j++) {
            long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, j));
            memcpy(p + 2 + 8 * j, &v, 8); /* little-endian int64, as struct "<q" */
            numel *= v;
        }
        Py_DECREF(shape);
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
        hl += 2 + 8 * (size_t)nd;
        size_t nbytes = (size_t)numel * e->any_size[code];
        if (nbytes) {
            if (!(addr[*np] = data_of(e, t)))
                return -1;
            len[(*np)++] = nbytes;
            total += nbytes;
        }
    }
    uint64_t lens[2] = {hl, total};
    memcpy(head, lens, sizeof lens);
    addr[0] = head;
    len[0] = 16 + hl;
    return 0;
}

static PyObject *eng_p2p_send_tensors(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    int dst;
    Py_ssize_t n, np;
    PyObject **items = p2p_args(e, args, nargs, &dst, &n);
    if (!items)
        Py_RETURN_NONE;
    char head[P2P_HEAD_BYTES];
    char *addr[P2P_MAX_TENSORS + 1];
    size_t len[P2P_MAX_TENSORS + 1];
    if (plain_message(e, items, n, head, addr, len, &np) < 0)
        Py_RETURN_NONE;
    if (take_abort(e))
        Py_RETURN_NONE; /* the general path reports it */
    pieces_t pc = {addr, len, np};
    return PyLong_FromLong(send_pieces(e, dst, &pc));
}

/*
 * plain(t) -> (dtype code, data address, numel) or None: the checks and
 * accessors of a torch-style collective's tensor in one call (each costs
 * 0.1-0.2 us through Python here).  None: not plain (plain_code), or the
 * engine is closed or failed; the caller takes the general path.
 */
static PyObject *eng_plain(Engine *e, PyObject *t)
{
    int code;
    char *a;
    long long n;
    if (!e->base || e->failed || !e->n_any || !e->d_numel || plain_info(e, t, &code, &a, &n) < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(iKL)", code, (unsigned long long)(uintptr_t)a, n);
}

/* set_p2p_dtypes((dtype, ...), (itemsize, ...), empty=None): the dtypes of
 * messages, by code, and the allocator p2p_recv_new calls (torch.empty) */
static PyObject *eng_set_p2p_dtypes(Engine *e, PyObject *args)
{
    PyObject *dts, *sizes, *empty = Py_None;
    if (!PyArg_ParseTuple(args, "O!O!|O", &PyTuple_Type, &dts, &PyTuple_Type, &sizes, &empty))
        return NULL;
    if (empty != Py_None) {
        if (!e->kw_dtype && !(e->kw_dtype = Py_BuildValue("(s)", "dtype")))
            return NULL;
        Py_INCREF(empty);
        Py_XSETREF(e->empty_fn, empty);
    }
    Py_ssize_t n = PyTuple_GET_SIZE(dts);
    if (n > MAX_ANY || PyTuple_GET_SIZE(sizes) != n) {
        PyErr_SetString(PyExc_ValueError, "set_p2p_dtypes: too many dtypes, or sizes differ");
        return NULL;
    }
    for (int i = 0; i < e->n_any; i++)
        Py_CLEAR(e->any_dtypes[i]);
    e->n_any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t sz = PyLong_AsSize_t(PyTuple_GET_ITEM(sizes, i));
        if (sz == (size_t)-1 && PyErr_Occurred())
            return NULL;
        PyObject *cx = PyObject_GetAttrString(PyTuple_GET_ITEM(dts, i), "is_complex");
        if (!cx)
            return NULL;
        int is_cx = PyObject_IsTrue(cx);
        Py_DECREF(cx);
        if (is_cx < 0)
            return NULL;
        Py_INCREF(PyTuple_GET_ITEM(dts, i));
        e->any_dtypes[i] = PyTuple_GET_ITEM(dts, i);
        e->any_size[i] = sz;
        e->any_complex[i] = (char)is_cx;
        e->n_any = (int)i + 1;
    }
    Py_RETURN_NONE;
}

/* the next chunk of the receive in progress is consumed: say so, wait for the
 * following one */
static int rx_next(Engine *e, PyThreadState **ts)
{
    publish(e, ctrl_line(e, e->rank, P2P_DONE_LINE(e->world, e->rx_src)), e->rx_k);
    e->rx_pos += e->rx_limit;
    if (e->rx_pos >= e->rx_total)
        return ST_OK;
    e->rx_k++;
    int st = wait_p2p(e, &ctrl_line(e, e->rx_src, P2P_SENT_LINE(e->rank))->seq, e->rx_k,
                      e->rx_src, ts);
    e->rx_used = 0;
    e->rx_limit = e->rx_total - e->rx_pos < e->p2p_piece ? e->rx_total - e->rx_pos : e->p2p_piece;
    return st;
}

/* copy n bytes of the stream into dst, crossing chunks as needed */
static int rx_copy(Engine *e, char *dst, size_t n, PyThreadState **ts)
{
    while (n) {
        if (e->rx_used == e->rx_limit) {
            int st = rx_next(e, ts);
            if (st != ST_OK)
                return st;
        }
        char *slot = p2p_slot_of(e, e->rx_src, e->rank, e->rx_k);
        size_t m = e->rx_limit - e->rx_used < n ? e->rx_limit - e->rx_used : n;
        memcpy(dst, slot + e->rx_used, m);
        e->rx_used += m;
        dst += m;
        n -= m;
    }
    return ST_OK;
}

/* Wait for the next message from src and read its header: a new bytes
 * object (NULL with an exception set), *st the status (the bytes are empty
 * unless it is ST_OK). */
static PyObject *recv_head(Engine *e, int src, int *st)
{
    PyThreadState *ts = NULL;
    e->busy = 1;
    e->rx_src = src;
    e->rx_k = e->p2p_recvd[src] + 1;
    *st = wait_p2p(e, &ctrl_line(e, src, P2P_SENT_LINE(e->rank))->seq, e->rx_k, src, &ts);
    if (ts) {
        PyEval_RestoreThread(ts);
        ts = NULL;
    }
    if (*st != ST_OK) {
        e->busy = 0;
        return PyBytes_FromStringAndSize("", 0);
    }
    uint64_t lens[2];
    memcpy(lens, p2p_slot_of(e, src, e->rank, e->rx_k), sizeof lens);
    uint64_t hl = P2P_HL(lens[0]);
    e->rx_np = P2P_NP(lens[0]);
    e->rx_dl = lens[1];
    /* by reference, the stream after the header is where the data lies */
    e->rx_total = 16 + hl + (e->rx_np ? 16 * (uint64_t)e->rx_np : lens[1]);
    e->rx_pos = 0;
    e->rx_used = 16;
    e->rx_limit = e->rx_total < e->p2p_piece ? e->rx_total : e->p2p_piece;
    PyObject *hdr = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)hl);
    if (!hdr) {
        e->busy = 0;
        return NULL;
    }
    *st = rx_copy(e, PyBytes_AS_STRING(hdr), (size_t)hl, &ts);
    if (ts)
        PyEval_RestoreThread(ts);
    e->busy = 0;
    if (*st == ST_OK && !e->rx_held) {
        /* until the body is read (recv_body, or rx_release when Python gives
         * up on it), the channel is mid-message: no other thread may come in */
        e->rx_held = 1;
        e->held++;
        e->holder = PyThread_get_thread_ident();
    }
    return hdr;
}

/* p2p_recv_head(src) -> (status, header bytes): the next message's header */
static PyObject *eng_p2p_recv_head(Engine *e, PyObject *arg)
{
    long src = PyLong_AsLong(arg);
    if ((src == -1 && PyErr_Occurred()) || check_rank(e, src, "p2p_recv_head") < 0)
        return NULL;
    int no = refuse(e);
    if (no)
        return Py_BuildValue("(iy#)", no, "", (Py_ssize_t)0);
    int st;
    PyObject *hdr = recv_head(e, (int)src, &st);
    return hdr ? Py_BuildValue("(iN)", st, hdr) : NULL;
}

/* The end of recv_head's hold: the body is read, or Python gave up on it. */
static void rx_release(Engine *e)
{
    if (e->rx_held) {
        e->rx_held = 0;
        e->held--;
    }
}

/* Receive the rest of the message (the header is read) into the pieces,
 * which must hold exactly its bytes.  -1 with an exception if they do not. */
static int recv_body(Engine *e, const pieces_t *pc)
{
    size_t total = 0;
    for (Py_ssize_t i = 0; i < pc->n; i++)
        total += pc->len[i];
    size_t left = e->rx_np ? e->rx_dl : e->rx_total - e->rx_pos - e->rx_used;
    if (total != left) {
        PyErr_Format(PyExc_ValueError, "p2p_recv_body: %zu bytes expected, %zu given", left,
                     total);
        return -1;
    }
    int st = ST_OK;
    e->busy = 1;
    PyThreadState *ts = total >= GIL_RELEASE_BYTES ? PyEval_SaveThread() : NULL;
    if (e->rx_np) { /* by reference: where the data is, then the data itself */
        char *desc = PyMem_RawMalloc(16 * (size_t)e->rx_np);
        st = desc ? rx_copy(e, desc, 16 * (size_t)e->rx_np, &ts) : cma_failed(e, e->rx_src, ENOMEM);
        if (st == ST_OK)
            st = cma_recv(e, e->rx_src, desc, e->rx_np, (size_t)e->rx_dl, pc);
        PyMem_RawFree(desc);
    }
    for (Py_ssize_t i = 0; !e->rx_np && i < pc->n && st == ST_OK; i++)
        st = rx_copy(e, pc->addr[i], pc->len[i], &ts);
    if (st == ST_OK) {
        /* the last chunk is consumed too */
        publish(e, ctrl_line(e, e->rank, P2P_DONE_LINE(e->world, e->rx_src)), e->rx_k);
        e->p2p_recvd[e->rx_src] = e->rx_k;
        e->rx_src = -1;
        e->rx_np = 0;
    }
    if (ts)
        PyEval_RestoreThread(ts);
    e->busy = 0;
    rx_release(e);
    return st;
}

/* p2p_recv_body([(address, nbytes), ...]) -> status: the rest of the message */
static PyObject *eng_p2p_recv_body(Engine *e, PyObject *list)
{
    pieces_t pc;
    if (!e->base)
        return eng_closed_error();
    if (other_thread(e))
        return PyLong_FromLong(ST_BUSY);
    if (e->rx_src < 0) {
        PyErr_SetString(PyExc_RuntimeError, "p2p_recv_body without p2p_recv_head");
        return NULL;
    }
    if (parse_pieces(list, &pc) < 0)
        return NULL;
    int st = recv_body(e, &pc);
    PyMem_Free(pc.addr);
    PyMem_Free(pc.len);
    return status_result(st);
}

/* The next message's header from src, for the one-call receives: the header
 * bytes (*h, *hl: their bytes and length); or NULL, *res being what the call
 * returns (the status, or NULL with an exception). */
static PyObject *fast_head(Engine *e, int src, PyObject **res, const unsigned char **h,
                           size_t *hl)
{
    int st;
    PyObject *hdr = recv_head(e, src, &st);
    if (hdr && st == ST_OK) {
        *h = (const unsigned char *)PyBytes_AS_STRING(hdr);
        *hl = (size_t)PyBytes_GET_SIZE(hdr);
        return hdr;
    }
    *res = hdr ? PyLong_FromLong(st) : NULL;
    Py_XDECREF(hdr);
    return NULL;
}

/*
 * p2p_recv_into(src, out) -> status | header bytes | None: Communicator.recv
 * with out= in one C call.  None: nothing was received (an argument the
 * general path must check or report, a closed or failed engine).  Otherwise
 * the next message's header is consumed; when it is binary and describes
 * exactly `out`'s plain tensors (same count, dtypes and shapes), the body
 * lands in them and the status comes back; else the header bytes come back
 * and protocols.recv_rest finishes the receive (it reports the mismatch).
 */
static PyObject *eng_p2p_recv_into(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    int src;
    Py_ssize_t n;
    PyObject **items = p2p_args(e, args, nargs, &src, &n);
    if (!items)
        Py_RETURN_NONE;
    int codes[P2P_MAX_TENSORS];
    for (Py_ssize_t i = 0; i < n; i++)
        if ((codes[i] = plain_code(e, items[i])) < 0)
            Py_RETURN_NONE; /* the general path checks these before receiving */
    if (take_abort(e))
        Py_RETURN_NONE;
    const unsigned char *h;
    size_t hl, at = 2;
    PyObject *res, *hdr = fast_head(e, src, &res, &h, &hl);
    if (!hdr)
        return res;
    int st;
    if (hl < 2 || h[0] != P2P_BINARY || h[1] != n)
        return hdr;
    char *addr[P2P_MAX_TENSORS];
    size_t len[P2P_MAX_TENSORS];
    Py_ssize_t np = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = items[i];
        if (at + 2 > hl)
            return hdr;
        int code = h[at], nd = h[at + 1];
        if (code >= e->n_any || nd > P2P_MAX_DIMS || at + 2 + 8 * (size_t)nd > hl ||
            codes[i] != code)
            return hdr;
        PyObject *shape = descr_get(e->d_shape, t);
        if (!shape) {
            PyErr_Clear();
            return hdr;
        }
        int same = PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) == nd;
        long long numel = 1;
        for (int j = 0; same && j < nd; j++) {
            long long want;
            memcpy(&want, h + at + 2 + 8 * j, 8);
            same = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, j)) == want;
            numel *= want;
        }
        Py_DECREF(shape);
        if (PyErr_Occurred())
            PyErr_Clear();
        if (!same)
            return hdr;
        at += 2 + 8 * (size_t)nd;
        size_t nbytes = (size_t)numel * e->any_size[code];
        if (nbytes) {
            if (!(addr[np] = data_of(e, t)))
                return hdr;
            len[np++] = nbytes;
        }
    }
    if (at != hl)
        return hdr;
    pieces_t pc = {addr, len, np};
    st = recv_body(e, &pc);
    if (st < 0) { /* the sizes disagree with the header: let Python report it */
        PyErr_Clear();
        return hdr;
    }
    Py_DECREF(hdr);
    return PyLong_FromLong(st);
}

/*
 * p2p_recv_new(src) -> [tensors] | status | header bytes | None:
 * Communicator.recv without out= in one C call (its Python steps cost ~17 us
 * per message on the development VM).  The next message's binary header is
 * read, a tensor of each dtype and shape it names is made (torch.empty), and
 * the body lands in them.  None: nothing was received (an argument the
 * general path must check, a closed or failed engine); header bytes: a
 * header this path leaves to protocols.recv_rest (pickled: a dict's values).
 */
static PyObject *eng_p2p_recv_new(Engine *e, PyObject *arg)
{
    int src = peer_arg(e, arg);
    if (src < 0 || !e->base || other_thread(e) || e->failed || !e->n_any || !e->empty_fn ||
        e->rx_src >= 0 || take_abort(e))
        Py_RETURN_NONE;
    const unsigned char *h;
    size_t hl, at = 2;
    PyObject *res, *hdr = fast_head(e, src, &res, &h, &hl);
    if (!hdr)
        return res;
    int st;
    if (hl < 2 || h[0] != P2P_BINARY)
        return hdr;
    int n = h[1];
    char *addr[P2P_MAX_TENSORS];
    size_t len[P2P_MAX_TENSORS];
    Py_ssize_t np = 0;
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        int code = at + 2 <= hl ? h[at] : -1, nd = at + 2 <= hl ? h[at + 1] : 0;
        if (code < 0 || code >= e->n_any || nd > P2P_MAX_DIMS || at + 2 + 8 * (size_t)nd > hl) {
            Py_CLEAR(list); /* not a header this path knows: Python reports it */
            return hdr;
        }
        PyObject *shape = PyTuple_New(nd);
        long long numel = 1;
        for (int j = 0; shape && j < nd; j++) {
            long long v;
            memcpy(&v, h + at + 2 + 8 * j, 8);
            numel *= v;
            PyObject *d = PyLong_FromLongLong(v);
            if (!d)
                Py_CLEAR(shape);
            else
                PyTuple_SET_ITEM(shape, j, d);
        }
        PyObject *argv[2] = {shape, e->any_dtypes[code]};
        PyObject *t = shape ? PyObject_Vectorcall(e->empty_fn, argv, 1, e->kw_dtype) : NULL;
        Py_XDECREF(shape);
        if (!t) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, t);
        at += 2 + 8 * (size_t)nd;
        size_t nbytes = (size_t)numel * e->any_size[code];
        if (nbytes) {
            if (!(addr[np] = data_of(e, t))) {
                PyErr_SetString(PyExc_RuntimeError, "p2p_recv_new: a new tensor has no address");
                Py_CLEAR(list);
                break;
            }
            len[np++] = nbytes;
        }
    }
    if (list && at != hl) {
        Py_CLEAR(list);
        return hdr;
    }
    Py_DECREF(hdr);
    if (!list) { /* no memory: the message stays half read, as in Python */
        rx_release(e);
        return NULL;
    }
    pieces_t pc = {addr, len, np};
    st = recv_body(e, &pc);
    if (st != ST_OK) {
        Py_DECREF(list);
        return st < 0 ? NULL : PyLong_FromLong(st);
    }
    return list;
}

/*
 * p2p_batch(ops) -> (status, [(index, header, data), ...]): point-to-point
 * operations progressed together, so that no order of them can deadlock
 * (torch's batch_isend_irecv promises that: two ranks may each send the other
 * a message larger than the ring before receiving).  ops is a list of
 *   (1, dst, pieces)          send: the message's whole byte stream
 *                             ([header length, data length] + header + data)
 *   (0, src, header, pieces)  receive the next message from src, whose header
 *                             must be `header`, its data into the pieces
 * Operations with the same peer and direction run in list order; the others
 * interleave chunk by chunk.  A received message that does not match (another
 * header, or data of another size) is received into a new bytearray instead,
 * so the channel stays in step and nothing is written, and comes back as
 * (index, its header, its data) for Python to judge.  The wait is the one
 * of wait_seq (spin, yield, sleep; liveness, crossed calls, the deadline
 * since the last progress, abort, signals) over every blocked peer.
 */

/* The whole header is in: does the message fit the receive?  If not, its
 * data goes to a new bytearray, which Python gets without another copy (the
 * GIL is taken for that moment). 0, or -1: no memory. */
static int brecv_check(bop_t *o, PyThreadState **ts)
{
    size_t room = 0;
    for (Py_ssize_t i = 0; i < o->pc.n; i++)
        room += o->pc.len[i];
    o->drop = o->hl != o->want_len || memcmp(o->hdr, o->want, o->hl) != 0 || o->dl != room;
    if (!o->drop)
        return 0;
    PyEval_RestoreThread(*ts);
    o->scratch_obj = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)o->dl);
    if (o->scratch_obj)
        o->scratch = PyByteArray_AS_STRING(o->scratch_obj);
    else
        PyErr_Clear(); /* reported as no memory */
    *ts = PyEval_SaveThread();
    return o->scratch_obj ? 0 : -1;
}

/* Copy n bytes at from (stream offset at) to where the receive puts them.
 * 0, or -1: no memory. */
static int brecv_put(Engine *e, bop_t *o, const char *from, size_t n, size_t at,
                     PyThreadState **ts)
{
    while (n) {
        size_t m;
        if (at < 16 + o->hl) { /* the header */
            m = 16 + o->hl - at < n ? 16 + o->hl - at : n;
            memcpy(o->hdr + (at - 16), from, m);
            o->got += m;
            if (o->got == o->hl && brecv_check(o, ts) < 0)
                return -1;
        } else if (o->np) { /* by reference: where the data is, then the data */
            m = n;
            memcpy(o->hdr + (at - 16), from, m);
            if (at + m == o->total) {
                pieces_t into = {&o->scratch, &o->dl, 1};
                o->err = cma_recv(e, o->peer, o->hdr + o->hl, o->np, o->dl,
                                  o->drop ? &into : &o->pc);
                if (o->err)
                    return 0;
            }
        } else { /* the data */
            m = n;
            if (o->drop) {
                memcpy(o->scratch + o->soff, from, m);
                o->soff += m;
            } else {
                size_t left = m;
                const char *f = from;
                while (left) {
                    size_t room = o->pc.len[o->piece] - o->off;
                    size_t c = room < left ? room : left;
                    memcpy(o->pc.addr[o->piece] + o->off, f, c);
                    o->off += c;
                    f += c;
                    left -= c;
                    if (o->off == o->pc.len[o->piece]) {
                        o->piece++;
                        o->off = 0;
                    }
                }
            }
        }
        from += m;
        at += m;
        n -= m;
    }
    return 0;
}

/* Take every chunk that has arrived; 1 if any did. -1: no memory. */
static int brecv_step(Engine *e, bop_t *o, PyThreadState **ts)
{
    const size_t cap = e->p2p_piece;
    _Atomic uint64_t *sent = &ctrl_line(e, o->peer, P2P_SENT_LINE(e->rank))->seq;
    line_t *done = ctrl_line(e, e->rank, P2P_DONE_LINE(e->world, o->peer));
    int moved = 0;
    if (!o->started) {
        o->k = e->p2p_recvd[o->peer] + 1;
        if (atomic_load_explicit(sent, memory_order_acquire) < o->k)
            return 0;
        uint64_t lens[2];
        memcpy(lens, p2p_slot_of(e, o->peer, e->rank, o->k), sizeof lens);
        o->hl = (size_t)P2P_HL(lens[0]);
        o->np = P2P_NP(lens[0]);
        o->dl = (size_t)lens[1];
        /* by reference, the stream after the header is where the data lies */
        o->total = 16 + o->hl + (o->np ? 16 * (size_t)o->np : o->dl);
        o->hdr = PyMem_RawMalloc(o->hl + 16 * (size_t)o->np + 1);
        if (!o->hdr)
            return -1;
        o->pos = 0;
        o->used = 16;
        o->limit = o->total < cap ? o->total : cap;
        o->started = 1;
        moved = 1;
        if (o->hl == 0 && brecv_check(o, ts) < 0) /* an empty header: decide now */
            return -1;
    }
    for (;;) {
        if (o->need) {
            if (atomic_load_explicit(sent, memory_order_acquire) < o->k)
                return moved;
            o->need = 0;
            o->used = 0;
            o->limit = o->total - o->pos < cap ? o->total - o->pos : cap;
        }
        if (o->used < o->limit) {
            const char *slot = p2p_slot_of(e, o->peer, e->rank, o->k);
            if (brecv_put(e, o, slot + o->used, o->limit - o->used, o->pos + o->used, ts) < 0)
                return -1;
            if (o->err) /* a read by reference failed */
                return 0;
            o->used = o->limit;
            moved = 1;
        }
        publish(e, done, o->k); /* chunk k is consumed */
        o->pos += o->limit;
        if (o->pos >= o->total) {
            e->p2p_recvd[o->peer] = o->k;
            o->done = 1;
            return 1;
        }
        o->k++;
        o->need = 1;
    }
}

/* The counter a blocked operation waits on, and the value it needs. */
static _Atomic uint64_t *bop_waits_on(Engine *e, bop_t *o, uint64_t *n)
{
    if (o->send) { /* room in the ring, or (by reference, all sent) the receiver's read */
        *n = o->np && o->pos >= o->total ? o->k : o->k + 1 - P2P_RING;
        return &ctrl_line(e, o->peer, P2P_DONE_LINE(e->world, e->rank))->seq;
    }
    *n = o->started ? o->k : e->p2p_recvd[o->peer] + 1;
    return &ctrl_line(e, o->peer, P2P_SENT_LINE(e->rank))->seq;
}

static int batch_run(Engine *e, bop_t *ops, Py_ssize_t n, PyThreadState **ts)
{
    uint64_t last = now_ns(), next_check = last + 2000000ull, next_signal = last + 50000000ull;
    hdr_t *h = HDR(e);
    /* a verdict (peer dead, calls crossed) is only given after one more pass
     * over the operations that moved nothing: the peer may have sent this
     * rank's message and then gone on (into a collective, or out) between the
     * last pass and the check.  Its counters were published before its round
     * or its exit, so the pass after seeing either sees them too. */
    int recheck = 0;
    for (;;) {
        int moved = 0, pending = 0;
        bop_t *first = NULL; /* the first blocked operation: the one to sleep on */
        for (Py_ssize_t i = 0; i < n; i++) {
            bop_t *o = &ops[i];
            if (o->done)
                continue;
            pending = 1;
            int behind = 0; /* an earlier one, same peer and direction, is not done */
            for (Py_ssize_t j = 0; j < i && !behind; j++)
                behind = !ops[j].done && ops[j].send == o->send && ops[j].peer == o->peer;
            if (behind)
                continue;
            int m = o->send ? bsend_step(e, o) : brecv_step(e, o, ts);
            if (m < 0)
                return -1;
            if (o->err)
                return o->err;
            moved |= m;
            if (!o->done && !first)
                first = o;
        }
        if (!pending)
            return ST_OK;
        uint64_t t = now_ns();
        if (moved) {
            last = t;
            recheck = 0;
            continue;
        }
        if (t >= next_check || recheck) {
            next_check = t + 2000000ull;
            if (take_abort(e))
                return ST_ABORTED;
            fault_pause(e); /* tests: widen the race the recheck closes */
            int verdict = ST_OK, who = -1;
            for (Py_ssize_t i = 0; i < n && verdict == ST_OK; i++) {
                bop_t *o = &ops[i];
                if (o->done)
                    continue;
                who = o->peer;
                if (!peer_alive(e, o->peer))
                    verdict = ST_PEER_DEAD;
                else if (peer_ahead(e, o->peer)) /* crossed: see wait_seq */
                    verdict = ST_CROSSED;
            }
            if (verdict != ST_OK && !recheck) {
                recheck = 1; /* one more pass first (above) */
                continue;
            }
            recheck = 0;
            if (verdict != ST_OK) {
                e->err_rank = who;
                e->failed = 1;
                set_abort(e, verdict, verdict == ST_PEER_DEAD ? who : e->rank);
                return verdict;
            }
            int st = deadline_and_signals(e, t - last >= e->timeout_ns, first ? first->peer : -1,
                                          t, &next_signal, ts);
            if (st != ST_OK)
                return st;
        }
        if (t - last < e->spin_ns) {
            cpu_relax();
        } else if (t - last < e->yield_ns) {
            sched_yield();
        } else if (first) {
            uint64_t want;
            _Atomic uint64_t *c = bop_waits_on(e, first, &want);
            atomic_fetch_add_explicit(&h->sleepers, 1, memory_order_seq_cst);
            uint64_t v = atomic_load_explicit(c, memory_order_seq_cst);
            if (v < want && !atomic_load_explicit(&h->abort_word, memory_order_relaxed)) {
                /* short: the other blocked operations are not watched here */
                struct timespec to = {0, 200000};
                syscall(SYS_futex, futex_word(c), FUTEX_WAIT, (uint32_t)v, &to, NULL, 0);
            }
            atomic_fetch_sub_explicit(&h->sleepers, 1, memory_order_relaxed);
        }
    }
}

/* Run a batch with the GIL released: the one entry of p2p_batch and
 * p2p_sendrecv.  Where the batch also receives, its large sends go by
 * reference (see cma_message): the rule lives here, not in the callers.
 * The status of batch_run. */
static int run_batch(Engine *e, bop_t *ops, Py_ssize_t n)
{
    int receives = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        receives |= !ops[i].send;
    for (Py_ssize_t i = 0; receives && i < n; i++) {
        bop_t *o = &ops[i];
        Py_ssize_t pieces = o->pc.n;
        if (o->send && cma_message(e, &o->pc, &o->rbuf, o->by_addr, o->by_len, &o->pc)) {
            o->np = pieces - 1;
            o->total = o->pc.len[0];
        }
    }
    e->busy = 1;
    e->in_p2p = 1;
    PyThreadState *ts = PyEval_SaveThread();
    int st = batch_run(e, ops, n, &ts);
    PyEval_RestoreThread(ts);
    e->in_p2p = 0;
    e->busy = 0;
    return st;
}

static void bops_free(bop_t *ops, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyMem_Free(ops[i].own.addr);
        PyMem_Free(ops[i].own.len);
        PyMem_RawFree(ops[i].rbuf);
        PyMem_RawFree(ops[i].hdr);
        Py_XDECREF(ops[i].scratch_obj);
    }
    PyMem_Free(ops);
}

static PyObject *eng_p2p_batch(Engine *e, PyObject *list)
{
    if (!e->base)
        return eng_closed_error();
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "p2p_batch: ops must be a list");
        return NULL;
    }
    int no = refuse(e);
    if (no)
        return Py_BuildValue("(i[])", no);
    if (e->rx_src >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "p2p_batch: a received message is half read");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    bop_t *ops = PyMem_Calloc((size_t)n + 1, sizeof(bop_t));
    if (!ops)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i), *pieces, *want = NULL;
        bop_t *o = &ops[i];
        int ok = PyTuple_Check(item) && PyTuple_GET_SIZE(item) >= 3 &&
                 PyArg_ParseTuple(item, PyTuple_GET_SIZE(item) == 3 ? "iiO" : "iiSO", &o->send,
                                  &o->peer, PyTuple_GET_SIZE(item) == 3 ? &pieces : &want,
                                  &pieces);
        if (!ok || (o->send != (want == NULL))) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError,
                                "p2p_batch: each op is (1, dst, pieces) or (0, src, header, "
                                "pieces)");
            bops_free(ops, i);
            return NULL;
        }
        if (check_rank(e, o->peer, "p2p_batch") < 0 || parse_pieces(pieces, &o->pc) < 0) {
            bops_free(ops, i);
            return NULL;
        }
        o->own = o->pc;
        if (o->send) {
            for (Py_ssize_t j = 0; j < o->pc.n; j++)
                o->total += o->pc.len[j];
            if (o->total < 16) {
                PyErr_SetString(PyExc_ValueError, "p2p_batch: a message has at least 16 bytes");
                bops_free(ops, i + 1);
                return NULL;
            }
        } else {
            o->want = PyBytes_AS_STRING(want); /* the list keeps the bytes alive */
            o->want_len = (size_t)PyBytes_GET_SIZE(want);
        }
    }
    int st = run_batch(e, ops, n);
    PyObject *bad = st < 0 ? NULL : PyList_New(0);
    for (Py_ssize_t i = 0; bad && st == ST_OK && i < n; i++) {
        if (ops[i].send || !ops[i].drop)
            continue;
        PyObject *pair =
            Py_BuildValue("(ny#O)", i, ops[i].hdr, (Py_ssize_t)ops[i].hl, ops[i].scratch_obj);
        if (!pair || PyList_Append(bad, pair) < 0)
            Py_CLEAR(bad);
        Py_XDECREF(pair);
    }
    bops_free(ops, n);
    if (st < 0) {
        Py_XDECREF(bad);
        return PyErr_NoMemory();
    }
    return bad ? Py_BuildValue("(iN)", st, bad) : NULL;
}

/*
 * p2p_sendrecv(dst, tensors, src, out) -> status | (header, data) | None:
 * Communicator.sendrecv with plain tensors in one C call (its Python steps
 * cost ~30 us per call on the development VM, ten times the exchange).  With
 * out=None the message is received whole into a bytearray, as p2p_batch does
 * for a receive that expects nothing, and Python makes the tensors.
 * The send and the receive progress together (batch_run).  None: nothing was
 * sent or received (a tensor that is not plain, an out that overlaps what is
 * sent, a closed or failed engine...): the general path runs.  (header, data):
 * the message did not match out and was received whole into data (a
 * bytearray), as p2p_batch reports it; out is untouched.
 */
static PyObject *eng_p2p_sendrecv(Engine *e, PyObject *const *args, Py_ssize_t nargs)
{
    int dst, src;
    Py_ssize_t ns, nr, nps, npr;
    if (nargs != 4)
        Py_RETURN_NONE;
    PyObject **sitems = p2p_args(e, args, 2, &dst, &ns), **ritems = NULL;
    int into = args[3] != Py_None; /* else new tensors: the message lands in a bytearray */
    if (!sitems || e->rx_src >= 0)
        Py_RETURN_NONE;
    if (into ? !(ritems = p2p_args(e, args + 2, 2, &src, &nr)) : (src = peer_arg(e, args[2])) < 0)
        Py_RETURN_NONE;
    char shead[P2P_HEAD_BYTES], rhead[P2P_HEAD_BYTES];
    char *saddr[P2P_MAX_TENSORS + 1], *raddr[P2P_MAX_TENSORS + 1];
    size_t slen[P2P_MAX_TENSORS + 1], rlen[P2P_MAX_TENSORS + 1];
    if (plain_message(e, sitems, ns, shead, saddr, slen, &nps) < 0 ||
        (into && plain_message(e, ritems, nr, rhead, raddr, rlen, &npr) < 0))
        Py_RETURN_NONE;
    if (!into) { /* an expected header no message has: received whole, aside */
        npr = 1;
        rlen[0] = 16;
    }
    for (Py_ssize_t i = 1; i < nps; i++) /* receiving into what is sent: Python copies it */
        for (Py_ssize_t j = 1; j < npr; j++)
            if (overlap(saddr[i], slen[i], raddr[j], rlen[j]))
                Py_RETURN_NONE;
    if (take_abort(e))
        Py_RETURN_NONE;
    bop_t ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].send = 1;
    ops[0].peer = dst;
    ops[0].pc = (pieces_t){saddr, slen, nps};
    for (Py_ssize_t i = 0; i < nps; i++)
        ops[0].total += slen[i];
    ops[1].peer = src;
    ops[1].pc = (pieces_t){raddr + 1, rlen + 1, npr - 1};
    ops[1].want = rhead + 16;
    ops[1].want_len = rlen[0] - 16;
    int st = run_batch(e, ops, 2);
    PyObject *res;
    if (st < 0)
        res = PyErr_NoMemory();
    else if (st == ST_OK && ops[1].drop)
        res = Py_BuildValue("(y#O)", ops[1].hdr, (Py_ssize_t)ops[1].hl, ops[1].scratch_obj);
    else
        res = PyLong_FromLong(st);
    PyMem_RawFree(ops[0].rbuf);
    PyMem_RawFree(ops[1].hdr);
    Py_XDECREF(ops[1].scratch_obj);
    return res;
}

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
    /* nthreads > 1: the helper-thread path of a rank, for tests (one process) */
    pool_t *P = nthreads > 1 ? pool_new(nthreads) : NULL;
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

static PyObject *eng_error_info(Engine *e, PyObject *unused)
{
    (void)unused;
    return Py_BuildValue("{s:i,s:I,s:I,s:I,s:K,s:K,s:K,s:K,s:i}", "rank", e->err_rank, "kind",
                         e->err_kind, "dtype", e->err_dtype, "op", e->err_op, "count",
                         (unsigned long long)e->err_count, "arg", (unsigned long long)e->err_arg,
                         "my_arg", (unsigned long long)e->err_my_arg, "reason",
                         (unsigned long long)e->err_reason, "errno", e->err_errno);
}

static PyObject *eng_header(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->base)
        return eng_closed_error();
    hdr_t *h = HDR(e);
    return Py_BuildValue("{s:K,s:K,s:I,s:I,s:K,s:K,s:K,s:K,s:K,s:I}", "p2p_bytes",
                         (unsigned long long)h->p2p_bytes, "magic",
                         (unsigned long long)h->magic, "version", h->version, "world", h->world,
                         "slot_bytes", (unsigned long long)h->slot_bytes, "total_bytes",
                         (unsigned long long)h->total_bytes, "ctrl_off",
                         (unsigned long long)h->ctrl_off, "slot_off",
                         (unsigned long long)h->slot_off, "nchan", (unsigned long long)h->nchan,
                         "attached", (unsigned)atomic_load(&h->attached));
}

/* attach() -> number of ranks attached so far, this one included */
static PyObject *eng_attach(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->base)
        return eng_closed_error();
    uint32_t n = atomic_fetch_add(&HDR(e)->attached, 1) + 1;
    return PyLong_FromUnsignedLong(n);
}

/* wait_attached(timeout_s) -> True when every rank attached, False on timeout */
static PyObject *eng_wait_attached(Engine *e, PyObject *arg)
{
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (!e->base)
        return eng_closed_error();
    uint64_t deadline = now_ns() + (uint64_t)(timeout * 1e9);
    int ok = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        if (atomic_load(&HDR(e)->attached) >= (uint32_t)e->world) {
            ok = 1;
            break;
        }
        if (now_ns() >= deadline)
            break;
        struct timespec s = {0, 200000};
        nanosleep(&s, NULL);
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *eng_peer_pids(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->base)
        return eng_closed_error();
    PyObject *l = PyList_New(e->world);
    if (!l)
        return NULL;
    for (int r = 0; r < e->world; r++)
        PyList_SET_ITEM(l, r, PyLong_FromUnsignedLongLong(*(uint64_t *)ctrl_of(e, r)));
    return l;
}


static PyObject *eng_abort(Engine *e, PyObject *arg)
{
    long reason = PyLong_AsLong(arg);
    if (reason == -1 && PyErr_Occurred())
        return NULL;
    if (e->base)
        set_abort(e, (uint64_t)reason, e->rank);
    e->failed = 1;
    Py_RETURN_NONE;
}

/*
 * Engines whose liveness lock this process holds.  A child made by fork()
 * (without exec: the descriptor is close-on-exec) inherits the descriptor,
 * which refers to the parent's open file description: while the child lives
 * the parent's lock stays held after the parent dies, and the peers would
 * wait out the timeout instead of raising PeerFailedError (a DataLoader
 * worker, a tokenizer process).  after_fork_child closes the child's copies
 * (the parent keeps its lock: it holds its own reference) and leaves the
 * engines unusable there.  It runs in the child before anything else, with
 * only the forking thread: plain stores and close(), no Python, no locks.
 */
static Engine *live_engines;

static void live_add(Engine *e)
{
    e->next_live = live_engines;
    live_engines = e;
    e->live = 1;
}

static void live_remove(Engine *e)
{
    if (!e->live)
        return;
    for (Engine **p = &live_engines; *p; p = (Engine **)&(*p)->next_live)
        if (*p == e) {
            *p = (Engine *)e->next_live;
            break;
        }
    e->live = 0;
}

static void after_fork_child(void)
{
    for (Engine *e = live_engines; e; e = (Engine *)e->next_live) {
        if (e->fd >= 0)
            close(e->fd);
        e->fd = -1;
        e->base = NULL;  /* every call now fails; the mapping stays (tensors of empty()) */
        e->pool = NULL;  /* its threads are the parent's: never join them here */
        e->busy = e->held = e->rx_held = 0; /* close() must not abort the parent's */
        e->live = 0;
    }
    live_engines = NULL;
    forked_child = 1;
}

static void eng_unmap(Engine *e)
{
    live_remove(e);
    pool_free(e->pool);
    e->pool = NULL;
    e->base = NULL;
    Py_CLEAR(e->mapping); /* unmaps once no tensor views it */
    if (e->fd >= 0) {
        close(e->fd); /* drops the liveness lock */
        e->fd = -1;
    }
}

/* close(wait_s): unmap.  If another thread is inside a call, or holds the
 * engine between calls, the communicator is aborted first (reason ST_CLOSED:
 * that call returns at its next check, within ms, and the peers learn that
 * this rank closed it) and close waits up to wait_s seconds, GIL released, for
 * the thread to leave; RuntimeError (nothing unmapped) if it does not. */
static PyObject *eng_close(Engine *e, PyObject *arg)
{
    double wait_s = PyFloat_AsDouble(arg);
    if (wait_s == -1.0 && PyErr_Occurred())
        return NULL;
    if (e->base && other_thread(e)) {
        set_abort(e, ST_CLOSED, e->rank);
        uint64_t deadline = now_ns() + (uint64_t)(wait_s > 0 ? wait_s * 1e9 : 0);
        while (other_thread(e) && now_ns() < deadline) {
            Py_BEGIN_ALLOW_THREADS
            struct timespec s = {0, 200000};
            nanosleep(&s, NULL);
            Py_END_ALLOW_THREADS
        }
        if (other_thread(e)) {
            PyErr_Format(PyExc_RuntimeError,
                         "close: another thread is still inside a call on this Communicator "
                         "%gs after it was aborted", wait_s);
            return NULL;
        }
    }
    eng_unmap(e);
    Py_RETURN_NONE;
}

/* hold() -> status: keep other threads out across the several calls of one
 * operation (0, or ST_BUSY when another thread is in); release() ends it.
 * Nested holds of one thread count. */
static PyObject *eng_hold(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->base)
        return eng_closed_error();
    if (other_thread(e))
        return PyLong_FromLong(ST_BUSY);
    e->held++;
    e->holder = PyThread_get_thread_ident();
    return PyLong_FromLong(ST_OK);
}

static PyObject *eng_release(Engine *e, PyObject *unused)
{
    (void)unused;
    if (e->held > e->rx_held && e->holder == PyThread_get_thread_ident())
        e->held--;
    Py_RETURN_NONE;
}

/* rx_release(): give up the hold of a received header whose body will not be
 * read (Python failed between the two); no-op otherwise */
static PyObject *eng_rx_release(Engine *e, PyObject *unused)
{
    (void)unused;
    if (e->holder == PyThread_get_thread_ident())
        rx_release(e);
    Py_RETURN_NONE;
}

/* in_use: whether another thread is inside a call or holds the engine */
static PyObject *eng_get_in_use(Engine *e, void *c)
{
    (void)c;
    return PyBool_FromLong(other_thread(e));
}

static PyObject *eng_get_mapping(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->mapping)
        return eng_closed_error();
    Py_INCREF(e->mapping);
    return e->mapping;
}

static PyObject *eng_address(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->base)
        return eng_closed_error();
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)e->base);
}

/*
 * Engine(fd, size, rank, world, slot_bytes, create, timeout_s, spin_us, yield_us)
 * Maps the segment (fd stays owned by the engine: it carries the liveness
 * lock), takes the liveness lock on byte `rank`, and writes the header when
 * `create` is true.  Header validation on attach is Python's (header()).
 */
static int eng_init(Engine *e, PyObject *args, PyObject *kw)
{
    (void)kw;
    int fd, rank, world, create;
    unsigned long long size, slot_bytes;
    double timeout, spin_us, yield_us;
    if (!PyArg_ParseTuple(args, "iKiiKpddd", &fd, &size, &rank, &world, &slot_bytes, &create,
                          &timeout, &spin_us, &yield_us))
        return -1;
    if (world < 2 || rank < 0 || rank >= world || slot_bytes == 0 || slot_bytes % PAGE) {
        PyErr_Format(PyExc_ValueError, "Engine: bad rank %d / world %d / slot_bytes %llu", rank,
                     world, slot_bytes);
        return -1;
    }
    if (world > MAX_WORLD) {
        PyErr_Format(PyExc_ValueError, "Engine: world %d too large", world);
        return -1;
    }
    uint64_t need = seg_size((uint32_t)world, slot_bytes);
    if (size < need) {
        PyErr_Format(PyExc_ValueError, "Engine: segment of %llu bytes, layout needs %llu", size,
                     (unsigned long long)need);
        return -1;
    }
    /* The liveness lock lives on an open file description of its own, which
     * nothing but myfd refers to: a mapping holds a reference to the
     * description it was made through, and a child made by fork() inherits
     * the mapping, so a lock on the mapping's description would outlive this
     * process as long as such a child lives (after_fork_child closes the
     * child's copy of myfd).  Reopening /proc/self/fd/N makes a new
     * description; without /proc, share fd's (as the fallback it is). */
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int myfd = open(path, O_RDWR | O_CLOEXEC);
    if (myfd < 0)
        myfd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (myfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        close(myfd);
        return -1;
    }
    /* Every rank opened the file itself: OFD locks of different ranks conflict. */
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = rank;
    fl.l_len = 1;
    if (fcntl(myfd, F_OFD_SETLK, &fl) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        munmap(p, (size_t)size);
        close(myfd);
        return -1;
    }
    Mapping *mp = PyObject_New(Mapping, &MappingType);
    if (!mp) {
        munmap(p, (size_t)size);
        close(myfd);
        return -1;
    }
    mp->base = p;
    mp->size = (size_t)size;
    eng_unmap(e);
    PyMem_Free(e->srcs);
    e->srcs = PyMem_Calloc((size_t)world, sizeof(void *));
    if (!e->srcs) {
        Py_DECREF(mp);
        close(myfd);
        PyErr_NoMemory();
        return -1;
    }
    e->mapping = (PyObject *)mp;
    PyMem_Free(e->p2p_sent);
    e->p2p_sent = PyMem_Calloc((size_t)world * 2, sizeof(uint64_t));
    if (!e->p2p_sent) {
        PyErr_NoMemory();
        return -1;
    }
    e->p2p_recvd = e->p2p_sent + world;
    e->rx_src = -1;
    e->base = p;
    e->size = (size_t)size;
    e->fd = myfd;
    live_add(e);
    e->rank = rank;
    e->world = world;
    e->slot_bytes = slot_bytes;
    e->ctrl_bytes = (size_t)ctrl_size((uint32_t)world);
    e->slot_off = PAGE + (size_t)world * e->ctrl_bytes;
    e->p2p_bytes = (size_t)p2p_size((uint32_t)world, slot_bytes);
    e->p2p_piece = 2 * e->p2p_bytes / P2P_RING; /* p2p_bytes: a multiple of 4 KiB, >= 64 KiB */
    e->p2p_off = e->slot_off + (size_t)world * 2 * slot_bytes;
    e->round = 0;
    e->timeout_ns = (uint64_t)(timeout * 1e9);
    e->spin_ns = (uint64_t)(spin_us * 1e3);
    e->yield_ns = (uint64_t)(yield_us * 1e3);
    e->busy = 0;
    e->failed = 0;
    e->twoshot_min = UINT64_MAX;
    if (create) {
        hdr_t *h = HDR(e);
        h->version = VERSION;
        h->world = (uint32_t)world;
        h->slot_bytes = slot_bytes;
        h->total_bytes = need;
        h->ctrl_off = PAGE;
        h->slot_off = e->slot_off;
        h->nchan = NCHAN;
        h->p2p_bytes = e->p2p_bytes;
        atomic_store(&h->attached, 0);
        atomic_store(&h->sleepers, 0);
        atomic_store(&h->abort_word, 0);
        atomic_thread_fence(memory_order_release);
        h->magic = MAGIC;
    }
    /* who maps it, for `tpcomm doctor` to tell stale segments from live ones,
     * and where the word is that peers read to check single-copy reads work */
    e->cma_word = cma_tag((uint64_t)getpid(), rank);
    *(uint64_t *)ctrl_of(e, rank) = (uint64_t)getpid();
    ((uint64_t *)ctrl_of(e, rank))[1] = (uint64_t)(uintptr_t)&e->cma_word;
    return 0;
}


static PyObject *eng_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)args;
    (void)kw;
    Engine *e = (Engine *)type->tp_alloc(type, 0);
    if (e)
        e->fd = -1; /* 0 is stdin: never close it by mistake */
    return (PyObject *)e;
}

static void eng_dealloc(Engine *e)
{
    Py_CLEAR(e->pending);
    PyMem_Free(e->p2p_sent);
    for (int i = 0; i < e->nsym; i++)
        PyMem_Free(e->sym[i].peers);
    eng_unmap(e);
    PyMem_Free(e->srcs);
    Py_CLEAR(e->tensor_type);
    Py_CLEAR(e->fallback);
    Py_CLEAR(e->d_dtype);
    Py_CLEAR(e->d_is_cpu);
    Py_CLEAR(e->d_is_contiguous);
    Py_CLEAR(e->d_data_ptr);
    Py_CLEAR(e->d_is_neg);
    Py_CLEAR(e->d_is_conj);
    Py_CLEAR(e->d_shape);
    for (int i = 0; i < e->n_any; i++)
        Py_CLEAR(e->any_dtypes[i]);
    Py_CLEAR(e->empty_fn);
    Py_CLEAR(e->kw_dtype);
    Py_CLEAR(e->d_numel);
    for (int i = 0; i < OP_COUNT; i++)
        Py_CLEAR(e->ops[i]);
    for (int i = 0; i < DT_COUNT; i++)
        Py_CLEAR(e->dtypes[i]);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyObject *eng_get_round(Engine *e, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(e->round);
}

static PyObject *eng_get_failed(Engine *e, void *c)
{
    (void)c;
    if (!e->failed && e->base)
        take_abort(e);
    return PyBool_FromLong(e->failed);
}

/* add_symmetric(base, size, [every rank's base]): register a symmetric buffer */
static PyObject *eng_add_symmetric(Engine *e, PyObject *args)
{
    unsigned long long base, size;
    PyObject *peers;
    if (!PyArg_ParseTuple(args, "KKO!", &base, &size, &PyList_Type, &peers))
        return NULL;
    if (PyList_GET_SIZE(peers) != e->world) {
        PyErr_SetString(PyExc_ValueError, "add_symmetric: one base per rank");
        return NULL;
    }
    if (e->nsym >= MAX_SYM) {
        PyErr_Format(PyExc_ValueError, "add_symmetric: at most %d buffers per communicator",
                     MAX_SYM);
        return NULL;
    }
    char **p = PyMem_Calloc((size_t)e->world, sizeof(char *));
    if (!p)
        return PyErr_NoMemory();
    for (int r = 0; r < e->world; r++) {
        p[r] = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(PyList_GET_ITEM(peers, r));
        if (PyErr_Occurred()) {
            PyMem_Free(p);
            return NULL;
        }
    }
    struct sym *sb = &e->sym[e->nsym++];
    sb->base = (char *)(uintptr_t)base;
    sb->size = (size_t)size;
    sb->peers = p;
    Py_RETURN_NONE;
}

/* set_threads(n): copies and reductions of large chunks use n threads */
static PyObject *eng_set_threads(Engine *e, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 1 || n > 256) {
        PyErr_Format(PyExc_ValueError, "set_threads: %ld threads, expected 1..256", n);
        return NULL;
    }
    if (e->busy) {
        PyErr_SetString(PyExc_RuntimeError, "set_threads: a collective is running");
        return NULL;
    }
    pool_free(e->pool);
    e->pool = NULL;
    if (n > 1 && !(e->pool = pool_new((int)n)))
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *eng_get_threads(Engine *e, void *c)
{
    (void)c;
    return PyLong_FromLong(e->pool ? e->pool->nhelp + 1 : 1);
}

/* reraise(): raise the exception a signal handler raised during a wait */
static PyObject *eng_reraise(Engine *e, PyObject *unused)
{
    (void)unused;
    if (!e->pending) {
        PyErr_SetString(PyExc_RuntimeError, "tpcomm: interrupted");
        return NULL;
    }
    PyObject *v = e->pending;
    e->pending = NULL;
    PyErr_SetObject((PyObject *)Py_TYPE(v), v);
    Py_DECREF(v);
    return NULL;
}

/* set_twoshot_min(bytes): -1 = never two-shot */
static PyObject *eng_set_twoshot_min(Engine *e, PyObject *arg)
{
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred())
        return NULL;
    e->twoshot_min = v < 0 ? UINT64_MAX : (uint64_t)v;
    Py_RETURN_NONE;
}


/*
 * cma_init(kind, want, min_bytes) -> (status, enabled): collective.  Every rank
 * tries to read every peer's check word (cma_tag) with process_vm_readv, then
 * one round (kind: a barrier's) tells every rank what every other found;
 * single-copy all_gathers are on only if every rank can read every peer and
 * wants them (want: 0 from TPCOMM_CMA=0 turns them off everywhere).
 */
static PyObject *eng_cma_init(Engine *e, PyObject *args)
{
    unsigned int kind;
    int want;
    unsigned long long min_bytes;
    if (!PyArg_ParseTuple(args, "IpK", &kind, &want, &min_bytes))
        return NULL;
    if (!e->base)
        return eng_closed_error();
    int en = enter(e);
    if (en < 0)
        return NULL;
    if (en > 0)
        return Py_BuildValue("(iO)", en, Py_False);
    int ok = want;
    for (int r = 0; ok && r < e->world; r++) {
        if (r == e->rank)
            continue;
        uint64_t v = 0, where = ((uint64_t *)ctrl_of(e, r))[1];
        struct iovec l = {&v, sizeof v}, rm = {(void *)(uintptr_t)where, sizeof v};
        ok = process_vm_readv(peer_pid(e, r), &l, 1, &rm, 1, 0) == (ssize_t)sizeof v &&
             v == cma_tag((uint64_t)peer_pid(e, r), r);
    }
    int p = (int)((e->round + 1) & 1);
    line_of(e, e->rank, 0, p)->_r = (uint32_t)ok;
    PyThreadState *ts = NULL;
    int st = round_sync(e, kind, 0, 0, 0, 0, &ts);
    st = leave_data(e, st, ts); /* ts is set by round_sync: two statements */
    int all = st == ST_OK;
    for (int r = 0; all && r < e->world; r++)
        all = line_of(e, r, 0, p)->_r == 1;
    e->cma = all;
    e->cma_min = min_bytes;
    return Py_BuildValue("(iO)", st, all ? Py_True : Py_False);
}

/* Fault injection for tests: every slow wait of p2p_batch sleeps this long
 * (microseconds) between its last pass and its verdicts (see batch_run), and
 * a single-copy all_gather, all_to_all or message read by reference before each
 * read of a peer (cma_read, cma_recv). */
static PyObject *eng_fault_check_delay(Engine *e, PyObject *arg)
{
    double us = PyFloat_AsDouble(arg);
    if (us == -1.0 && PyErr_Occurred())
        return NULL;
    e->fault_check_delay_ns = us > 0 ? (uint64_t)(us * 1e3) : 0;
    Py_RETURN_NONE;
}

/* Fault injection for tests: single-copy all_gathers and all_to_alls, and
 * messages sent by reference, publish an address the peers cannot read (a
 * read error with every rank alive: ST_CMA). */
static PyObject *eng_fault_cma_addr(Engine *e, PyObject *arg)
{
    int v = PyObject_IsTrue(arg);
    if (v < 0)
        return NULL;
    e->fault_cma_addr = v;
    Py_RETURN_NONE;
}

static PyMethodDef eng_methods[] = {
    {"fault_check_delay", (PyCFunction)eng_fault_check_delay, METH_O, NULL},
    {"cma_init", (PyCFunction)eng_cma_init, METH_VARARGS, NULL},
    {"fault_cma_addr", (PyCFunction)eng_fault_cma_addr, METH_O, NULL},
    {"all_reduce", (PyCFunction)(void (*)(void))eng_all_reduce, METH_FASTCALL, NULL},
    {"fast_all_reduce", (PyCFunction)(void (*)(void))eng_fast_all_reduce,
     METH_FASTCALL | METH_KEYWORDS, NULL},
    {"set_fast_path", (PyCFunction)eng_set_fast_path, METH_VARARGS, NULL},
    {"error_info", (PyCFunction)eng_error_info, METH_NOARGS, NULL},
    {"header", (PyCFunction)eng_header, METH_NOARGS, NULL},
    {"attach", (PyCFunction)eng_attach, METH_NOARGS, NULL},
    {"wait_attached", (PyCFunction)eng_wait_attached, METH_O, NULL},
    {"peer_pids", (PyCFunction)eng_peer_pids, METH_NOARGS, NULL},
    {"abort", (PyCFunction)eng_abort, METH_O, NULL},
    {"close", (PyCFunction)eng_close, METH_O, NULL},
    {"hold", (PyCFunction)eng_hold, METH_NOARGS, NULL},
    {"release", (PyCFunction)eng_release, METH_NOARGS, NULL},
    {"rx_release", (PyCFunction)eng_rx_release, METH_NOARGS, NULL},
    {"p2p_batch", (PyCFunction)eng_p2p_batch, METH_O, NULL},
    {"address", (PyCFunction)eng_address, METH_NOARGS, NULL},
    {"mapping", (PyCFunction)eng_get_mapping, METH_NOARGS, NULL},
    {"set_twoshot_min", (PyCFunction)eng_set_twoshot_min, METH_O, NULL},
    {"add_symmetric", (PyCFunction)eng_add_symmetric, METH_VARARGS, NULL},
    {"set_threads", (PyCFunction)eng_set_threads, METH_O, NULL},
    {"reraise", (PyCFunction)eng_reraise, METH_NOARGS, NULL},
    {"p2p_send", (PyCFunction)eng_p2p_send, METH_VARARGS, NULL},
    {"gatherv", (PyCFunction)(void (*)(void))eng_gatherv, METH_FASTCALL, NULL},
    {"fast_gather", (PyCFunction)(void (*)(void))eng_fast_gather, METH_FASTCALL, NULL},
    {"alltoallv", (PyCFunction)(void (*)(void))eng_alltoallv, METH_FASTCALL, NULL},
    {"broadcast", (PyCFunction)(void (*)(void))eng_broadcast, METH_FASTCALL, NULL},
    {"reduce_scatterv", (PyCFunction)(void (*)(void))eng_reduce_scatterv, METH_FASTCALL, NULL},
    {"p2p_send_tensors", (PyCFunction)(void (*)(void))eng_p2p_send_tensors, METH_FASTCALL, NULL},
    {"p2p_recv_new", (PyCFunction)eng_p2p_recv_new, METH_O, NULL},
    {"p2p_sendrecv", (PyCFunction)(void (*)(void))eng_p2p_sendrecv, METH_FASTCALL, NULL},
    {"p2p_recv_into", (PyCFunction)(void (*)(void))eng_p2p_recv_into, METH_FASTCALL, NULL},
    {"set_p2p_dtypes", (PyCFunction)eng_set_p2p_dtypes, METH_VARARGS, NULL},
    {"plain", (PyCFunction)eng_plain, METH_O, NULL},
    {"fast_broadcast", (PyCFunction)(void (*)(void))eng_fast_broadcast, METH_FASTCALL, NULL},
    {"fast_all_gather", (PyCFunction)(void (*)(void))eng_fast_all_gather, METH_FASTCALL, NULL},
    {"fast_reduce_scatter", (PyCFunction)(void (*)(void))eng_fast_reduce_scatter, METH_FASTCALL,
     NULL},
    {"p2p_recv_head", (PyCFunction)eng_p2p_recv_head, METH_O, NULL},
    {"p2p_recv_body", (PyCFunction)eng_p2p_recv_body, METH_O, NULL},
    {"sync", (PyCFunction)(void (*)(void))eng_sync, METH_FASTCALL, NULL},
    {"layout", (PyCFunction)eng_layout, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef eng_getset[] = {
    {"round", (getter)eng_get_round, NULL, NULL, NULL},
    {"threads", (getter)eng_get_threads, NULL, NULL, NULL},
    {"failed", (getter)eng_get_failed, NULL, NULL, NULL},
    {"in_use", (getter)eng_get_in_use, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tpcomm._native.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = eng_new,
    .tp_init = (initproc)eng_init,
    .tp_dealloc = (destructor)eng_dealloc,
    .tp_methods = eng_methods,
    .tp_getset = eng_getset,
};

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

/* copy(dst, src, nbytes): memcpy between raw addresses, for the protocols
 * written in Python (torch's copy_ and slicing cost microseconds each).  The
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

/* set_tuning(nt_min_bytes): copies into a slot of at least this many bytes use
 * non-temporal stores (-1: never). */
static PyObject *mod_set_tuning(PyObject *self, PyObject *args)
{
    (void)self;
    long long v;
    if (!PyArg_ParseTuple(args, "L", &v))
        return NULL;
    nt_min = v < 0 ? (size_t)-1 : (size_t)v;
    Py_RETURN_NONE;
}

static PyObject *mod_isa(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
#if defined(__x86_64__)
    /* what do_reduce dispatches to, switches (TPCOMM_NO_AVX512...) included */
    __builtin_cpu_init();
    const char *level = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                            ? "x86-64-v4"
                        : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                            ? "x86-64-v3"
                            : "x86-64";
    if (have_avx512())
        return PyUnicode_FromFormat("%s (avx512; bfloat16 %s)", level,
                                    have_bf16_insn ? "avx512_bf16" : "integer rounding");
    return PyUnicode_FromFormat("%s (compiler-vectorised)", level);
#elif defined(__aarch64__)
    return PyUnicode_FromString("aarch64 (neon)");
#else
    return PyUnicode_FromString("generic (scalar)");
#endif
}

static PyMethodDef mod_methods[] = {
    {"segment_size", mod_segment_size, METH_VARARGS, NULL},
    {"reduce", eng_reduce_kernel, METH_VARARGS, NULL},
    {"isa", mod_isa, METH_NOARGS, NULL},
    {"set_tuning", mod_set_tuning, METH_VARARGS, NULL},
    {"copy", (PyCFunction)(void (*)(void))mod_copy, METH_FASTCALL, NULL},
    {"time_memcpy", mod_time_memcpy, METH_VARARGS, NULL},
    {"touch", (PyCFunction)(void (*)(void))mod_touch, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "tpcomm._native", NULL, -1, mod_methods,
                                 NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void)
{
    if (PyType_Ready(&EngineType) < 0 || PyType_Ready(&MappingType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&mod);
    if (!m)
        return NULL;
    if (pthread_atfork(NULL, NULL, after_fork_child) != 0) {
        Py_DECREF(m);
        PyErr_SetString(PyExc_RuntimeError, "tpcomm: pthread_atfork failed");
        return NULL;
    }
    S_dtype = PyUnicode_InternFromString("dtype");
    S_is_cpu = PyUnicode_InternFromString("is_cpu");
    S_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    S_data_ptr = PyUnicode_InternFromString("data_ptr");
    S_numel = PyUnicode_InternFromString("numel");
    S_is_neg = PyUnicode_InternFromString("is_neg");
    S_is_conj = PyUnicode_InternFromString("is_conj");
    S_shape = PyUnicode_InternFromString("shape");
    if (!S_dtype || !S_is_cpu || !S_is_contiguous || !S_data_ptr || !S_numel || !S_is_neg ||
        !S_is_conj || !S_shape)
        return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "ST_OK", ST_OK);
    PyModule_AddIntConstant(m, "ST_TIMEOUT", ST_TIMEOUT);
    PyModule_AddIntConstant(m, "ST_PEER_DEAD", ST_PEER_DEAD);
    PyModule_AddIntConstant(m, "ST_MISMATCH", ST_MISMATCH);
    PyModule_AddIntConstant(m, "ST_ABORTED", ST_ABORTED);
    PyModule_AddIntConstant(m, "ST_INTERRUPTED", ST_INTERRUPTED);
    PyModule_AddIntConstant(m, "ST_CROSSED", ST_CROSSED);
    PyModule_AddIntConstant(m, "ST_BUSY", ST_BUSY);
    PyModule_AddIntConstant(m, "ST_CLOSED", ST_CLOSED);
    PyModule_AddIntConstant(m, "ST_CMA", ST_CMA);
    PyModule_AddIntConstant(m, "KIND_ALL_GATHER", KIND_ALL_GATHER);
    PyModule_AddObject(m, "MAGIC", PyLong_FromUnsignedLongLong(MAGIC));
    PyModule_AddIntConstant(m, "VERSION", VERSION);
    PyModule_AddIntConstant(m, "PAGE", PAGE);
    PyModule_AddIntConstant(m, "NCHAN", NCHAN);
    return m;
}
