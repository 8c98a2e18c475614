/* The FUSE channel fast path: see ckptfs_fuse.h for what and why. */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 35

#include <Python.h>     /* first, as Python asks: only to release the GIL while waiting */

#include "ckptfs_fuse.h"
#include "ckptfs_readpool.h"
#include "ckptfs_readx.h"
#include "ckptfs_coldtable_answer.h"
#include "ckptfs_logfault.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <fuse_lowlevel.h>
#include <linux/fuse.h>

#define FP_OPCODES 64
#define FP_COUNTERS (FP_OPCODES + 7)
/* After the write counters: READs answered from the log's mapping. */
#define FP_MAPPED_READS 0
#define FP_FAST_GETATTR 1
#define FP_FAST_RELEASE 2
#define FP_MCOUNTERS 3
#define FP_OTHER_OPCODE FP_OPCODES
#define FP_WRITE_BYTES (FP_OPCODES + 1)
#define FP_FAST_GETXATTR (FP_OPCODES + 2)
#define FP_EMPTY_READS (FP_OPCODES + 3)
#define FP_FAST_READS (FP_OPCODES + 4)
#define FP_FAST_READ_BYTES (FP_OPCODES + 5)
#define FP_READS_PASSED (FP_OPCODES + 6)
/* After the read pool's four (ckptfs_fuse_counters' out[71..74]). */
#define FP_FAST_WRITES 0
#define FP_FAST_WRITE_BYTES 1
#define FP_WRITES_PASSED 2
#define FP_WRITES_SPLICED 3
#define FP_WCOUNTERS 4

/* How many requests one read may answer itself before it hands one to
 * libfuse or gives the event loop its turn, and for how long at most. */
#define FP_MAX_BURST 256
#define FP_MAX_BURST_NS 2000000L

/* After answering, how long to wait for the writer's next question: it
 * comes as soon as the writer has copied its next write() into the page
 * cache, a few microseconds for small writes.  Waited for with the GIL
 * released; meanwhile only the event loop's timers and worker threads'
 * results wait (other requests are read as they come).  Only while waiting
 * pays (linger_credit): a writer of 1 MiB pieces asks once a millisecond or
 * so, and waiting for it would only stall the loop.  (An average of the time
 * between questions decided this before; under load that average grew past
 * the bound exactly when waiting was needed most, and the fast path fell
 * back to the loop for good.) */
#define FP_LINGER_NS 200000L

/* Inodes known to have no security.capability: a direct-mapped set (a
 * colliding mark evicts the older one, which then asks the daemon again). */
#define FP_SLOTS 65536u

static const char CAPS_NAME[] = "security.capability";

/* Directory attributes the daemon left for the GETATTR the kernel sends next
 * (ckptfs_fuse_attr_leave): a direct-mapped set, one answer each. */
#define FP_ATTR_SLOTS 16u

typedef struct {
    uint64_t ino;                   /* 0: a free slot */
    struct fuse_attr_out out;
} fp_attr;

static fp_attr attrs_left[FP_ATTR_SLOTS];
static unsigned n_attrs_left;       /* slots in use: 0 skips every look-up */

/* Handles whose RELEASE needs nothing of the daemon but its bookkeeping
 * (ckptfs_fuse_release_quiet: a FLUSH left the file with nothing to
 * commit): direct-mapped by fh, a colliding mark evicts the older one
 * (whose RELEASE then goes to the daemon).  Any other request about the
 * inode drops its marks first (quiet_touch). */
#define FP_QUIET_SLOTS 64u
/* RELEASEs answered here and not yet taken; a full queue sends the next
 * one to the daemon (which takes them first). */
#define FP_RELEASED_MAX 256

typedef struct {
    uint64_t fh, ino;               /* ino 0: a free slot */
} fp_quiet;

static fp_quiet quiet[FP_QUIET_SLOTS];
static unsigned n_quiet;            /* slots in use: 0 skips every look-up */
static uint64_t released[FP_RELEASED_MAX];
static size_t n_released;
static void (*release_folder)(void);

/* Read tables: one per file being read (chunkread.py keeps at most
 * MAX_WINDOWS windows, fewer than this). */
#define FP_READ_SLOTS 64
/* The largest READ answered here: the kernel's (and libfuse's) max_read. */
#define FP_READ_MAX (1u << 20)
/* Log read-ahead asked for ahead of a sequential reader (chunkread.py's
 * HINT_BYTES and HINT_SLACK_BYTES: the same policy as the daemon's reads). */
#define FP_HINT_BYTES (16ull << 20)
#define FP_HINT_SLACK (4ull << 20)
#define FP_BLOCK_BYTES 65536ull        /* index.CRC_BLOCK_BYTES */
/* Extents a READ answered from the log's mapping may span (more: copied). */
#define FP_MAP_PIECES 128
#define FP_PAGE 4096ull
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22           /* Linux 5.14 */
#endif

typedef rp_read_fn fp_read_fn;
typedef size_t (*fp_hint_fn)(int, const ckptfs_rx_extent *, size_t, uint64_t, uint64_t);

typedef struct {
    uint64_t ino;                   /* 0: a free slot */
    int fd;                         /* the daemon's log fd (the mapping's) */
    int own;                        /* 1 + the reader's own open file of the log; 0: none */
    const ckptfs_rx_extent *ext;
    size_t n;
    const uint8_t *crcs;
    size_t n_crcs;
    uint64_t start, end;
    uint64_t read_to, hinted_to;    /* where the last read ended, hints asked up to */
    uint64_t age;                   /* when it was made: the oldest goes first */
    int active;                     /* 0: retired (a reader moved on), READs go to the daemon */
    uint64_t next_at;               /* a sequential READ ending past it asks for the next table */
    int next_asked;                 /* 1: asked (ckptfs_fuse_read_wanted not called yet), 2: taken */
    int end_is_eof;                 /* end is the file's size: READs past it are answered short */
    unsigned inflight;              /* the file's READs queued or read in the pool (its lock) */
} fp_table;

static fp_table tables[FP_READ_SLOTS];

/* The fd a table's log bytes are read through: its own open file of the
 * log when it has one, so the kernel keeps a read-ahead state per reader. */
static int reader_fd(const fp_table *t)
{
    return t->own ? t->own - 1 : t->fd;
}

/* Close t's own file of the log; no READ of it may be in the pool. */
static void own_close(fp_table *t)
{
    if (t->own)
        close(t->own - 1);
    t->own = 0;
}
static uint64_t table_clock;
static fp_read_fn read_extents;
static fp_hint_fn hint_extents;

/* The log mapped read-only: a READ whose log pages are all in the page
 * cache is checked and written to the kernel straight from there, without
 * first copying it into reply_buf (that copy was a quarter of the trio
 * thread's time on a cold torch.load).  Each READ's pages are populated
 * before the check (MADV_POPULATE_READ: an I/O error is an error, not a
 * SIGBUS) and unmapped after the reply (MADV_DONTNEED: the page cache
 * keeps them, the daemon's RSS does not grow by what it read). */
typedef uint32_t (*fp_crc_fn)(uint32_t, const void *, size_t);
static fp_crc_fn crc32c;
static int map_fd = -1;             /* the fd the mapping was made of */
static dev_t map_dev;
static ino_t map_ino;               /* ... and its file: an fd number may be reused */
static const uint8_t *map_base;
static uint64_t map_len;
static int map_off;                 /* 1: CKPTFS_NO_MAPPED_READS=1, or mapping failed */
static int map_populate = 1;        /* 0: the kernel has no MADV_POPULATE_READ */
/* A SIGBUS on the mapping (the log cut short, a page whose read failed
 * after the populate) is a zero page and a new generation here, not a dead
 * daemon (ckptfs_logfault.c): without that guard, nothing is read in place. */
static const ckptfs_logfault_api *log_faults;
static int map_slot = -1;
/* Test hook: CKPTFS_DEBUG_PAUSE=mapped-read:PATH stops the first mapped READ
 * after its pages are populated, before they are checked, while PATH exists
 * (debugpause.py), so a test can cut the log file there. */
static const char *map_pause_path;
static uint64_t mcounters[FP_MCOUNTERS];
static uint8_t *reply_buf;          /* FP_READ_MAX bytes, then the executor's scratch */
static int ahead_fd = -1;           /* readable: a reader wants its next table */

/* Write windows: one per file written front to back (a checkpoint writer
 * writes a few files at once, shards8 eight). */
#define FP_WRITE_SLOTS 16
/* WRITEs answered here and not yet taken; a WRITE that finds it full goes
 * to the daemon (which takes them first). */
#define FP_PENDING_MAX 256

typedef struct {
    uint64_t ino;                   /* 0: a free slot */
    int fd;
    int kind;                       /* FP_WIN_STREAM, or a rewrite window's FP_WIN_* */
    uint64_t file_off;              /* stream: where the next WRITE must start; rewrite:
                                     * where the daemon's stream is or would begin */
    uint64_t log_off, log_end;      /* where its bytes go, the space left */
} fp_window;

/* A stream's window answers the WRITE at file_off only.  A rewrite window
 * answers a WRITE at any offset except those the daemon would stream:
 * FP_WIN_BESIDE (the file has a stream, next at file_off) passes on a WRITE
 * holding the byte at file_off; FP_WIN_BELOW (no stream: one would begin at a
 * WRITE at or past file_off, the end of what the file's changes cover) passes
 * on a WRITE starting at or past file_off. */
#define FP_WIN_STREAM 0
#define FP_WIN_BESIDE 1
#define FP_WIN_BELOW 2

