/*
 * The float family on AVX2 + F16C (x86-64-v3: AMD Zen 1-3, Intel Haswell on),
 * 8 values per vector, with intrinsics: gcc vectorises neither the _Float16
 * conversions nor the bfloat16 rounding of the portable kernels.  Same
 * arithmetic as them, lane by lane: widen to float32 exactly (bfloat16: a
 * 16-bit shift; float16: vcvtph2ps), combine in rank order, round once
 * (bfloat16: integer round to nearest even, NaN quieted with its sign, the
 * same rule as f32_to_bf16; float16: vcvtps2ph to nearest even).  No FMA,
 * and AVG divides, as the portable kernels do: results are bitwise theirs.
 * The last n % 16 values go to the portable kernels, so no load or store
 * passes the end of a buffer.
 */
#include "kernels.h"

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2,f16c")))

/* float32 and float16 (bfloat16 has its own loop below) */
AVX2 static inline __m256 ld8(int dtype, const void *p, size_t i)
{
    if (dtype == DT_F32)
        return _mm256_loadu_ps((const float *)p + i);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}

/* bfloat16 of 8 floats, in the low 16 bits of each 32-bit lane */
AVX2 static inline __m256i bf16_round8(__m256 x)
{
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i isnan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, nan, isnan);
}

/* 16 values (a: the first 8, b: the next 8) stored as float32 or float16 at p + i */
AVX2 static inline void st16(int dtype, void *p, size_t i, __m256 a, __m256 b)
{
    if (dtype == DT_F32) {
        _mm256_storeu_ps((float *)p + i, a);
        _mm256_storeu_ps((float *)p + i + 8, b);
        return;
    }
    /* two 128-bit stores: no lane insert */
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i + 8), _mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* NaN-propagating max/min (torch.maximum / torch.minimum, FMAX / FMIN) */
AVX2 static inline __m256 vmax8(__m256 a, __m256 b)
{
    __m256 take_b = _mm256_or_ps(_mm256_cmp_ps(b, a, _CMP_GT_OQ), _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
    __m256 r = _mm256_blendv_ps(a, b, take_b);
    return _mm256_blendv_ps(r, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}

AVX2 static inline __m256 vmin8(__m256 a, __m256 b)
{
    __m256 take_b = _mm256_or_ps(_mm256_cmp_ps(b, a, _CMP_LT_OQ), _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
    __m256 r = _mm256_blendv_ps(a, b, take_b);
    return _mm256_blendv_ps(r, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}

AVX2 static inline __m256 op8(int op, __m256 a, __m256 b)
{
    if (op == OP_SUM || op == OP_AVG)
        return _mm256_add_ps(a, b);
    return op == OP_MAX ? vmax8(a, b) : vmin8(a, b);
}

/* One instance per (dtype, op) so the branches fold away: 16 values a step,
 * two independent vectors for the adds to overlap. */
#define DEF_AVX2(NAME, DT, OP)                                                                   \
    AVX2 static size_t NAME(void *dst, void *const *srcs, int w, size_t n)                      \
    {                                                                                           \
        size_t i = 0;                                                                           \
        for (; i + 16 <= n; i += 16) {                                                          \
            __m256 a = ld8(DT, srcs[0], i), b = ld8(DT, srcs[0], i + 8);                        \
            for (int r = 1; r < w; r++) {                                                       \
                a = op8(OP, a, ld8(DT, srcs[r], i));                                            \
                b = op8(OP, b, ld8(DT, srcs[r], i + 8));                                        \
            }                                                                                   \
            if (OP == OP_AVG) {                                                                 \
                a = _mm256_div_ps(a, _mm256_set1_ps((float)w));                                 \
                b = _mm256_div_ps(b, _mm256_set1_ps((float)w));                                 \
            }                                                                                   \
            st16(DT, dst, i, a, b);                                                             \
        }                                                                                       \
        return i;                                                                               \
    }
/* SUM of any number of sources (..._sumw: two go to a loop of their own), AVG, MAX, MIN */
#define DEF_AVX2_OPS(D, DT)                                                                     \
    DEF_AVX2(avx2_##D##_sumw, DT, OP_SUM)                                                       \
    DEF_AVX2(avx2_##D##_avg, DT, OP_AVG)                                                        \
    DEF_AVX2(avx2_##D##_max, DT, OP_MAX)                                                        \
    DEF_AVX2(avx2_##D##_min, DT, OP_MIN)
DEF_AVX2_OPS(f32, DT_F32)
DEF_AVX2_OPS(f16, DT_F16)

/* two sources, SUM: both pointers held in registers, 32 values a step.  The
 * loop above reloads srcs[r] after every store (an intrinsic store may alias
 * anything): with two sources in L1 it did 63-68 GB/s against 101-104 (AMD
 * Zen 4, 4-16 KiB, benchmarks/kernels.c). */
AVX2 static size_t avx2_f32_sum(void *dst, void *const *srcs, int w, size_t n)
{
    if (w != 2)
        return avx2_f32_sumw(dst, srcs, w, n);
    const float *a = srcs[0], *b = srcs[1];
    float *d = dst;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 x0 = _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
        __m256 x1 = _mm256_add_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8));
        __m256 x2 = _mm256_add_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16));
        __m256 x3 = _mm256_add_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24));
        _mm256_storeu_ps(d + i, x0);
        _mm256_storeu_ps(d + i + 8, x1);
        _mm256_storeu_ps(d + i + 16, x2);
        _mm256_storeu_ps(d + i + 24, x3);
    }
    return i;
}

/* two sources, SUM: 32 values a step, four independent conversions in flight */
AVX2 static size_t avx2_f16_sum(void *dst, void *const *srcs, int w, size_t n)
{
    if (w != 2)
        return avx2_f16_sumw(dst, srcs, w, n);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a0 = ld8(DT_F16, srcs[0], i), a1 = ld8(DT_F16, srcs[0], i + 8);
        __m256 a2 = ld8(DT_F16, srcs[0], i + 16), a3 = ld8(DT_F16, srcs[0], i + 24);
        a0 = _mm256_add_ps(a0, ld8(DT_F16, srcs[1], i));
        a1 = _mm256_add_ps(a1, ld8(DT_F16, srcs[1], i + 8));
        a2 = _mm256_add_ps(a2, ld8(DT_F16, srcs[1], i + 16));
        a3 = _mm256_add_ps(a3, ld8(DT_F16, srcs[1], i + 24));
        st16(DT_F16, dst, i, a0, a1);
        st16(DT_F16, dst, i + 16, a2, a3);
    }
    return i;
}

