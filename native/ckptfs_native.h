/* Native helpers for ckptfs: CRC-32C and persistent-memory primitives.
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

#endif