static fp_window windows[FP_WRITE_SLOTS];
static unsigned n_windows;          /* slots in use: 0 skips every look-up */
static ckptfs_fuse_wextent pending[FP_PENDING_MAX];
static size_t n_pending;
static void (*folder)(void);
static uint64_t wcounters[FP_WCOUNTERS];

/* While a write window is open, requests are taken from the FUSE fd with
 * splice() into this pipe rather than read(): the kernel puts a WRITE's
 * payload pages in the pipe by reference, so a WRITE answered here costs one
 * copy (pipe -> the log's page cache, splice again) instead of two (the fd
 * -> libfuse's buffer, the buffer -> the log).  Every other request, and a
 * WRITE passed on, is read out of the pipe into libfuse's buffer whole.  The
 * pipe holds nothing between requests. */
static int splice_pipe[2] = {-1, -1};
static int splice_state;            /* 0 not tried yet, 1 on, -1 off */
static int splice_wanted = 1;

static uint64_t counters[FP_COUNTERS];
static fp_window *window_of(uint64_t ino);
static int touches_only_nodeid(uint32_t opcode);
static uint64_t caps_absent[FP_SLOTS];
static int wanted;
static int hooked;
static int session_fd = -1;         /* the FUSE fd, once the fast path is on it */
static int init_seen;
static uint64_t init_unique;
static int init_replied;
static uint16_t max_background;     /* 0: what libfuse says (the kernel's 12) */
/* FUSE_HANDLE_KILLPRIV_V2: asked for by the daemon, offered by the kernel's
 * INIT, put in the INIT reply.  With it the kernel stops asking GETXATTR
 * before every write() (the mount gets SB_NOSEC) and instead flags the
 * requests after which suid/sgid must go; the nodeids of those passed on are
 * kept for the daemon (trio thread only: fp_read and ckptfs_fuse_kill_asked). */
static int killpriv_wanted, killpriv_offered, killpriv_on;
#define FP_KILL_MAX 256
static uint64_t kill_inos[FP_KILL_MAX];
static size_t n_kill;
static int kill_overflow;           /* a flag lost: every ask says yes from then on */
/* Whether waiting pays: waits that saw the next question earn credit, waits
 * that timed out cost more; without credit, only every FP_PROBE_EVERY-th
 * answer waits, to notice a writer that became a small-piece writer. */
#define FP_CREDIT_MAX 16
#define FP_CREDIT_MISS 4
#define FP_PROBE_EVERY 64
static int linger_credit = FP_CREDIT_MAX;
static unsigned since_probe;

static void bump(size_t i, uint64_t by)
{
    __atomic_fetch_add(&counters[i], by, __ATOMIC_RELAXED);
}

static void bump_w(size_t i)
{
    __atomic_fetch_add(&wcounters[i], 1, __ATOMIC_RELAXED);
}

static size_t slot_of(uint64_t ino)
{
    /* Fibonacci hashing: consecutive inode numbers spread over the table. */
    return (size_t)((ino * 0x9E3779B97F4A7C15ull) >> 48) & (FP_SLOTS - 1);
}

void ckptfs_fuse_want(int on)
{
    wanted = on != 0;
}

void ckptfs_fuse_splice_writes(int on)
{
    splice_wanted = on != 0;
}

void ckptfs_fuse_max_background(unsigned n)
{
    max_background = n > 0xffff ? 0xffff : (uint16_t)n;
}

void ckptfs_fuse_killpriv_v2(int on)
{
    killpriv_wanted = on != 0;
}

int ckptfs_fuse_killpriv_v2_on(void)
{
    return __atomic_load_n(&killpriv_on, __ATOMIC_ACQUIRE);
}

int ckptfs_fuse_kill_asked(uint64_t ino)
{
    if (kill_overflow)
        return 1;
    for (size_t i = 0; i < n_kill; i++)
        if (kill_inos[i] == ino) {
            kill_inos[i] = kill_inos[--n_kill];
            return 1;
        }
    return 0;
}

/* A request passed on to the daemon: does it carry the kernel's "kill
 * suid/sgid" (a WRITE, a SETATTR (truncate, chown), an OPEN with O_TRUNC)? */
static void note_kill(const struct fuse_in_header *in)
{
    const void *arg = in + 1;
    size_t left = in->len >= sizeof *in ? in->len - sizeof *in : 0;
    int kill = 0;
    if (in->opcode == FUSE_WRITE && left >= sizeof(struct fuse_write_in))
        kill = (((const struct fuse_write_in *)arg)->write_flags & FUSE_WRITE_KILL_SUIDGID) != 0;
    else if (in->opcode == FUSE_SETATTR && left >= sizeof(struct fuse_setattr_in))
        kill = (((const struct fuse_setattr_in *)arg)->valid & FATTR_KILL_SUIDGID) != 0;
    else if (in->opcode == FUSE_OPEN && left >= sizeof(struct fuse_open_in))
        kill = (((const struct fuse_open_in *)arg)->open_flags & FUSE_OPEN_KILL_SUIDGID) != 0;
    if (!kill)
        return;
    if (n_kill < FP_KILL_MAX)
        kill_inos[n_kill++] = in->nodeid;
    else
        kill_overflow = 1;
}

int ckptfs_fuse_hooked(void)
{
    return __atomic_load_n(&hooked, __ATOMIC_RELAXED);
}

void ckptfs_fuse_caps_absent(uint64_t ino)
{
    if (ino != 0)
        caps_absent[slot_of(ino)] = ino;
}

void ckptfs_fuse_caps_unknown(uint64_t ino)
{
    size_t s = slot_of(ino);
    if (caps_absent[s] == ino)
        caps_absent[s] = 0;
}

static fp_attr *attr_slot(uint64_t ino)
{
    return &attrs_left[(size_t)((ino * 0x9E3779B97F4A7C15ull) >> 60) & (FP_ATTR_SLOTS - 1)];
}

/* libfuse's calc_timeout_sec / calc_timeout_nsec (fuse_reply_attr). */
static uint64_t timeout_sec(double t)
{
    if (t > (double)ULONG_MAX)
        return ULONG_MAX;
    if (t < 0.0)
        return 0;
    return (unsigned long)t;
}

static uint32_t timeout_nsec(double t)
{
    double f = t - (double)timeout_sec(t);
    if (f < 0.0)
        return 0;
    if (f >= 0.999999999)
        return 999999999;
    return (uint32_t)(f * 1.0e9);
}

void ckptfs_fuse_attr_leave(uint64_t ino, uint64_t size, uint64_t blocks, int64_t atime_ns,
                            int64_t mtime_ns, int64_t ctime_ns, uint32_t mode, uint32_t nlink,
                            uint32_t uid, uint32_t gid, uint32_t rdev, uint32_t blksize,
                            double attr_timeout)
{
    if (ino == 0)
        return;
    fp_attr *a = attr_slot(ino);
    if (a->ino == 0)
        n_attrs_left++;
    memset(a, 0, sizeof *a);
    a->ino = ino;
    struct fuse_attr_out *o = &a->out;
    o->attr_valid = timeout_sec(attr_timeout);
    o->attr_valid_nsec = timeout_nsec(attr_timeout);
    /* As libfuse's convert_stat of pyfuse3's struct stat (its *_ns setters
     * split with C's / and %). */
    o->attr.ino = ino;
    o->attr.size = size;
    o->attr.blocks = blocks;
    o->attr.atime = (uint64_t)(atime_ns / 1000000000);
    o->attr.mtime = (uint64_t)(mtime_ns / 1000000000);
    o->attr.ctime = (uint64_t)(ctime_ns / 1000000000);
    o->attr.atimensec = (uint32_t)(atime_ns % 1000000000);
    o->attr.mtimensec = (uint32_t)(mtime_ns % 1000000000);
    o->attr.ctimensec = (uint32_t)(ctime_ns % 1000000000);
    o->attr.mode = mode;
    o->attr.nlink = nlink;
    o->attr.uid = uid;
    o->attr.gid = gid;
    o->attr.rdev = rdev;
    o->attr.blksize = blksize;
}

void ckptfs_fuse_attr_drop(uint64_t ino)
{
    if (n_attrs_left == 0 || ino == 0)
        return;
    fp_attr *a = attr_slot(ino);
    if (a->ino == ino) {
        a->ino = 0;
        n_attrs_left--;
    }
}

void ckptfs_fuse_release_quiet(uint64_t fh, uint64_t ino)
{
    if (ino == 0)
        return;
    fp_quiet *q = &quiet[fh % FP_QUIET_SLOTS];
    if (q->ino == 0)
        n_quiet++;
    q->fh = fh;
    q->ino = ino;
}

/* A request about ino (any but a RELEASE, which answer_release looks at)
 * may change what its RELEASE has to do: its marks go.  A COPY_FILE_RANGE
 * names its second file in its arguments: every mark goes. */
static void quiet_touch(const struct fuse_in_header *in)
{
    if (in->opcode == FUSE_RELEASE || in->opcode == FUSE_FORGET
            || in->opcode == FUSE_BATCH_FORGET || in->opcode == FUSE_INTERRUPT)
        return;
    int all = !touches_only_nodeid(in->opcode) && in->opcode != FUSE_CREATE
              && in->opcode != FUSE_MKNOD && in->opcode != FUSE_LINK
              && in->opcode != FUSE_UNLINK && in->opcode != FUSE_RMDIR
              && in->opcode != FUSE_RENAME && in->opcode != FUSE_RENAME2;
    for (unsigned i = 0; i < FP_QUIET_SLOTS && n_quiet > 0; i++) {
        if (quiet[i].ino != 0 && (all || quiet[i].ino == in->nodeid)) {
            quiet[i].ino = 0;
            n_quiet--;
        }
    }
}

