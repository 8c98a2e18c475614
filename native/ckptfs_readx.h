/* The read executor (ckptfs/chunkread.py): the committed extents of a file
 * read into one reply buffer, verified, in one call.
 *
 * Plain C11, no Python state: cffi calls it with the GIL released.
 * ckptfs/_native_build.py feeds this file (minus its '#' lines) to
 * ffi.cdef() after ckptfs_native.h, so keep it to plain declarations. */
#ifndef CKPTFS_READX_H
#define CKPTFS_READX_H

#include <stddef.h>
#include <stdint.h>

/* One extent of a file whose chunk is in the log (a LOG chunk): file bytes
 * [file_off, file_off + length) are chunk bytes [chunk_off, chunk_off +
 * length) of the chunk of chunk_len bytes at log offset log_off, whose
 * per-block CRC-32Cs (block_bytes each, the last block may be short) are
 * crcs[crc_at], crcs[crc_at + 1], ... as little-endian uint32s. */
typedef struct {
    uint64_t file_off;
    uint64_t length;
    uint64_t log_off;
    uint64_t chunk_off;
    uint64_t chunk_len;
    uint64_t crc_at;
} ckptfs_rx_extent;

/* Why a read failed: kind 1 a block's CRC does not match (log_off: the
 * chunk's log offset, block: its number in the chunk), 2 the log ends before
 * a byte it must hold (log_off: that offset), 3 an extent that cannot be one
 * ckptfs wrote (past its chunk, extents out of order, a CRC index outside
 * crcs: block is the extent's index), 4 the read(2) itself failed (err: its
 * errno), 5 nowait was set and a byte was not in the page cache (nothing is
 * wrong: read again without nowait, on a thread that may block). */
typedef struct {
    int kind;
    int err;
    uint64_t log_off;
    uint64_t block;
} ckptfs_rx_error;

/* Fill dst[0, len) with file bytes [off, off + len): from the n extents
 * (sorted by file_off, not overlapping; they may begin before off and end
 * after off + len), zeros where none is (holes).  Every block_bytes block of
 * a chunk a byte comes from is read whole from fd (the log) and its CRC
 * checked before the call returns 0; a read needs one preadv per run of
 * extents contiguous in both the file and the log, the partial blocks at
 * its ends going to scratch (2 * block_bytes bytes).  dst need not be
 * zeroed.  nowait != 0: preadv2(RWF_NOWAIT), failing with kind 5 rather
 * than wait for the disk.  Returns 0, or -1 with *err filled (dst then holds
 * anything). */
int ckptfs_read_extents(int fd, const ckptfs_rx_extent *ext, size_t n,
                        const uint8_t *crcs, size_t n_crcs, uint64_t block_bytes,
                        uint64_t off, uint8_t *dst, size_t len,
                        uint8_t *scratch, int nowait, ckptfs_rx_error *err);

/* Ask the kernel to read ahead (POSIX_FADV_WILLNEED) the log bytes of file
 * bytes [off, off + len) of the n extents: per run contiguous in the log,
 * one call per 2 MiB of it (aligned), so that all of it is read.  Advice
 * only: returns how many calls it made.  May block briefly (page
 * allocation, I/O submission: ~0.15-0.25 ms per MiB here). */
size_t ckptfs_hint_extents(int fd, const ckptfs_rx_extent *ext, size_t n,
                           uint64_t off, uint64_t len);

/* The rows of a read window (chunkread.py's loader) from the index's
 * records as stored, with no Python object per extent: n extents (keys:
 * 16 bytes each, the big-endian inode and file offset; vals: 24 bytes each,
 * the little-endian chunk number, chunk offset and length) and their
 * chunks' records (recs: rec_lens[i] bytes for extent i, one after another,
 * in extent order). A record is read as index.py's _log_location reads it
 * (kind 1, or 4 with a pack copy whose stored length is at most the chunk's;
 * a length of at most max_chunk; exactly one CRC per block_bytes block).
 * Writes n rows (crc_at counting from 0 in crcs) and their CRCs as stored
 * (at most crcs_cap bytes) and returns how many CRCs; -1 - i if extent i is
 * not one the executor reads (another kind, a record so rejected, or bytes
 * past its chunk): the caller then takes the decoding path. */
int64_t ckptfs_window_rows(const uint8_t *keys, const uint8_t *vals, const uint8_t *recs,
                           const uint32_t *rec_lens, size_t n, uint64_t max_chunk,
                           uint64_t block_bytes, ckptfs_rx_extent *rows, uint8_t *crcs,
                           size_t crcs_cap);

#endif
