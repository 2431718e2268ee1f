/*
 * Reduce kernels: load every source as float32 (or the integer type), combine in
 * rank order, store once; the portable C versions (compiler-vectorised per ISA
 * level), the two-source fused form, the copy into a slot, and do_reduce, the
 * one entry, which runs the variant chosen (kernel_set_isa, TPCOMM_ISA) or the
 * best the CPU has (do_reduce_copy: the same with the result copied to a
 * second place).  Plain C: no Python (kernels.h).
 */
#include <stdio.h>
#include <stdlib.h>

#include "kernels.h"

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
 * Copy into this rank's slot, with non-temporal stores where the engine says
 * (from its nt_min bytes, or as allreduce.c chooses as it runs): the lines go
 * to memory/L3 instead of this core's L2, so the peers
 * read them without snooping a modified line out of another core, and the
 * stores need no read-for-ownership of lines the peers still hold shared.
 * 512-bit stores with the AVX-512 kernels, 256-bit with the AVX2 ones (the
 * variant TPCOMM_ISA picks, so each is testable on an AVX-512 CPU); elsewhere
 * a plain memcpy.  The destination's unaligned head goes by memcpy, so any
 * address works.  Copies out of a slot are plain memcpys: their destination
 * is the caller's, who reads it next.
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

__attribute__((target("avx2"))) static void copy_nt_avx2(char *dst, const char *src, size_t n)
{
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    for (; i + 32 <= n; i += 32)
        _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
    if (i < n)
        memcpy(dst + i, src + i, n - i);
}
#endif

/* 1 where copy_slot's non-temporal stores exist (x86 with the AVX2 or
 * AVX-512 kernels in use), else 0: a plain memcpy either way */
int copy_nt_available(void)
{
#if defined(__x86_64__)
    int isa = kernel_isa_in_use();
    return isa == ISA_AVX512 || isa == ISA_AVX2;
#else
    return 0;
#endif
}

void copy_slot(char *dst, const char *src, size_t n, int nt)
{
#if defined(__x86_64__)
    int isa = nt ? kernel_isa_in_use() : ISA_SCALAR;
    if (isa == ISA_AVX512 || isa == ISA_AVX2) {
        size_t head = (size_t)(-(uintptr_t)dst & 63); /* to a 64-byte boundary */
        if (head > n)
            head = n;
        memcpy(dst, src, head);
        if (isa == ISA_AVX512)
            copy_nt_avx512(dst + head, src + head, n - head);
        else
            copy_nt_avx2(dst + head, src + head, n - head);
        _mm_sfence();
        return;
    }
#else
    (void)nt;
#endif
    memcpy(dst, src, n);
}

/* The portable kernels: the reference every variant matches bit for bit. */
void reduce_portable(int dtype, int op, void *dst, void *const *srcs, int w, size_t n)
{
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

void reduce_tail(int dtype, int op, void *dst, void *const *srcs, int w, size_t n, size_t done)
{
    if (done >= n)
        return;
    const size_t es = dt_size[dtype];
    void *tail[w];
    for (int r = 0; r < w; r++)
        tail[r] = (char *)srcs[r] + done * es;
    reduce_portable(dtype, op, (char *)dst + done * es, tail, w, n - done);
}

int kernel_has_isa(int isa)
{
    switch (isa) {
    case ISA_SCALAR:
        return 1;
    case ISA_AVX2:
        return avx2_present();
    case ISA_AVX512:
        return avx512_level() > 0;
    case ISA_NEON:
#if defined(__aarch64__)
        return 1;
#else
        return 0;
#endif
    default:
        return 0;
    }
}

static int isa_best(void)
{
    for (int isa = ISA_COUNT - 1; isa > ISA_SCALAR; isa--)
        if (kernel_has_isa(isa))
            return isa;
    return ISA_SCALAR;
}

static int isa_forced = ISA_AUTO; /* kernel_set_isa (TPCOMM_ISA) */
static int isa_current = -2;      /* resolved on first use */

int kernel_set_isa(int isa)
{
    if (isa != ISA_AUTO && !kernel_has_isa(isa))
        return -1;
    isa_forced = isa;
    isa_current = isa == ISA_AUTO ? isa_best() : isa;
    return 0;
}

int kernel_isa_in_use(void)
{
    if (isa_current < 0)
        isa_current = isa_forced == ISA_AUTO ? isa_best() : isa_forced;
    return isa_current;
}

const char *kernel_isa_name(int isa)
{
    static const char *names[ISA_COUNT] = {"scalar", "avx2", "avx512", "neon"};
    return isa >= 0 && isa < ISA_COUNT ? names[isa] : "auto";
}

/* The reduce whose result goes to two places (two-shot's shard: the tensor
 * and the slot the peers read it from).  Where the AVX2 kernels run, two
 * sources, SUM and plain stores take one loop that stores each vector twice:
 * the second store rides on the 16-bit kernels' arithmetic (world 2, AMD Zen 3,
 * both forms in turns in the same ranks, 11 rounds: bfloat16 and float16
 * 0.89-0.93x at 256 KiB-16 MiB, float32 0.91-1.01x).  Otherwise the reduce,
 * then copy_slot. */
void do_reduce_copy(int dtype, int op, void *dst, char *copy, void *const *srcs, int w, size_t n,
                    int nt)
{
    if (!nt && w == 2 && op == OP_SUM && kernel_isa_in_use() == ISA_AVX2 &&
        reduce_copy_avx2(dtype, dst, copy, srcs, n))
        return;
    do_reduce(dtype, op, dst, srcs, w, n);
    copy_slot(copy, dst, n * dt_size[dtype], nt);
}

void do_reduce(int dtype, int op, void *dst, void *const *srcs, int w, size_t n)
{
    switch (kernel_isa_in_use()) {
    case ISA_AVX512:
        if (reduce_avx512(dtype, op, dst, srcs, w, n))
            return;
        break;
    case ISA_AVX2:
        if (reduce_avx2(dtype, op, dst, srcs, w, n))
            return;
        break;
    case ISA_NEON:
        if (reduce_neon(dtype, op, dst, srcs, w, n))
            return;
        break;
    }
    reduce_portable(dtype, op, dst, srcs, w, n);
}

/* The variant in use and why: "avx2 (AVX2 + F16C; chosen: the best this CPU
 * has)", for tpcomm doctor and the perf header. */
const char *kernel_isa(void)
{
    static char text[200];
    int isa = kernel_isa_in_use();
    const char *what[ISA_COUNT] = {
        "portable C, compiler-vectorised",
        "AVX2 + F16C",
        avx512_level() == 2 ? "AVX-512, bfloat16 by AVX512_BF16" : "AVX-512, bfloat16 by integer rounding",
        "NEON",
    };
    const char *f16 = isa == ISA_AVX512 && avx512_f16_narrow() ? ", float16 by 256-bit F16C (AMD Zen 4)" : "";
    const char *why = isa_forced != ISA_AUTO ? "forced by TPCOMM_ISA" : "the best this CPU has";
    snprintf(text, sizeof text, "%s (%s%s; %s)", kernel_isa_name(isa), what[isa], f16, why);
    return text;
}
