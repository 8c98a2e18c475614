/* The FUSE channel fast path (ckptfs/fastpath.py, docs/ARCHITECTURE.md).
 *
 * Built into its own cffi module, ckptfs._fusepath, which the daemon loads
 * with RTLD_GLOBAL before pyfuse3: its fuse_session_mount() then stands in
 * for libfuse's when pyfuse3.init() mounts.  It calls libfuse's, then gives
 * the session a custom I/O (fuse_session_custom_io) whose read() sees every
 * request before libfuse does and whose writev() sees every reply.
 *
 * What the read side does:
 *  - counts requests by opcode (and WRITE payload bytes);
 *  - answers GETXATTR "security.capability" with ENODATA itself, without
 *    entering the interpreter, for inodes the daemon said have no such
 *    attribute (ckptfs_fuse_caps_absent).  The kernel asks that before every
 *    write() (file_remove_privs: the connection does not negotiate
 *    FUSE_HANDLE_KILLPRIV_V2, which the libfuse of Debian 12 cannot), so an
 *    8 KiB writer made one Python round trip per write.  Any other request,
 *    and this one for an inode not marked, goes to libfuse as before;
 *  - after answering, takes the next request if one is already waiting (the
 *    fd is non-blocking), at most FP_MAX_BURST in a row, so a stream of them
 *    costs one event loop wake-up, not one each.  A read that finds nothing
 *    waiting reports EINTR, which pyfuse3 answers by waiting again.
 *  - answers READ itself for a file the daemon published a read table of
 *    (ckptfs_fuse_read_table: chunkread.py's read window of a file with no
 *    uncommitted changes, every extent a LOG chunk), when every byte asked
 *    for is in the table and in the page cache: the read executor
 *    (ckptfs_readx.c, given by address: ckptfs_fuse_read_executor) fills a
 *    reply buffer, every block CRC-checked, and the reply is written here,
 *    with the GIL released.  Anything else (a byte not cached, a check that
 *    fails, a range outside the table) goes to libfuse, and the daemon's
 *    read path does it as before (a failed check is EIO there);
 *  - for a file with no such table, asks its cold table
 *    (ckptfs_coldtable.h: cold chunks fetched and verified, answered from
 *    the cold cache's memory);
 * The write side notes when libfuse has sent the INIT reply: the kernel
 * resets the mount's read-ahead while it handles that reply, so the daemon
 * raises it only after (ckptfs_fuse_init_replied).
 *
 * Everything runs on the thread that reads the FUSE fd (pyfuse3's trio
 * thread), and so do the mark/unmark calls; the counters are read from any
 * thread with relaxed atomics. */
#ifndef CKPTFS_FUSE_H
#define CKPTFS_FUSE_H

#include <stddef.h>
#include <stdint.h>

/* Before pyfuse3.init(): 1 to install the fast path when the session mounts,
 * 0 (the default) to leave the session as libfuse made it. */
void ckptfs_fuse_want(int on);

/* 1 once the fast path is installed on a mounted session.  0 if pyfuse3 was
 * loaded before this module (its fuse_session_mount is libfuse's then), or
 * the fast path was not wanted, or installing it failed. */
int ckptfs_fuse_hooked(void);

/* The inode has no "security.capability" attribute: answer the kernel's
 * GETXATTR of it in C from now on.  Call it only with that knowledge (a new
 * inode; the daemon just answered ENODATA for it). */
void ckptfs_fuse_caps_absent(uint64_t ino);

/* The inode may have that attribute (about to be set): from now on its
 * GETXATTR goes to the daemon again.  Call it before the change is made. */
void ckptfs_fuse_caps_unknown(uint64_t ino);

/* The read executor's two functions (ckptfs._native: ckptfs_read_extents and
 * ckptfs_hint_extents, as addresses), needed before any read table. */
void ckptfs_fuse_read_executor(uintptr_t read_extents, uintptr_t hint_extents);

/* Answer READs of inode ino for file bytes [start, end) (end <= the file's
 * size) from the n extents at ext (ckptfs_rx_extent[], file order, every one
 * a LOG chunk; zeros between them) whose CRCs are crcs[0, n_crcs), read from
 * log_fd.  The memory stays the caller's and must stay valid and unchanged
 * until ckptfs_fuse_read_forget(ino): call that before the file's map, its
 * chunks or its size change, or the memory goes.  Replaces an earlier table
 * of ino; with every slot taken, the oldest goes.  0, or -1 if no executor
 * was given. */
int ckptfs_fuse_read_table(uint64_t ino, int log_fd, uintptr_t ext, size_t n, uintptr_t crcs,
                           size_t n_crcs, uint64_t start, uint64_t end);

/* READs of ino go to the daemon again (no-op if it has no table). */
void ckptfs_fuse_read_forget(uint64_t ino);

/* 1 once libfuse has sent the reply to the kernel's INIT request. */
int ckptfs_fuse_init_replied(void);

/* Counters since the mount: out[i] for i < 64 is the number of requests with
 * opcode i (FUSE_* of linux/fuse.h) that were read; out[64] the requests with
 * a larger opcode; out[65] the WRITE payload bytes; out[66] the GETXATTRs
 * answered here; out[67] the reads that found nothing waiting; out[68] the
 * READs answered here, out[69] their bytes; out[70] READs of a file with a
 * table that went to the daemon (not cached, outside the table, a failed
 * check).  n <= 71. */
void ckptfs_fuse_counters(uint64_t *out, size_t n);

#endif