/*
 * bfloat16, 16 values a step from one 256-bit load per source: as float32 the
 * even ones are the low halves shifted up, the odd ones the high halves
 * masked (two single-cycle operations for 16 values, where widening costs two
 * shuffles and two shifts).  The results go back in order and round in
 * 16-bit lanes (bf16_pair_finite).
 *
 * NaN: every float32 here is a bfloat16 widened, so its low half is zero,
 * and so is that of any NaN an addition or division makes of them (x86
 * returns a NaN operand quieted, or the default NaN 0xffc00000): such a NaN
 * rounds to its own high half, quiet, which is f32_to_bf16's rule.  Only a
 * NaN that no arithmetic touched can be signalling: MAX/MIN pass values
 * through, and so does SUM of one source.  Those steps test for NaN and
 * quiet it (bf16_pair); SUM of two or more sources and AVG need no test.
 */
AVX2 static inline __m256 bf16_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }

AVX2 static inline __m256 bf16_odd(__m256i v)
{
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/*
 * 16 bfloat16 back in order from the even and odd float32 results, rounded to
 * nearest even in 16-bit lanes: H holds every result's high half in place
 * (the even ones' shifted down, one word blend), L its low half; the carry
 * into H is L + 0x7fff + (H & 1) >= 0x10000, i.e. L + (H & 1) > 0x8000,
 * i.e. the top bit of L minus (1 - (H & 1)), saturating at zero (L = 0 with
 * H even must not wrap): one andnot, one saturating subtract, and the top
 * bit spread over the word by an arithmetic shift is -1 where H carries.
 * 8 operations for 16 values, 3 of them shifts (a signed compare against
 * -(H & 1) after flipping L's top bit took 9; rounding each float32 on its
 * own, 10).  A NaN must have a zero low half (see above): a carry would turn
 * one whose payload sits there into infinity.
 */
AVX2 static inline __m256i bf16_pair_finite(__m256 e, __m256 o)
{
    __m256i eu = _mm256_castps_si256(e), ou = _mm256_castps_si256(o);
    __m256i hi = _mm256_blend_epi16(_mm256_srli_epi32(eu, 16), ou, 0xAA);
    __m256i lo = _mm256_blend_epi16(eu, _mm256_slli_epi32(ou, 16), 0xAA);
    __m256i even = _mm256_andnot_si256(hi, _mm256_set1_epi16(1));
    __m256i top = _mm256_subs_epu16(lo, even);
    return _mm256_sub_epi16(hi, _mm256_srai_epi16(top, 15));
}

/* the same with NaN quieted (f32_to_bf16's rule), for a step that holds one */
AVX2 static inline __m256i bf16_pair_any(__m256 e, __m256 o)
{
    return _mm256_or_si256(bf16_round8(e), _mm256_slli_epi32(bf16_round8(o), 16));
}

/* the results of MAX/MIN or of SUM of one source: a NaN may be signalling */
AVX2 static inline __m256i bf16_pair(__m256 e, __m256 o)
{
    __m256 nan = _mm256_cmp_ps(e, o, _CMP_UNORD_Q);
    return _mm256_testz_ps(nan, nan) ? bf16_pair_finite(e, o) : bf16_pair_any(e, o);
}

#define DEF_AVX2_BF16(NAME, OP)                                                                  \
    AVX2 static size_t NAME(void *dst, void *const *srcs, int w, size_t n)                      \
    {                                                                                           \
        const int computed = OP == OP_AVG || (OP == OP_SUM && w > 1); /* NaN quiet */           \
        size_t i = 0;                                                                           \
        for (; i + 16 <= n; i += 16) {                                                          \
            __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)srcs[0] + i));   \
            __m256 e = bf16_even(v), o = bf16_odd(v);                                           \
            for (int r = 1; r < w; r++) {                                                       \
                v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)srcs[r] + i));       \
                e = op8(OP, e, bf16_even(v));                                                   \
                o = op8(OP, o, bf16_odd(v));                                                    \
            }                                                                                   \
            if (OP == OP_AVG) {                                                                 \
                e = _mm256_div_ps(e, _mm256_set1_ps((float)w));                                 \
                o = _mm256_div_ps(o, _mm256_set1_ps((float)w));                                 \
            }                                                                                   \
            _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i),                               \
                                computed ? bf16_pair_finite(e, o) : bf16_pair(e, o));           \
        }                                                                                       \
        return i;                                                                               \
    }
