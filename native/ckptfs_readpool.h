/* The read pool of the FUSE fast path (ckptfs_fuse.c): READs of a published
 * read table whose bytes are not in the page cache, read and answered on a
 * few C threads, so that neither the trio thread nor the interpreter waits
 * for the disk.
 *
 * Internal to ckptfs._fusepath (not given to cffi): ckptfs_fuse.c submits,
 * the pool threads read with the read executor (ckptfs_readx.c), check every
 * block's CRC-32C, and write the reply to the FUSE fd themselves.  They also
 * write the replies of cold READs (ckptfs_coldtable.c) from the verified cold
 * cache's memory, so that the copy into FUSE is not the trio thread's: the
 * table counts those jobs in flight the same way and waits for them before
 * it lets go of the memory they read.
 *
 * Why withdrawing a table is safe while its reads run here.  A job carries
 * copies of what it reads with (the log fd, the extents its READ spans,
 * their chunks' CRCs), so the table's memory may go at any time, and a
 * pointer to its file's in-flight count (one per table slot, kept while the
 * slot stays that file's, across the tables of a reader moving on), raised
 * under the pool's lock when the job is queued and lowered, under the lock,
 * once the job no longer reads the log (its reply is in its own buffer).
 * The fast path calls rp_quiesce(count) before a file's tables are
 * forgotten (ckptfs_fuse_read_forget) and before its slot goes to another
 * file; forgetting comes before the file's map, its chunks or its size
 * change (chunkread.py's windows).  So once a file's tables are forgotten
 * no pool thread reads log bytes for it, and log space released afterwards
 * (only after the change that stopped naming it) is never read by a job
 * that planned with the old map.  A reader moving on to its next window
 * changes nothing: its old table is retired (ckptfs_fuse_read_retire)
 * without waiting, and its jobs stay counted.  The wait is short: at most
 * the jobs queued for that one file, each one read of at most 1 MiB.
 *
 * A job that fails (a CRC that does not match, a read error, the log
 * shorter than a chunk) is not answered here: it is handed back to the
 * daemon (rp_handbacks, woken through an eventfd), which reads it through
 * its own path, as if the fast path had never seen it (so a damaged block is
 * EIO there, logged and counted as every other one).
 *
 * rp_stop (the session's end) lets the threads finish the jobs already
 * queued, joins them, and only then may the FUSE fd, the log fd or the
 * tables' memory go.  A thread never takes the GIL nor waits for the
 * interpreter, so a trio thread waiting in rp_quiesce cannot deadlock. */
#ifndef CKPTFS_READPOOL_H
#define CKPTFS_READPOOL_H

#include <stddef.h>
#include <stdint.h>

#include <sys/uio.h>

#include "ckptfs_readx.h"

typedef int (*rp_read_fn)(int, const ckptfs_rx_extent *, size_t, const uint8_t *, size_t,
                          uint64_t, uint64_t, uint8_t *, size_t, uint8_t *, int,
                          ckptfs_rx_error *);

/* The most extents and CRCs one job carries: a 1 MiB READ of chunks of at
 * least 16 KiB (the chunker's smallest but the last of a file), each chunk
 * at most 1 MiB (16 CRCs).  A READ needing more is passed on. */
#define RP_EXT_MAX 96
#define RP_CRC_MAX (RP_EXT_MAX * 16)

/* A READ the pool answers: what the reply needs and what the read needs,
 * the extents it spans and their chunks' CRCs copied (crc_at indexes crcs
 * here), so a job never reads the table's memory. */
/* A cold READ's reply is at most this many pieces of verified memory
 * (ckptfs_coldtable.c's CT_MAX_IOV). */
#define RP_IOV_MAX 256

typedef struct {
    int fuse_fd;
    uint64_t unique, nodeid, fh, offset;
    uint32_t size;
    int cold;                      /* 1: a cold READ, its reply from iov as it is */
    int log_fd;
    size_t n, n_crcs;              /* cold: n is how many iov */
    unsigned *inflight;            /* its file's in-flight count (under the pool's lock) */
    union {
        struct {
            ckptfs_rx_extent ext[RP_EXT_MAX];
            uint8_t crcs[4 * RP_CRC_MAX];
        };
        /* A cold READ (ckptfs_coldtable.c): its bytes, already verified, in
         * the cold cache's memory, which stays as it is until the job is
         * done (the cold table waits for its jobs before it lets go). */
        struct iovec iov[RP_IOV_MAX];
    };
} rp_job;

/* A READ handed back to the daemon (ckptfs_fuse.h: ckptfs_fuse_handback). */
typedef struct {
    uint64_t unique, nodeid, fh, offset;
    uint32_t size;
    int32_t kind;                  /* ckptfs_rx_error.kind that made the pool give up */
} rp_handback;

/* Start the threads (once; later calls are no-ops).  0, or -1 (no pool:
 * every submit then says no). */
int rp_start(rp_read_fn read_fn);

/* Queue job: 1 queued (its table's in-flight count raised), 0 not (no pool,
 * the queue full, stopping): the caller passes the READ on. */
int rp_submit(const rp_job *job);

/* Wait until *inflight is 0 (no job of that table is queued or reading).
 * Call with the GIL released. */
void rp_quiesce(unsigned *inflight);

/* Is *inflight above 0 (under the lock: 0 means every job of it is done)? */
int rp_busy(unsigned *inflight);

/* The session ends: finish the queued jobs, join the threads. */
void rp_stop(void);

/* The eventfd that turns readable when a READ is handed back, -1 without a pool. */
int rp_handback_fd(void);

/* Up to n handed-back READs into out; how many. */
size_t rp_handbacks(rp_handback *out, size_t n);

/* Counters the pool keeps: READs answered, their bytes, READs handed back,
 * withdrawals (rp_quiesce) that had to wait for reads in flight. */
void rp_counters(uint64_t *answered, uint64_t *bytes, uint64_t *handed_back,
                 uint64_t *waits);

#endif