/* Move the first n (at most *count) rows of a queue of size-byte rows to
 * out; the rest move up. */
static size_t take_rows(void *out, void *rows, size_t *count, size_t n, size_t size)
{
    if (n > *count)
        n = *count;
    memcpy(out, rows, n * size);
    memmove(rows, (uint8_t *)rows + n * size, (*count - n) * size);
    *count -= n;
    return n;
}

size_t ckptfs_fuse_release_take(uint64_t *out, size_t n)
{
    return take_rows(out, released, &n_released, n, sizeof *released);
}

void ckptfs_fuse_release_folder(uintptr_t fn)
{
    release_folder = (void (*)(void))fn;
}

void ckptfs_fuse_read_mapper(uintptr_t crc_fn, int off)
{
    crc32c = (fp_crc_fn)crc_fn;
    map_off = off != 0 || crc_fn == 0;
    const char *pause = getenv("CKPTFS_DEBUG_PAUSE");
    if (pause != NULL && strncmp(pause, "mapped-read:", 12) == 0 && pause[12] != '\0')
        map_pause_path = strdup(pause + 12);
}

void ckptfs_fuse_log_faults(uintptr_t api)
{
    log_faults = (const ckptfs_logfault_api *)api;
}

static void map_pause(void)
{
    const char *path = map_pause_path;
    if (path == NULL)
        return;
    map_pause_path = NULL;      /* once */
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0)
        close(fd);
    struct timespec tick = {.tv_sec = 0, .tv_nsec = 20000000L};
    while (access(path, F_OK) == 0)
        nanosleep(&tick, NULL);
}

/* Map the log of fd (once; again if fd is another file now).  Trio thread. */
static void map_log(int fd)
{
    struct stat st;
    if (map_off || crc32c == NULL || log_faults == NULL || fstat(fd, &st) != 0)
        return;
    if (map_base != NULL && map_fd == fd && map_dev == st.st_dev && map_ino == st.st_ino
            && map_len == (uint64_t)st.st_size)
        return;
    if (map_base != NULL) {
        log_faults->unguard(map_slot);
        map_slot = -1;
        munmap((void *)map_base, (size_t)map_len);
        map_base = NULL;
        map_fd = -1;
    }
    if (!S_ISREG(st.st_mode) || st.st_size <= 0)
        return;
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return;                 /* reads copy through reply_buf as before */
    map_slot = log_faults->guard((uintptr_t)p, (size_t)st.st_size, PROT_READ);
    if (map_slot < 0) {
        munmap(p, (size_t)st.st_size);
        return;
    }
    /* Pages come and go per READ: no read-ahead of the mapping's own. */
    madvise(p, (size_t)st.st_size, MADV_RANDOM);
    map_base = p;
    map_len = (uint64_t)st.st_size;
    map_fd = fd;
    map_dev = st.st_dev;
    map_ino = st.st_ino;
}

void ckptfs_fuse_read_executor(uintptr_t read_fn, uintptr_t hint_fn)
{
    read_extents = (fp_read_fn)read_fn;
    hint_extents = (fp_hint_fn)hint_fn;
    /* Without threads, a READ that is not cached goes to the daemon as before. */
    rp_start(read_extents);
}

/* No READ of t's file is queued or reading in the pool any more.  On the
 * trio thread, the only one that submits, so none is queued meanwhile; the
 * GIL is released while waiting for the reads in flight. */
static void quiesce(fp_table *t)
{
    if (!rp_busy(&t->inflight))
        return;                 /* (handing the GIL to another thread could cost ms) */
    PyThreadState *saved = NULL;
    if (Py_IsInitialized() && PyGILState_Check())
        saved = PyEval_SaveThread();
    rp_quiesce(&t->inflight);
    if (saved != NULL)
        PyEval_RestoreThread(saved);
}

static fp_table *table_of(uint64_t ino)
{
    for (size_t i = 0; i < FP_READ_SLOTS; i++)
        if (tables[i].ino == ino)
            return &tables[i];
    return NULL;
}

int ckptfs_fuse_read_table(uint64_t ino, int log_fd, uintptr_t ext, size_t n, uintptr_t crcs,
                           size_t n_crcs, uint64_t start, uint64_t end)
{
    if (read_extents == NULL || hint_extents == NULL || ino == 0)
        return -1;
    if (reply_buf == NULL) {
        void *p = NULL;
        if (posix_memalign(&p, 4096, FP_READ_MAX + 2 * FP_BLOCK_BYTES) != 0)
            return -1;
        reply_buf = p;
    }
    fp_table *t = table_of(ino);
    if (t == NULL) {
        t = &tables[0];
        for (size_t i = 0; i < FP_READ_SLOTS && t->ino != 0; i++)
            if (tables[i].ino == 0 || tables[i].age < t->age)
                t = &tables[i];
        quiesce(t);             /* the slot's count fences another file's reads */
    }
    /* A sequential reader moving on to its next window keeps its place, and
     * its reads in the pool stay counted (the jobs carry their own copies):
     * field by field, since inflight is the pool's, changed under its lock. */
    if (t->ino != ino) {
        t->read_to = t->hinted_to = 0;
        t->ino = ino;
        own_close(t);           /* (quiesced above: the slot was another file's) */
    }
    if (t->fd != log_fd && t->own) {
        quiesce(t);
        own_close(t);
    }
    t->fd = log_fd;
    /* Its own open file of the log (a reader moving on keeps it): the pool's
     * and the copying path's reads through it drive the kernel's read-ahead
     * for this reader alone, in large folios, as a process reading its own
     * file gets. The log fd's one read-ahead state, shared by every reader,
     * saw no sequential stream, and WILLNEED hints read 4 KiB pages (disk
     * requests of at most ~1 MiB) with the page allocation on this thread. */
    if (!t->own) {
        char path[40];
        snprintf(path, sizeof path, "/proc/self/fd/%d", log_fd);
        int own = open(path, O_RDONLY | O_CLOEXEC);
        if (own >= 0)
            t->own = own + 1;   /* else the hints, through the log fd */
    }
    map_log(log_fd);
    t->ext = (const ckptfs_rx_extent *)ext;
    t->n = n;
    t->crcs = (const uint8_t *)crcs;
    t->n_crcs = n_crcs;
    t->start = start;
    t->end = end;
    t->age = ++table_clock;
    t->active = 1;
    t->next_at = UINT64_MAX;
    t->next_asked = 0;
    t->end_is_eof = 0;
    return 0;
}

int ckptfs_fuse_read_ahead_fd(void)
{
    if (ahead_fd < 0)
        ahead_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    return ahead_fd;
}

void ckptfs_fuse_read_marks(uint64_t ino, uint64_t next_at, int end_is_eof)
{
    fp_table *t = table_of(ino);
    if (t != NULL && ino != 0 && t->active) {
        t->next_at = ahead_fd >= 0 ? next_at : UINT64_MAX;
        t->next_asked = 0;
        t->end_is_eof = end_is_eof != 0;
    }
}

size_t ckptfs_fuse_read_wanted(uint64_t *inos, uint64_t *read_to, size_t n)
{
    uint64_t drained;
    if (ahead_fd >= 0 && read(ahead_fd, &drained, sizeof drained) < 0)
        drained = 0;            /* EAGAIN: nothing was asked since the last call */
    size_t k = 0;
    for (size_t i = 0; i < FP_READ_SLOTS && k < n; i++) {
        fp_table *t = &tables[i];
        if (t->ino != 0 && t->active && t->next_asked == 1) {
            t->next_asked = 2;
            inos[k] = t->ino;
            read_to[k] = t->read_to;
            k++;
        }
    }
    return k;
}

void ckptfs_fuse_read_retire(uint64_t ino)
{
    fp_table *t = table_of(ino);
    if (t != NULL && ino != 0) {
        t->active = 0;
        t->next_at = UINT64_MAX;
        t->end_is_eof = 0;
        t->ext = NULL;
        t->crcs = NULL;
        t->n = t->n_crcs = 0;
    }
}

void ckptfs_fuse_read_forget(uint64_t ino)
{
    fp_table *t = table_of(ino);
    if (t != NULL && ino != 0) {
        quiesce(t);             /* then inflight is 0 and no job can raise it */
        own_close(t);
        memset(t, 0, sizeof *t);
    }
}

int ckptfs_fuse_init_replied(void)
{
    return __atomic_load_n(&init_replied, __ATOMIC_ACQUIRE);
}

void ckptfs_fuse_counters(uint64_t *out, size_t n)
{
    uint64_t all[FP_COUNTERS + 4 + FP_WCOUNTERS + FP_MCOUNTERS];
    for (size_t i = 0; i < FP_COUNTERS; i++)
        all[i] = __atomic_load_n(&counters[i], __ATOMIC_RELAXED);
    uint64_t pool_reads, pool_bytes, handed_back, waits;
    rp_counters(&pool_reads, &pool_bytes, &handed_back, &waits);
    all[FP_FAST_READS] += pool_reads;
    all[FP_FAST_READ_BYTES] += pool_bytes;
    all[FP_READS_PASSED] += handed_back;
    all[FP_COUNTERS] = pool_reads;
    all[FP_COUNTERS + 1] = pool_bytes;
    all[FP_COUNTERS + 2] = handed_back;
    all[FP_COUNTERS + 3] = waits;
    for (size_t i = 0; i < FP_WCOUNTERS; i++)
        all[FP_COUNTERS + 4 + i] = __atomic_load_n(&wcounters[i], __ATOMIC_RELAXED);
    for (size_t i = 0; i < FP_MCOUNTERS; i++)
        all[FP_COUNTERS + 4 + FP_WCOUNTERS + i] = __atomic_load_n(&mcounters[i],
                                                                  __ATOMIC_RELAXED);
    if (n > FP_COUNTERS + 4 + FP_WCOUNTERS + FP_MCOUNTERS)
        n = FP_COUNTERS + 4 + FP_WCOUNTERS + FP_MCOUNTERS;
    memcpy(out, all, n * sizeof *out);
}

