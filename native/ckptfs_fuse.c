/* The FUSE channel fast path: see ckptfs_fuse.h for what and why. */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 35

#include <Python.h>     /* first, as Python asks: only to release the GIL while waiting */

#include "ckptfs_fuse.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <fuse_lowlevel.h>
#include <linux/fuse.h>

#define FP_OPCODES 64
#define FP_COUNTERS (FP_OPCODES + 4)
#define FP_OTHER_OPCODE FP_OPCODES
#define FP_WRITE_BYTES (FP_OPCODES + 1)
#define FP_FAST_GETXATTR (FP_OPCODES + 2)
#define FP_EMPTY_READS (FP_OPCODES + 3)

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

static uint64_t counters[FP_COUNTERS];
static uint64_t caps_absent[FP_SLOTS];
static int wanted;
static int hooked;
static int init_seen;
static uint64_t init_unique;
static int init_replied;
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

static size_t slot_of(uint64_t ino)
{
    /* Fibonacci hashing: consecutive inode numbers spread over the table. */
    return (size_t)((ino * 0x9E3779B97F4A7C15ull) >> 48) & (FP_SLOTS - 1);
}

void ckptfs_fuse_want(int on)
{
    wanted = on != 0;
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

int ckptfs_fuse_init_replied(void)
{
    return __atomic_load_n(&init_replied, __ATOMIC_ACQUIRE);
}

void ckptfs_fuse_counters(uint64_t *out, size_t n)
{
    if (n > FP_COUNTERS)
        n = FP_COUNTERS;
    for (size_t i = 0; i < n; i++)
        out[i] = __atomic_load_n(&counters[i], __ATOMIC_RELAXED);
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

static void count(const struct fuse_in_header *in, size_t len)
{
    bump(in->opcode < FP_OPCODES ? in->opcode : FP_OTHER_OPCODE, 1);
    if (in->opcode == FUSE_WRITE && len >= sizeof *in + sizeof(struct fuse_write_in))
        bump(FP_WRITE_BYTES, ((const struct fuse_write_in *)(in + 1))->size);
    else if (in->opcode == FUSE_INIT && !init_seen) {
        init_unique = in->unique;
        init_seen = 1;
    }
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

static ssize_t fp_read(int fd, void *buf, size_t buf_len, void *userdata)
{
    (void)userdata;
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (unsigned answered = 0;;) {
        ssize_t n = read(fd, buf, buf_len);
        if (n < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                return -1;
            /* Nothing waiting.  Right after an answer, the writer's next
             * question is due: wait a moment for it rather than a trip
             * through the event loop.  Otherwise (or if it does not come)
             * EINTR: pyfuse3 waits for the fd again. */
            if (answered > 0 && answered < FP_MAX_BURST && elapsed_ns(&start) < FP_MAX_BURST_NS
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
        if ((size_t)n < sizeof(struct fuse_in_header))
            return n;           /* libfuse reports the short read */
        const struct fuse_in_header *in = buf;
        count(in, (size_t)n);
        if (answered >= FP_MAX_BURST || !answerable(in, (size_t)n))
            return n;
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

static ssize_t fp_writev(int fd, struct iovec *iov, int iovcnt, void *userdata)
{
    (void)userdata;
    ssize_t res = writev(fd, iov, iovcnt);
    if (res >= 0 && init_seen && !init_replied && iovcnt > 0
            && iov[0].iov_len >= sizeof(struct fuse_out_header)) {
        const struct fuse_out_header *out = iov[0].iov_base;
        if (out->unique == init_unique)
            __atomic_store_n(&init_replied, 1, __ATOMIC_RELEASE);
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
    __atomic_store_n(&hooked, 1, __ATOMIC_RELAXED);
    return 0;
}