DEF_AVX2_BF16(avx2_bf16p_sumw, OP_SUM)

/* a[0..16) + b[0..16), bfloat16: the step of both two-source sums below */
AVX2 static inline __m256i bf16_sum16(const uint16_t *a, const uint16_t *b)
{
    __m256i va = _mm256_loadu_si256((const __m256i *)a);
    __m256i vb = _mm256_loadu_si256((const __m256i *)b);
    __m256 e = _mm256_add_ps(bf16_even(va), bf16_even(vb));
    __m256 o = _mm256_add_ps(bf16_odd(va), bf16_odd(vb));
    return bf16_pair_finite(e, o);
}

/* two sources, SUM: the hot case at world size 2, 32 values a step */
AVX2 static size_t avx2_bf16p_sum(void *dst, void *const *srcs, int w, size_t n)
{
    if (w != 2)
        return avx2_bf16p_sumw(dst, srcs, w, n);
    const uint16_t *a = srcs[0], *b = srcs[1];
    uint16_t *d = dst;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        _mm256_storeu_si256((__m256i *)(d + i), bf16_sum16(a + i, b + i));
        _mm256_storeu_si256((__m256i *)(d + i + 16), bf16_sum16(a + i + 16, b + i + 16));
    }
    return i;
}
DEF_AVX2_BF16(avx2_bf16p_avg, OP_AVG)
DEF_AVX2_BF16(avx2_bf16p_max, OP_MAX)
DEF_AVX2_BF16(avx2_bf16p_min, OP_MIN)