int ckptfs_fuse_handback_fd(void)
{
    return rp_handback_fd();
}

size_t ckptfs_fuse_handbacks(ckptfs_fuse_handback *out, size_t n)
{
    rp_handback got[64];
    size_t k = rp_handbacks(got, n < 64 ? n : 64);
    for (size_t i = 0; i < k; i++)
        out[i] = (ckptfs_fuse_handback){.unique = got[i].unique, .nodeid = got[i].nodeid,
                                        .fh = got[i].fh, .offset = got[i].offset,
                                        .size = got[i].size, .kind = got[i].kind};
    return k;
}

int ckptfs_fuse_reply(uint64_t unique, int error, const uint8_t *data, size_t len)
{
    if (session_fd < 0)
        return -EBADF;
    if (error != 0)
        len = 0;
    struct fuse_out_header out = {
        .len = (uint32_t)(sizeof out + len), .error = error > 0 ? -error : error,
        .unique = unique};
    struct iovec iov[2] = {{.iov_base = &out, .iov_len = sizeof out},
                           {.iov_base = (void *)data, .iov_len = len}};
    ssize_t w = writev(session_fd, iov, len ? 2 : 1);
    /* ENOENT: interrupted meanwhile, nobody waits for it. */
    return w < 0 && errno != ENOENT ? -errno : 0;
}

/* A GETXATTR of security.capability for an inode marked as having none? */
static int answerable(const struct fuse_in_header *in, size_t len)
{
    const size_t at = sizeof *in + sizeof(struct fuse_getxattr_in);
    if (in->opcode != FUSE_GETXATTR || len < at + sizeof CAPS_NAME)
        return 0;
    if (memcmp((const char *)in + at, CAPS_NAME, sizeof CAPS_NAME) != 0)
        return 0;               /* compares the terminating NUL too */
    return in->nodeid != 0 && caps_absent[slot_of(in->nodeid)] == in->nodeid;
}

/* A GETATTR of an inode whose attributes the daemon left: answered with
 * them (1), once; 0 for the daemon; -1 the session ended. */
static int answer_getattr(int fd, const struct fuse_in_header *in, size_t len)
{
    if (n_attrs_left == 0 || in->opcode != FUSE_GETATTR
            || len < sizeof *in + sizeof(struct fuse_getattr_in) || in->nodeid == 0)
        return 0;
    fp_attr *a = attr_slot(in->nodeid);
    if (a->ino != in->nodeid)
        return 0;
    struct fuse_out_header out = {
        .len = sizeof out + sizeof a->out, .error = 0, .unique = in->unique};
    struct iovec iov[2] = {{.iov_base = &out, .iov_len = sizeof out},
                           {.iov_base = &a->out, .iov_len = sizeof a->out}};
    ssize_t w = writev(fd, iov, 2);
    int e = errno;
    a->ino = 0;
    n_attrs_left--;
    if (w < 0 && e == ENODEV) {
        errno = ENODEV;
        return -1;              /* unmounted: libfuse ends the session */
    }
    /* ENOENT: the request was interrupted meanwhile, nobody waits for it. */
    __atomic_fetch_add(&mcounters[FP_FAST_GETATTR], 1, __ATOMIC_RELAXED);
    return 1;
}

/* A RELEASE of a handle the daemon marked (ckptfs_fuse_release_quiet, no
 * request about its inode since): answered (1), the handle queued for the
 * daemon's release folder; 0 for the daemon; -1 the session ended.  A
 * release that unlocks (flock) or flushes goes to the daemon. */
static int answer_release(int fd, const struct fuse_in_header *in, size_t len)
{
    if (n_quiet == 0 || release_folder == NULL || n_released >= FP_RELEASED_MAX
            || len < sizeof *in + sizeof(struct fuse_release_in))
        return 0;
    const struct fuse_release_in *rel = (const struct fuse_release_in *)(in + 1);
    fp_quiet *q = &quiet[rel->fh % FP_QUIET_SLOTS];
    if (q->ino == 0 || q->fh != rel->fh || q->ino != in->nodeid || rel->release_flags != 0)
        return 0;
    q->ino = 0;
    n_quiet--;
    /* As a RELEASE passed on would (passing_on): no more WRITEs of it here. */
    if (n_windows > 0)
        ckptfs_fuse_write_close(in->nodeid);
    /* Queued first: the handle is gone for the kernel whatever the write says. */
    released[n_released++] = rel->fh;
    struct fuse_out_header out = {.len = sizeof out, .error = 0, .unique = in->unique};
    ssize_t w = write(fd, &out, sizeof out);
    if (w < 0 && errno == ENODEV)
        return -1;              /* unmounted: libfuse ends the session */
    /* ENOENT: the request was interrupted meanwhile, nobody waits for it. */
    __atomic_fetch_add(&mcounters[FP_FAST_RELEASE], 1, __ATOMIC_RELAXED);
    return 1;
}

static void count(const struct fuse_in_header *in, size_t len)
{
    bump(in->opcode < FP_OPCODES ? in->opcode : FP_OTHER_OPCODE, 1);
    if (in->opcode == FUSE_WRITE && len >= sizeof *in + sizeof(struct fuse_write_in))
        bump(FP_WRITE_BYTES, ((const struct fuse_write_in *)(in + 1))->size);
    else if (in->opcode == FUSE_INIT && !init_seen) {
        init_unique = in->unique;
        init_seen = 1;
        const size_t need = sizeof *in + offsetof(struct fuse_init_in, flags) + sizeof(uint32_t);
        killpriv_offered = len >= need &&
            (((const struct fuse_init_in *)(in + 1))->flags & FUSE_HANDLE_KILLPRIV_V2) != 0;
    }
}

/* The extents of t that overlap [off, end): [*first, *first + return). */
static size_t span_of(const fp_table *t, uint64_t off, uint64_t end, size_t *first)
{
    size_t lo = 0, hi = t->n;           /* first extent ending after off */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (t->ext[mid].file_off + t->ext[mid].length <= off)
            lo = mid + 1;
        else
            hi = mid;
    }
    size_t j = lo;
    while (j < t->n && t->ext[j].file_off < end)
        j++;
    *first = lo;
    return j - lo;
}

/* A sequential reader's next FP_HINT_BYTES of log asked for (chunkread.py's
 * _hint_ahead), so its next READs find them in the page cache. */
static void hint_ahead(fp_table *t, uint64_t off, uint64_t end)
{
    int sequential = off + FP_HINT_SLACK >= t->read_to && off <= t->read_to + FP_HINT_SLACK;
    t->read_to = sequential && t->read_to > end ? t->read_to : end;
    if (sequential && t->read_to > t->next_at && t->next_asked == 0) {
        /* The daemon loads the reader's next table now, before the reader
         * gets there: no READ waits for it (ckptfs_fuse_read_wanted). */
        static const uint64_t one = 1;
        t->next_asked = 1;
        if (write(ahead_fd, &one, sizeof one) < 0)
            t->next_asked = 0;  /* (the counter is full: cannot happen) */
    }
    if (!sequential || t->own || t->hinted_to >= end + FP_HINT_BYTES / 2)
        return;                 /* own file: the kernel reads ahead for it */
    /* From the READ's own bytes when they were not asked for yet (a reader's
     * first READ, or its first after a jump): their disk reads are queued
     * first, not behind the 16 MiB ahead of them. */
    uint64_t from = t->hinted_to > off ? t->hinted_to : off;
    uint64_t to = end + FP_HINT_BYTES < t->end ? end + FP_HINT_BYTES : t->end;
    t->hinted_to = to;
    if (to > from)
        hint_extents(t->fd, t->ext, t->n, from, to - from);
}

/* Queue a READ of extents [first, first + count) of t to the read pool, with
 * copies of those extents and their chunks' CRCs: 1 queued, 0 not (too many
 * extents or CRCs for a job, a CRC index outside the table, the pool's
 * queue full). */
static int submit(int fd, const struct fuse_in_header *in, const struct fuse_read_in *rd,
                  uint32_t size, fp_table *t, size_t first, size_t count)
{
    static rp_job job;          /* trio thread only; 10 KiB, so not on its stack */
    if (count > RP_EXT_MAX)
        return 0;
    size_t n_crcs = 0;
    for (size_t i = 0; i < count; i++) {
        ckptfs_rx_extent e = t->ext[first + i];
        uint64_t blocks = e.chunk_len / FP_BLOCK_BYTES + (e.chunk_len % FP_BLOCK_BYTES != 0);
        if (e.crc_at > t->n_crcs || blocks > t->n_crcs - e.crc_at
                || blocks > RP_CRC_MAX - n_crcs)
            return 0;
        memcpy(job.crcs + 4 * n_crcs, t->crcs + 4 * e.crc_at, (size_t)(4 * blocks));
        e.crc_at = n_crcs;
        n_crcs += (size_t)blocks;
        job.ext[i] = e;
    }
    job.fuse_fd = fd;
    job.unique = in->unique;
    job.nodeid = in->nodeid;
    job.fh = rd->fh;
    job.offset = rd->offset;
    job.size = size;
    job.log_fd = reader_fd(t);
    job.n = count;
    job.n_crcs = n_crcs;
    job.inflight = &t->inflight;
    return rp_submit(&job);
}

