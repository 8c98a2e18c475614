/* Cold read tables: see ckptfs_coldtable.h for what and why. */
#define _GNU_SOURCE

#include <Python.h>     /* first, as Python asks: only to release the GIL while writing */

#include "ckptfs_coldtable.h"
#include "ckptfs_coldtable_answer.h"
#include "ckptfs_readpool.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <linux/fuse.h>

/* One per file being read (chunkread.py keeps at most MAX_WINDOWS windows,
 * and withdraws a window's table when it drops the window). */
#define CT_SLOTS 64
/* A READ made of more pieces than this goes to the daemon (1 MiB of the
 * smallest chunks the chunker cuts is far fewer); one iov more for the
 * reply's header fits a read pool job (RP_IOV_MAX). */
#define CT_MAX_IOV (RP_IOV_MAX - 1)
/* In-flight counts per table, one per stretch between two trims
 * (ckptfs_cold_trim_later), used round: a count is 0 once every reply
 * counted in it since the last time it was 0 is written. */
#define CT_EPOCHS 4

typedef struct {
    uint64_t off, length;
    const uint8_t *addr;
} ct_piece;

typedef struct {
    uint64_t ino;               /* 0: a free slot */
    ct_piece *pieces;           /* [first, n) are live, in file order */
    size_t first, n, cap;
    uint64_t refill_at;
    uint64_t wake_at;           /* an answered READ ending past it wakes the daemon */
    uint64_t read_to;           /* where the furthest answered READ ended */
    int wake_asked;             /* 1: asked (ckptfs_cold_wanted not called yet), 2: taken */
    unsigned inflight[CT_EPOCHS];  /* its READs queued or being written in the read
                                      pool, by epoch (under the pool's lock) */
    unsigned epoch;             /* the count READs answered now go to */
} ct_table;

static ct_table tables[CT_SLOTS];
static uint64_t counters[4];
static int wake_fd = -1;        /* readable: a reader passed its table's mark */

static ct_table *table_of(uint64_t ino)
{
    if (ino == 0)
        return NULL;
    for (size_t i = 0; i < CT_SLOTS; i++)
        if (tables[i].ino == ino)
            return &tables[i];
    return NULL;
}

static ct_table *table_made(uint64_t ino)
{
    ct_table *t = table_of(ino);
    for (size_t i = 0; i < CT_SLOTS && t == NULL; i++)
        if (tables[i].ino == 0) {
            t = &tables[i];
            ct_piece *keep = t->pieces;     /* a freed slot keeps its array */
            size_t cap = t->cap;
            /* inflight is all 0: the slot was freed by ckptfs_cold_forget, which waited */
            *t = (ct_table){.ino = ino, .pieces = keep, .cap = cap, .refill_at = 0,
                            .wake_at = UINT64_MAX};
        }
    return t;
}

static int add_piece(ct_table *t, uint64_t off, uint64_t length, uintptr_t addr)
{
    if (length == 0 || addr == 0 || off + length < off)
        return -1;
    if (t->n > t->first) {
        const ct_piece *last = &t->pieces[t->n - 1];
        if (off < last->off + last->length)
            return -1;
    }
    if (t->n == t->cap) {
        if (t->first > 0) {             /* room left by trimmed pieces first */
            memmove(t->pieces, t->pieces + t->first, (t->n - t->first) * sizeof *t->pieces);
            t->n -= t->first;
            t->first = 0;
        }
        if (t->n == t->cap) {
            size_t cap = t->cap ? 2 * t->cap : 512;
            ct_piece *p = realloc(t->pieces, cap * sizeof *p);
            if (p == NULL)
                return -1;
            t->pieces = p;
            t->cap = cap;
        }
    }
    t->pieces[t->n++] = (ct_piece){.off = off, .length = length, .addr = (const uint8_t *)addr};
    return 0;
}

