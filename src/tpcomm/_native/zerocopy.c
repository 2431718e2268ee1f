/*
 * Zero-copy all-reduce (a tensor in a symmetric buffer, Communicator.empty:
 * every rank reads its peers' tensors where they are), and rank 0's choice,
 * as calls run, of zero copy or the copies through the slots for such a
 * tensor (allreduce.c runs the copies and asks this file which way a call
 * goes), with the engine methods that show and set that choice.
 */
#include "tpcomm.h"

/*
 * Zero-copy all-reduce of a tensor that lives in a symmetric buffer: every
 * rank reads its peers' tensors where they are, so nothing is copied in.
 *   round 1: everyone's data is ready;
 *   then piece by piece (`piece` elements of every shard at a time; the
 *   whole shard where piece is 0): rank r reduces its piece of shard r of
 *   every rank's tensor, in rank order, into shard r of its own (only rank r
 *   ever reads shard r of anyone before this piece's round, so writing it in
 *   place is safe); a round: this piece of every shard is reduced; each rank
 *   copies the others' pieces from their owners' tensors into its own (the
 *   owners read those places of it before the round, never after);
 *   last round: nobody reads this rank's tensor any more: the caller may
 *   change it.
 * In pieces of a cache's size a rank copies each reduced piece out while it
 * is still in its owner's caches, not back from memory: at 16-64 MiB, far
 * past the L2, 0.74-0.76 of the time of the whole shards at once on AMD Zen
 * 3 (docs/DECISIONS.md); within the caches more rounds only cost.  Every
 * rank takes as many rounds (the pieces of the largest shard).  The metadata
 * arg carries the buffer, the offset and the piece, so ranks whose tensors
 * are not at the same place in the same buffer, or that cut it differently,
 * get a mismatch error.
 */
int zero_copy_all_reduce(Engine *e, struct sym *sb, size_t off, size_t count, size_t piece,
                                int dtype, int op, uint32_t kind, uint64_t arg, PyThreadState **ts)
{
    const size_t es = dt_size[dtype];
    const int w = e->world, me = e->rank;
    char *mine = sb->base + off;
    int st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, arg, ts);
    const size_t shard = shard_start(count, w, 1); /* the largest shard: rank 0's */
    if (piece == 0 || piece > shard)
        piece = shard;
    for (size_t a = 0, first = 1; st == ST_OK && (first || a < shard); a += piece, first = 0) {
        size_t lo = shard_start(count, w, me) + a, hi = shard_start(count, w, me + 1);
        if (lo < hi) {
            size_t n = hi - lo < piece ? hi - lo : piece;
            for (int r = 0; r < w; r++)
                e->srcs[r] = sb->peers[r] + off + lo * es;
            par_reduce(e->pool, dtype, op, mine + lo * es, e->srcs, w, n);
        }
        st = round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, arg, ts);
        for (int i = 1; st == ST_OK && i < w; i++) {
            int j = (me + i) % w;
            size_t jlo = shard_start(count, w, j) + a, jhi = shard_start(count, w, j + 1);
            if (jlo < jhi)
                par_copy_out(e->pool, mine + jlo * es, sb->peers[j] + off + jlo * es,
                             (jhi - jlo < piece ? jhi - jlo : piece) * es);
        }
    }
    if (st != ST_OK)
        return st;
    return round_sync(e, kind, (uint32_t)dtype, (uint32_t)op, count, arg, ts);
}

struct sym *find_sym(Engine *e, const char *t, size_t bytes)
{
    for (int i = 0; i < e->nsym; i++)
        if (t >= e->sym[i].base && t + bytes <= e->sym[i].base + e->sym[i].size)
            return &e->sym[i];
    return NULL;
}

