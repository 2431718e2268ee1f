/*
 * The float family on aarch64 NEON (Graviton, Ampere, Apple), 4 values per
 * vector, 8 a step.  Same arithmetic as the portable kernels, lane by lane:
 * widen to float32 exactly (bfloat16: a 16-bit shift left, ushll; float16:
 * fcvtl), combine in rank order, round once (bfloat16: integer round to
 * nearest even, NaN quieted with its sign, as f32_to_bf16; float16: fcvtn,
 * which rounds to nearest even under the default FPCR).  vaddq_f32 and
 * vdivq_f32 only (no fused multiply-add), NaN-propagating MAX/MIN by
 * compare-and-select (fmax would differ in which NaN it returns): results are
 * bitwise the portable kernels'.  The last n % 8 values go to the portable
 * kernels.
 */
#include "kernels.h"

#if defined(__aarch64__)
#include <arm_neon.h>

static inline float32x4_t ld4(int dtype, const void *p, size_t i)
{
    if (dtype == DT_F32)
        return vld1q_f32((const float *)p + i);
    if (dtype == DT_BF16)
        return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p + i), 16));
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p + i)));
}

/* bfloat16 of 4 floats, round to nearest even, NaN quieted */
static inline uint16x4_t bf16_round4(float32x4_t x)
{
    uint32x4_t u = vreinterpretq_u32_f32(x);
    uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff))), 16);
    uint32x4_t nan = vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40));
    uint32x4_t ok = vceqq_f32(x, x); /* all ones where x is not NaN */
    return vmovn_u32(vbslq_u32(ok, r, nan));
}

static inline void st4(int dtype, void *p, size_t i, float32x4_t x)
{
    if (dtype == DT_F32)
        vst1q_f32((float *)p + i, x);
    else if (dtype == DT_BF16)
        vst1_u16((uint16_t *)p + i, bf16_round4(x));
    else
        vst1_u16((uint16_t *)p + i, vreinterpret_u16_f16(vcvt_f16_f32(x)));
}

/* NaN-propagating max/min: FMAX(a, b) = a NaN ? a : (b > a || b NaN ? b : a) */
static inline float32x4_t vmax4(float32x4_t a, float32x4_t b)
{
    uint32x4_t b_nan = vmvnq_u32(vceqq_f32(b, b));
    uint32x4_t take_b = vorrq_u32(vcgtq_f32(b, a), b_nan);
    float32x4_t r = vbslq_f32(take_b, b, a);
    return vbslq_f32(vceqq_f32(a, a), r, a);
}

static inline float32x4_t vmin4(float32x4_t a, float32x4_t b)
{
    uint32x4_t b_nan = vmvnq_u32(vceqq_f32(b, b));
    uint32x4_t take_b = vorrq_u32(vcltq_f32(b, a), b_nan);
    float32x4_t r = vbslq_f32(take_b, b, a);
    return vbslq_f32(vceqq_f32(a, a), r, a);
}

static inline float32x4_t op4(int op, float32x4_t a, float32x4_t b)
{
    if (op == OP_SUM || op == OP_AVG)
        return vaddq_f32(a, b);
    return op == OP_MAX ? vmax4(a, b) : vmin4(a, b);
}

#define DEF_NEON(NAME, DT, OP)                                                                   \
    static size_t NAME(void *dst, void *const *srcs, int w, size_t n)                           \
    {                                                                                           \
        size_t i = 0;                                                                           \
        for (; i + 8 <= n; i += 8) {                                                            \
            float32x4_t a = ld4(DT, srcs[0], i), b = ld4(DT, srcs[0], i + 4);                   \
            for (int r = 1; r < w; r++) {                                                       \
                a = op4(OP, a, ld4(DT, srcs[r], i));                                            \
                b = op4(OP, b, ld4(DT, srcs[r], i + 4));                                        \
            }                                                                                   \
            if (OP == OP_AVG) {                                                                 \
                a = vdivq_f32(a, vdupq_n_f32((float)w));                                        \
                b = vdivq_f32(b, vdupq_n_f32((float)w));                                        \
            }                                                                                   \
            st4(DT, dst, i, a);                                                                 \
            st4(DT, dst, i + 4, b);                                                             \
        }                                                                                       \
        return i;                                                                               \
    }
#define DEF_NEON_OPS(D, DT)                                                                     \
    DEF_NEON(neon_##D##_sum, DT, OP_SUM)                                                        \
    DEF_NEON(neon_##D##_avg, DT, OP_AVG)                                                        \
    DEF_NEON(neon_##D##_max, DT, OP_MAX)                                                        \
    DEF_NEON(neon_##D##_min, DT, OP_MIN)
DEF_NEON_OPS(f32, DT_F32)
DEF_NEON_OPS(bf16, DT_BF16)
DEF_NEON_OPS(f16, DT_F16)

typedef size_t (*neon_fn)(void *, void *const *, int, size_t);
static const neon_fn neon_kernels[3][OP_COUNT] = {
    {neon_f32_sum, neon_f32_avg, neon_f32_max, neon_f32_min},
    {neon_bf16_sum, neon_bf16_avg, neon_bf16_max, neon_bf16_min},
    {neon_f16_sum, neon_f16_avg, neon_f16_max, neon_f16_min},
};

int reduce_neon(int dtype, int op, void *dst, void *const *srcs, int w, size_t n)
{
    if (dtype > DT_F16)
        return 0;
    reduce_tail(dtype, op, dst, srcs, w, n, neon_kernels[dtype][op](dst, srcs, w, n));
    return 1;
}
#else
int reduce_neon(int dtype, int op, void *dst, void *const *srcs, int w, size_t n)
{
    (void)dtype, (void)op, (void)dst, (void)srcs, (void)w, (void)n;
    return 0;
}
#endif
