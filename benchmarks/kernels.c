/*
 * kernels: the reduce kernels alone, every variant this CPU runs, per dtype.
 *
 * Built from the library's own kernel sources (src/tpcomm/_native/kernels*.c,
 * as tests/c/test_kernels.c is) and called from C, so no call through Python
 * (about half a microsecond, longer than a 16 KiB float32 kernel) has to be
 * taken off a timing.  Two sources, SUM, in place into the first (the
 * one-shot all_reduce reduces into the caller's tensor), the second at 2112
 * bytes past a page (tensor and slot are not at the same place in their
 * pages).  16 KiB: in the first cache levels, the kernel's instructions set
 * its speed; 1 MiB: past L2 on most CPUs, memory does.  Per variant the
 * dtypes' loops run in turns (a change of the machine's speed meets them
 * alike), each loop long enough for the clock not to count; the best of 15.
 * GB/s counts the bytes of one source; "x f32" is the dtype's GB/s over
 * float32's with the same variant.  The sums grow slowly from 0.5-1.5 by
 * 0.001-0.01 a call: no denormal, no overflow, in any dtype.
 *
 * usage: kernels [LOOPS]          (run by `make bench`)
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kernels.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint16_t half_of(int dtype, float f)
{
    if (dtype == DT_F16) {
#if defined(__aarch64__) || defined(__FLT16_MAX__)
        _Float16 h = (_Float16)f;
        uint16_t u;
        memcpy(&u, &h, 2);
        return u;
#else
        (void)f;
        return 0x3c00; /* 1.0 */
#endif
    }
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16); /* bfloat16: these values are exact enough */
}

static void fill(int dtype, void *p, size_t n, float lo, float step)
{
    for (size_t i = 0; i < n; i++) {
        float v = lo + step * (float)(i % 97);
        if (dtype == DT_F32)
            ((float *)p)[i] = v;
        else
            ((uint16_t *)p)[i] = half_of(dtype, v);
    }
}

int main(int argc, char **argv)
{
    const int loops = argc > 1 ? atoi(argv[1]) : 15;
    if (loops < 1) {
        fprintf(stderr, "usage: kernels [LOOPS >= 1]\n");
        return 2;
    }
    static const size_t sizes[] = {16u << 10, 1u << 20};
    static const char *names[] = {"float32", "bfloat16", "float16"};
    const size_t most = 1u << 20;
    char *a = aligned_alloc(4096, most + 4096), *b0 = aligned_alloc(4096, most + 8192);
    if (!a || !b0)
        return 1;
    char *b = b0 + 2112;
    printf("# reduce kernel alone, 2 sources, SUM into the first, one thread, from C "
           "(GB/s of one source, best of %d loops)\n",
           loops);
    printf("# %8s %8s %9s %6s %9s %6s %9s %6s\n", "size", "variant", names[0], "x f32", names[1],
           "x f32", names[2], "x f32");
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        const size_t bytes = sizes[s];
        const int reps = bytes >= most ? 40 : 2000;
        for (int isa = 0; isa < ISA_COUNT; isa++) {
            if (!kernel_has_isa(isa) || kernel_set_isa(isa) != 0)
                continue;
            double best[3] = {1e30, 1e30, 1e30};
            for (int k = 0; k < loops; k++)
                for (int j = 0; j < 3; j++) {
                    const int dt = (j + k) % 3; /* the order turns every loop */
                    const size_t n = bytes / dt_size[dt];
                    fill(dt, a, n, 0.5f, 0.01f);
                    fill(dt, b, n, 0.001f, 0.0001f);
                    void *srcs[2] = {a, b};
                    do_reduce(dt, OP_SUM, a, srcs, 2, n); /* warm */
                    const double t0 = now();
                    for (int r = 0; r < reps; r++)
                        do_reduce(dt, OP_SUM, a, srcs, 2, n);
                    const double t = (now() - t0) / reps;
                    if (t < best[dt])
                        best[dt] = t;
                }
            char size[16];
            snprintf(size, sizeof size, bytes >= most ? "%zu MiB" : "%zu KiB",
                     bytes >= most ? bytes >> 20 : bytes >> 10);
            printf("  %8s %8s", size, kernel_isa_name(isa));
            for (int d = 0; d < 3; d++)
                printf(" %9.1f %6.2f", (double)bytes / best[d] / 1e9, best[0] / best[d]);
            printf("   # %s\n", kernel_isa());
        }
    }
    kernel_set_isa(ISA_AUTO);
    free(a);
    free(b0);
    return 0;
}
