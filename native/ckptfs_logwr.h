/* The log writer (ckptfs/logwriter.py): a write's bytes copied into the log
 * file by pwrite on C threads, completions signalled through an eventfd.
 *
 * A stream WRITE's pwrite of 1 MiB went to a Python worker thread and back:
 * two thread hand-overs, each with the GIL taken and given back several times
 * (about 40 futex calls per WRITE with the feed and the committer also
 * wanting it).  These threads never touch Python: the trio thread queues a
 * job (no blocking: a mutex held for a list push) and learns it is done from
 * the eventfd its event loop already polls.
 *
 * Plain C11 + pthreads, no Python state: cffi calls it with the GIL released.
 * ckptfs/_native_build.py feeds this file (minus its '#' lines) to
 * ffi.cdef(), so keep it to plain declarations. */
#ifndef CKPTFS_LOGWR_H
#define CKPTFS_LOGWR_H

#include <stddef.h>
#include <stdint.h>

typedef struct ckptfs_logwr ckptfs_logwr;

/* Start nthreads (1..16) writer threads and a nonblocking eventfd.  NULL
 * with errno set on failure. */
ckptfs_logwr *ckptfs_logwr_new(int nthreads);

/* The eventfd that becomes readable when jobs are done (read it, then reap). */
int ckptfs_logwr_fd(const ckptfs_logwr *w);

/* Queue pwrite(fd, buf, len, off), repeated until all len bytes are written
 * (EINTR and short writes retried).  buf must stay valid and unchanged until
 * the job is reaped.  token comes back with the result.  0, or -ENOMEM.
 * buf NULL: start the writeback of fd's dirty pages in [off, off+len) to the
 * disk instead (sync_file_range SYNC_FILE_RANGE_WRITE: submitted, not waited
 * for; it may sleep while the device is busy, which is why a thread does
 * it); nothing is reported and it is never reaped. */
int ckptfs_logwr_submit(ckptfs_logwr *w, int fd, const void *buf, size_t len,
                        uint64_t off, uint64_t token);

/* As ckptfs_logwr_submit (buf not NULL), then fdatasync(fd) once every byte
 * is written: the result is len only when both succeeded, else -errno of the
 * pwrite or of the fdatasync (the index journal's append: a record made
 * durable without a Python thread, index.py). */
int ckptfs_logwr_submit_durable(ckptfs_logwr *w, int fd, const void *buf, size_t len,
                                uint64_t off, uint64_t token);

/* Take up to max finished jobs: tokens[k] and results[k] (len, or -errno of
 * the pwrite that failed).  Returns how many.  Never blocks. */
size_t ckptfs_logwr_reap(ckptfs_logwr *w, uint64_t *tokens, int64_t *results,
                         size_t max);

/* Let every queued job finish, stop the threads, close the eventfd and free
 * w (its unreaped results are dropped).  May block until the jobs are done. */
void ckptfs_logwr_free(ckptfs_logwr *w);

#endif