static uint32_t le32_at(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Log bytes [at, at + len) of the mapping, its pages whole. */
typedef struct {
    uint64_t at, len;
} fp_span;

/* The whole pages [*p0, *p1) a span lies in. */
static void span_pages(const fp_span *s, uint64_t *p0, uint64_t *p1)
{
    *p0 = s->at & ~(FP_PAGE - 1);
    *p1 = (s->at + s->len + FP_PAGE - 1) & ~(FP_PAGE - 1);
}

/* A fault on the mapping (MADV_POPULATE_READ's, a check's, writev's) maps
 * every page of the large folio it hits, and the pages around it (the
 * kernel's fault-around): pages outside the READ's spans, which stayed
 * mapped when the drop covered only the spans (RSS: ~100 KiB per mapped
 * READ, 107 MB after shards8's 2 GiB).  A page cache folio is at most a PMD
 * (2 MiB) and aligned in the file to its size, so the drop covers the
 * spans' 2 MiB-aligned stretches of the file: a page of another READ there
 * is faulted in again by its reader (from the page cache). */
#define FP_FOLIO_MAX (2ull << 20)

static void map_drop(const fp_span *spans, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t a = spans[i].at & ~(FP_FOLIO_MAX - 1);
        uint64_t b = (spans[i].at + spans[i].len + FP_FOLIO_MAX - 1) & ~(FP_FOLIO_MAX - 1);
        if (b > map_len)
            b = map_len;
        /* The next span usually lies in the same stretch: dropped once. */
        while (i + 1 < n && (spans[i + 1].at & ~(FP_FOLIO_MAX - 1)) >= a
                && (spans[i + 1].at & ~(FP_FOLIO_MAX - 1)) < b) {
            uint64_t e = spans[i + 1].at + spans[i + 1].len;
            e = (e + FP_FOLIO_MAX - 1) & ~(FP_FOLIO_MAX - 1);
            b = e > b ? (e < map_len ? e : map_len) : b;
            i++;
        }
        madvise((void *)(map_base + a), (size_t)(b - a), MADV_DONTNEED);
    }
}

/* Answer a READ of file bytes [off, off + size), extents [first, first +
 * count) of t, from the log's mapping: every 64 KiB block a byte comes
 * from checked there, then the reply written from there.  1 answered, 0
 * not here (a hole, too many extents, past the mapping, a failed check or
 * writev: the copying path reads it again and reports what is wrong), 2 a
 * page is not in the page cache (for the pool), -1 the session ended (errno
 * ENODEV).  Trio thread, the GIL released.  The pages are in the page
 * cache when checked: a page reclaimed between the check and its use is a
 * blocking read here (rare), and only an I/O error on that read would be
 * a SIGBUS. */
static int map_answer(int fd, const struct fuse_in_header *in, const fp_table *t,
                      size_t first, size_t count, uint64_t off, uint64_t size)
{
    static struct iovec iov[FP_MAP_PIECES + 1];
    static fp_span spans[FP_MAP_PIECES];
    static struct {
        const ckptfs_rx_extent *e;
        uint64_t bs, be;
    } checks[FP_MAP_PIECES];
    static unsigned char vec[256];
    const uint64_t B = FP_BLOCK_BYTES, end = off + size;
    uint64_t filled = off, prev_end = 0;
    size_t n_iov = 1, n_spans = 0, n_checks = 0;

    if (count == 0 || count > FP_MAP_PIECES)
        return 0;
    /* What is read from the mapping counts only if no log fault came
     * between here and the end of the checks (ckptfs_logfault.h). */
    uint64_t gen0 = log_faults->gen();
    if (!log_faults->clean(map_slot, gen0)) {
        log_faults->repair(map_slot, map_fd, 0);
        return 0;               /* this one copied: the copying path reports */
    }
    for (size_t i = first; i < first + count; i++) {
        const ckptfs_rx_extent *e = &t->ext[i];
        uint64_t nblocks = e->chunk_len / B + (e->chunk_len % B != 0);
        if (e->length == 0 || e->file_off < prev_end || e->length > UINT64_MAX - e->file_off
                || e->chunk_off > e->chunk_len || e->length > e->chunk_len - e->chunk_off
                || e->crc_at > t->n_crcs || nblocks > t->n_crcs - e->crc_at
                || e->log_off > map_len || e->chunk_len > map_len - e->log_off)
            return 0;
        prev_end = e->file_off + e->length;
        uint64_t a = e->file_off > off ? e->file_off : off;
        uint64_t b = prev_end < end ? prev_end : end;
        if (a >= b)
            continue;
        if (a != filled)
            return 0;           /* a hole: the copying path writes its zeros */
        filled = b;
        uint64_t ca = e->chunk_off + (a - e->file_off), cb = ca + (b - a);
        uint64_t bs = ca - ca % B, be = cb % B ? cb - cb % B + B : cb;
        if (be > e->chunk_len)
            be = e->chunk_len;
        checks[n_checks].e = e;
        checks[n_checks].bs = bs;
        checks[n_checks++].be = be;
        const uint8_t *src = map_base + e->log_off + ca;
        struct iovec *last = &iov[n_iov - 1];
        if (n_iov > 1 && (const uint8_t *)last->iov_base + last->iov_len == src)
            last->iov_len += (size_t)(b - a);
        else
            iov[n_iov++] = (struct iovec){.iov_base = (void *)src, .iov_len = (size_t)(b - a)};
        uint64_t s0 = e->log_off + bs, s1 = e->log_off + be;
        fp_span *sp = n_spans ? &spans[n_spans - 1] : NULL;
        if (sp != NULL && s0 >= sp->at && s0 <= sp->at + sp->len + FP_PAGE) {
            if (s1 > sp->at + sp->len)
                sp->len = s1 - sp->at;
        } else {
            spans[n_spans++] = (fp_span){.at = s0, .len = s1 - s0};
        }
    }
    if (filled != end)
        return 0;
    /* Every page in the page cache, else the pool waits for the disk. */
    for (size_t i = 0; i < n_spans; i++) {
        uint64_t p0, p1;
        span_pages(&spans[i], &p0, &p1);
        for (uint64_t q = p0; q < p1; q += sizeof vec * FP_PAGE) {
            size_t pages = (size_t)((p1 - q) / FP_PAGE);
            if (pages > sizeof vec)
                pages = sizeof vec;
            if (mincore((void *)(map_base + q), pages * FP_PAGE, vec) != 0)
                return 0;
            for (size_t j = 0; j < pages; j++)
                if (!(vec[j] & 1))
                    return 2;
        }
    }
    /* Mapped in one call per span rather than a fault per 64 KiB; an error
     * here (a page gone and its read failed) is the pool's to report. */
    for (size_t i = 0; map_populate && i < n_spans; i++) {
        uint64_t p0, p1;
        span_pages(&spans[i], &p0, &p1);
        if (madvise((void *)(map_base + p0), (size_t)(p1 - p0), MADV_POPULATE_READ) != 0) {
            if (errno == EINVAL) {
                map_populate = 0;       /* an older kernel: the check faults them in */
                break;
            }
            map_drop(spans, i + 1);     /* (a part of span i may be mapped) */
            return 2;
        }
    }
    map_pause();
    for (size_t i = 0; i < n_checks; i++) {
        const ckptfs_rx_extent *e = checks[i].e;
        const uint8_t *chunk = map_base + e->log_off;
        for (uint64_t k0 = checks[i].bs; k0 < checks[i].be; k0 += B) {
            uint64_t k1 = k0 + B < e->chunk_len ? k0 + B : e->chunk_len;
            if (crc32c(0, chunk + k0, (size_t)(k1 - k0))
                    != le32_at(t->crcs + 4 * (e->crc_at + k0 / B))) {
                map_drop(spans, n_spans);
                if (!log_faults->clean(map_slot, gen0))
                    log_faults->repair(map_slot, map_fd, 0);    /* zeros checked */
                return 0;
            }
        }
    }
    /* A fault while checking: a zero page may have been checked (and
     * would be written); the copying path reads the file again. */
    if (!log_faults->clean(map_slot, gen0)) {
        map_drop(spans, n_spans);
        log_faults->repair(map_slot, map_fd, 0);
        return 0;
    }
    struct fuse_out_header out = {
        .len = (uint32_t)(sizeof out + size), .error = 0, .unique = in->unique};
    iov[0] = (struct iovec){.iov_base = &out, .iov_len = sizeof out};
    ssize_t w = writev(fd, iov, (int)n_iov);
    int e = errno;
    map_drop(spans, n_spans);
    if (w < 0 && e == ENODEV) {
        errno = ENODEV;
        return -1;              /* unmounted: libfuse ends the session */
    }
    /* Any other failure (EFAULT: a page reclaimed since the check whose read
     * from the disk failed) wrote nothing, and the READ still waits: the
     * copying path reads it again and answers, with EIO if the disk says so. */
    if (w < 0 && e != ENOENT)
        return 0;
    /* ENOENT: the request was interrupted meanwhile, nobody waits for it. */
    __atomic_fetch_add(&mcounters[FP_MAPPED_READS], 1, __ATOMIC_RELAXED);
    return 1;
}

