/* Native helpers for ckptfs: CRC-32C, persistent-memory primitives and the
 * content-defined chunking scan.
 *
 * Plain C11: raw pointers and lengths, no Python state, so cffi can call
 * every function with the GIL released.  ckptfs/_native_build.py feeds this
 * file (minus its '#' lines) to ffi.cdef(), so keep it to plain prototypes. */
#ifndef CKPTFS_NATIVE_H
#define CKPTFS_NATIVE_H

#include <stddef.h>
#include <stdint.h>

/* CRC-32C (Castagnoli) of buf continuing from `crc`, a previous result (0 to
 * start).  Uses the SSE4.2 crc32 instruction when the CPU has it. */
uint32_t ckptfs_crc32c(uint32_t crc, const void *buf, size_t len);

/* The table-driven fallback, exported so tests can check both paths. */
uint32_t ckptfs_crc32c_sw(uint32_t crc, const void *buf, size_t len);

/* 1 if ckptfs_crc32c uses the hardware instruction. */
int ckptfs_crc32c_hw(void);

/* CRC-32C of each block_size piece of buf (the last may be short), stored in
 * out as little-endian uint32s.  out holds 4 * ceil(len / block_size) bytes;
 * block_size must be > 0. */
void ckptfs_crc32c_blocks(const void *buf, size_t len, size_t block_size,
                          uint8_t *out);

/* Cache-line flush in use: 0 none (not x86), 1 clflush, 2 clflushopt, 3 clwb. */
int ckptfs_flush_kind(void);

/* Persist [addr, addr + len).  dax != 0 and a flush instruction exists: write
 * back every cache line, then sfence.  Otherwise msync(MS_SYNC) over the
 * pages covering the range (addr's page must lie inside the mapping).
 * Returns 0 or an errno value. */
int ckptfs_persist(void *addr, size_t len, int dax);

/* Copy len bytes with non-temporal stores so they bypass the cache; the
 * unaligned head and tail are stored normally and flushed.  Ends with sfence.
 * The ranges must not overlap.  Plain memcpy when not on x86-64. */
void ckptfs_copy_nt(void *dst, const void *src, size_t len);

/* ---- content-defined chunking --------------------------------------------
 *
 * FastCDC-style gear hash with normalized chunking (two masks, level 2).  The
 * cut rule, which fixes where chunks end and so is part of the chunk format:
 *
 *   h(j) = sum over k = 0..63 of gear[x[j - k]] << k  (mod 2^64), the gear
 *   hash of the 64 bytes ending at byte j of the chunk; b = log2(avg_size).
 *   A chunk starting at x[0] has the smallest length L, min <= L <= max, with
 *     h(L - 1) < 2^(64 - b - 2)   when L < avg_size   (harder: 1 in 4 * avg)
 *     h(L - 1) < 2^(64 - b + 2)   when L >= avg_size  (easier: 1 in avg / 4)
 *     or L == max_size;
 *   the stream's last chunk may be shorter than min_size.
 *
 * h depends on the last 64 bytes only, so a chunk's end is found without
 * looking before its start (min_size >= 64) and the first min_size - 64
 * bytes of every chunk are skipped unhashed.  gear[] is the first 256 outputs
 * of splitmix64 seeded with 0x636b707466734344 ("ckptfsCD").
 *
 * Streaming: the caller keeps one state per stream, zeroed at the start and
 * again at every forced cut (a tensor boundary: the caller ends the chunk
 * there itself and restarts the scan), and passes each new buffer as it comes;
 * no byte is passed twice and none needs to be kept.  The state holds the
 * position inside the pending chunk and the running hash. */
typedef struct {
    uint64_t hash;    /* running gear hash, once near or past min_size */
    uint64_t pending; /* bytes of the pending, not yet cut, chunk seen so far */
} ckptfs_gear_state;

