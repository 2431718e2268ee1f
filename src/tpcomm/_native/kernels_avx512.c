/*
 * The AVX-512 kernels of the float family, and reduce_avx512, which runs them
 * where they may run (the CPU has them, TPCOMM_NO_AVX512 is unset).
 */
#include <stdlib.h>

#include "kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>

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

/*
 * 32 bfloat16 back in order from 16 even and 16 odd float32 results, rounded
 * to nearest even in 16-bit lanes (AVX-512 without AVX512_BF16): hi holds
 * every result's high half in place (the even ones' shifted down, one masked
 * word blend), lo its low half; the carry into hi is lo + 0x7fff + (hi & 1)
 * >= 0x10000, i.e. lo > 0x8000 - (hi & 1) unsigned: one compare into a mask
 * and a masked add.  8 operations for 32 values where rounding each float32
 * on its own took 20.  A NaN must have a zero low half (kernels_avx2.c says
 * when): a carry would turn one whose payload sits there into infinity.
 */
AVX512 static inline __m512i bf16_pair_finite(__m512 e, __m512 o)
{
    const __mmask32 odd = 0xAAAAAAAAu;
    const __m512i one = _mm512_set1_epi16(1);
    __m512i eu = _mm512_castps_si512(e), ou = _mm512_castps_si512(o);
    __m512i hi = _mm512_mask_blend_epi16(odd, _mm512_srli_epi32(eu, 16), ou);
    __m512i lo = _mm512_mask_blend_epi16(odd, eu, _mm512_slli_epi32(ou, 16));
    __m512i limit = _mm512_sub_epi16(_mm512_set1_epi16((short)0x8000), _mm512_and_si512(hi, one));
    return _mm512_mask_add_epi16(hi, _mm512_cmpgt_epu16_mask(lo, limit), hi, one);
}

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
/* SUM (its instance named SUM: float32's, sumw, takes any number of sources
 * and two go to a loop of their own), AVG, MAX, MIN */
#define DEF_AVX512_OPS(D, DT, SUM)                                                              \
    DEF_AVX512(avx512_##D##_##SUM, DT, OP_SUM)                                                  \
    DEF_AVX512(avx512_##D##_avg, DT, OP_AVG)                                                    \
    DEF_AVX512(avx512_##D##_max, DT, OP_MAX)                                                    \
    DEF_AVX512(avx512_##D##_min, DT, OP_MIN)
DEF_AVX512_OPS(f32, DT_F32, sumw)

/* two sources, SUM: both pointers held in registers (kernels_avx2.c's
 * avx2_f32_sum says why); with two sources in L1 it did 100-104 GB/s against
 * 60-77 (AMD Zen 4, 4-16 KiB, benchmarks/kernels.c) */
AVX512 static void avx512_f32_sum(void *dst, void *const *srcs, int w, size_t n)
{
    if (w != 2) {
        avx512_f32_sumw(dst, srcs, w, n);
        return;
    }
    const float *a = srcs[0], *b = srcs[1];
    float *d = dst;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 x0 = _mm512_add_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i));
        __m512 x1 = _mm512_add_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16));
        _mm512_storeu_ps(d + i, x0);
        _mm512_storeu_ps(d + i + 16, x1);
    }
    for (; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(d + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i)));
    }
}
DEF_AVX512_OPS(f16, DT_F16, sum)

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
        /* SUM of two or more sources and AVG quiet every NaN (kernels_avx2.c) */             \
        const int computed = OP == OP_AVG || (OP == OP_SUM && w > 1);                           \
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
            else if (!NATIVE && (computed || !_mm512_cmp_ps_mask(e, o, _CMP_UNORD_Q)))          \
                out = bf16_pair_finite(e, o);                                                   \
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

/* 0: no AVX-512 kernels here (the CPU lacks them, or TPCOMM_NO_AVX512 is set);
 * 1: AVX-512 with bfloat16 rounded by integer ops; 2: with AVX512_BF16 too. */
int avx512_level(void)
{
    static int v = -1;
    if (v < 0) {
        __builtin_cpu_init();
        int base = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
                   !getenv("TPCOMM_NO_AVX512");
        int bf16 = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq") &&
                   !getenv("TPCOMM_NO_AVX512BF16");
        v = base ? 1 + bf16 : 0;
    }
    return v;
}

/*
 * 1: float16 runs the 256-bit F16C kernels of kernels_avx2.c.  AMD Zen 4
 * (family 0x19 with AVX-512) runs a 512-bit vcvtph2ps / vcvtps2ph as two
 * halves, and its float16 kernel, bound by those conversions, is faster with
 * the 256-bit ones (two sources x 1 MiB: 25 GB/s against 22; docs/ENGINE.md).
 * Intel converts 16 values per instruction at the rate of 8, so it keeps the
 * 512-bit kernels, as does any other CPU until measured.  TPCOMM_AVX512_F16=1
 * keeps them on Zen 4 too (for tests).
 */
int avx512_f16_narrow(void)
{
    static int v = -1;
    if (v < 0) {
        unsigned a, b, c, d, fam = 0;
        /* vendor "AuthenticAMD" in ebx, edx, ecx */
        if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163 &&
            __get_cpuid(1, &a, &b, &c, &d)) {
            fam = (a >> 8) & 0xf;
            if (fam == 0xf)
                fam += (a >> 20) & 0xff;
        }
        v = fam == 0x19 && avx2_present() && !getenv("TPCOMM_AVX512_F16");
    }
    return v;
}

int reduce_avx512(int dtype, int op, void *dst, void *const *srcs, int w, size_t n)
{
    int level = avx512_level();
    if (dtype > DT_F16 || !level)
        return 0;
    if (dtype == DT_F16 && avx512_f16_narrow())
        return reduce_avx2(dtype, op, dst, srcs, w, n);
    (dtype == DT_BF16 && level == 2 ? bf16n_kernels : avx512_kernels[dtype])[op](dst, srcs, w, n);
    return 1;
}
#else
int avx512_level(void) { return 0; }
int avx512_f16_narrow(void) { return 0; }

int reduce_avx512(int dtype, int op, void *dst, void *const *srcs, int w, size_t n)
{
    (void)dtype, (void)op, (void)dst, (void)srcs, (void)w, (void)n;
    return 0;
}
#endif