size_t ckptfs_cold_publish(uint64_t ino, const uint64_t *offs, const uint64_t *lens,
                           const uintptr_t *addrs, size_t n, uint64_t refill_at)
{
    if (ino == 0)
        return 0;
    ct_table *t = n > 0 ? table_made(ino) : table_of(ino);
    if (t == NULL)
        return 0;
    size_t k = 0;
    while (k < n && add_piece(t, offs[k], lens[k], addrs[k]) == 0)
        k++;
    t->refill_at = refill_at;
    return k;
}

/* No READ of t is queued or being written in the read pool any more: the
 * memory of its pieces may go.  On the thread that answers (the only one
 * that submits), so none is queued meanwhile; the GIL is released while
 * waiting (a job is one writev of at most 1 MiB). */
static void quiesce(ct_table *t)
{
    for (unsigned e = 0; e < CT_EPOCHS; e++) {
        if (!rp_busy(&t->inflight[e]))
            continue;
        PyThreadState *saved = NULL;
        if (Py_IsInitialized() && PyGILState_Check())
            saved = PyEval_SaveThread();
        rp_quiesce(&t->inflight[e]);
        if (saved != NULL)
            PyEval_RestoreThread(saved);
    }
}

int ckptfs_cold_trim_later(uint64_t ino, uint64_t below)
{
    ct_table *t = table_of(ino);
    if (t == NULL)
        return -1;
    size_t first = t->first;
    while (t->first < t->n && t->pieces[t->first].off + t->pieces[t->first].length <= below)
        t->first++;
    if (t->first == first)
        return -1;
    /* The replies in flight carry their own iovs: only the memory they
     * point into must stay, which the caller keeps until drained. */
    int old = (int)t->epoch;
    t->epoch = (t->epoch + 1) % CT_EPOCHS;
    return old;
}

int ckptfs_cold_drained(uint64_t ino, int epoch)
{
    ct_table *t = table_of(ino);
    if (t == NULL)
        return 1;               /* forgotten: ckptfs_cold_forget waited */
    if (epoch < 0 || epoch >= CT_EPOCHS)
        return 0;
    return !rp_busy(&t->inflight[epoch]);
}

void ckptfs_cold_trim(uint64_t ino, uint64_t below)
{
    ct_table *t = table_of(ino);
    if (t == NULL)
        return;
    if (t->first < t->n && t->pieces[t->first].off + t->pieces[t->first].length <= below)
        quiesce(t);             /* a READ in flight may read a piece that goes */
    while (t->first < t->n && t->pieces[t->first].off + t->pieces[t->first].length <= below)
        t->first++;
}

void ckptfs_cold_forget(uint64_t ino)
{
    ct_table *t = table_of(ino);
    if (t == NULL)
        return;
    quiesce(t);
    t->ino = 0;
    t->first = t->n = 0;        /* the array is kept for the slot's next table */
}

int ckptfs_cold_wake_fd(void)
{
    if (wake_fd < 0)
        wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    return wake_fd;
}

int ckptfs_cold_mark(uint64_t ino, uint64_t wake_at)
{
    ct_table *t = table_of(ino);
    if (t == NULL || wake_fd < 0)
        return 0;
    t->wake_at = wake_at;
    t->wake_asked = 0;
    return 1;
}

size_t ckptfs_cold_wanted(uint64_t *inos, uint64_t *read_to, size_t n)
{
    uint64_t drained;
    if (wake_fd >= 0 && read(wake_fd, &drained, sizeof drained) < 0)
        drained = 0;            /* EAGAIN: nothing was asked since the last call */
    size_t k = 0;
    for (size_t i = 0; i < CT_SLOTS && k < n; i++) {
        ct_table *t = &tables[i];
        if (t->ino != 0 && t->wake_asked == 1) {
            t->wake_asked = 2;
            inos[k] = t->ino;
            read_to[k] = t->read_to;
            k++;
        }
    }
    return k;
}