/* Scan buf for cut points, continuing the stream described by *state.  Stores
 * the end offset (relative to buf, in (0, len]) of each chunk that ends in buf
 * into cuts and returns how many; the bytes after the last cut begin the
 * pending chunk, recorded in *state.  At most max_cuts are stored: a return of
 * max_cuts may mean the scan stopped early, right after the last cut (state
 * then describes an empty pending chunk), and the caller continues with
 * buf + cuts[max_cuts - 1].  len / min_size + 1 entries always suffice.
 * Requires 64 <= min_size <= avg_size <= max_size and avg_size a power of two
 * in [64, 2^40]; returns SIZE_MAX (touching nothing) otherwise. */
size_t ckptfs_gear_cuts(ckptfs_gear_state *state, const void *buf, size_t len,
                        size_t min_size, size_t avg_size, size_t max_size,
                        size_t *cuts, size_t max_cuts);

/* Whether the scan hashes long spans in 16 lanes with AVX-512 (chosen at load
 * time when the CPU has AVX-512F and BW and the lanes were the faster form in
 * a timed scan of 256 KiB: their gathers are slow on some CPUs; the cuts are
 * the same either way).  on: 1
 * to use it when the CPU can, 0 not to, -1 to leave it; returns the setting
 * before.  For tests and benchmarks that compare the two. */
int ckptfs_gear_vector(int on);

/* ---- naming chunks as they are cut (ckptfs/chunker.py BatchChunker) -----
 *
 * One call per written buffer: the gear scan above, forced cuts at given
 * offsets, and for every chunk that ends in the buffer its length, whether
 * every byte is zero, and the CRC-32C of each crc_block piece of it (counted
 * from the chunk's start: the CRCs the log's records carry).  A chunk may
 * begin in an earlier buffer: the state carries its CRC of the unfinished
 * block, the CRCs of its finished blocks and its zero flag, so no byte is
 * read twice.  When built with BLAKE3 (ckptfs_chunk_hashes() == 1) it also
 * gives each chunk's BLAKE3-256 id, the state carrying the hasher of the
 * pending chunk.  Zero the state to start a stream. */
#define CKPTFS_CHUNK_MAX_CRCS 16
typedef struct {
    ckptfs_gear_state gear;
    uint64_t absorbed;  /* bytes of the pending chunk CRC'd so far */
    uint32_t crc;       /* CRC-32C of its unfinished block */
    uint32_t nonzero;   /* it holds a nonzero byte */
    uint8_t crcs[64];   /* its finished blocks' CRCs, little-endian */
    uint32_t hashing;   /* hasher holds the pending chunk's bytes so far */
    uint64_t hasher[256]; /* a blake3_hasher (opaque here) */
} ckptfs_chunk_state;

/* 1 if ckptfs_chunk_feed names chunks with BLAKE3 (the build found the
 * BLAKE3 C library), else 0: the caller hashes them. */
int ckptfs_chunk_hashes(void);

/* Continue the stream with buf.  forced: nforced ascending offsets in [0, len]
 * where a chunk must end (a pending chunk, if any, ends there and the scan
 * restarts).  For each chunk ending in buf, in order, stores: ends[k] its end
 * offset in buf (1..len), lengths[k] its whole length, zero[k] 1 if all its
 * bytes are zero, crcs[64k..] its ceil(length / crc_block) block CRCs (four
 * bytes each, little-endian; the rest of the 64 bytes untouched), and, if
 * ids is not NULL and ckptfs_chunk_hashes(), ids[32k..] its BLAKE3-256
 * (all zero bytes for a zero chunk, which is never looked up).  Returns
 * how many, or SIZE_MAX (touching nothing) when the sizes are invalid (see
 * ckptfs_gear_cuts), max_size > 16 * crc_block, forced is not ascending
 * within [0, len], or max_out < len / min_size + nforced + 1. */
size_t ckptfs_chunk_feed(ckptfs_chunk_state *st, const void *buf, size_t len,
                         const uint64_t *forced, size_t nforced,
                         size_t min_size, size_t avg_size, size_t max_size,
                         size_t crc_block, uint64_t *ends, uint64_t *lengths,
                         uint8_t *zero, uint8_t *crcs, uint8_t *ids, size_t max_out);

