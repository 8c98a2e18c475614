/* Opening a path strictly beneath a directory fd, never through a symlink:
 * how ckptfs reaches the pre-existing files below SOURCE, a tree that other
 * users may change under it (see ckptfs_native.h). */
#define _GNU_SOURCE /* O_PATH, syscall() */

#include "ckptfs_native.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__has_include)
#if __has_include(<linux/openat2.h>)
#include <linux/openat2.h>
#endif
#endif

#ifndef RESOLVE_BENEATH
/* The kernel ABI (include/uapi/linux/openat2.h), for older headers. */
struct open_how {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};
#define RESOLVE_NO_MAGICLINKS 0x02
#define RESOLVE_NO_SYMLINKS 0x04
#define RESOLVE_BENEATH 0x08
#endif

#ifndef SYS_openat2
#define SYS_openat2 437 /* the same number on every architecture */
#endif

#define NAME_MAX_BYTES 255

/* Set once openat2 answered ENOSYS (a kernel before 5.6): walk from then on. */
static volatile int no_openat2;

/* A relative path of plain names: no leading '/', no empty, "." or ".."
 * component, no trailing '/'. Anything else is refused before any lookup. */
static int plain_relative(const char *path)
{
    const char *p = path;
    if (*p == '\0' || *p == '/')
        return 0;
    while (*p) {
        const char *end = strchr(p, '/');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == 0 || len > NAME_MAX_BYTES || (len == 1 && p[0] == '.') ||
            (len == 2 && p[0] == '.' && p[1] == '.'))
            return 0;
        if (!end)
            break;
        p = end + 1;
        if (*p == '\0')
            return 0; /* trailing slash */
    }
    return 1;
}

static int open_walk(int dirfd, const char *path, int flags)
{
    char name[NAME_MAX_BYTES + 1];
    int cur = dirfd;
    const char *p = path;
    for (;;) {
        const char *end = strchr(p, '/');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        memcpy(name, p, len);
        name[len] = '\0';
        int fd;
        if (end) {
            /* O_NOFOLLOW with O_DIRECTORY: a symlink here fails (ENOTDIR). */
            fd = openat(cur, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        } else {
            fd = openat(cur, name, flags | O_NOFOLLOW | O_CLOEXEC);
        }
        int err = errno;
        if (cur != dirfd)
            close(cur);
        if (fd < 0)
            return -err;
        if (!end)
            return fd;
        cur = fd;
        p = end + 1;
    }
}

/* O_PATH | O_NOFOLLOW (with openat2 too) opens a trailing symlink itself:
 * refuse it like any other symlink. */
static int no_symlink(int fd, int flags)
{
    struct stat st;
    if (fd < 0 || !(flags & O_PATH))
        return fd;
    int bad = fstat(fd, &st) != 0 ? errno : S_ISLNK(st.st_mode) ? ELOOP : 0;
    if (bad) {
        close(fd);
        return -bad;
    }
    return fd;
}

int ckptfs_open_beneath(int dirfd, const char *path, int flags, int walk)
{
    if (!plain_relative(path))
        return -EINVAL;
    if (!walk && !no_openat2) {
        struct open_how how;
        memset(&how, 0, sizeof how);
        how.flags = (uint64_t)(flags | O_NOFOLLOW | O_CLOEXEC);
        how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
        long fd = syscall(SYS_openat2, dirfd, path, &how, sizeof how);
        if (fd >= 0)
            return no_symlink((int)fd, flags);
        if (errno != ENOSYS)
            return -errno;
        no_openat2 = 1;
    }
    return no_symlink(open_walk(dirfd, path, flags), flags);
}