/*
 * Zero copy or the copies for a comm.empty tensor, chosen as it runs.  Zero
 * copy reads every peer's tensor where its owner wrote it: each byte crosses
 * between the cores as a modified line, which costs more than going through
 * memory where the machine makes cache-to-cache transfers slow (this VM's
 * slow mode, a rank on another chiplet), while the copies can go through
 * memory (non-temporal stores, chosen as they run).  So rank 0 times whole
 * calls of both, per size (a bucket per power of two from 256 KiB), and
 * keeps the cheaper, as the stores are kept (a moving average of ticks per
 * KiB, a call that took more than twice the average counting twice, the
 * other taking over under 0.8 of it).
 *
 * Unlike the stores, ranks that choose differently run different rounds, so
 * what runs is agreed by round: a state of 16 bits (bit b: bucket b copies;
 * ZC_TRIAL_SHIFT: the bucket + 1 that tries the other one now, 0: none;
 * ZC_ON: rank 0 chooses at all) that rank 0 alone writes, into zc_word as
 * (state before, state from, round R + 1) after a call that ended on round
 * R.  A call that starts after round S uses "from" where S >= R + 1, else
 * "before".  Every rank that starts a call after R + 1 passed a round rank 0
 * published after writing, so it reads the new word; a call that starts
 * after R (the next, maybe begun already on another rank) uses the old state
 * on every rank, whichever word it read.  Once the change is in force rank 0
 * settles the word (before = from), as the round is kept in 32 bits.  So a
 * state rank 0 wants holds from the call after the next one.
 *
 * The other one is tried warm.  The first call that tries it finds caches
 * that the choice left, and so does the second where the copies go one-shot
 * (each call in the other slot): at 1 MiB on this VM the copies so tried took
 * 1.6-2.4x, 1.0-1.35x and 1.0-1.15x their steady time in their first, second
 * and third calls, and in the slow mode, timing the first alone, zero copy
 * was kept at twice the copies' cost.  So every 128th call of a bucket rank 0
 * asks for a trial and times the third call of that bucket that tries the
 * other one, or a later one where the copies take more places in the slots
 * (zc_trial_warm); only then it asks for the choice back, so a trial is four
 * calls where the calls are all of one size, as one layer's are (the two
 * cold ones, the timed one, and the one that starts before the choice is
 * back), and three of each size where two sizes alternate.  The timed one
 * switches at once where the other one wins (what runs next is what it
 * timed).  Rank 0 times one in 16 of the other calls, none right after a
 * trial, and where one was slow, more (zc_sample: a change of the machine is
 * seen at once).
 * A size's first trial comes after its 16th call, not its 128th: a size
 * that starts on the wrong one pays for it 16 calls, not 128.
 *
 * A trial of the copies sets their chunks' stores (the stores' bit in the
 * header, which every rank reads): the first as they stand, the next the
 * other kind, and so on in turns; rank 0 keeps the copies' cost on each
 * kind, and theirs is the lesser.  Zero copy loses where the machine makes
 * cache-to-cache transfers slow, which is where the copies need
 * non-temporal stores, and the stores' own choice learns nothing for a size
 * whose copies never run: it stays on what it started with, the nearest
 * timed size's choice (store_spread), plain where no size was timed (in this
 * VM's slow mode `tpcomm perf -Z` then kept zero copy at 1 MiB at 232 us,
 * where the copies took 96-130 that day).  But where the machine is fast,
 * non-temporal stores make the copies of a size that fits the caches slow
 * (256 KiB on AMD Zen 4: 4x), and trials on those alone kept zero copy
 * there for 1700 calls at twice the copies' time.  A trial that a jump of
 * zero copy's cost asks for (zc_sample) runs them non-temporal: a jump is
 * the machine turning slow.  Where the copies win, the stores take their
 * cheaper kind (their own choice goes on from there); else they go back to
 * what they were.  A call whose chunks' stores were the stores' own trial
 * of the other kind (store_begin: two rounds in 256) is timed as neither
 * way, and a trial times the next call instead: one such call on 6 ms
 * slower non-temporal stores, taken for plain ones, kept zero copy in a
 * test.
 * A rank that copies a comm.empty tensor marks its metadata (ARG_COPIED), so
 * a peer that passes an ordinary tensor gets the mismatch error as before.
 * The bits, so the results, are the same either way.
 */
#define ZC_TRIAL_SHIFT 11 /* 4 bits: the bucket on trial + 1, 0: none */
#define ZC_TRIAL_EVERY 128 /* calls of a bucket between trials */
#define ZC_TRIAL_FIRST 16  /* the call of a bucket after which its first trial comes */

int zc_bucket(size_t bytes) { return size_bucket(bytes, ZC_MIN_LOG2, ZC_BUCKETS); }

/* the state in force for a call that starts after round s */
static unsigned zc_bits(uint64_t word, uint64_t s)
{
    int from_now = (int32_t)((uint32_t)s - (uint32_t)word) >= 0;
    return (unsigned)((from_now ? word >> 48 : word >> 32) & 0xFFFF);
}

unsigned zc_agreed(const Engine *e)
{
    return zc_bits(atomic_load_explicit(&HDR((Engine *)e)->zc_word, memory_order_acquire), e->round);
}

/* the bucket on trial in state `bits` (-1: none) */
static int zc_trial(unsigned bits) { return (int)((bits >> ZC_TRIAL_SHIFT) & 15) - 1; }

/* whether bucket b's calls copy in state `bits`: its choice, or the other
 * one while it is on trial */
