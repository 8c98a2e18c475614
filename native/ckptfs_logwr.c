/* The log writer: see ckptfs_logwr.h. */
#define _GNU_SOURCE
#include "ckptfs_logwr.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>

#define LOGWR_MAX_THREADS 16

typedef struct logwr_job {
    struct logwr_job *next;
    const unsigned char *buf;
    size_t len;
    uint64_t off;
    uint64_t token;
    int64_t result;
    int fd;
    int writeback; /* sync_file_range WRITE, not reported: freed when done */
    int datasync;  /* fdatasync(fd) after the bytes are written (ckptfs_logwr_submit_durable) */
} logwr_job;

struct ckptfs_logwr {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    logwr_job *todo, *todo_tail;      /* FIFO: queued, not started */
    logwr_job *done, *done_tail;      /* FIFO: finished, not reaped */
    int stopping;
    int efd;
    int nthreads;
    pthread_t threads[LOGWR_MAX_THREADS];
};

static int64_t write_all(int fd, const unsigned char *p, size_t len, uint64_t off)
{
    size_t done = 0;
    while (done < len) {
        ssize_t n = pwrite(fd, p + done, len - done, (off_t)(off + done));
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -(int64_t)errno;
        }
        if (n == 0)
            return -(int64_t)EIO;
        done += (size_t)n;
    }
    return (int64_t)len;
}

static void *logwr_main(void *arg)
{
    ckptfs_logwr *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->todo && !w->stopping)
            pthread_cond_wait(&w->wake, &w->mu);
        logwr_job *j = w->todo;
        if (!j)
            break; /* stopping, and nothing left to write */
        w->todo = j->next;
        if (!w->todo)
            w->todo_tail = NULL;
        pthread_mutex_unlock(&w->mu);

        if (j->writeback) {
            /* Nobody waits for it: a failure shows in the fsync that needs
             * these pages (errseq), which this does not consume. */
            (void)sync_file_range(j->fd, (off_t)j->off, (off_t)j->len, SYNC_FILE_RANGE_WRITE);
            free(j);
            pthread_mutex_lock(&w->mu);
            continue;
        }
        j->result = write_all(j->fd, j->buf, j->len, j->off);
        if (j->datasync && j->result >= 0 && fdatasync(j->fd) != 0)
            j->result = -(int64_t)errno;

        pthread_mutex_lock(&w->mu);
        j->next = NULL;
        if (w->done_tail)
            w->done_tail->next = j;
        else
            w->done = j;
        w->done_tail = j;
        /* After the push: a reaper that read the eventfd before it will be
         * woken again and find the job. */
        uint64_t one = 1;
        ssize_t r = write(w->efd, &one, sizeof one);
        (void)r; /* EAGAIN only at a counter near 2^64: already readable */
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

ckptfs_logwr *ckptfs_logwr_new(int nthreads)
{
    if (nthreads < 1 || nthreads > LOGWR_MAX_THREADS) {
        errno = EINVAL;
        return NULL;
    }
    ckptfs_logwr *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    w->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->efd < 0) {
        int e = errno;
        free(w);
        errno = e;
        return NULL;
    }
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->wake, NULL);
    for (int i = 0; i < nthreads; i++) {
        int e = pthread_create(&w->threads[i], NULL, logwr_main, w);
        if (e) {
            w->nthreads = i;
            ckptfs_logwr_free(w);
            errno = e;
            return NULL;
        }
    }
    w->nthreads = nthreads;
    return w;
}

int ckptfs_logwr_fd(const ckptfs_logwr *w)
{
    return w->efd;
}

static int submit(ckptfs_logwr *w, int fd, const void *buf, size_t len, uint64_t off,
                  uint64_t token, int datasync)
{
    logwr_job *j = malloc(sizeof *j);
    if (!j)
        return -ENOMEM;
    j->next = NULL;
    j->buf = buf;
    j->len = len;
    j->off = off;
    j->token = token;
    j->result = 0;
    j->fd = fd;
    j->writeback = buf == NULL;
    j->datasync = datasync;
    pthread_mutex_lock(&w->mu);
    if (w->todo_tail)
        w->todo_tail->next = j;
    else
        w->todo = j;
    w->todo_tail = j;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->mu);
    return 0;
}

int ckptfs_logwr_submit(ckptfs_logwr *w, int fd, const void *buf, size_t len,
                        uint64_t off, uint64_t token)
{
    return submit(w, fd, buf, len, off, token, 0);
}

int ckptfs_logwr_submit_durable(ckptfs_logwr *w, int fd, const void *buf, size_t len,
                                uint64_t off, uint64_t token)
{
    if (buf == NULL)
        return -EINVAL;
    return submit(w, fd, buf, len, off, token, 1);
}

size_t ckptfs_logwr_reap(ckptfs_logwr *w, uint64_t *tokens, int64_t *results, size_t max)
{
    size_t n = 0;
    logwr_job *list;
    pthread_mutex_lock(&w->mu);
    list = w->done;
    logwr_job *last = NULL;
    while (w->done && n < max) {
        last = w->done;
        w->done = last->next;
        n++;
    }
    if (!w->done)
        w->done_tail = NULL;
    pthread_mutex_unlock(&w->mu);
    if (last)
        last->next = NULL;
    for (size_t k = 0; k < n; k++) {
        logwr_job *j = list;
        list = j->next;
        tokens[k] = j->token;
        results[k] = j->result;
        free(j);
    }
    return n;
}

void ckptfs_logwr_free(ckptfs_logwr *w)
{
    pthread_mutex_lock(&w->mu);
    w->stopping = 1;
    pthread_cond_broadcast(&w->wake);
    pthread_mutex_unlock(&w->mu);
    for (int i = 0; i < w->nthreads; i++)
        pthread_join(w->threads[i], NULL);
    while (w->done) {
        logwr_job *j = w->done;
        w->done = j->next;
        free(j);
    }
    close(w->efd);
    pthread_cond_destroy(&w->wake);
    pthread_mutex_destroy(&w->mu);
    free(w);
}
