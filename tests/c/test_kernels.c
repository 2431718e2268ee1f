/*
 * The reduce kernels alone, in plain C (no Python): every variant this CPU can
 * run (AVX2, AVX-512, NEON) gives bitwise the portable kernels' result, for
 * every dtype and op, world sizes 1-16, lengths around every vector width and
 * tail, random bit patterns (NaN, infinities, denormals, both zeros) and
 * rounding ties; every bfloat16 and float16 pattern against 64 others, SUM
 * and AVG of two; in place too (dst = srcs[0], as all_reduce uses it); the
 * reduce that also copies its result (do_reduce_copy), into the last source
 * as two-shot's rank 1 calls it.  Where
 * both results are NaN they count as equal: which NaN's payload survives when
 * two meet is the hardware's choice and differs between CPUs anyway; a
 * bfloat16 or float16 NaN must be quiet in both.
 *
 * Built and run by `make test` (natively) and `make test-arm` (for aarch64,
 * under qemu).  Exit status 0 when every case matches.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "../../src/tpcomm/_native/kernels.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* one element of dtype dt: mostly ordinary values, some of every special kind */
static void fill(int dt, void *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t r = next();
        int kind = (int)(r % 16);
        if (dt == DT_F32) {
            uint32_t u = (uint32_t)(r >> 32);
            if (kind < 10) { /* ordinary values near 1 */
                float f = (float)((int)(r >> 40) % 2000 - 1000) / 64.0f;
                memcpy(&u, &f, 4);
            } else if (kind == 10) {
                u = (u & 0x807fffffu) | 0x7f800000u; /* NaN or inf */
            } else if (kind == 11) {
                u &= 0x807fffffu; /* denormal or zero */
            } else if (kind == 12) { /* a tie for bfloat16 rounding */
                u = (u & 0xffff0000u) | 0x8000u;
            } else if (kind == 13) { /* +0 or -0: MAX / MIN must keep which */
                u &= 0x80000000u;
            }
            ((uint32_t *)p)[i] = u;
        } else if (dt == DT_BF16 || dt == DT_F16) {
            uint16_t h = (uint16_t)(r >> 48);
            if (kind < 10) /* ordinary values: keep the exponent moderate */
                h = dt == DT_BF16 ? (uint16_t)((h & 0x807f) | 0x3f00) : (uint16_t)((h & 0x83ff) | 0x3c00);
            else if (kind == 13) /* +0 or -0 */
                h &= 0x8000;
            ((uint16_t *)p)[i] = h;
        } else if (dt == DT_I32) {
            ((uint32_t *)p)[i] = (uint32_t)(r >> 32);
        } else {
            ((uint64_t *)p)[i] = r;
        }
    }
}

static int is_nan(int dt, const char *p)
{
    if (dt == DT_F32) {
        uint32_t u;
        memcpy(&u, p, 4);
        return (u & 0x7fffffffu) > 0x7f800000u;
    }
    if (dt == DT_BF16 || dt == DT_F16) {
        uint16_t h;
        memcpy(&h, p, 2);
        return dt == DT_BF16 ? (h & 0x7fff) > 0x7f80 : (h & 0x7fff) > 0x7c00;
    }
    return 0;
}

/* a bfloat16 or float16 NaN with its quiet bit set (the rounding's rule: a
 * signalling NaN in the inputs comes out quiet, whatever the op) */
static int is_quiet_16(int dt, const char *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return (h & (dt == DT_BF16 ? 0x0040 : 0x0200)) != 0;
}

static int same(int dt, const char *a, const char *b, size_t n)
{
    const size_t es = dt_size[dt];
    for (size_t i = 0; i < n; i++) {
        const char *x = a + i * es, *y = b + i * es;
        if (memcmp(x, y, es) == 0)
            continue;
        if (!(is_nan(dt, x) && is_nan(dt, y)))
            return 0;
        if ((dt == DT_BF16 || dt == DT_F16) && !(is_quiet_16(dt, x) && is_quiet_16(dt, y)))
            return 0;
    }
    return 1;
}

/* w sources of n random elements of dt, bytes each (src to free, s to pass) */
static void sources(int dt, int w, size_t n, size_t bytes, char **src, void **s)
{
    for (int r = 0; r < w; r++) {
        src[r] = malloc(bytes);
        fill(dt, src[r], n);
        s[r] = src[r];
    }
}