/* Answer a READ from its file's read table: 1 answered, 0 for the daemon
 * (no table, outside it, not in the page cache, a failed check), -1 the
 * session ended. */
static int answer_read(int fd, const struct fuse_in_header *in, size_t len)
{
    if (in->opcode != FUSE_READ || len < sizeof *in + sizeof(struct fuse_read_in))
        return 0;
    const struct fuse_read_in *rd = (const struct fuse_read_in *)(in + 1);
    if (window_of(in->nodeid) != NULL)
        return 0;               /* being written here: the daemon reads it */
    fp_table *t = table_of(in->nodeid);
    if (t == NULL || in->nodeid == 0 || read_extents == NULL || !t->active)
        /* Not a log window: maybe cold chunks already fetched and verified. */
        return ckptfs_cold_answer(fd, in->nodeid, in->unique, rd->offset, rd->size);
    uint64_t off = rd->offset, size = rd->size;
    if (t->end_is_eof && off < t->end && size > t->end - off)
        size = t->end - off;    /* the kernel asks for whole pages: short at the end */
    if (size == 0 || size > FP_READ_MAX || off < t->start || off > t->end
            || size > t->end - off) {
        bump(FP_READS_PASSED, 1);
        return 0;
    }
    size_t first, count = span_of(t, off, off + size, &first);
    hint_ahead(t, off, off + size);
    ckptfs_rx_error err;
    PyThreadState *saved = NULL;
    if (Py_IsInitialized() && PyGILState_Check())
        saved = PyEval_SaveThread();
    int mapped = map_base != NULL && t->fd == map_fd
                 ? map_answer(fd, in, t, first, count, off, size) : 0;
    if (mapped != 0) {
        int e = errno;
        if (saved != NULL)
            PyEval_RestoreThread(saved);
        if (mapped < 0) {
            errno = e;
            return -1;
        }
        if (mapped == 2) {
            if (submit(fd, in, rd, (uint32_t)size, t, first, count))
                return 1;
            bump(FP_READS_PASSED, 1);
            return 0;
        }
        bump(FP_FAST_READS, 1);
        bump(FP_FAST_READ_BYTES, size);
        return 1;
    }
    /* From the page cache only: waiting for the disk would stall every
     * other request; the daemon sends such a read to a worker thread. */
    int rc = read_extents(reader_fd(t), t->ext + first, count, t->crcs, t->n_crcs, FP_BLOCK_BYTES,
                          off, reply_buf, (size_t)size, reply_buf + FP_READ_MAX, 1, &err);
    ssize_t w = 0;
    if (rc == 0) {
        struct fuse_out_header out = {
            .len = (uint32_t)(sizeof out + size), .error = 0, .unique = in->unique};
        struct iovec iov[2] = {{.iov_base = &out, .iov_len = sizeof out},
                               {.iov_base = reply_buf, .iov_len = (size_t)size}};
        w = writev(fd, iov, 2);
    }
    int e = errno;
    if (saved != NULL)
        PyEval_RestoreThread(saved);
    if (rc != 0 && err.kind == 5) {
        /* Not in the page cache: a pool thread waits for the disk, checks
         * and answers it (ckptfs_readpool.h), and this one goes on. */
        if (submit(fd, in, rd, (uint32_t)size, t, first, count))
            return 1;
    }
    if (rc != 0) {
        bump(FP_READS_PASSED, 1);
        return 0;
    }
    if (w < 0 && e == ENODEV) {
        errno = ENODEV;
        return -1;              /* unmounted: libfuse ends the session */
    }
    /* ENOENT: the request was interrupted meanwhile, nobody waits for it. */
    bump(FP_FAST_READS, 1);
    bump(FP_FAST_READ_BYTES, size);
    return 1;
}

/* ------------------------------------------------------------ write windows */

static fp_window *window_of(uint64_t ino)
{
    if (n_windows == 0 || ino == 0)
        return NULL;
    for (size_t i = 0; i < FP_WRITE_SLOTS; i++)
        if (windows[i].ino == ino)
            return &windows[i];
    return NULL;
}

int ckptfs_fuse_write_window(uint64_t ino, int log_fd, uint64_t file_off, uint64_t log_off,
                             uint64_t log_end)
{
    if (!hooked || ino == 0 || log_fd < 0 || log_end < log_off)
        return -1;
    fp_window *w = window_of(ino);
    for (size_t i = 0; w == NULL && i < FP_WRITE_SLOTS; i++)
        if (windows[i].ino == 0) {
            w = &windows[i];
            n_windows++;
        }
    if (w == NULL)
        return -1;
    *w = (fp_window){.ino = ino, .fd = log_fd, .file_off = file_off, .log_off = log_off,
                     .log_end = log_end};
    return 0;
}

int ckptfs_fuse_rewrite_window(uint64_t ino, int log_fd, uint64_t stream_at, int has_stream,
                               uint64_t log_off, uint64_t log_end)
{
    if (ckptfs_fuse_write_window(ino, log_fd, stream_at, log_off, log_end) != 0)
        return -1;
    window_of(ino)->kind = has_stream ? FP_WIN_BESIDE : FP_WIN_BELOW;
    return 0;
}

void ckptfs_fuse_write_close(uint64_t ino)
{
    fp_window *w = window_of(ino);
    if (w != NULL) {
        memset(w, 0, sizeof *w);
        n_windows--;
    }
}

static void close_all_windows(void)
{
    memset(windows, 0, sizeof windows);
    n_windows = 0;
}

size_t ckptfs_fuse_write_take(ckptfs_fuse_wextent *out, size_t n)
{
    return take_rows(out, pending, &n_pending, n, sizeof *pending);
}

void ckptfs_fuse_write_folder(uintptr_t fn)
{
    folder = (void (*)(void))fn;
}

/* Requests that can change no file but their own nodeid's (or none): any
 * other one passed on closes every window (an unlink or rename names the
 * file by its parent, a copy_file_range has a second inode, ...). */
static int touches_only_nodeid(uint32_t opcode)
{
    switch (opcode) {
    case FUSE_LOOKUP: case FUSE_GETATTR: case FUSE_SETATTR: case FUSE_READLINK:
    case FUSE_SYMLINK: case FUSE_MKDIR: case FUSE_OPEN: case FUSE_READ: case FUSE_WRITE:
    case FUSE_STATFS: case FUSE_RELEASE: case FUSE_FSYNC: case FUSE_SETXATTR:
    case FUSE_GETXATTR: case FUSE_LISTXATTR: case FUSE_REMOVEXATTR: case FUSE_FLUSH:
    case FUSE_OPENDIR: case FUSE_READDIR: case FUSE_RELEASEDIR: case FUSE_FSYNCDIR:
    case FUSE_GETLK: case FUSE_SETLK: case FUSE_SETLKW: case FUSE_ACCESS:
    case FUSE_FALLOCATE: case FUSE_READDIRPLUS: case FUSE_LSEEK: case FUSE_POLL:
        return 1;
    default:
        return 0;
    }
}

/* A SETATTR of times only (no size, mode, owner; no suid/sgid to drop)?
 * The kernel sends one whenever it writes back the inode of a file written
 * through the page cache (fuse_flush_times: mtime, ctime, the handle): ~60
 * per 2 GiB streamed.  It changes no byte and no size: the daemon records
 * the times (after the WRITEs answered before it are folded: fp_read folds
 * first, and the handler does not yield), so the stream's window may stay
 * open. */
static int times_only(const struct fuse_in_header *in)
{
    const uint32_t times = FATTR_ATIME | FATTR_MTIME | FATTR_CTIME | FATTR_ATIME_NOW
                           | FATTR_MTIME_NOW | FATTR_FH | FATTR_LOCKOWNER;
    if (in->opcode != FUSE_SETATTR || in->len < sizeof *in + sizeof(struct fuse_setattr_in))
        return 0;
    return (((const struct fuse_setattr_in *)(in + 1))->valid & ~times) == 0;
}

/* A request goes to the daemon: no WRITE of the file(s) it may touch is
 * answered here until the daemon opens their windows again. */
static void passing_on(const struct fuse_in_header *in)
{
    if (killpriv_on)
        note_kill(in);
    if (n_windows == 0)
        return;
    if (!touches_only_nodeid(in->opcode)) {
        close_all_windows();
        return;
    }
    if (times_only(in))
        return;
    fp_window *w = window_of(in->nodeid);
    if (w != NULL) {
        if (in->opcode == FUSE_WRITE)
            bump_w(FP_WRITES_PASSED);
        ckptfs_fuse_write_close(in->nodeid);
    }
}

/* n bytes of the pipe into out (they are in it: the pipe holds the request
 * spliced from the FUSE fd); 0, or -1 (errno set). */
static int pipe_take(void *out, size_t n)
{
    size_t done = 0;
    while (done < n) {
        ssize_t k = read(splice_pipe[0], (uint8_t *)out + done, n - done);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            if (k == 0)
                errno = EIO;
            return -1;
        }
        done += (size_t)k;
    }
    return 0;
}

/* size bytes of payload at log_off of fd: from data, or (data NULL) spliced
 * from the pipe.  How many landed, in order from the first. */
static uint64_t log_payload(int fd, const uint8_t *data, uint64_t size, uint64_t log_off)
{
    uint64_t done = 0;
    while (done < size) {
        ssize_t k;
        if (data != NULL) {
            k = pwrite(fd, data + done, (size_t)(size - done), (off_t)(log_off + done));
        } else {
            loff_t at = (loff_t)(log_off + done);
            k = splice(splice_pipe[0], NULL, fd, &at, (size_t)(size - done), SPLICE_F_MOVE);
        }
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            break;
        done += (uint64_t)k;
    }
    return done;
}

