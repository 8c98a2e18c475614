/* Log faults: a SIGBUS on a page of a registered log mapping becomes an
 * error of the operation that touched it (ckptfs_logfault.c).
 *
 * Not parsed by cffi: the Python-facing declarations are in
 * ckptfs_native.h; this is the table of the same functions that the FUSE
 * fast path (a module of its own, _fusepath) is given by address. */
#ifndef CKPTFS_LOGFAULT_H
#define CKPTFS_LOGFAULT_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int (*guard)(uintptr_t base, size_t len, int prot);
    void (*unguard)(int slot);
    uint64_t (*gen)(void);
    int (*clean)(int slot, uint64_t gen0);
    int (*repair)(int slot, int fd, uint64_t file_off);
} ckptfs_logfault_api;

#endif