int zc_copies(unsigned bits, int b) { return (int)((bits >> b) & 1) ^ (zc_trial(bits) == b); }

/* the state `bits` with no trial */
static unsigned zc_chosen(unsigned bits) { return bits & ~(15u << ZC_TRIAL_SHIFT); }

/* rank 0, between calls: `bits` from the call after the next one on; with
 * the bits in force, settle a change that is in force for every rank now */
static void zc_publish(Engine *e, unsigned bits)
{
    uint64_t w = atomic_load_explicit(&HDR(e)->zc_word, memory_order_relaxed), nw;
    const unsigned now = zc_bits(w, e->round), from = (unsigned)(w >> 48);
    if (bits != now)
        nw = (uint64_t)bits << 48 | (uint64_t)now << 32 | (uint32_t)(e->round + 1);
    else if (((w >> 32) & 0xFFFF) != from && now == from)
        nw = (uint64_t)now << 48 | (uint64_t)now << 32 | (uint32_t)w;
    else
        return;
    atomic_store_explicit(&HDR(e)->zc_word, nw, memory_order_release);
}

/* rank 0: the copies' cost in bucket b, the cheaper of their stores' (0:
 * unknown) */
static float zc_copies_cost(const Engine *e, int b)
{
    const float *c = e->zc.cost[b];
    return c[1] > 0.0f && (c[2] == 0.0f || c[1] < c[2]) ? c[1] : c[2];
}

/* rank 0: switch bucket b where the other one costs under 0.8 of the choice */
static void zc_decide(Engine *e, int b)
{
    const float zc = e->zc.cost[b][0], copies = zc_copies_cost(e, b);
    const int cur = (int)(e->zc.want >> b) & 1;
    const float mine = cur ? copies : zc, other = cur ? zc : copies;
    if (other > 0.0f && other < 0.8f * mine) {
        e->zc.want ^= 1u << b;
        e->zc.switches++;
    }
}

/* rank 0: a call of bucket b took dt ticks, by way w (0 zero copy, 1 the
 * copies on plain stores, 2 on non-temporal ones) */
static void zc_learn(Engine *e, int b, int w, uint64_t dt, size_t bytes)
{
    float x = (float)dt * 1024.0f / (float)bytes, *c = &e->zc.cost[b][w];
    const int cur = (int)(e->zc.want >> b) & 1;
    if (*c > 0.0f && x > 2.0f * *c)
        x = 2.0f * *c;
    *c = *c == 0.0f ? x : *c + (x - *c) * ((w > 0) == cur ? 0.25f : 0.5f);
    zc_decide(e, b);
}

/*
 * rank 0: a timed call of bucket b's choice.  One over twice its cost counts
 * as twice (zc_learn: a preempted call), and the second and third calls
 * after it are timed too (not the next: a peer that slept through the slow
 * one wakes in it; and two calls in a row, not every second one, which a
 * peer that sleeps in every other call, as on a machine with more busy
 * threads than cores, would make look slow each time: 140-160 and 570-640 us
 * in turns at 512 KiB here).  ZC_JUMP of them over twice in a row are the
 * machine changing (in this VM's slow mode zero copy at 4 MiB went from 155
 * to 1764 us a call from one call to the next, the copies from 165 to 330):
 * the least of them is its cost from now on, and the other one is tried at
 * once (1: asked), where the capped average took about 100 calls to see it,
 * 0.2-0.5 s at 4-16 MiB.  What the other one cost was learnt before the
 * change, so the trial's time replaces it (blended with it, copies that had
 * cost 8 ms more and now cost nothing more lost to a zero copy 3 ms slower
 * in a test).  The next trial comes a whole period after that
 * one, not at the next multiple of the period.
 */
#define ZC_JUMP 3

static int zc_sample(Engine *e, int b, int w, uint64_t dt, size_t bytes)
{
    const float x = (float)dt * 1024.0f / (float)bytes, c = e->zc.cost[b][w];
    if (!(c > 0.0f && x > 2.0f * c)) {
        e->zc.outliers[b] = 0;
        zc_learn(e, b, w, dt, bytes);
        return 0;
    }
    if (e->zc.outliers[b] == 0 || x < e->zc.outlier[b])
        e->zc.outlier[b] = x;
    e->zc.confirm[b] = e->zc.outliers[b] == 0 ? 2 : 1; /* the second call on, then the next */
    if (++e->zc.outliers[b] < ZC_JUMP) {
        zc_learn(e, b, w, dt, bytes);
        return 0;
    }
    float *cost = e->zc.cost[b];
    cost[w] = e->zc.outlier[b];
    if (w == 0) /* the other one's costs are from before the change: tried afresh */
        cost[1] = cost[2] = 0.0f;
    else
        cost[0] = 0.0f;
    e->zc.outliers[b] = 0;
    e->zc.jumps++;
    zc_decide(e, b);
    return 1;
}

