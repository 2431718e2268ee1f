/*
 * The reduce kernels' interface: plain C, no Python, so the kernels compile
 * and are tested alone (tests/c/test_kernels.c: natively, and for aarch64
 * under qemu with `make test-arm`).
 *
 * Every kernel computes dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[w-1][i]
 * in that order, in float32 for the float family (bfloat16 and float16 are
 * widened exactly and rounded once, to nearest even, NaN kept quiet), with
 * NaN-propagating MAX/MIN (torch.maximum / torch.minimum) and AVG = SUM / w.
 * The variants (portable C, AVX2 + F16C, AVX-512, NEON) are bitwise the same:
 * same order, same rounding, no contraction into FMA.  dst may alias a source.
 */
#ifndef TPCOMM_KERNELS_H
#define TPCOMM_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
/* The portable kernels: gcc builds one clone per ISA level and picks at load
 * time (ifunc).  x86-64-v4 = AVX-512, v3 = AVX2 + FMA + F16C. */
#define KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KERNEL
#endif

/* dtype and op codes of the reductions (exported to Python by module.c) */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_I32 = 3, DT_I64 = 4, DT_COUNT };
enum { OP_SUM = 0, OP_AVG = 1, OP_MAX = 2, OP_MIN = 3, OP_COUNT };
static const size_t dt_size[DT_COUNT] = {4, 2, 2, 4, 8};

/* The kernel variants.  ISA_AUTO picks the best the CPU has. */
enum { ISA_AUTO = -1, ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_NEON = 3, ISA_COUNT };

/* kernels.c: the one entry, and the choice of variant */
void do_reduce(int dtype, int op, void *dst, void *const *srcs, int w, size_t n);
void reduce_portable(int dtype, int op, void *dst, void *const *srcs, int w, size_t n);
/* the values from `done` on, by the portable kernels (a vector variant's tail) */
void reduce_tail(int dtype, int op, void *dst, void *const *srcs, int w, size_t n, size_t done);
int kernel_has_isa(int isa);       /* 1 if this CPU (and build) can run the variant */
int kernel_set_isa(int isa);       /* 0, or -1: the CPU lacks it (nothing changed) */
int kernel_isa_in_use(void);       /* the variant do_reduce runs (never ISA_AUTO) */
const char *kernel_isa_name(int isa);
const char *kernel_isa(void);      /* the variant in use and why, for doctor and perf */
void copy_slot(char *dst, const char *src, size_t n, int nt); /* nt: non-temporal stores */
/* do_reduce into dst, and the result copied to `copy` too (copy_slot's nt) */
void do_reduce_copy(int dtype, int op, void *dst, char *copy, void *const *srcs, int w, size_t n,
                    int nt);
int copy_nt_available(void);

/* one file per variant; each returns 0 (nothing done) for a dtype it leaves
 * to the portable kernels, or where it is not built */
int avx512_level(void); /* 0 none (or TPCOMM_NO_AVX512), 1 AVX-512, 2 with AVX512_BF16 */
int avx512_f16_narrow(void); /* 1: float16 by the 256-bit kernels (AMD Zen 4) */
int reduce_avx512(int dtype, int op, void *dst, void *const *srcs, int w, size_t n);
int avx2_present(void);
int reduce_avx2(int dtype, int op, void *dst, void *const *srcs, int w, size_t n);
int reduce_neon(int dtype, int op, void *dst, void *const *srcs, int w, size_t n);
/* two sources, SUM, into dst and copy in one loop (plain stores); 0: not done */
int reduce_copy_avx2(int dtype, void *dst, void *copy, void *const *srcs, size_t n);

#endif /* TPCOMM_KERNELS_H */