void ckptfs_cold_counters(uint64_t *out, size_t n)
{
    if (n > 4)
        n = 4;
    for (size_t i = 0; i < n; i++)
        out[i] = __atomic_load_n(&counters[i], __ATOMIC_RELAXED);
}

int ckptfs_cold_answer(int fd, uint64_t ino, uint64_t unique, uint64_t off, uint64_t size)
{
    ct_table *t = table_of(ino);
    if (t == NULL)
        return 0;
    uint64_t end = off + size;
    if (size == 0 || end < off || end > t->refill_at) {
        __atomic_fetch_add(&counters[2], 1, __ATOMIC_RELAXED);
        return 0;
    }
    size_t lo = t->first, hi = t->n;     /* the first piece ending after off */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (t->pieces[mid].off + t->pieces[mid].length <= off)
            lo = mid + 1;
        else
            hi = mid;
    }
    struct fuse_out_header out = {.len = (uint32_t)(sizeof out + size), .error = 0,
                                  .unique = unique};
    struct iovec iov[CT_MAX_IOV + 1];
    iov[0] = (struct iovec){.iov_base = &out, .iov_len = sizeof out};
    int n_iov = 1;
    uint64_t pos = off;
    for (size_t k = lo; pos < end; k++) {
        /* Every byte from a piece, the pieces back to back: a gap (a byte
         * not fetched yet, a hole, a log chunk) is the daemon's to read. */
        if (k == t->n || t->pieces[k].off > pos || n_iov > CT_MAX_IOV) {
            __atomic_fetch_add(&counters[2], 1, __ATOMIC_RELAXED);
            return 0;
        }
        const ct_piece *p = &t->pieces[k];
        uint64_t stop = p->off + p->length < end ? p->off + p->length : end;
        iov[n_iov++] = (struct iovec){.iov_base = (void *)(p->addr + (pos - p->off)),
                                      .iov_len = (size_t)(stop - pos)};
        pos = stop;
    }
    /* The kernel copies out of the pieces' memory: the only copy, on a read
     * pool thread (this one goes on reading requests), the job counted in
     * the table's in-flight count until it is written, and the memory kept
     * until then (trim and forget wait for it).  Inline if the pool cannot
     * take it: nothing else changes the table meanwhile (only this thread
     * does), and the memory stays until the table lets go, so the GIL may go. */
    static rp_job job;          /* this thread only; ~10 KiB, so not on its stack */
    job.cold = 1;
    job.fuse_fd = fd;
    job.unique = unique;
    job.nodeid = ino;
    job.offset = off;
    job.size = (uint32_t)size;
    job.n = (size_t)n_iov;
    job.inflight = &t->inflight[t->epoch];
    memcpy(job.iov + 1, iov + 1, (size_t)(n_iov - 1) * sizeof *iov);
    if (rp_submit(&job)) {
        __atomic_fetch_add(&counters[3], 1, __ATOMIC_RELAXED);
    } else {
        PyThreadState *saved = NULL;
        if (Py_IsInitialized() && PyGILState_Check())
            saved = PyEval_SaveThread();
        ssize_t w = writev(fd, iov, n_iov);
        int e = errno;
        if (saved != NULL)
            PyEval_RestoreThread(saved);
        if (w < 0 && e == ENODEV) {
            errno = ENODEV;
            return -1;          /* unmounted: libfuse ends the session */
        }
        /* ENOENT: the request was interrupted meanwhile, nobody waits for it. */
    }
    if (end > t->read_to)
        t->read_to = end;
    if (end > t->wake_at && t->wake_asked == 0) {
        /* The daemon tops the look-ahead up and publishes further now,
         * before the reader gets there: no READ goes to it for that. */
        static const uint64_t one = 1;
        t->wake_asked = 1;
        if (write(wake_fd, &one, sizeof one) < 0)
            t->wake_asked = 0;  /* (the counter is full: cannot happen) */
    }
    __atomic_fetch_add(&counters[0], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&counters[1], size, __ATOMIC_RELAXED);
    return 1;
}
