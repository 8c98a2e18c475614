/* The fast path's side of the cold read tables (ckptfs_coldtable.h): not
 * for the daemon, so not in the header cffi reads. */
#ifndef CKPTFS_COLDTABLE_ANSWER_H
#define CKPTFS_COLDTABLE_ANSWER_H

#include <stdint.h>

/* Answer FUSE READ `unique` of [off, off+size) of ino from its cold table on
 * fd: 1 answered (its reply queued to the read pool, or written here), 0 for
 * the daemon (no table, a byte not in it), -1 the session ended (errno
 * ENODEV).  Trio thread (it holds the GIL, released while a reply is
 * written here). */
int ckptfs_cold_answer(int fd, uint64_t ino, uint64_t unique, uint64_t off, uint64_t size);

#endif
