/*
 * The pages of a caller's output, made present before a collective writes
 * it.
 *
 * A tensor the caller has just made (torch.empty of a few hundred KiB or
 * more: glibc maps it fresh, and vLLM's all_gather makes one every call) has
 * no pages yet, and the collective's copies then take a fault on every page
 * of it, one at a time, between its rounds: on the VM these were measured on
 * a 4 KiB page cost about 1.7 us that way, more than copying it.
 * madvise(MADV_POPULATE_WRITE) (Linux 5.14) maps the whole range in one call
 * in about 0.6 of that time, and the rounds then copy into present pages.
 * Pages that are there already still cost a walk (about 0.17 us a page), so
 * one page in the middle of the range is asked for first (mincore): an
 * output that is there (a tensor used again, a symmetric buffer, an input
 * gathered in place) is left as it is.  Nothing here changes a byte; a kernel
 * without the advice (EINVAL) is asked once, then never again.
 */
#include <sys/mman.h>

#include "tpcomm.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

static size_t page_size(void)
{
    static size_t v;
    if (!v) {
        long p = sysconf(_SC_PAGESIZE);
        v = p > 0 ? (size_t)p : 4096;
    }
    return v;
}

static int populate_works = 1; /* 0 once the kernel said it has no such advice */

/* the whole pages inside [p, p + n): the partial ones at the ends may hold
 * other data (a heap block's header), and they are present if they do */
static int inner_pages(const span_t *s, uintptr_t *lo, uintptr_t *hi)
{
    const uintptr_t pg = page_size();
    *lo = ((uintptr_t)s->p + pg - 1) & ~(pg - 1);
    *hi = ((uintptr_t)s->p + s->n) & ~(pg - 1);
    return s->p && *hi > *lo;
}

/*
 * The k ranges a call's rounds write next: if they hold populate_min bytes or
 * more and the middle page of the largest is not present, every whole page
 * of them is made present (counted in the record).  A probe (mincore) costs
 * about 1.5 us on the VM these were measured on, so it is not made every
 * call: per size (a power of two) a probe that found the pages there skips
 * the next PROBE_EVERY - 1 calls of that size, and one that found them
 * missing probes again next call.  A caller that makes its output anew every
 * call (vLLM's all_gather) gets its pages every call; one that uses the same
 * tensor again pays a probe every PROBE_EVERY calls.
 */
#define PROBE_EVERY 64

void ready_pages(Engine *e, const span_t *s, int k)
{
    size_t total = 0;
    int big = -1;
    for (int i = 0; i < k; i++) {
        if (!s[i].p)
            continue;
        total += s[i].n;
        if (big < 0 || s[i].n > s[big].n)
            big = i;
    }
    uintptr_t lo, hi;
    if (!populate_works || total < e->populate_min || big < 0 || !inner_pages(&s[big], &lo, &hi))
        return;
    const int b = 63 - __builtin_clzll((unsigned long long)total);
    if (!e->pages.fresh[b] && e->pages.skip[b]) {
        e->pages.skip[b]--;
        return;
    }
    const uintptr_t pg = page_size();
    unsigned char there = 1;
    if (mincore((void *)(lo + ((hi - lo) / 2 & ~(pg - 1))), pg, &there) != 0 || (there & 1)) {
        e->pages.fresh[b] = 0;
        e->pages.skip[b] = PROBE_EVERY - 1;
        return;
    }
   
    /* a call of populate_min bytes or more runs without the GIL (call_begin) */
    for (int i = 0; i < k; i++) {
        if (!inner_pages(&s[i], &lo, &hi))
            continue;
        if (madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE) != 0) {
            if (errno == EINVAL) /* before Linux 5.14: the copies fault them in, as before */
                populate_works = 0;
            return;
        }
        e->rec.populated_bytes += hi - lo;
    }
    e->rec.populated++;
}

/* set_populate_min(min_bytes): outputs of at least min_bytes get their pages
 * before the rounds write them (-1: never) */
PyObject *eng_set_populate_min(Engine *e, PyObject *arg)
{
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred())
        return NULL;
    e->populate_min = v < 0 ? UINT64_MAX : (uint64_t)v;
    memset(&e->pages, 0, sizeof e->pages); /* probe afresh */
    Py_RETURN_NONE;
}