int main(void)
{
    static const size_t lens[] = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 257, 1029};
    static const char *dts[] = {"float32", "bfloat16", "float16", "int32", "int64"};
    static const char *ops[] = {"sum", "avg", "max", "min"};
    int checked = 0, failed = 0, variants = 0;
    for (int isa = ISA_SCALAR + 1; isa < ISA_COUNT; isa++) {
        if (!kernel_has_isa(isa)) {
            printf("# %s: not on this CPU, skipped\n", kernel_isa_name(isa));
            continue;
        }
        variants++;
        for (int dt = 0; dt < DT_COUNT; dt++)
            for (int op = 0; op < OP_COUNT; op++) {
                if (op == OP_AVG && dt >= DT_I32)
                    continue;
                for (int w = 1; w <= 16; w++)
                    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
                        const size_t n = lens[li], es = dt_size[dt], bytes = n * es + 1;
                        char *src[16], *ref = malloc(bytes), *got = malloc(bytes);
                        void *s[16];
                        sources(dt, w, n, bytes, src, s);
                        kernel_set_isa(ISA_SCALAR);
                        do_reduce(dt, op, ref, s, w, n);
                        kernel_set_isa(isa);
                        do_reduce(dt, op, got, s, w, n);
                        int ok = same(dt, ref, got, n);
                        do_reduce(dt, op, src[0], s, w, n); /* in place */
                        ok = ok && same(dt, ref, src[0], n);
                        checked++;
                        if (!ok && failed++ < 10)
                            printf("FAIL %s %s %s world %d n %zu\n", kernel_isa_name(isa),
                                   dts[dt], ops[op], w, n);
                        for (int r = 0; r < w; r++)
                            free(src[r]);
                        free(ref);
                        free(got);
                    }
            }
    }
    /* the reduce whose result also goes to a second place (two-shot's shard
     * into its slot): both copies the portable kernels' result, plain and
     * non-temporal stores, in place as two-shot calls it */
    for (int isa = ISA_SCALAR + 1; isa < ISA_COUNT; isa++) {
        if (!kernel_has_isa(isa))
            continue;
        for (int dt = 0; dt < DT_COUNT; dt++)
            for (int op = 0; op < OP_COUNT; op++)
                for (int w = 1; w <= 3; w++)
                    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
                        for (int nt = 0; nt < 2; nt++) {
                            if (op == OP_AVG && dt >= DT_I32)
                                continue;
                            const size_t n = lens[li], es = dt_size[dt], bytes = n * es + 1;
                            char *src[3], *ref = malloc(bytes), *copy = malloc(bytes + 64);
                            void *s[3];
                            sources(dt, w, n, bytes, src, s);
                            kernel_set_isa(ISA_SCALAR);
                            do_reduce(dt, op, ref, s, w, n);
                            kernel_set_isa(isa);
                            do_reduce_copy(dt, op, src[w - 1], copy + 8, s, w, n, nt);
                            checked++;
                            if (!(same(dt, ref, src[w - 1], n) && same(dt, ref, copy + 8, n)) &&
                                failed++ < 10)
                                printf("FAIL %s %s %s world %d n %zu nt %d: reduce with a copy\n",
                                       kernel_isa_name(isa), dts[dt], ops[op], w, n, nt);
                            for (int r = 0; r < w; r++)
                                free(src[r]);
                            free(ref);
                            free(copy);
                        }
    }

    /* every 16-bit pattern against 64 others apiece, SUM and AVG of two: each
     * rounding carry, tie and NaN the 16-bit kernels can meet at world 2 */
    const size_t all = 65536;
    uint16_t *a = malloc(all * 2), *b = malloc(all * 2), *ref = malloc(all * 2), *got = malloc(all * 2);
    for (int isa = ISA_SCALAR + 1; isa < ISA_COUNT; isa++) {
        if (!kernel_has_isa(isa))
            continue;
        for (int dt = DT_BF16; dt <= DT_F16; dt++)
            for (int op = OP_SUM; op <= OP_AVG; op++)
                for (unsigned k = 0; k < 64; k++) {
                    for (size_t i = 0; i < all; i++) {
                        a[i] = (uint16_t)i;
                        b[i] = (uint16_t)(i + k * 1031u + (i & 7) * (k & 3));
                    }
                    void *s[2] = {a, b};
                    kernel_set_isa(ISA_SCALAR);
                    do_reduce(dt, op, ref, s, 2, all);
                    kernel_set_isa(isa);
                    do_reduce(dt, op, got, s, 2, all);
                    checked++;
                    if (!same(dt, (const char *)ref, (const char *)got, all) && failed++ < 10)
                        printf("FAIL %s %s %s: every pattern against pattern + %u\n",
                               kernel_isa_name(isa), dts[dt], ops[op], k * 1031u);
                }
    }
    free(a);
    free(b);
    free(ref);
    free(got);
    kernel_set_isa(ISA_AUTO);
    printf("# kernels: %d variant(s) against the portable kernels, %d cases\n", variants, checked);
    printf("%d passed, %d failed\n", checked - failed, failed);
    return failed != 0;
}
