/* Log faults: a page of a shared mapping of the log that cannot be read
 * when user space touches it (the log file cut short underneath the daemon,
 * a page reclaimed after MADV_POPULATE_READ whose read from the disk then
 * failed) raises SIGBUS, and SIGBUS kills the process: every user of the
 * mount would get ENOTCONN where the copying path answers one READ with EIO.
 *
 * The readers of the mappings are code we cannot wrap in sigsetjmp (BLAKE3,
 * the gear scan, CRC-32C, on several threads at once), so the handler lets
 * the instruction finish instead: for an address inside a registered
 * mapping it maps an anonymous zero page over the faulting page and counts
 * the fault.  Every reader reads the generation before it touches a mapping
 * and asks `clean` after: if a fault (or a repair) happened meanwhile, or a
 * page of its mapping is still zero, what it read is thrown away and it
 * reads the bytes again by copying (pread: EIO, or the right bytes).  So a
 * zero page's bytes are never served or hashed.  A poisoned page stays
 * counted in its mapping's `outstanding` until `repair` maps the file back
 * over it, and a repair bumps the generation too: a reader that touched the
 * zero page before the repair sees either the count or the new generation.
 *
 * A SIGBUS anywhere else (the index's LMDB map, a user-sent signal) goes to
 * the handler that was there before, or kills the process as before. */

#define _GNU_SOURCE
#include "ckptfs_native.h"
#include "ckptfs_logfault.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define LF_SLOTS 32                 /* mappings guarded at once */
#define LF_PAGES 1024               /* poisoned pages remembered for repair */
#define LF_CLAIMED 1                /* a poisoned[] entry being written or repaired */

typedef struct {
    uintptr_t base;                 /* 0: a free slot */
    size_t len;                     /* set last, cleared first: the handler's test */
    int prot;
    uint64_t outstanding;           /* pages of it mapped to zero, not repaired yet */
    int lost;                       /* a poisoned page that could not be remembered */
} lf_map;

static lf_map maps[LF_SLOTS];
static struct {
    uintptr_t page;                 /* 0 free, LF_CLAIMED busy, else the page */
    int slot;
} poisoned[LF_PAGES];
static uint64_t generation;         /* bumped by every fault and every repair */
static uint64_t faults;             /* every fault handled, for the metrics */
static struct sigaction previous;
static int installed;
static long page_bytes;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void pass_on(int sig, siginfo_t *si, void *ctx)
{
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction != NULL) {
            previous.sa_sigaction(sig, si, ctx);
            return;
        }
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    /* The default: a fault runs its instruction again and dies of it; a
     * signal someone sent is delivered again once this handler returns. */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGBUS, &dfl, NULL);
    if (si == NULL || si->si_code <= 0)
        raise(sig);
}

/* Async-signal-safe: atomics and one raw mmap; errno kept. */
static void on_sigbus(int sig, siginfo_t *si, void *ctx)
{
    int saved_errno = errno;
    uintptr_t at = si != NULL && si->si_code > 0 ? (uintptr_t)si->si_addr : 0;
    for (int s = 0; at != 0 && s < LF_SLOTS; s++) {
        size_t len = __atomic_load_n(&maps[s].len, __ATOMIC_ACQUIRE);
        uintptr_t base = __atomic_load_n(&maps[s].base, __ATOMIC_RELAXED);
        if (len == 0 || at < base || at - base >= len)
            continue;
        uintptr_t page = at & ~(uintptr_t)(page_bytes - 1);
        /* Counted before the zero page is there: a reader that finds it
         * sees the count; recorded only after: a repair never maps the
         * file back before the zero page lands (it would stay, uncounted). */
        __atomic_fetch_add(&maps[s].outstanding, 1, __ATOMIC_SEQ_CST);
        __atomic_fetch_add(&generation, 1, __ATOMIC_SEQ_CST);
        __atomic_fetch_add(&faults, 1, __ATOMIC_RELAXED);
        long r = syscall(SYS_mmap, (void *)page, (size_t)page_bytes, PROT_READ,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0L);
        errno = saved_errno;
        if (r == -1)
            break;              /* could not continue: die as before */
        int kept = 0;
        for (int i = 0; i < LF_PAGES && !kept; i++) {
            uintptr_t free_slot = 0;
            if (__atomic_compare_exchange_n(&poisoned[i].page, &free_slot, LF_CLAIMED, 0,
                                            __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
                poisoned[i].slot = s;
                __atomic_store_n(&poisoned[i].page, page, __ATOMIC_RELEASE);
                kept = 1;
            }
        }
        if (!kept)
            __atomic_store_n(&maps[s].lost, 1, __ATOMIC_SEQ_CST);   /* never clean again */
        return;
    }
    errno = saved_errno;
    pass_on(sig, si, ctx);
}

static int install(void)
{
    if (installed)
        return 0;
    page_bytes = sysconf(_SC_PAGESIZE);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous) != 0)
        return -1;
    installed = 1;
    return 0;
}