/* The call of a trial that is timed, for an all_reduce of `bytes` of dtype:
 * the third, or the first after its copies have gone once round their
 * places in the slots (slot_pos), at most the eighth.  Until they have,
 * their stores meet lines the peers read more recently than a whole round
 * of places ago: at 256 KiB (four places) on AMD Zen 4 the first four calls
 * of the copies after zero copy took 38-57 us, the fifth on 27-29, and the
 * third timed made the copies look 2.5-3x their steady cost. */
static unsigned zc_trial_warm(const Engine *e, size_t bytes, int dtype)
{
    const ar_plan_t pl = ar_plan(e, bytes, dtype, 0);
    if (pl.algo != AR_ONESHOT && pl.algo != AR_TWOSHOT)
        return 3;
    return trial_warm(e, first_chunk(&pl, bytes));
}

/* rank 0: a trial of the copies of `bytes` of dtype, bucket b, begins: their
 * chunks' stores as they stand on its first, else the other kind than its
 * last trial's, non-temporal where `jump` (zero copy's cost jumped: the
 * machine turned slow, which is where the copies need them), remembering
 * the kind they had (see above) */
static void zc_trial_stores(Engine *e, int b, size_t bytes, int dtype, int jump)
{
    const ar_plan_t pl = ar_plan(e, bytes, dtype, 0);
    const int sb = plan_store_bucket(e, &pl, bytes);
    if (sb < 0)
        return;
    const int had = stores_bit(e, sb);
    const int nt = jump || (e->zc.tried[b] ? e->zc.tried[b] == 1 : had);
    store_set(e, sb, nt);
    e->zc.tried[b] = (uint8_t)(1 + nt);
    e->zc.st_bucket = sb + 1;
    e->zc.st_had = had;
}

/* rank 0: that trial is over; where the copies are now the choice of bucket
 * b, their stores take the cheaper kind, else the kind they had */
static void zc_trial_stores_end(Engine *e, int b)
{
    const int sb = e->zc.st_bucket - 1;
    if (sb < 0)
        return;
    const float *c = e->zc.cost[b];
    const int nt = (e->zc.want >> b) & 1 ? c[2] > 0.0f && c[2] == zc_copies_cost(e, b) : e->zc.st_had;
    store_set(e, sb, nt);
    e->zc.st_bucket = 0;
}

/* rank 0, after a call of `bytes` of dtype, bucket b, that ran in state
 * `bits` by way w (zc_learn; -1: the copies, some of them on the stores the
 * stores' own choice was trying, which tell nothing of either way) and took
 * dt ticks: learn from it where it was timed, ask for a trial or for the
 * choice back, and publish what it wants */
void zc_after_call(Engine *e, unsigned bits, int b, int w, uint64_t dt, size_t bytes, int dtype)
{
    const int tb = zc_trial(e->zc.want), copied = w != 0; /* the bucket asked to try */
    if (zc_trial(bits) == b) { /* on trial */
        const unsigned warm = zc_trial_warm(e, bytes, dtype);
        /* the one to time tried the other stores: the next is timed instead */
        const int skip = w < 0 && e->zc.seen[b] + 1u == warm;
        if (!skip && ++e->zc.seen[b] == warm) { /* warm (see above) */
            zc_learn(e, b, w, dt, bytes);
            e->zc.trials++;
            e->zc.want = zc_chosen(e->zc.want); /* the choice back after the next call */
            e->zc.asked = 0;
            zc_trial_stores_end(e, b);
        }
    } else {
        int now = 0; /* a trial at once (zc_sample) */
        const int confirming = e->zc.outliers[b] > 0;
        if (e->zc.seen[b] == 0 && w >= 0 &&
            (confirming ? --e->zc.confirm[b] == 0 : e->zc.calls[b] % 16 == 5))
            now = zc_sample(e, b, w, dt, bytes) && (int)((e->zc.want >> b) & 1) == copied;
        e->zc.seen[b] = 0;
        if (e->zc.asked && ++e->zc.asked > 2 * ZC_TRIAL_EVERY) { /* its size stopped coming */
            e->zc.want = zc_chosen(e->zc.want);
            e->zc.asked = 0;
            zc_trial_stores_end(e, tb);
        }
        const uint32_t n = ++e->zc.calls[b];
        const int first = n == ZC_TRIAL_FIRST && !e->zc.trials_of[b];
        if ((n % ZC_TRIAL_EVERY == 0 || first || now) && !e->zc.asked) {
            if (now) /* the next trial a whole period after this one */
                e->zc.calls[b] = 0;
            e->zc.want |= (unsigned)(b + 1) << ZC_TRIAL_SHIFT;
            e->zc.asked = 1;
            e->zc.trials_of[b] = 1;
            if (!((e->zc.want >> b) & 1)) /* a trial of the copies */
                zc_trial_stores(e, b, bytes, dtype, now);
        }
    }
    zc_publish(e, e->zc.want);
}

