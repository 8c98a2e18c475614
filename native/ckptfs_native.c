/* Native helpers for ckptfs; see ckptfs_native.h and README.md.
 *
 * Built for baseline x86-64: functions that need newer instructions carry a
 * target attribute and are chosen at load time from cpuid. */
#define _POSIX_C_SOURCE 200809L /* msync and sysconf under -std=c11 */

#include "ckptfs_native.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define CPUID1_EDX_CLFSH (1u << 19) /* cpuid.h has no name for it */
#endif

#define CRC32C_POLY 0x82f63b78u /* Castagnoli, bit-reflected */

enum { FLUSH_NONE, FLUSH_CLFLUSH, FLUSH_CLFLUSHOPT, FLUSH_CLWB };

/* All set once by native_init() when the library is loaded, read-only after. */
static uint32_t sw_table[8][256];
static int have_hw_crc;
static int flush_kind = FLUSH_NONE;
static uintptr_t page_size = 4096;
#if defined(__x86_64__)
static uintptr_t line_size = 64;
#endif

static inline uint64_t load64_le(const unsigned char *p)
{
    /* Byte assembly stays correct on big-endian; compilers fold it to a load. */
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 |
           (uint64_t)p[3] << 24 | (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 |
           (uint64_t)p[6] << 48 | (uint64_t)p[7] << 56;
}

/* ---- CRC-32C, software: slicing-by-8 ------------------------------------ */

static uint32_t crc32c_sw(uint32_t crc, const unsigned char *p, size_t len)
{
    crc = ~crc;
    while (len && ((uintptr_t)p & 7)) {
        crc = (crc >> 8) ^ sw_table[0][(crc ^ *p++) & 0xff];
        len--;
    }
    for (; len >= 8; p += 8, len -= 8) {
        uint64_t v = load64_le(p) ^ crc;
        crc = sw_table[7][v & 0xff] ^ sw_table[6][(v >> 8) & 0xff] ^
              sw_table[5][(v >> 16) & 0xff] ^ sw_table[4][(v >> 24) & 0xff] ^
              sw_table[3][(v >> 32) & 0xff] ^ sw_table[2][(v >> 40) & 0xff] ^
              sw_table[1][(v >> 48) & 0xff] ^ sw_table[0][v >> 56];
    }
    while (len--)
        crc = (crc >> 8) ^ sw_table[0][(crc ^ *p++) & 0xff];
    return ~crc;
}

/* ---- CRC-32C, hardware: three interleaved crc32q streams ----------------- */

#if defined(__x86_64__)
/* crc32q has 3-cycle latency and 1-cycle throughput, so three independent
 * streams keep the unit busy.  The streams are merged by shifting a CRC
 * register over n zero bytes (a multiply by x^(8n) mod P), done by table. */
#define CRC_LONG 8192
#define CRC_SHORT 256
static uint32_t zeros_long[4][256];
static uint32_t zeros_short[4][256];

static inline uint32_t crc_shift(uint32_t zeros[4][256], uint32_t crc)
{
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^
           zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

static inline uint64_t load64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

__attribute__((target("sse4.2")))
static uint32_t crc32c_hw(uint32_t crc, const unsigned char *p, size_t len)
{
    uint64_t c0 = ~crc, c1, c2;

    while (len && ((uintptr_t)p & 7)) {
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
        len--;
    }
    for (; len >= 3 * CRC_LONG; len -= 3 * CRC_LONG) {
        const unsigned char *end = p + CRC_LONG;
        c1 = c2 = 0;
        do {
            c0 = _mm_crc32_u64(c0, load64(p));
            c1 = _mm_crc32_u64(c1, load64(p + CRC_LONG));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * CRC_LONG));
            p += 8;
        } while (p < end);
        c0 = crc_shift(zeros_long, (uint32_t)c0) ^ c1;
        c0 = crc_shift(zeros_long, (uint32_t)c0) ^ c2;
        p += 2 * CRC_LONG;
    }
    for (; len >= 3 * CRC_SHORT; len -= 3 * CRC_SHORT) {
        const unsigned char *end = p + CRC_SHORT;
        c1 = c2 = 0;
        do {
            c0 = _mm_crc32_u64(c0, load64(p));
            c1 = _mm_crc32_u64(c1, load64(p + CRC_SHORT));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * CRC_SHORT));
            p += 8;
        } while (p < end);
        c0 = crc_shift(zeros_short, (uint32_t)c0) ^ c1;
        c0 = crc_shift(zeros_short, (uint32_t)c0) ^ c2;
        p += 2 * CRC_SHORT;
    }
    for (; len >= 8; p += 8, len -= 8)
        c0 = _mm_crc32_u64(c0, load64(p));
    while (len--)
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return ~(uint32_t)c0;
}

/* a * b mod P in the reflected representation, where bit 31 is x^0. */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return p;
}

static void make_zeros_table(uint32_t zeros[4][256], size_t nbytes)
{
    uint32_t op = 1u << 31, sq = 1u << 23; /* x^0 and x^8 */
    for (; nbytes; nbytes >>= 1, sq = multmodp(sq, sq))
        if (nbytes & 1)
            op = multmodp(sq, op);
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 0; k < 4; k++)
            zeros[k][n] = multmodp(op, n << (8 * k));
}
#endif /* __x86_64__ */