/* May w answer a WRITE of size bytes at file offset off (its room aside)? */
static int in_window(const fp_window *w, uint64_t off, uint64_t size)
{
    if (size > UINT64_MAX - off)
        return 0;
    switch (w->kind) {
    case FP_WIN_STREAM:
        return off == w->file_off;
    case FP_WIN_BESIDE:
        return !(off <= w->file_off && w->file_off < off + size);
    case FP_WIN_BELOW:
        return off < w->file_off;
    default:
        return 0;
    }
}

/* Answer a WRITE from its file's write window: 1 answered, 0 for the
 * daemon (no window, not where the window is, does not fit, the pending
 * list full, a kill-suid flag, the log write failed: the daemon writes it
 * again into the same space), -1 the session ended.  len is the request's
 * length.  in_pipe NULL: all of it is in buf.  Else *in_pipe of its bytes
 * (the payload) are still in the pipe, the rest in buf; set to 0 when this
 * returns 0 having taken them (what went into the log read back from it,
 * the rest out of the pipe, into buf after the header). */
static int answer_write(int fd, const struct fuse_in_header *in, size_t len, size_t *in_pipe)
{
    if (in->opcode != FUSE_WRITE || len < sizeof *in + sizeof(struct fuse_write_in))
        return 0;
    const struct fuse_write_in *wr = (const struct fuse_write_in *)(in + 1);
    fp_window *w = window_of(in->nodeid);
    if (w == NULL)
        return 0;
    uint64_t size = wr->size;
    if (size == 0 || len < sizeof *in + sizeof *wr + size || !in_window(w, wr->offset, size)
            || size > w->log_end - w->log_off || n_pending >= FP_PENDING_MAX
            || (wr->write_flags & ~(uint32_t)(FUSE_WRITE_CACHE | FUSE_WRITE_LOCKOWNER)) != 0)
        return 0;
    uint8_t *data = (uint8_t *)(wr + 1);
    uint64_t log_off = w->log_off;
    int spliced = in_pipe != NULL && *in_pipe == size;
    if (in_pipe != NULL && !spliced)
        return 0;
    PyThreadState *saved = NULL;
    if (Py_IsInitialized() && PyGILState_Check())
        saved = PyEval_SaveThread();
    /* Into the log's page cache; what is durable when stays the daemon's
     * (a commit persists the chunks it names). */
    uint64_t done = log_payload(w->fd, spliced ? NULL : data, size, log_off);
    if (spliced && done != size) {
        /* The daemon gets the whole request: what landed read back from
         * the log, the rest out of the pipe. */
        uint64_t back = 0;
        while (back < done) {
            ssize_t k = pread(w->fd, data + back, (size_t)(done - back), (off_t)(log_off + back));
            if (k < 0 && errno == EINTR)
                continue;
            if (k <= 0)
                break;
            back += (uint64_t)k;
        }
        if (back != done || pipe_take(data + done, (size_t)(size - done)) != 0) {
            if (saved != NULL)
                PyEval_RestoreThread(saved);
            errno = EIO;
            return -1;          /* cannot happen: the bytes are in the page cache and the pipe */
        }
        *in_pipe = 0;
    }
    ssize_t sent = 0;
    int e = 0;
    if (done == size) {
        struct fuse_out_header out = {
            .len = sizeof out + sizeof(struct fuse_write_out), .error = 0,
            .unique = in->unique};
        struct fuse_write_out wo = {.size = (uint32_t)size};
        struct iovec iov[2] = {{.iov_base = &out, .iov_len = sizeof out},
                               {.iov_base = &wo, .iov_len = sizeof wo}};
        sent = writev(fd, iov, 2);
        e = errno;
    }
    if (saved != NULL)
        PyEval_RestoreThread(saved);
    if (done != size)
        return 0;               /* the daemon writes it (and reports what fails) */
    /* Recorded whether or not the reply went out: the bytes are in the log
     * and the kernel may send them again; either way the daemon takes them. */
    ckptfs_fuse_wextent *last = n_pending ? &pending[n_pending - 1] : NULL;
    if (last != NULL && last->ino == in->nodeid && last->file_off + last->length == wr->offset
            && last->log_off + last->length == log_off)
        last->length += size;
    else
        pending[n_pending++] = (ckptfs_fuse_wextent){
            .ino = in->nodeid, .file_off = wr->offset, .log_off = log_off, .length = size};
    if (w->kind == FP_WIN_STREAM)
        w->file_off += size;
    w->log_off += size;
    if (sent < 0 && e == ENODEV) {
        errno = ENODEV;
        return -1;              /* unmounted: libfuse ends the session */
    }
    bump_w(FP_FAST_WRITES);
    if (spliced)
        bump_w(FP_WRITES_SPLICED);
    __atomic_fetch_add(&wcounters[FP_FAST_WRITE_BYTES], size, __ATOMIC_RELAXED);
    return 1;
}

/* At the mount: the pipe for splice_pipe.  It must hold any request
 * whole, or the kernel fails it (EIO): a page for the header, one per page
 * of payload (writeback's are the file's own pages, by reference), one more
 * for a payload that does not start on a page.  fs.pipe-max-size (1 MiB
 * by default, 256 pages) is the most a daemon without CAP_SYS_RESOURCE may
 * ask for, so the INIT reply lowers max_write to what the pipe holds
 * (splice_payload_max: 254 pages, 1016 KiB, with 4 KiB pages); splicing
 * starts only once that reply went out. */
static uint32_t splice_payload_max;
static int splice_init_done;

static void splice_prepare(void)
{
    splice_state = -1;
    if (!splice_wanted)
        return;
    int p[2];
    if (pipe2(p, O_NONBLOCK | O_CLOEXEC) != 0)
        return;
    long page = sysconf(_SC_PAGESIZE);
    int got = -1;
    for (long want = 2L << 20; got < 0 && want >= (256L << 10); want /= 2)
        got = fcntl(p[1], F_SETPIPE_SZ, want);
    if (got < 0 || got / page < 4) {
        close(p[0]);
        close(p[1]);
        return;
    }
    splice_pipe[0] = p[0];
    splice_pipe[1] = p[1];
    splice_payload_max = (uint32_t)((got / page - 2) * page);
    splice_state = 1;
}

/* May requests be spliced from the FUSE fd now (see splice_pipe)? */
static int splice_ready(void)
{
    return splice_state > 0 && __atomic_load_n(&splice_init_done, __ATOMIC_ACQUIRE) == 1;
}

/* The next request from the FUSE fd: spliced (1: *n bytes in the pipe) or
 * read into buf (0), or -1 (errno: EAGAIN, nothing waiting). */
static int next_request(int fd, void *buf, size_t buf_len, ssize_t *n)
{
    if (n_windows > 0 && splice_ready()) {
        *n = splice(fd, NULL, splice_pipe[1], NULL, buf_len, SPLICE_F_NONBLOCK);
        return *n < 0 ? -1 : 1;
    }
    *n = read(fd, buf, buf_len);
    return *n < 0 ? -1 : 0;
}

static long elapsed_ns(const struct timespec *since)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - since->tv_sec) * 1000000000L + (now.tv_nsec - since->tv_nsec);
}

/* Wait until fd is readable or FP_LINGER_NS passed; 1 if readable. */
static int linger(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    const struct timespec timeout = {.tv_sec = 0, .tv_nsec = FP_LINGER_NS};
    PyThreadState *saved = NULL;
    if (Py_IsInitialized() && PyGILState_Check())
        saved = PyEval_SaveThread();
    int ready = ppoll(&p, 1, &timeout, NULL);
    if (saved != NULL)
        PyEval_RestoreThread(saved);
    return ready == 1 && (p.revents & POLLIN);
}

