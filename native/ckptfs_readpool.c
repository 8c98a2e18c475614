/* The fast path's read pool: see ckptfs_readpool.h for what and why. */
#define _GNU_SOURCE

#include "ckptfs_readpool.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <linux/fuse.h>

/* As many reads waiting for the disk at once as the daemon's worker
 * threads had (core.py's io_limiter: 4): several readers at once (8 shards)
 * keep the disk's queue full; the CRC checks share the cores either way. */
#define RP_THREADS 4
/* Jobs waiting at most: more than the kernel sends at once (its
 * max_background is 12 by default); a full queue passes READs on. */
#define RP_QUEUE 64
#define RP_READ_MAX (1u << 20)          /* ckptfs_fuse.c's FP_READ_MAX */
#define RP_BLOCK_BYTES 65536ull         /* index.CRC_BLOCK_BYTES */

typedef struct handback_node {
    rp_handback hb;
    struct handback_node *next;
} handback_node;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work = PTHREAD_COND_INITIALIZER;     /* a job queued, or stopping */
static pthread_cond_t idle = PTHREAD_COND_INITIALIZER;     /* some table's count fell to 0 */
static rp_job queue[RP_QUEUE];
static size_t q_head, q_len;
static int started, stopping, n_threads;
static pthread_t threads[RP_THREADS];
static rp_read_fn read_extents;
static int wake_fd = -1;
static handback_node *hb_first, *hb_last;
static uint64_t n_answered, n_bytes, n_handed_back, n_waits;

static void handback(const rp_job *job, int kind)
{
    handback_node *node = malloc(sizeof *node);
    if (node == NULL) {
        /* Cannot reach the daemon: the reader gets EIO rather than a hang. */
        struct fuse_out_header out = {.len = sizeof out, .error = -EIO, .unique = job->unique};
        ssize_t w = write(job->fuse_fd, &out, sizeof out);
        (void)w;
        return;
    }
    node->hb = (rp_handback){.unique = job->unique, .nodeid = job->nodeid, .fh = job->fh,
                             .offset = job->offset, .size = job->size, .kind = kind};
    node->next = NULL;
    pthread_mutex_lock(&lock);
    if (hb_last != NULL)
        hb_last->next = node;
    else
        hb_first = node;
    hb_last = node;
    n_handed_back++;
    pthread_mutex_unlock(&lock);
    uint64_t one = 1;
    ssize_t w = write(wake_fd, &one, sizeof one);
    (void)w;            /* the counter is only a wake-up: it cannot overflow here */
}

/* Read and answer one job; the table's count is lowered by the caller. */
static void run(rp_job *job, uint8_t *buf)
{
    if (job->cold) {
        /* Verified bytes: one writev, the kernel's copy the only one. */
        struct fuse_out_header out = {
            .len = (uint32_t)(sizeof out + job->size), .error = 0, .unique = job->unique};
        job->iov[0] = (struct iovec){.iov_base = &out, .iov_len = sizeof out};
        /* ENOENT: interrupted meanwhile, nobody waits; ENODEV: unmounted. */
        ssize_t w = writev(job->fuse_fd, job->iov, (int)job->n);
        (void)w;
        return;
    }
    ckptfs_rx_error err;
    int rc = read_extents(job->log_fd, job->ext, job->n, job->crcs, job->n_crcs,
                          RP_BLOCK_BYTES, job->offset, buf, job->size, buf + RP_READ_MAX, 0,
                          &err);
    if (rc != 0) {
        handback(job, err.kind);
        return;
    }
    struct fuse_out_header out = {
        .len = (uint32_t)(sizeof out + job->size), .error = 0, .unique = job->unique};
    struct iovec iov[2] = {{.iov_base = &out, .iov_len = sizeof out},
                           {.iov_base = buf, .iov_len = job->size}};
    /* ENOENT: interrupted meanwhile, nobody waits; ENODEV: unmounted. */
    ssize_t w = writev(job->fuse_fd, iov, 2);
    (void)w;
    __atomic_fetch_add(&n_answered, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&n_bytes, job->size, __ATOMIC_RELAXED);
}

/* A thread's own memory: its reply buffer (then the executor's scratch) and
 * its copy of the job it runs. */
typedef struct {
    uint8_t *buf;
    rp_job job;
} worker_mem;

static worker_mem *mems[RP_THREADS];

