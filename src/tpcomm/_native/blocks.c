/*
 * Blocked layouts: the copies of a collective along a dim other than 0
 * (rounds.c's gather and reduce-scatter rounds, cma.c's single-copy gather).
 * A tensor of `outer` rows, each row the ranks' blocks side by side.  Rank
 * r's contribution (or shard) is its blocks, one per row, of blk bytes at
 * byte offset off of every row of row bytes; counted in that order, byte q of
 * it is byte q % blk of block q / blk.  With outer 1 the contribution is the
 * contiguous range at off.
 */
#include "tpcomm.h"

/* n bytes of a contribution from src, from its byte q on, to their places in out */
void put_blocks(char *out, const char *src, size_t q, size_t n, size_t blk, size_t row, size_t off)
{
    while (n) {
        size_t a = q / blk, in = q % blk, m = blk - in < n ? blk - in : n;
        memcpy(out + a * row + off + in, src, m);
        src += m;
        q += m;
        n -= m;
    }
}

/* the inverse of put_blocks: n bytes of the contribution, from byte q on, to
 * dst in a slot (nt: non-temporal stores) */
void take_blocks(char *dst, const char *x, size_t q, size_t n, size_t blk, size_t row, size_t off,
                 int nt)
{
    while (n) {
        size_t a = q / blk, in = q % blk, m = blk - in < n ? blk - in : n;
        copy_slot(dst, x + a * row + off + in, m, nt);
        dst += m;
        q += m;
        n -= m;
    }
}
