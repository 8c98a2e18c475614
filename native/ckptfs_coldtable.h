/* Cold read tables: READs of cold chunks answered on the FUSE fast path
 * (ckptfs_fuse.c's answer_read asks here when a file has no log read table).
 *
 * The daemon's reader (chunkread.py) publishes, per inode, the pieces of
 * its read window whose cold chunks the cold store has fetched and verified
 * (coldstore.py: each payload's CRC-32C and BLAKE3 id checked before a byte
 * is cached): (file offset, length, address into that verified memory).  A
 * READ wholly covered by consecutive pieces, ending before the table's
 * refill point, is answered with one writev straight from that memory
 * (GIL released); anything else goes to the daemon, which serves it, asks
 * the prefetcher for more and publishes further.  An answered READ past the
 * table's mark wakes the daemon (an eventfd) to do the same without a READ.
 *
 * Every call, and the answers, run on the thread that reads the FUSE fd
 * (pyfuse3's trio thread); an answer's reply (the copy out of the cache) is
 * written by a thread of the fast path's read pool (ckptfs_readpool.h),
 * inline when the pool cannot take it, and counted in the table's in-flight
 * count until written.  The memory stays the caller's and must stay valid
 * and unchanged until ckptfs_cold_forget or ckptfs_cold_trim drops the
 * pieces that point into it: those two wait (GIL released) for the table's
 * replies in flight first, so once they return no thread reads the dropped
 * pieces' memory.  Call ckptfs_cold_forget before the file's map, its
 * chunks or its size change.  Counters are read from any thread. */
#ifndef CKPTFS_COLDTABLE_H
#define CKPTFS_COLDTABLE_H

#include <stddef.h>
#include <stdint.h>

/* Add n pieces to ino's table (made if it has none): file bytes
 * [offs[k], offs[k] + lens[k]) are the lens[k] bytes at addrs[k].  Pieces
 * come in file order: each at or after the end of the one before.  Then
 * READs reaching past refill_at go to the daemon (which publishes further
 * and moves this point on).  One call for many pieces: cffi releases and
 * takes the GIL again around each call, which costs while workers run.
 * Returns how many were added: fewer than n if one is out of order or
 * empty, memory ran out, or every table slot is taken (the refill point is
 * set when the table exists). */
size_t ckptfs_cold_publish(uint64_t ino, const uint64_t *offs, const uint64_t *lens,
                           const uintptr_t *addrs, size_t n, uint64_t refill_at);

/* Drop ino's pieces that end at or before file offset below (after the
 * table's replies in flight are written, if it drops any).  May block
 * briefly. */
void ckptfs_cold_trim(uint64_t ino, uint64_t below);

/* ckptfs_cold_trim without the wait: the pieces go from the table at once
 * (no READ answered from now on reads them) while replies already queued
 * may still read their memory, which the caller keeps until
 * ckptfs_cold_drained(ino, the epoch returned) says 1, for this epoch and
 * every epoch returned before it (release them in order).  -1: nothing was
 * dropped (no table, or no piece ends at or before below).  Never blocks:
 * a refill that trims behind its reader does not stop the READs behind it
 * (the wait took 0-25 ms per trim on the trio thread). */
int ckptfs_cold_trim_later(uint64_t ino, uint64_t below);

/* 1 if every reply of ino's table counted in epoch (ckptfs_cold_trim_later)
 * is written, or ino has no table (ckptfs_cold_forget waited for them all);
 * 0 if one may still be in flight.  The counts are used round: it may say
 * 0 for a later epoch's reply counted there too, never 1 too early. */
int ckptfs_cold_drained(uint64_t ino, int epoch);

/* Drop ino's table: its READs go to the daemon again (after its replies in
 * flight are written).  May block briefly. */
void ckptfs_cold_forget(uint64_t ino);

/* ino's wake mark (no-op, 0, for an ino without a table or before
 * ckptfs_cold_wake_fd made the fd; a new table has none): once a READ
 * answered from the table ends past file offset wake_at, the eventfd of
 * ckptfs_cold_wake_fd turns readable and ckptfs_cold_wanted reports ino
 * (once per mark), so the daemon can top its look-ahead up and publish
 * further while the READs go on being answered here.  1 if set. */
int ckptfs_cold_wake_fd(void);
int ckptfs_cold_mark(uint64_t ino, uint64_t wake_at);

/* Up to n inodes whose reader passed its mark since the last call, into
 * inos, and the end of the furthest READ answered from each table into
 * read_to; how many.  Drains the eventfd. */
size_t ckptfs_cold_wanted(uint64_t *inos, uint64_t *read_to, size_t n);

/* Counters since the mount: out[0] READs answered from cold tables,
 * out[1] their bytes, out[2] READs of an inode with a table that went to
 * the daemon (a byte not published, past the refill point, too many
 * pieces), out[3] of the answered ones those whose reply a read pool
 * thread wrote (the others were written inline: the pool was full).  n <= 4. */
void ckptfs_cold_counters(uint64_t *out, size_t n);

#endif