/* End the stream: if a chunk is pending, store it as ckptfs_chunk_feed would
 * (its end offset is 0) and return 1, else 0; the state is zeroed. */
size_t ckptfs_chunk_finish(ckptfs_chunk_state *st, size_t crc_block,
                           uint64_t *lengths, uint8_t *zero, uint8_t *crcs,
                           uint8_t *ids);

/* Name n pieces of buf, each as one whole chunk: what ckptfs_chunk_feed and
 * ckptfs_chunk_finish give for a stream that is the piece alone when no cut
 * falls inside it (a piece shorter than the minimum chunk size, no forced
 * cut): zero[k], crcs[64k..] and, if ids is not NULL and
 * ckptfs_chunk_hashes(), ids[32k..] as they describe.  Piece k is
 * [offs[k], offs[k] + lens[k]).  One call for many small pieces (commit-time
 * cutting of 4 KiB rewrites).  Returns 0, or -1 (touching nothing) when a
 * piece is empty, lies outside buf or is longer than 16 * crc_block. */
int ckptfs_name_pieces(const void *buf, size_t len, const uint64_t *offs,
                       const uint64_t *lens, size_t n, size_t crc_block,
                       uint8_t *zero, uint8_t *crcs, uint8_t *ids);

/* Offset of the first occurrence of the 4-byte needle in buf, or len if there
 * is none.  SSE2; the format hint parser's search for zip data descriptors. */
size_t ckptfs_find4(const void *buf, size_t len, const void *needle);


/* ---- chunk compression (ckptfs/codec.py, docs/COMPRESSION.md) ------------
 *
 * Byte planes: a buffer of n = len / width elements of width bytes, plus
 * r = len % width trailing bytes.  Plane p holds byte p of every element;
 * the planes are stored one after the other (plane p at p * n) and the r
 * trailing bytes follow unchanged at width * n.  merge is the inverse.
 * width >= 1; the buffers must not overlap. */
void ckptfs_split_planes(const void *src, size_t len, size_t width, void *dst);
void ckptfs_merge_planes(const void *src, size_t len, size_t width, void *dst);

/* Guess how buf is laid out as little-endian floats, from its bytes alone.
 * With width == 0: returns 2 (bf16/fp16), 4 (fp32) or 0 (not float-like).
 * With width in 2..16: returns width (a hint taken as given).  In both cases
 * *phase gets the offset, in [0, width), of the first whole element: the
 * element boundary that makes byte width - 1 of each element the most
 * predictable (sign and exponent).  *runs gets 1000 times the ratio of how
 * often neighbouring elements have equal top bytes to how often independent
 * draws would (about 1000: no sequential structure; more: worth trying an
 * LZ coder).  Looks at up to 16 KiB sampled evenly. */
unsigned ckptfs_float_layout(const void *buf, size_t len, unsigned width,
                             unsigned *phase, unsigned *runs);

/* CODEC_FLOAT payload (layout in docs/COMPRESSION.md) of len bytes of
 * width-byte little-endian elements starting at offset phase: the top 16
 * bits of each element are rANS-coded as a symbol of their top b bits
 * (8 <= b <= max_bits <= 16, chosen per chunk) plus 16 - b raw bits, every
 * lower byte plane raw or rANS-coded on its own; a CRC-32C of the chunk
 * closes the payload.  Returns the payload size, or 0 if it would exceed cap
 * (or the arguments are unusable: width outside 2..16, phase >= width,
 * fewer than one element, len >= 2^32, out of memory). */
size_t ckptfs_fc_encode(const void *src, size_t len, unsigned width,
                        unsigned phase, unsigned max_bits, void *out,
                        size_t cap);

/* Decode a CODEC_FLOAT payload into exactly len bytes at dst.  Returns 0,
 * or -1 if the payload is damaged in any way (malformed, short, long, CRC
 * mismatch; dst then holds garbage), -2 if out of memory.  Bounded time and
 * no out-of-bounds access for any input. */
int ckptfs_fc_decode(const void *payload, size_t plen, unsigned width,
                     void *dst, size_t len);