static void *worker(void *arg)
{
    worker_mem *mem = arg;
    uint8_t *buf = mem->buf;
    rp_job *job = &mem->job;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (q_len == 0 && !stopping)
            pthread_cond_wait(&work, &lock);
        if (q_len == 0)
            break;                      /* stopping, and every queued job done */
        memcpy(job, &queue[q_head], sizeof *job);
        q_head = (q_head + 1) % RP_QUEUE;
        q_len--;
        pthread_mutex_unlock(&lock);
        run(job, buf);
        pthread_mutex_lock(&lock);
        /* The job no longer reads the log. */
        if (--*job->inflight == 0)
            pthread_cond_broadcast(&idle);
    }
    pthread_mutex_unlock(&lock);
    return NULL;
}

int rp_start(rp_read_fn read_fn)
{
    pthread_mutex_lock(&lock);
    int rc = 0;
    if (!started) {
        started = 1;
        read_extents = read_fn;
        wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (wake_fd >= 0) {
            /* The threads block no signal the daemon handles: they are
             * created with every signal blocked, so signals go to Python's
             * main thread as before. */
            sigset_t all, old;
            sigfillset(&all);
            pthread_sigmask(SIG_SETMASK, &all, &old);
            for (int i = 0; i < RP_THREADS; i++) {
                worker_mem *mem = malloc(sizeof *mem);
                void *p = NULL;
                if (mem == NULL
                        || posix_memalign(&p, 4096, RP_READ_MAX + 2 * RP_BLOCK_BYTES) != 0) {
                    free(mem);
                    break;
                }
                mem->buf = p;
                if (pthread_create(&threads[n_threads], NULL, worker, mem) != 0) {
                    free(p);
                    free(mem);
                    break;
                }
                mems[n_threads++] = mem;
            }
            pthread_sigmask(SIG_SETMASK, &old, NULL);
        }
    }
    if (n_threads == 0)
        rc = -1;
    pthread_mutex_unlock(&lock);
    return rc;
}

int rp_submit(const rp_job *job)
{
    pthread_mutex_lock(&lock);
    int ok = n_threads > 0 && !stopping && q_len < RP_QUEUE;
    if (ok) {
        queue[(q_head + q_len) % RP_QUEUE] = *job;
        q_len++;
        ++*job->inflight;
        pthread_cond_signal(&work);
    }
    pthread_mutex_unlock(&lock);
    return ok;
}

void rp_quiesce(unsigned *inflight)
{
    pthread_mutex_lock(&lock);
    n_waits += *inflight != 0;
    while (*inflight != 0)
        pthread_cond_wait(&idle, &lock);
    pthread_mutex_unlock(&lock);
}

int rp_busy(unsigned *inflight)
{
    pthread_mutex_lock(&lock);
    int busy = *inflight != 0;
    pthread_mutex_unlock(&lock);
    return busy;
}

void rp_stop(void)
{
    pthread_mutex_lock(&lock);
    stopping = 1;
    pthread_cond_broadcast(&work);
    int n = n_threads;
    pthread_mutex_unlock(&lock);
    for (int i = 0; i < n; i++) {
        pthread_join(threads[i], NULL);
        free(mems[i]->buf);
        free(mems[i]);
        mems[i] = NULL;
    }
    pthread_mutex_lock(&lock);
    n_threads = 0;
    pthread_mutex_unlock(&lock);
}

int rp_handback_fd(void)
{
    return n_threads > 0 ? wake_fd : -1;
}

size_t rp_handbacks(rp_handback *out, size_t n)
{
    uint64_t count;
    ssize_t r = read(wake_fd, &count, sizeof count);     /* clears the wake-up */
    (void)r;
    size_t got = 0;
    pthread_mutex_lock(&lock);
    while (got < n && hb_first != NULL) {
        handback_node *node = hb_first;
        hb_first = node->next;
        if (hb_first == NULL)
            hb_last = NULL;
        out[got++] = node->hb;
        free(node);
    }
    int more = hb_first != NULL;
    pthread_mutex_unlock(&lock);
    if (more) {
        uint64_t one = 1;       /* the rest on the next call */
        ssize_t w = write(wake_fd, &one, sizeof one);
        (void)w;
    }
    return got;
}

void rp_counters(uint64_t *answered, uint64_t *bytes, uint64_t *handed_back,
                 uint64_t *waits)
{
    *answered = __atomic_load_n(&n_answered, __ATOMIC_RELAXED);
    *bytes = __atomic_load_n(&n_bytes, __ATOMIC_RELAXED);
    pthread_mutex_lock(&lock);
    *handed_back = n_handed_back;
    *waits = n_waits;
    pthread_mutex_unlock(&lock);
}