static ssize_t fp_read_requests(int fd, void *buf, size_t buf_len)
{
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    /* The last answer was a GETATTR's: no wait for the next request then.
     * The writer asked it from open() and sends its LOOKUP only once it ran
     * again; waiting for that held the event loop (and the commits whose
     * flush had finished) up for nothing. */
    int last_getattr = 0;
    for (unsigned answered = 0;;) {
        if (answered > 0 && elapsed_ns(&start) >= FP_MAX_BURST_NS) {
            /* The event loop's turn (READs answered here take a while). */
            errno = EINTR;
            return -1;
        }
        ssize_t n;
        int spliced = next_request(fd, buf, buf_len, &n);
        if (spliced < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                return -1;
            /* Nothing waiting.  Right after an answer, the writer's next
             * question is due: wait a moment for it rather than a trip
             * through the event loop.  Otherwise (or if it does not come)
             * EINTR: pyfuse3 waits for the fd again. */
            if (answered > 0 && !last_getattr && answered < FP_MAX_BURST
                    && elapsed_ns(&start) < FP_MAX_BURST_NS
                    && (linger_credit > 0 || ++since_probe >= FP_PROBE_EVERY)) {
                since_probe = 0;
                if (linger(fd)) {
                    if (linger_credit < FP_CREDIT_MAX)
                        linger_credit++;
                    continue;
                }
                linger_credit = linger_credit > FP_CREDIT_MISS ? linger_credit - FP_CREDIT_MISS : 0;
            }
            bump(FP_EMPTY_READS, 1);
            errno = EINTR;
            return -1;
        }
        size_t in_pipe = 0;
        if (spliced) {
            /* The header first (a WRITE's with its fuse_write_in): a WRITE
             * answered here leaves its payload in the pipe for the log. */
            size_t head = sizeof(struct fuse_in_header) + sizeof(struct fuse_write_in);
            size_t first = (size_t)n < head ? (size_t)n : head;
            if (pipe_take(buf, first) != 0)
                return -1;
            in_pipe = (size_t)n - first;
        }
        if ((size_t)n < sizeof(struct fuse_in_header))
            return n;           /* libfuse reports the short read */
        const struct fuse_in_header *in = buf;
        count(in, (size_t)n);
        if (n_quiet > 0)
            quiet_touch(in);
        last_getattr = 0;
        if (in->opcode == FUSE_WRITE && answered < FP_MAX_BURST) {
            int r = answer_write(fd, in, (size_t)n, spliced ? &in_pipe : NULL);
            if (r < 0)
                return -1;
            if (r > 0) {
                answered++;
                continue;
            }
        }
        if (in_pipe > 0 && pipe_take((uint8_t *)buf + (n - in_pipe), in_pipe) != 0)
            return -1;
        if (answered >= FP_MAX_BURST || in->opcode == FUSE_WRITE)
            return n;
        if (in->opcode == FUSE_RELEASE) {
            int r = answer_release(fd, in, (size_t)n);
            if (r < 0)
                return -1;
            if (r == 0)
                return n;
            answered++;
            /* No wait after it: the kernel sent it as close() returned, the
             * writer's next request comes once it ran again (as after a
             * GETATTR answered here), and a wait that times out costs the
             * credit that the wait for a WRITE after its GETXATTR needs. */
            last_getattr = 1;
            continue;
        }
        if (in->opcode == FUSE_GETATTR) {
            int r = answer_getattr(fd, in, (size_t)n);
            if (r < 0)
                return -1;
            if (r == 0)
                return n;
            answered++;
            last_getattr = 1;
            continue;
        }
        if (!answerable(in, (size_t)n)) {
            int r = answer_read(fd, in, (size_t)n);
            if (r < 0)
                return -1;
            if (r == 0)
                return n;
            answered++;
            continue;
        }
        struct fuse_out_header out = {
            .len = sizeof out, .error = -ENODATA, .unique = in->unique};
        ssize_t w = write(fd, &out, sizeof out);
        if (w < 0 && errno == ENODEV)
            return -1;          /* unmounted: libfuse ends the session */
        /* ENOENT: the request was interrupted meanwhile, nobody waits for it. */
        answered++;
        bump(FP_FAST_GETXATTR, 1);
    }
}

/* The session's read: requests answered here, then the one for libfuse (or
 * none), the WRITEs answered here folded into the daemon's state first. */
static ssize_t fp_read(int fd, void *buf, size_t buf_len, void *userdata)
{
    (void)userdata;
    /* pyfuse3 calls this with the GIL held.  The burst touches no Python
     * object (keep it so: it runs without the GIL; the answers' own releases
     * find it released and do nothing), so the GIL is let go once for the
     * whole burst, the copy of each request out of the fd included, rather
     * than once per answer: fewer hand-overs to the other threads. */
    PyThreadState *saved = NULL;
    if (Py_IsInitialized() && PyGILState_Check())
        saved = PyEval_SaveThread();
    ssize_t n = fp_read_requests(fd, buf, buf_len);
    int e = errno;
    if (saved != NULL)
        PyEval_RestoreThread(saved);
    if (n >= (ssize_t)sizeof(struct fuse_in_header))
        passing_on((const struct fuse_in_header *)buf);
    if (n_pending > 0 && folder != NULL)
        folder();               /* takes the GIL if this thread does not hold it */
    if (n_released > 0 && release_folder != NULL)
        release_folder();       /* after the WRITEs: their folds first, as they came */
    errno = e;
    return n;
}

/* The INIT reply about to go out: ask for max_background requests in flight
 * (readahead READs, writeback WRITEs) and a congestion threshold at 3/4 of
 * it, as the kernel's defaults (12, 9) are.  libfuse leaves both 0 unless
 * the file system's init sets them, which pyfuse3's does not. */
static void raise_background(struct iovec *iov, int iovcnt)
{
    const size_t need = offsetof(struct fuse_init_out, congestion_threshold)
                        + sizeof(uint16_t);
    const struct fuse_out_header *out = iov[0].iov_base;
    if (max_background == 0 || out->error != 0 || iovcnt < 2 || iov[1].iov_len < need)
        return;
    struct fuse_init_out *arg = iov[1].iov_base;
    if (arg->max_background < max_background) {
        arg->max_background = max_background;
        arg->congestion_threshold = (uint16_t)(max_background * 3 / 4);
    }
}

/* The INIT reply about to go out: no WRITE larger than the splice pipe
 * holds (splice_prepare); splicing may start once it went out.  Without a
 * reply to change (an error, an old kernel's short one), never. */
static void limit_max_write(struct iovec *iov, int iovcnt)
{
    const size_t need = offsetof(struct fuse_init_out, max_write) + sizeof(uint32_t);
    const struct fuse_out_header *out = iov[0].iov_base;
    if (splice_state <= 0 || out->error != 0 || iovcnt < 2 || iov[1].iov_len < need)
        return;
    struct fuse_init_out *arg = iov[1].iov_base;
    if (arg->max_write > splice_payload_max)
        arg->max_write = splice_payload_max;
    splice_init_done = 2;       /* set to 1 once the reply is written */
}

/* The INIT reply about to go out: FUSE_HANDLE_KILLPRIV_V2 when the daemon
 * wants it and the kernel offered it (libfuse 3.14 cannot ask for it).  1 if
 * it was put in. */
static int ask_killpriv_v2(struct iovec *iov, int iovcnt)
{
    const size_t need = offsetof(struct fuse_init_out, flags) + sizeof(uint32_t);
    const struct fuse_out_header *out = iov[0].iov_base;
    if (!killpriv_wanted || !killpriv_offered || out->error != 0 || iovcnt < 2
            || iov[1].iov_len < need)
        return 0;
    ((struct fuse_init_out *)iov[1].iov_base)->flags |= FUSE_HANDLE_KILLPRIV_V2;
    return 1;
}

static ssize_t fp_writev(int fd, struct iovec *iov, int iovcnt, void *userdata)
{
    (void)userdata;
    int killpriv = 0;
    if (init_seen && !init_replied && iovcnt > 0
            && iov[0].iov_len >= sizeof(struct fuse_out_header)
            && ((const struct fuse_out_header *)iov[0].iov_base)->unique == init_unique) {
        raise_background(iov, iovcnt);
        limit_max_write(iov, iovcnt);
        killpriv = ask_killpriv_v2(iov, iovcnt);
    }
    ssize_t res = writev(fd, iov, iovcnt);
    if (res >= 0 && init_seen && !init_replied && iovcnt > 0
            && iov[0].iov_len >= sizeof(struct fuse_out_header)) {
        const struct fuse_out_header *out = iov[0].iov_base;
        if (out->unique == init_unique) {
            if (splice_init_done == 2)
                __atomic_store_n(&splice_init_done, 1, __ATOMIC_RELEASE);
            if (killpriv)
                __atomic_store_n(&killpriv_on, 1, __ATOMIC_RELEASE);
            __atomic_store_n(&init_replied, 1, __ATOMIC_RELEASE);
        }
    }
    return res;
}

static const struct fuse_custom_io fp_io = {
    .writev = fp_writev,
    .read = fp_read,
};

/* Stands in for libfuse's (this module is loaded with RTLD_GLOBAL before
 * pyfuse3, so pyfuse3's call binds here): mount as libfuse does, then put the
 * fast path between the fd and the session. */
int fuse_session_mount(struct fuse_session *se, const char *mountpoint)
{
    int (*real)(struct fuse_session *, const char *) =
        (int (*)(struct fuse_session *, const char *))dlsym(RTLD_NEXT, "fuse_session_mount");
    if (real == NULL)
        return -1;
    int res = real(se, mountpoint);
    if (res != 0 || !wanted)
        return res;
    int fd = fuse_session_fd(se);
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
        return 0;               /* mounted; served the usual way */
    if (fuse_session_custom_io(se, &fp_io, fd) != 0) {
        fcntl(fd, F_SETFL, flags);
        return 0;
    }
    session_fd = fd;
    splice_prepare();
    __atomic_store_n(&hooked, 1, __ATOMIC_RELAXED);
    return 0;
}

/* Stand in for libfuse's too (pyfuse3.close calls them, in this order):
 * the read pool's threads finish and are joined before the FUSE fd closes,
 * and before the daemon closes the log and frees the tables' memory. */
void fuse_session_unmount(struct fuse_session *se)
{
    void (*real)(struct fuse_session *) =
        (void (*)(struct fuse_session *))dlsym(RTLD_NEXT, "fuse_session_unmount");
    rp_stop();
    if (real != NULL)
        real(se);
}

void fuse_session_destroy(struct fuse_session *se)
{
    void (*real)(struct fuse_session *) =
        (void (*)(struct fuse_session *))dlsym(RTLD_NEXT, "fuse_session_destroy");
    rp_stop();
    session_fd = -1;
    if (splice_state > 0) {
        close(splice_pipe[0]);
        close(splice_pipe[1]);
        splice_pipe[0] = splice_pipe[1] = -1;
    }
    splice_state = 0;
    splice_init_done = 0;
    killpriv_on = killpriv_offered = 0;
    n_kill = 0;
    kill_overflow = 0;
    if (real != NULL)
        real(se);
}