/* One byte plane, order-0 rANS (the "rANS" plane method of CODEC_PLANES):
 * encode returns the size written to out (at most cap), or 0 if that would
 * not fit; decode fills exactly n bytes and returns 0, or -1 if damaged. */
size_t ckptfs_rans8_encode(const void *src, size_t n, void *out, size_t cap);
int ckptfs_rans8_decode(const void *in, size_t in_len, void *dst, size_t n);

/* ---- reaching pre-existing files below SOURCE (ckptfs/files.py) ---------
 *
 * Open path (relative, plain names: no leading '/', no empty, "." or ".."
 * component) beneath the directory dirfd without following a symlink at any
 * component, the last one included: openat2(RESOLVE_BENEATH |
 * RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS), or, with walk != 0 or on a
 * kernel without openat2 (ENOSYS, before 5.6), one openat per component with
 * O_PATH | O_DIRECTORY | O_NOFOLLOW and the last with flags | O_NOFOLLOW (a
 * symlink opened by O_PATH is refused). O_NOFOLLOW and O_CLOEXEC are always
 * added. Returns the fd, or -errno: EINVAL for a path that is not plain,
 * ELOOP or ENOTDIR where a symlink is met, ENOENT, EACCES, ... */
int ckptfs_open_beneath(int dirfd, const char *path, int flags, int walk);

/* ---- cold chunks read back from a pack (ckptfs/coldstore.py) -------------
 *
 * Check n payloads that lie in buf: payload k is buf[offs[k], offs[k] +
 * lens[k]); if ids is not NULL and ids[32k..] is not all zeros, its
 * BLAKE3-256 must be ids[32k..] (a raw payload is the chunk's bytes: the id
 * over all of them proves them, and their CRC is not computed); otherwise its
 * CRC-32C must be crcs[k]. Returns n if all pass, else the index of
 * the first that does not, with *what saying which check failed; -1 if ids
 * were given but the module has no BLAKE3 (ckptfs_chunk_hashes() == 0).
 * n is at most INT_MAX. */
#define CKPTFS_VERIFY_RANGE 1
#define CKPTFS_VERIFY_CRC 2
#define CKPTFS_VERIFY_ID 3
int ckptfs_verify_payloads(const void *buf, size_t buf_len, size_t n,
                           const uint64_t *offs, const uint64_t *lens,
                           const uint32_t *crcs, const uint8_t *ids, int *what);

/* ---- log faults (native/ckptfs_logfault.c) -------------------------------
 *
 * Guard a shared mapping of the log, [base, base + len) mapped with prot:
 * a SIGBUS on one of its pages (the file cut short, a page whose read from
 * the disk failed) maps a zero page over that page and is counted, instead
 * of killing the process (the SIGBUS handler is installed with the first
 * guard; a SIGBUS outside every guarded mapping goes where it went before).
 * Returns the slot, or -1 (too many mappings: do not read it in place).
 * A reader of a guarded mapping takes gen0 = ckptfs_logfault_gen() before
 * it touches it, and trusts what it read only if ckptfs_logfault_clean(slot,
 * gen0) says 1 after; else it reads the bytes again by copying them, and
 * ckptfs_logfault_repair maps the file (fd, whose offset file_off is at
 * base) back over the slot's zeroed pages (a count, or -errno).  Unguard
 * before the mapping goes.  Any thread; the handler is async-signal-safe. */
int ckptfs_logfault_guard(uintptr_t base, size_t len, int prot);
void ckptfs_logfault_unguard(int slot);
uint64_t ckptfs_logfault_gen(void);
int ckptfs_logfault_clean(int slot, uint64_t gen0);
int ckptfs_logfault_repair(int slot, int fd, uint64_t file_off);
/* Faults on guarded mappings handled since the process started. */
uint64_t ckptfs_logfault_count(void);
/* The functions above as a ckptfs_logfault_api (ckptfs_logfault.h), for _fusepath. */
uintptr_t ckptfs_logfault_api_address(void);

#endif