int ckptfs_logfault_guard(uintptr_t base, size_t len, int prot)
{
    int slot = -1;
    pthread_mutex_lock(&lock);
    if (base != 0 && len != 0 && install() == 0) {
        for (int s = 0; s < LF_SLOTS; s++) {
            if (maps[s].base == 0) {
                maps[s].base = base;
                maps[s].prot = prot;
                __atomic_store_n(&maps[s].outstanding, 0, __ATOMIC_SEQ_CST);
                __atomic_store_n(&maps[s].lost, 0, __ATOMIC_SEQ_CST);
                __atomic_store_n(&maps[s].len, len, __ATOMIC_RELEASE);
                slot = s;
                break;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return slot;
}

void ckptfs_logfault_unguard(int slot)
{
    if (slot < 0 || slot >= LF_SLOTS)
        return;
    pthread_mutex_lock(&lock);
    __atomic_store_n(&maps[slot].len, 0, __ATOMIC_RELEASE);
    for (int i = 0; i < LF_PAGES; i++) {
        uintptr_t page = __atomic_load_n(&poisoned[i].page, __ATOMIC_ACQUIRE);
        if (page > LF_CLAIMED && poisoned[i].slot == slot)
            __atomic_compare_exchange_n(&poisoned[i].page, &page, 0, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED);
    }
    maps[slot].base = 0;
    pthread_mutex_unlock(&lock);
}

uint64_t ckptfs_logfault_gen(void)
{
    return __atomic_load_n(&generation, __ATOMIC_SEQ_CST);
}

int ckptfs_logfault_clean(int slot, uint64_t gen0)
{
    if (slot < 0 || slot >= LF_SLOTS)
        return 0;
    return __atomic_load_n(&generation, __ATOMIC_SEQ_CST) == gen0
           && __atomic_load_n(&maps[slot].outstanding, __ATOMIC_SEQ_CST) == 0
           && !__atomic_load_n(&maps[slot].lost, __ATOMIC_SEQ_CST);
}

int ckptfs_logfault_repair(int slot, int fd, uint64_t file_off)
{
    if (slot < 0 || slot >= LF_SLOTS)
        return -EINVAL;
    uintptr_t base = maps[slot].base;
    int repaired = 0;
    for (int i = 0; i < LF_PAGES; i++) {
        uintptr_t page = __atomic_load_n(&poisoned[i].page, __ATOMIC_ACQUIRE);
        if (page <= LF_CLAIMED || poisoned[i].slot != slot)
            continue;
        if (!__atomic_compare_exchange_n(&poisoned[i].page, &page, LF_CLAIMED, 0,
                                         __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            continue;           /* another thread repairs it */
        void *p = mmap((void *)page, (size_t)page_bytes, maps[slot].prot, MAP_SHARED | MAP_FIXED,
                       fd, (off_t)(file_off + (page - base)));
        if (p == MAP_FAILED) {
            int e = errno;
            __atomic_store_n(&poisoned[i].page, page, __ATOMIC_RELEASE);
            return -e;
        }
        /* The file's page again (a page past a cut end faults again). */
        __atomic_fetch_add(&generation, 1, __ATOMIC_SEQ_CST);
        __atomic_fetch_sub(&maps[slot].outstanding, 1, __ATOMIC_SEQ_CST);
        __atomic_store_n(&poisoned[i].page, 0, __ATOMIC_RELEASE);
        repaired++;
    }
    return repaired;
}

uint64_t ckptfs_logfault_count(void)
{
    return __atomic_load_n(&faults, __ATOMIC_RELAXED);
}

static const ckptfs_logfault_api api = {
    .guard = ckptfs_logfault_guard,
    .unguard = ckptfs_logfault_unguard,
    .gen = ckptfs_logfault_gen,
    .clean = ckptfs_logfault_clean,
    .repair = ckptfs_logfault_repair,
};

uintptr_t ckptfs_logfault_api_address(void)
{
    return (uintptr_t)&api;
}