uint32_t ckptfs_crc32c(uint32_t crc, const void *buf, size_t len)
{
#if defined(__x86_64__)
    if (have_hw_crc)
        return crc32c_hw(crc, buf, len);
#endif
    return crc32c_sw(crc, buf, len);
}

uint32_t ckptfs_crc32c_sw(uint32_t crc, const void *buf, size_t len)
{
    return crc32c_sw(crc, buf, len);
}

int ckptfs_crc32c_hw(void)
{
    return have_hw_crc;
}

void ckptfs_crc32c_blocks(const void *buf, size_t len, size_t block_size,
                          uint8_t *out)
{
    const unsigned char *p = buf;
    while (len) {
        size_t n = len < block_size ? len : block_size;
        uint32_t c = ckptfs_crc32c(0, p, n);
        out[0] = (uint8_t)c;
        out[1] = (uint8_t)(c >> 8);
        out[2] = (uint8_t)(c >> 16);
        out[3] = (uint8_t)(c >> 24);
        out += 4;
        p += n;
        len -= n;
    }
}

/* ---- cache-line flushes and persistence --------------------------------- */

int ckptfs_flush_kind(void)
{
    return flush_kind;
}

#if defined(__x86_64__)
/* One loop per instruction so the choice is made once, not per line. */
__attribute__((target("clwb")))
static void flush_clwb(uintptr_t p, uintptr_t end, uintptr_t step)
{
    for (; p < end; p += step)
        _mm_clwb((void *)p);
}

__attribute__((target("clflushopt")))
static void flush_clflushopt(uintptr_t p, uintptr_t end, uintptr_t step)
{
    for (; p < end; p += step)
        _mm_clflushopt((void *)p);
}

static void flush_clflush(uintptr_t p, uintptr_t end, uintptr_t step)
{
    for (; p < end; p += step)
        _mm_clflush((void *)p);
}

/* Write back every line touching [addr, addr + len); the caller fences. */
static void flush_lines(const void *addr, size_t len)
{
    uintptr_t p = (uintptr_t)addr & ~(line_size - 1);
    uintptr_t end = (uintptr_t)addr + len;
    switch (flush_kind) {
    case FLUSH_CLWB:
        flush_clwb(p, end, line_size);
        break;
    case FLUSH_CLFLUSHOPT:
        flush_clflushopt(p, end, line_size);
        break;
    case FLUSH_CLFLUSH:
        flush_clflush(p, end, line_size);
        break;
    default:
        break;
    }
}
#endif

int ckptfs_persist(void *addr, size_t len, int dax)
{
    if (len == 0)
        return 0;
#if defined(__x86_64__)
    if (dax && flush_kind != FLUSH_NONE) {
        flush_lines(addr, len);
        _mm_sfence(); /* clflush is ordered already; fence for uniformity */
        return 0;
    }
#else
    (void)dax; /* no portable user-space flush: msync is the barrier */
#endif
    uintptr_t start = (uintptr_t)addr & ~(page_size - 1);
    if (msync((void *)start, (uintptr_t)addr + len - start, MS_SYNC) != 0)
        return errno;
    return 0;
}

void ckptfs_copy_nt(void *dst, const void *src, size_t len)
{
#if defined(__x86_64__)
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t head = (size_t)(-(uintptr_t)d & 15);

    if (len < head + 64) { /* too short for streaming to pay off */
        memcpy(d, s, len);
        flush_lines(d, len);
        _mm_sfence();
        return;
    }
    if (head) {
        memcpy(d, s, head);
        flush_lines(d, head);
        d += head;
        s += head;
        len -= head;
    }
    /* 16-byte streams up to a line boundary, so the main loop fills whole
     * write-combining buffers. */
    for (; len >= 16 && ((uintptr_t)d & 63); d += 16, s += 16, len -= 16)
        _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
    for (; len >= 64; d += 64, s += 64, len -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    for (; len >= 16; d += 16, s += 16, len -= 16)
        _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
    if (len) {
        memcpy(d, s, len);
        flush_lines(d, len);
    }
    _mm_sfence(); /* drain the write-combining buffers and order the flushes */
#else
    memcpy(dst, src, len);
#endif
}

/* ---- load-time setup ---------------------------------------------------- */

__attribute__((constructor))
static void native_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        sw_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++)
            sw_table[k][n] = (sw_table[k - 1][n] >> 8) ^
                             sw_table[0][sw_table[k - 1][n] & 0xff];

    long ps = sysconf(_SC_PAGESIZE);
    if (ps > 0)
        page_size = (uintptr_t)ps;

#if defined(__x86_64__)
    unsigned int a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        have_hw_crc = (c & bit_SSE4_2) != 0;
        if (d & CPUID1_EDX_CLFSH) {
            flush_kind = FLUSH_CLFLUSH;
            if ((b >> 8) & 0xff) /* clflush line size, in 8-byte units */
                line_size = ((b >> 8) & 0xff) * 8;
        }
    }
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        if (b & bit_CLWB)
            flush_kind = FLUSH_CLWB;
        else if (b & bit_CLFLUSHOPT)
            flush_kind = FLUSH_CLFLUSHOPT;
    }
    if (have_hw_crc) {
        make_zeros_table(zeros_long, CRC_LONG);
        make_zeros_table(zeros_short, CRC_SHORT);
    }
#endif
}