/* two sources, SUM, the result stored at dst and at copy (the values a rank
 * reduces in two-shot go to its tensor and its slot): the second store rides
 * on the loop's arithmetic instead of a pass of its own */
AVX2 static size_t avx2_f32_sum_copy(float *d, float *c, const float *a, const float *b, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
        __m256 x1 = _mm256_add_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8));
        _mm256_storeu_ps(d + i, x0);
        _mm256_storeu_ps(d + i + 8, x1);
        _mm256_storeu_ps(c + i, x0);
        _mm256_storeu_ps(c + i + 8, x1);
    }
    return i;
}

AVX2 static size_t avx2_bf16_sum_copy(uint16_t *d, uint16_t *c, const uint16_t *a, const uint16_t *b,
                                      size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i r = bf16_sum16(a + i, b + i);
        _mm256_storeu_si256((__m256i *)(d + i), r);
        _mm256_storeu_si256((__m256i *)(c + i), r);
    }
    return i;
}

AVX2 static size_t avx2_f16_sum_copy(uint16_t *d, uint16_t *c, const uint16_t *a, const uint16_t *b,
                                     size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = _mm256_add_ps(ld8(DT_F16, a, i), ld8(DT_F16, b, i));
        __m256 x1 = _mm256_add_ps(ld8(DT_F16, a, i + 8), ld8(DT_F16, b, i + 8));
        __m128i h0 = _mm256_cvtps_ph(x0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m128i h1 = _mm256_cvtps_ph(x1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(d + i), h0);
        _mm_storeu_si128((__m128i *)(d + i + 8), h1);
        _mm_storeu_si128((__m128i *)(c + i), h0);
        _mm_storeu_si128((__m128i *)(c + i + 8), h1);
    }
    return i;
}

int reduce_copy_avx2(int dtype, void *dst, void *copy, void *const *srcs, size_t n)
{
    if (dtype > DT_F16 || !avx2_present())
        return 0;
    size_t done;
    if (dtype == DT_F32)
        done = avx2_f32_sum_copy(dst, copy, srcs[0], srcs[1], n);
    else if (dtype == DT_BF16)
        done = avx2_bf16_sum_copy(dst, copy, srcs[0], srcs[1], n);
    else
        done = avx2_f16_sum_copy(dst, copy, srcs[0], srcs[1], n);
    reduce_tail(dtype, OP_SUM, dst, srcs, 2, n, done);
    const size_t es = dt_size[dtype];
    memcpy((char *)copy + done * es, (char *)dst + done * es, (n - done) * es);
    return 1;
}

typedef size_t (*avx2_fn)(void *, void *const *, int, size_t);
static const avx2_fn avx2_kernels[3][OP_COUNT] = {
    {avx2_f32_sum, avx2_f32_avg, avx2_f32_max, avx2_f32_min},
    {avx2_bf16p_sum, avx2_bf16p_avg, avx2_bf16p_max, avx2_bf16p_min},
    {avx2_f16_sum, avx2_f16_avg, avx2_f16_max, avx2_f16_min},
};

int avx2_present(void)
{
    static int v = -1;
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    }
    return v;
}

int reduce_avx2(int dtype, int op, void *dst, void *const *srcs, int w, size_t n)
{
    if (dtype > DT_F16 || !avx2_present())
        return 0;
    reduce_tail(dtype, op, dst, srcs, w, n, avx2_kernels[dtype][op](dst, srcs, w, n));
    return 1;
}
#else
int avx2_present(void) { return 0; }

int reduce_copy_avx2(int dtype, void *dst, void *copy, void *const *srcs, size_t n)
{
    (void)dtype, (void)dst, (void)copy, (void)srcs, (void)n;
    return 0;
}

int reduce_avx2(int dtype, int op, void *dst, void *const *srcs, int w, size_t n)
{
    (void)dtype, (void)op, (void)dst, (void)srcs, (void)w, (void)n;
    return 0;
}
#endif
