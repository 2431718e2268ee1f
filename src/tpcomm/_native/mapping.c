/*
 * A segment's mapping: the object that owns the mmap (Mapping), mapping a
 * segment with this rank's liveness lock, the engine's view of where each
 * part of it lies, and the header rank 0 writes.  engine.c's eng_init puts
 * them together.
 */
#include "tpcomm.h"

/*
 * Mapping owns the mmap of a segment: it unmaps in its destructor.  The
 * engine holds one reference, and torch.frombuffer(mapping) tensors hold
 * others, so memory a tensor views stays mapped as long as the tensor lives,
 * even after close() (which drops the engine's reference and the liveness
 * lock).
 */
static int map_getbuffer(Mapping *m, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)m, m->base, (Py_ssize_t)m->size, 0, flags);
}

static PyBufferProcs map_as_buffer = {(getbufferproc)map_getbuffer, NULL};

static void map_dealloc(Mapping *m)
{
    if (m->base)
        munmap(m->base, m->size);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tpcomm._native.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)map_dealloc,
    .tp_as_buffer = &map_as_buffer,
};

/* Map the segment (fd) and take rank's liveness lock on a descriptor of its
 * own (*myfd): the mapping as a Mapping object, or NULL with an exception
 * (nothing left open). */
Mapping *map_segment(int fd, size_t size, int rank, int *myfd_out)
{
    /* The liveness lock lives on an open file description of its own, which
     * nothing but myfd refers to: a mapping holds a reference to the
     * description it was made through, and a child made by fork() inherits
     * the mapping, so a lock on the mapping's description would outlive this
     * process as long as such a child lives (after_fork_child closes the
     * child's copy of myfd).  Reopening /proc/self/fd/N makes a new
     * description; without /proc, share fd's (as the fallback it is). */
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int myfd = open(path, O_RDWR | O_CLOEXEC);
    if (myfd < 0)
        myfd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (myfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        close(myfd);
        return NULL;
    }
    /* Every rank opened the file itself: OFD locks of different ranks conflict. */
    struct flock fl = rank_lock(rank);
    if (fcntl(myfd, F_OFD_SETLK, &fl) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        munmap(p, size);
        close(myfd);
        return NULL;
    }
    Mapping *mp = PyObject_New(Mapping, &MappingType);
    if (!mp) {
        munmap(p, size);
        close(myfd);
        return NULL;
    }
    mp->base = p;
    mp->size = size;
    *myfd_out = myfd;
    return mp;
}

/* The engine's view of a mapped segment: where each part lies (tpcomm.h
 * "Layout"), its waits, and every switch point off until Python sets them. */
void set_layout(Engine *e, void *p, size_t size, int rank, int world, uint64_t slot_bytes,
                double timeout, double spin_us, double yield_us)
{
    e->rx.src = -1;
    e->base = p;
    e->size = size;
    e->rank = rank;
    e->world = world;
    e->slot_bytes = slot_bytes;
    e->ctrl_bytes = (size_t)ctrl_size((uint32_t)world);
    e->slot_off = PAGE + (size_t)world * e->ctrl_bytes;
    e->p2p_bytes = (size_t)p2p_size((uint32_t)world, slot_bytes);
    e->p2p_piece = 2 * e->p2p_bytes / P2P_RING; /* p2p_bytes: a multiple of 4 KiB, >= 64 KiB */
    e->p2p_off = e->slot_off + (size_t)world * 2 * slot_bytes;
    e->round = 0;
    e->waits.timeout_ns = ns_of(timeout);
    waits_set(e, spin_us, yield_us, YIELD_LOST_NS / 1e3);
    e->busy = 0;
    e->failed = 0;
    e->twoshot_min = UINT64_MAX;
    e->twoshot_min16 = UINT64_MAX;
    e->zc_min = UINT64_MAX;
    e->zc_max = UINT64_MAX;
    e->chunk_min = UINT64_MAX;
    e->chunk_bytes = 0;
    e->cma_ar_min = UINT64_MAX;
    e->nt_min = UINT64_MAX;
    e->populate_min = UINT64_MAX;
    e->twoshot_max = e->twoshot_max16 = e->cma_ar_max = e->nt_max = UINT64_MAX;
    e->slot_move_min = UINT64_MAX;
}

/* Rank 0 writes the header of the segment it created; the magic last,
 * after a release fence: a rank that sees it sees the rest. */
void write_header(Engine *e, uint64_t need)
{
    hdr_t *h = HDR(e);
    h->version = VERSION;
    h->world = (uint32_t)e->world;
    h->slot_bytes = e->slot_bytes;
    h->total_bytes = need;
    h->ctrl_off = PAGE;
    h->slot_off = e->slot_off;
    h->nchan = NCHAN;
    h->p2p_bytes = e->p2p_bytes;
    h->slot_move_min = e->slot_move_min;
    atomic_store(&h->attached, 0);
    atomic_store(&h->sleepers, 0);
    atomic_store(&h->abort_word, 0);
    atomic_thread_fence(memory_order_release);
    h->magic = MAGIC;
}
