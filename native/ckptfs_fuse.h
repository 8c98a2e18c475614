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
 *  - answers the one GETATTR of a directory that follows a change the
 *    daemon made in it (a CREATE's parent: the kernel drops the directory's
 *    attributes and, with default_permissions, asks for them before the
 *    next create there) with the attributes the daemon left for it
 *    (ckptfs_fuse_attr_leave), which the daemon drops as soon as any of
 *    them changes (ckptfs_fuse_attr_drop);
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
 *    with the GIL released.  A READ inside the table whose bytes are not in
 *    the page cache goes to the read pool (ckptfs_readpool.h: C threads
 *    that wait for the disk and answer it; ckptfs_fuse_read_forget waits
 *    for the file's READs there first).  Anything else (a check that
 *    fails, a range outside the table, the pool's queue full) goes to
 *    libfuse, and the daemon's read path does it as before (a failed check
 *    is EIO there);
 *  - for a file with no such table, asks its cold table
 *    (ckptfs_coldtable.h: cold chunks fetched and verified, answered from
 *    the cold cache's memory);
 *  - answers WRITE itself for a file the daemon opened a write window of
 *    (ckptfs_fuse_write_window: a file written front to back, the log
 *    space reserved for its next bytes): a WRITE at the window's file
 *    offset that fits is written into the log from the request buffer
 *    (pwrite, GIL released; while a window is open requests come through
 *    a pipe with splice(), and the payload goes on to the log with splice
 *    from it), recorded as a pending extent and answered; and from a
 *    rewrite window (ckptfs_fuse_rewrite_window: a file rewritten out of
 *    stream order, log space reserved for its next rewrites) a WRITE at
 *    any offset but those the daemon would stream, each one's payload
 *    after the previous one's in that space.
 *    Whenever this module hands control back (before it returns from its
 *    read, with a request for libfuse or none), it calls the daemon's
 *    folder (ckptfs_fuse_write_folder), which takes the pending extents
 *    (ckptfs_fuse_write_take) into the file's changes: no Python on the
 *    trio thread ever sees a WRITE answered here and not folded.  A request
 *    it passes on closes the window of its inode first (a request that
 *    names no inode it could touch closes every window), so the daemon
 *    sees it as after a WRITE of its own and opens the window again only
 *    from its write path;
 *  - answers RELEASE itself for a handle the daemon marked as needing
 *    nothing but its bookkeeping (ckptfs_fuse_release_quiet: a FLUSH of it
 *    left its file nothing to commit), unless a request about the inode
 *    came since; the handle is queued, and the daemon's release folder
 *    (ckptfs_fuse_release_folder) takes them (ckptfs_fuse_release_take)
 *    before this module returns from its read, after the WRITEs' folder.
 *    A small file's close is FLUSH then RELEASE: the RELEASE costs no
 *    trip through the interpreter and the event loop then;
 * The write side notes when libfuse has sent the INIT reply: the kernel
 * resets the mount's read-ahead while it handles that reply, so the daemon
 * raises it only after (ckptfs_fuse_init_replied).
 *
 * Everything runs on the thread that reads the FUSE fd (pyfuse3's trio
 * thread), and so do the mark/unmark calls and the table calls, except the
 * read pool's threads; the counters are read from any thread with relaxed
 * atomics.  This module also stands in for fuse_session_unmount and
 * fuse_session_destroy: the pool's threads finish and are joined first. */
#ifndef CKPTFS_FUSE_H
#define CKPTFS_FUSE_H

#include <stddef.h>
#include <stdint.h>

/* Before pyfuse3.init(): 1 to install the fast path when the session mounts,
 * 0 (the default) to leave the session as libfuse made it. */
void ckptfs_fuse_want(int on);

/* Before pyfuse3.init(): 0 to read every request with read(), 1 (the
 * default) to take requests with splice() while a write window is open, so
 * a WRITE answered here goes from the kernel's pages into the log with one
 * copy, not two (the pipe needs room for a whole request: without it, as 0). */
void ckptfs_fuse_splice_writes(int on);

/* 1 once the fast path is installed on a mounted session.  0 if pyfuse3 was
 * loaded before this module (its fuse_session_mount is libfuse's then), or
 * the fast path was not wanted, or installing it failed. */
int ckptfs_fuse_hooked(void);

/* Ask for FUSE_HANDLE_KILLPRIV_V2 in the INIT reply (call before the mount;
 * on: 1).  With it the kernel asks no GETXATTR("security.capability") before
 * each write() and the daemon clears suid/sgid where the kernel says:
 * ckptfs_fuse_kill_asked(ino) is 1, once per request passed on (a WRITE, a
 * SETATTR, an OPEN) that carries the kernel's kill flag for ino (always 1
 * after more than 256 were not taken).  ckptfs_fuse_killpriv_v2_on: 1 once
 * the INIT reply that asked for it went out.  Trio thread only. */
void ckptfs_fuse_killpriv_v2(int on);
int ckptfs_fuse_killpriv_v2_on(void);
int ckptfs_fuse_kill_asked(uint64_t ino);

/* Before pyfuse3.init(): the INIT reply asks the kernel for n background
 * requests in flight (readahead READs, writeback WRITEs; its default is 12)
 * and a congestion threshold of 3n/4; 0 leaves libfuse's reply as it is.
 * Only with the fast path installed (it sees the reply). */
void ckptfs_fuse_max_background(unsigned n);

/* The inode has no "security.capability" attribute: answer the kernel's
 * GETXATTR of it in C from now on.  Call it only with that knowledge (a new
 * inode; the daemon just answered ENODATA for it). */
void ckptfs_fuse_caps_absent(uint64_t ino);

/* The inode may have that attribute (about to be set): from now on its
 * GETXATTR goes to the daemon again.  Call it before the change is made. */
void ckptfs_fuse_caps_unknown(uint64_t ino);

/* The kernel's next GETATTR of inode ino (a directory the daemon just
 * changed: a CREATE in it makes the kernel ask for its attributes again)
 * is answered here with these attributes (what the daemon's getattr would
 * reply: libfuse's fuse_reply_attr of them), once.  Call
 * ckptfs_fuse_attr_drop(ino) as any of them changes, before the change is
 * visible to another request: the answer must never be older than the
 * daemon's. */
void ckptfs_fuse_attr_leave(uint64_t ino, uint64_t size, uint64_t blocks, int64_t atime_ns,
                            int64_t mtime_ns, int64_t ctime_ns, uint32_t mode, uint32_t nlink,
                            uint32_t uid, uint32_t gid, uint32_t rdev, uint32_t blksize,
                            double attr_timeout);
void ckptfs_fuse_attr_drop(uint64_t ino);

/* The read executor's two functions (ckptfs._native: ckptfs_read_extents and
 * ckptfs_hint_extents, as addresses), needed before any read table. */
void ckptfs_fuse_read_executor(uintptr_t read_extents, uintptr_t hint_extents);

/* READs whose log pages are all in the page cache are answered from a
 * read-only mapping of the log (checked there with crc_fn, ckptfs._native's
 * ckptfs_crc32c by address, and written to the kernel from there: one copy
 * fewer than through a reply buffer).  off != 0 (or crc_fn 0): never, every
 * READ is copied as before.  Call before the first read table. */
void ckptfs_fuse_read_mapper(uintptr_t crc_fn, int off);

/* The log-fault guard (ckptfs_logfault_api_address() of _native): the
 * mapping is guarded, and what a READ read from it counts only if no fault
 * came meanwhile.  Without it, READs are never answered from the mapping. */
void ckptfs_fuse_log_faults(uintptr_t api);

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

/* A reader of ino moves on: READs of ino go to the daemon until its next
 * table, nothing about the file changed.  Does not wait: the read pool's
 * jobs carry copies of what they read with and stay counted for ino; the
 * table's memory may go once this returns. */
void ckptfs_fuse_read_retire(uint64_t ino);

/* Marks on ino's current table (no-op for an ino without an active one;
 * ckptfs_fuse_read_table and ckptfs_fuse_read_retire clear them):
 * next_at: once a READ of it that continues the reader's run ends past file
 * offset next_at, the eventfd of ckptfs_fuse_read_ahead_fd turns readable
 * and ckptfs_fuse_read_wanted reports ino (once per mark), so the daemon
 * can publish the next stretch before the reader gets there (UINT64_MAX:
 * never; nothing is asked before ckptfs_fuse_read_ahead_fd made the fd).
 * end_is_eof: the table's end is the file's size, so a READ reaching past
 * it (the kernel asks for whole pages) is answered short. */
int ckptfs_fuse_read_ahead_fd(void);
void ckptfs_fuse_read_marks(uint64_t ino, uint64_t next_at, int end_is_eof);

/* Up to n inodes whose reader asked for its next table since the last call,
 * into inos, and where each reader's run has reached (file offset) into
 * read_to; how many.  Drains the eventfd. */
size_t ckptfs_fuse_read_wanted(uint64_t *inos, uint64_t *read_to, size_t n);

/* READs of ino go to the daemon again (no-op if it has no table).  Returns
 * once no READ of ino is queued or being read on the read pool's threads
 * (GIL released while it waits), its retired tables' included: the caller
 * may then change what the tables named and free their memory. */
void ckptfs_fuse_read_forget(uint64_t ino);

/* 1 once libfuse has sent the reply to the kernel's INIT request. */
int ckptfs_fuse_init_replied(void);

/* Counters since the mount: out[i] for i < 64 is the number of requests with
 * opcode i (FUSE_* of linux/fuse.h) that were read; out[64] the requests with
 * a larger opcode; out[65] the WRITE payload bytes; out[66] the GETXATTRs
 * answered here; out[67] the reads that found nothing waiting; out[68] the
 * READs answered in C (here or on the read pool's threads), out[69] their
 * bytes; out[70] READs of a file with a table that went to the daemon
 * (outside the table, a failed check, the pool's queue full, handed back);
 * out[71] and out[72] the READs the pool answered and their bytes; out[73]
 * the READs it handed back; out[74] the withdrawals of a table that waited
 * for its reads in the pool; out[75] the WRITEs answered here, out[76]
 * their bytes, out[77] the WRITEs of an inode with a window that went to
 * the daemon, out[78] the WRITEs answered here whose payload was spliced
 * into the log (see ckptfs_fuse_splice_writes); out[79] the READs answered
 * from the log's mapping (ckptfs_fuse_read_mapper); out[80] the GETATTRs
 * answered with attributes the daemon left (ckptfs_fuse_attr_leave);
 * out[81] the RELEASEs answered here (ckptfs_fuse_release_quiet).
 * n <= 82. */
void ckptfs_fuse_counters(uint64_t *out, size_t n);

/* A READ of a published table that missed the page cache goes to the read
 * pool (ckptfs_readpool.h: a few C threads that wait for the disk, check
 * every block and answer).  One that fails there (a CRC that does not
 * match, a read error) is handed back to the daemon: the fd below turns
 * readable, ckptfs_fuse_handbacks takes them, and the daemon reads each
 * through its own path and answers with ckptfs_fuse_reply. */
typedef struct {
    uint64_t unique;
    uint64_t nodeid;
    uint64_t fh;
    uint64_t offset;
    uint32_t size;
    int32_t kind;       /* why the pool gave up: ckptfs_rx_error.kind */
} ckptfs_fuse_handback;

/* The eventfd readable when READs were handed back; -1 without a pool. */
int ckptfs_fuse_handback_fd(void);

/* Up to n (at most 64) handed-back READs into out: how many. */
size_t ckptfs_fuse_handbacks(ckptfs_fuse_handback *out, size_t n);

/* Reply to request unique: len bytes of data, or error (an errno, > 0).
 * 0, or -errno of the write (an interrupted request is 0). */
int ckptfs_fuse_reply(uint64_t unique, int error, const uint8_t *data, size_t len);

/* WRITEs of inode ino at file offset file_off (the next byte a sequential
 * writer sends) may be answered here while they fit in log bytes
 * [log_off, log_end) of log_fd, written in order: each one's payload goes to
 * the log where the previous one ended.  Replaces ino's window (at most
 * FP_WRITE_SLOTS files at once: 0 answered, -1 none free or not hooked). */
int ckptfs_fuse_write_window(uint64_t ino, int log_fd, uint64_t file_off, uint64_t log_off,
                             uint64_t log_end);

/* A rewrite window: WRITEs of ino at any file offset may be answered here
 * while they fit in log bytes [log_off, log_end) of log_fd, each one's
 * payload where the previous one's ended, except those the daemon would cut
 * as a stream: has_stream, a WRITE holding the byte at stream_at (the
 * stream's next); else a WRITE starting at or past stream_at (where the
 * file's changes end: a stream would begin there).  Replaces ino's window;
 * 0, or -1 as ckptfs_fuse_write_window. */
int ckptfs_fuse_rewrite_window(uint64_t ino, int log_fd, uint64_t stream_at, int has_stream,
                               uint64_t log_off, uint64_t log_end);

/* No more WRITEs of ino answered here (the pending ones stay to be taken). */
void ckptfs_fuse_write_close(uint64_t ino);

/* A WRITE answered here, not yet taken by the daemon: file bytes
 * [file_off, file_off + length) of ino are at log_off.  Consecutive WRITEs
 * of a file are one extent. */
typedef struct {
    uint64_t ino;
    uint64_t file_off;
    uint64_t log_off;
    uint64_t length;
} ckptfs_fuse_wextent;

/* Up to n pending extents into out, oldest first, taken: how many. */
size_t ckptfs_fuse_write_take(ckptfs_fuse_wextent *out, size_t n);

/* The daemon's folder: a void(void) function this module calls (on the
 * thread that reads the FUSE fd, taking the GIL) whenever WRITEs it
 * answered are pending, before it returns from its read.  0 to remove. */
void ckptfs_fuse_write_folder(uintptr_t fn);

/* The RELEASE of handle fh of inode ino needs nothing of the daemon but the
 * handle's bookkeeping (its FLUSH just committed everything, nothing of the
 * file is in flight): answer it here, unless another request about ino
 * comes first (that drops the mark).  Call it before the FLUSH is answered. */
void ckptfs_fuse_release_quiet(uint64_t fh, uint64_t ino);

/* Up to n handles whose RELEASE was answered here into out, oldest first,
 * taken: how many. */
size_t ckptfs_fuse_release_take(uint64_t *out, size_t n);

/* The daemon's release folder: a void(void) function this module calls (on
 * the thread that reads the FUSE fd, taking the GIL) whenever RELEASEs it
 * answered are queued, before it returns from its read.  0 to remove (no
 * RELEASE is answered here then). */
void ckptfs_fuse_release_folder(uintptr_t fn);

#endif