/* set_zero_copy(min_bytes, max_bytes): all-reduces of min_bytes to max_bytes
 * of a tensor in a symmetric buffer (Communicator.empty) read the peers'
 * tensors where they are (min -1: never, they copy through the slots like
 * any other; max -1: no limit) */
PyObject *eng_set_zero_copy(Engine *e, PyObject *args)
{
    long long lo, hi;
    if (!PyArg_ParseTuple(args, "LL", &lo, &hi))
        return NULL;
    e->zc_min = lo < 0 ? UINT64_MAX : (uint64_t)lo;
    e->zc_max = hi < 0 ? UINT64_MAX : (uint64_t)hi;
    Py_RETURN_NONE;
}

/* set_zero_copy_auto(on): rank 0 chooses zero copy or the copies per size as
 * calls run (from the call after the next one on; off: zero copy, and what
 * was learnt is forgotten); other ranks follow rank 0 whatever they set */
PyObject *eng_set_zero_copy_auto(Engine *e, PyObject *arg)
{
    int v = PyObject_IsTrue(arg);
    if (v < 0)
        return NULL;
    if (refuse_if_busy(e, "set_zero_copy_auto") < 0)
        return NULL;
    if (e->rank == 0 && e->base) {
        const uint64_t switches = e->zc.switches, copied = e->zc.copied;
        memset(&e->zc, 0, sizeof e->zc);
        e->zc.switches = switches;
        e->zc.copied = copied;
        e->zc.want = v ? zc_chosen(zc_agreed(e)) | ZC_ON : 0;
        zc_publish(e, e->zc.want);
    }
    Py_RETURN_NONE;
}

/* zero_copy_state() -> {"auto", "copies": [per bucket, as agreed now],
 * "trial": the bucket trying the other one now (-1: none), "cost": [[zero
 * copy, the copies on plain stores, on non-temporal ones] ticks per KiB]
 * (rank 0), "switches", "trials" (timed trial
 * calls, rank 0), "jumps" (costs taken at once, zc_sample, rank 0),
 * "copied", "min_bytes", "word"}: tests, tpcomm doctor */
PyObject *eng_zero_copy_state(Engine *e, PyObject *unused)
{
    (void)unused;
    const unsigned bits = e->base ? zc_agreed(e) : 0;
    PyObject *copies = PyList_New(ZC_BUCKETS), *cost = PyList_New(ZC_BUCKETS);
    if (!copies || !cost) {
        Py_XDECREF(copies);
        Py_XDECREF(cost);
        return NULL;
    }
    for (int b = 0; b < ZC_BUCKETS; b++) {
        PyList_SET_ITEM(copies, b, PyLong_FromLong((long)(bits >> b) & 1));
        PyList_SET_ITEM(cost, b, Py_BuildValue("(ddd)", (double)e->zc.cost[b][0],
                                               (double)e->zc.cost[b][1], (double)e->zc.cost[b][2]));
    }
    return Py_BuildValue("{s:O,s:N,s:i,s:N,s:K,s:K,s:K,s:K,s:K,s:K}", "auto",
                         bits & ZC_ON ? Py_True : Py_False, "copies", copies, "trial",
                         zc_trial(bits), "cost", cost, "switches",
                         (unsigned long long)e->zc.switches, "trials",
                         (unsigned long long)e->zc.trials, "jumps",
                         (unsigned long long)e->zc.jumps, "copied",
                         (unsigned long long)e->zc.copied, "min_bytes",
                         (unsigned long long)(1u << ZC_MIN_LOG2), "word",
                         e->base ? (unsigned long long)atomic_load(&HDR(e)->zc_word) : 0ULL);
}

/* tests: every zero-copy all-reduce of this rank spins this many more
 * microseconds (0: none) */
PyObject *eng_fault_zero_copy(Engine *e, PyObject *arg)
{
    double us = PyFloat_AsDouble(arg);
    if (us == -1.0 && PyErr_Occurred())
        return NULL;
    e->fault.zc_ns = us > 0 ? (uint64_t)(us * 1e3) : 0;
    Py_RETURN_NONE;
}
