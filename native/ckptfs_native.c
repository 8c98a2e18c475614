/* Native helpers for ckptfs; see ckptfs_native.h and README.md.
 *
 * Built for baseline x86-64: functions that need newer instructions carry a
 * target attribute and are chosen at load time from cpuid. */
#define _POSIX_C_SOURCE 200809L /* msync and sysconf under -std=c11 */

#include "ckptfs_native.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
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

/* Whole blocks of 3 x stride bytes as three streams, merged at each block's
 * end; returns the running CRC register and advances *p and *len. */
__attribute__((target("sse4.2")))
static inline uint64_t crc_blocks(uint64_t c0, const unsigned char **p, size_t *len,
                                  size_t stride, uint32_t zeros[4][256])
{
    const unsigned char *q = *p;
    for (; *len >= 3 * stride; *len -= 3 * stride) {
        const unsigned char *end = q + stride;
        uint64_t c1 = 0, c2 = 0;
        do {
            c0 = _mm_crc32_u64(c0, load64(q));
            c1 = _mm_crc32_u64(c1, load64(q + stride));
            c2 = _mm_crc32_u64(c2, load64(q + 2 * stride));
            q += 8;
        } while (q < end);
        c0 = crc_shift(zeros, (uint32_t)c0) ^ c1;
        c0 = crc_shift(zeros, (uint32_t)c0) ^ c2;
        q += 2 * stride;
    }
    *p = q;
    return c0;
}

__attribute__((target("sse4.2")))
static uint32_t crc32c_hw(uint32_t crc, const unsigned char *p, size_t len)
{
    uint64_t c0 = ~crc;

    while (len && ((uintptr_t)p & 7)) {
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
        len--;
    }
    c0 = crc_blocks(c0, &p, &len, CRC_LONG, zeros_long);
    c0 = crc_blocks(c0, &p, &len, CRC_SHORT, zeros_short);
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

/* ---- content-defined chunking: gear-hash cut points --------------------- */

/* splitmix64 outputs 0..255, seed 0x636b707466734344 ("ckptfsCD"); the tests
 * regenerate it.  Part of the chunk format: a different table moves every cut
 * point, and data chunked before would no longer dedup against data after. */
static const uint64_t gear[256] = {
    0x67c7a32896bbb751, 0x6cdb38b4f93d1077, 0x36e9fecc54f73e64,
    0x5547812cc649d9ac, 0xb4fde50f8952461b, 0xf413e70cf42ae552,
    0xcdf99ce9f247608c, 0xb5051e29c34aa6d9, 0x9a12eba2237a43db,
    0x6ae5a81e6e075493, 0x6efd4fa8316ee4d0, 0x35ca376dfb3d202f,
    0x51052fbdd50fe1ed, 0x390deb10c2231d64, 0x3d64da499eb6bedd,
    0xde2c67370b85918f, 0xb58040c265c3c62b, 0xc9539a89785205d1,
    0x994635f3917d7f1f, 0xc36802fac3ee702b, 0xcf83750abd9ad4f7,
    0xfe17495e6cea4e74, 0x1177f6c3fd8b2c6b, 0x2ecdc77c9bc93ebc,
    0x7610a00002954c1e, 0x98f02581e0e5fa7a, 0xc16f1d8a4bef5757,
    0x8c081538f3b97231, 0xd3ac60809826b944, 0xbb26ee8cb41d75d6,
    0x7ad4d266e7ff6f6d, 0x932469da6a98ae42, 0xe94f50e869d9aa43,
    0x0bc51de45516c66f, 0x3f73aba3b2e5c082, 0x6f7609d6a403dba0,
    0xf6bace162aa65ac7, 0xa42078b09b60e5fe, 0x2f224a36291795ea,
    0x3f5b6a974aa7322b, 0xa34554677c433b37, 0xfe5d8b01b0f0bad6,
    0xf03b316af3c39ab4, 0xec7d495eb58dcd04, 0x5b3113c8a24e3957,
    0x3fe78880bf917320, 0xcaf9828c60d10f90, 0x964706cad8877643,
    0x6a6d91f94045b0b3, 0xe0676d728838fad9, 0x77f78b77fc63ef30,
    0xcdd5e2a9a8c5021f, 0x083429677914a1d5, 0x85d3b914f89ed77f,
    0x7959ad16445f4423, 0x25663a9136fb975b, 0x35606123b3ead546,
    0x7004b51ad970c9bc, 0x32c46a13b8947aa4, 0x3a99a0ec62067bb3,
    0x7a498dcdedff54e4, 0xa3554f3959efd4e6, 0x035c4482151b122a,
    0x04620c2df310fafd, 0x9b6e9aea3e64376f, 0xbe0e8d8e0f1fd5a4,
    0x478f89ef5beba031, 0x65d3a3b02261bde4, 0xdafe854268a06b4e,
    0x4cad730e206828c5, 0x9b6253d96e1c3111, 0x875a32fe61de1961,
    0xb217f15a66086489, 0xd8b034df2dddf3ee, 0x7eb97271cd573160,
    0x9837add99c9bb0a9, 0xcc01615bb5c62276, 0x15b11581355d991a,
    0xf708ecbede820ed4, 0xde70c2342be7d4e7, 0x58da64c17135c5ac,
    0x19e06f7b7e15d2f9, 0xd9247dc585b77f09, 0x4e80324099121d44,
    0x22cc666b33d27afa, 0x5bb4021e3a299224, 0x6e04ccab83940069,
    0x3edeb8307f6a4333, 0xa362f1f74343a4a3, 0xe3088efa168b86b9,
    0x81b50751d484f9a7, 0x31155999afed13b4, 0x4c7a969ccb97679d,
    0x0567648e16e8e8b2, 0x89fd6f176853dd29, 0x61bae112a41b2d61,
    0xb73fee22d3d4594f, 0xac0a8038eb5976de, 0x4bc1b9a67c7cf012,
    0x1131ac4abb54e5ed, 0x9f04971340f6864d, 0xb5946bb30481e1db,
    0xab51f3c82c155fe0, 0x963de1ec6eca5de9, 0xe920bd000a0e1b5c,
    0x9c21b43bfc51a94c, 0x14f96b16001f9eb9, 0xd3ded087edaf7a7f,
    0xff7dcf2ce4a1b11f, 0xf5145655bc2f0530, 0x9217ab5340b0aaee,
    0x726b4e5108b0b5e2, 0xba1803d81d9362bd, 0x821934199af70723,
    0x0a938ac727c1db82, 0x57db532b282258a0, 0x0a4ea81e920ad76d,
    0x078ec2535aaf7bc2, 0xdb0cb7a7e2de8c88, 0x7ba8102cc9556d94,
    0x2e759ade6bc52e1c, 0x4e00539b4276cc95, 0xd2b9e989b3d4ca9a,
    0x4a9f6391883ceac6, 0x050bb2af42518e6f, 0xc2aa8dc544a864ac,
    0x1f38bca241f621ac, 0x31306855095407b5, 0x0eedfb4ed27c51a0,
    0xdccb090afa22c3f5, 0xb655027ef97be2a7, 0xd34713aaa2a18210,
    0x5800b2b725f357b8, 0x45daeab0262db68e, 0x994269f1bcaffd58,
    0x2bdc5275fe8a3c67, 0xab58c9127f1a9cb8, 0xae1eefd42e6ccfba,
    0x11fcb617e50bab8b, 0x729d961e011f1f16, 0xb5209f29e22247ae,
    0xda75ff3c88721f69, 0xb00ea2a00c939a0a, 0x056965424b80ce5f,
    0xbb0987091e1a804e, 0x50b92aec302d2180, 0x67ec5728ddc0156c,
    0x92cf4acfe6ad0509, 0xb9728e126db29c2f, 0xd515b06a19be09e5,
    0x8126d28f6cf7c51c, 0x7aaa13be61985837, 0x0f50e48b62edc9b3,
    0x22aeef0131817003, 0x3fea835dc19c8ff5, 0xaa09425950afb8b2,
    0x9454f61c8ab22cf3, 0x5a742b26be5f0f72, 0x810aa63c35c1c02b,
    0xdce929838f9bf553, 0x6420a0d0159198f6, 0x09f6b241429c90fa,
    0x0f629982ca20cffd, 0xb2e84f375cc4ff9c, 0xef8bd51bdd698863,
    0xda0765f4a8d22f34, 0xa1178f635d20f0c7, 0xf21fad61bb967377,
    0xa4bbc99002c1d723, 0x8f4bc716b8379c71, 0x143d728fefa7df65,
    0xacc872af850c5a37, 0x0970b2439dd3b38c, 0x0e978e9d1952547b,
    0xc169e9e8f21601ab, 0x719dbbcfb65a4aca, 0x865e7704b1cca280,
    0x65a37b4a8ba9f9bd, 0xe14b96cd7bbe371c, 0x791ca9af68d135a9,
    0x6137b0dca4d31194, 0xaf660a4569e19c32, 0xfa500e63096f89b3,
    0x2df3a1be5c7d72bd, 0xfb219d1f0888c50c, 0xf5e57d2cffbb3d50,
    0x06da67847d2bee63, 0x1197374efb60f2e6, 0x7519b7aa98df29d5,
    0xc6a3bc182e3313ef, 0xa33d0998cc6f2381, 0xfe5ab70ea3b0d6d1,
    0xa732d85c81a261b9, 0x1119d8760ff65138, 0x5ad2941fae16d14c,
    0x19ba82b3e1242d72, 0x6ea983dee718b3a0, 0xefebd3bf3bea89ba,
    0xedf8601d728a85c5, 0x7bac2d95a44e48c8, 0x433c2791416b83d3,
    0xfc7917947585d969, 0x8e857f528a4efa1b, 0xb7d0018bdd01c1e6,
    0x3f529c0d11acdc73, 0x3814433ef0c41c47, 0x2d4cc350d7be7c94,
    0x4ccc2319baaec9b1, 0xf9af888e135fe349, 0x24e3e0f02f41a43a,
    0xb2fad8f3a926d3a2, 0x6ab18fb6e3e8c492, 0xd6a5879a1e21d8ea,
    0xa2475cd1a276b09e, 0x6ee238b2523e3496, 0xff7e3134514c15f1,
    0xf491033165c68867, 0x2da58923c6b52c30, 0xe9f21b8017a2f7d3,
    0xd80505bbcee06153, 0x2c0199107ae26e02, 0xed95db3380309c50,
    0xe70cfe10e7e00248, 0x2b8f19797d82f103, 0xbf8d9787c8fb6c24,
    0x99676942ce47ff1b, 0xb9396cfc056a53de, 0x4ece1817a0fcfd45,
    0xd0442a2a4fd3f850, 0x7f8533a1135c6200, 0xb3a97c34a171fc31,
    0x64dff22e9f6fb12b, 0xbbf12af0e2af9544, 0x53921bba4e231d8a,
    0x54940338951db57e, 0x10359e9ccee164dd, 0xd173b8012a0b13cd,
    0x233884aef7ead50e, 0x56312636004dcf8d, 0x8c30f3d94ee30bf4,
    0xb0f72b57ec674c92, 0x30d0390a51e8c7d1, 0xe4c00b584e505aeb,
    0x731d3c5e70eca93b, 0x3d6794f545be2dae, 0xfc5295db159420cc,
    0x977fd24ea6d70dca, 0x38f6e2795f01bda0, 0x146c500f10cd121a,
    0xff66fb9c9f0f1768, 0x01ced1f0a100424b, 0xd25e0c7e0e2c510c,
    0xc233d6ae4a50b8d9, 0x71f91edfce4c1a8f, 0x21e1c0cd923a0664,
    0x3b27bde4d5f8e49d,
};

/* Hash p[0..n) continuing from *hp and return the index of the first byte
 * after which the hash is below thr, or n if there is none.  *hp becomes the
 * hash up to and including that byte (all n bytes if none).
 *
 * The plain loop, h = 2h + gear[x], is bound by its one-cycle dependency
 * chain.  Two bytes per step, h2 = 4h + (2 g0 + g1), leave one lea on the
 * chain and let the loads and compares of neighbouring steps overlap. */
#define GEAR_PAIR(k)                                                          \
    do {                                                                      \
        uint64_t g0 = gear[p[i + (k)]], g1 = gear[p[i + (k) + 1]];            \
        uint64_t h1 = (h << 1) + g0, h2 = (h << 2) + ((g0 << 1) + g1);        \
        if (__builtin_expect(h1 < thr, 0)) {                                  \
            *hp = h1;                                                         \
            return i + (k);                                                   \
        }                                                                     \
        if (__builtin_expect(h2 < thr, 0)) {                                  \
            *hp = h2;                                                         \
            return i + (k) + 1;                                               \
        }                                                                     \
        h = h2;                                                               \
    } while (0)

static size_t gear_find_scalar(const unsigned char *p, size_t n, uint64_t *hp,
                               uint64_t thr)
{
    uint64_t h = *hp;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        GEAR_PAIR(0);
        GEAR_PAIR(2);
        GEAR_PAIR(4);
        GEAR_PAIR(6);
    }
    for (; i < n; i++) {
        h = (h << 1) + gear[p[i]];
        if (h < thr) {
            *hp = h;
            return i;
        }
    }
    *hp = h;
    return n;
}
#undef GEAR_PAIR

/* h of the 64 bytes ending at p[j] (j >= 63): the window alone, whatever came
 * before it, as the rule says. */
static uint64_t gear_window(const unsigned char *p, size_t j)
{
    uint64_t h = 0;
    for (size_t i = j - 63; i <= j; i++)
        h = (h << 1) + gear[p[i]];
    return h;
}

#if defined(__x86_64__)
/* The scan in 16 lanes at once (two AVX-512 registers of eight 64-bit
 * hashes), for long spans.  The scalar loop is bound by its loads and
 * compares (about 1.6 GB/s here); here each lane runs the same recurrence over
 * its own stretch of the span, its table loads one gather for eight lanes.
 * Since h depends on the last 64 bytes only, a lane hashes the 64 bytes before
 * its stretch first and then has the exact h of every byte in it.  A round
 * gives each lane GEAR_LANE_BYTES consecutive bytes; the first cut is the
 * first hit of the lowest lane that has one (lanes are in byte order), found
 * again byte by byte inside its group of eight.  A cut at a hit means the
 * rest of its round was hashed for nothing: about half a round (8 KiB) per
 * cut beyond avg_size, against 64 KiB chunks. */
static int gear_vector; /* set by native_init: AVX-512F and AVX-512BW usable */

#define GEAR_LANES 16
#define GEAR_LANE_BYTES 1024
#define GEAR_LANE_MIN 256 /* shorter spans: the warm-up would cost more than it saves */

__attribute__((target("avx512f,avx512bw")))
static size_t gear_find_avx512(const unsigned char *p, size_t s, size_t n, uint64_t thr,
                               size_t lane_bytes)
{
    /* Bytes p[s..n), s >= 64: the first j with h(j) < thr, or n. */
    const __m512i t_v = _mm512_set1_epi64((long long)thr);
    /* pick[k]: byte k of each 64-bit lane moved to its low byte, the other
     * seven zeroed (pshufb zeroes where the control byte's top bit is set):
     * the table index of the lane's k-th byte in one shuffle, not a shift and
     * a mask. */
    __m512i pick[8];
    for (int k = 0; k < 8; k++)
        pick[k] = _mm512_set_epi64(0x8080808080808000LL | (8 + k), 0x8080808080808000LL | k,
                                   0x8080808080808000LL | (8 + k), 0x8080808080808000LL | k,
                                   0x8080808080808000LL | (8 + k), 0x8080808080808000LL | k,
                                   0x8080808080808000LL | (8 + k), 0x8080808080808000LL | k);
    while (n - s >= GEAR_LANES * GEAR_LANE_MIN) {
        size_t b = (n - s) / GEAR_LANES;
        b = b > lane_bytes ? lane_bytes : b & ~(size_t)7;
        /* lane l hashes p[s + l*b - 64 .. s + (l+1)*b) */
        const long long o = (long long)(s - 64), w = (long long)b;
        __m512i a0 = _mm512_set_epi64(o + 7 * w, o + 6 * w, o + 5 * w, o + 4 * w,
                                      o + 3 * w, o + 2 * w, o + w, o);
        __m512i a1 = _mm512_add_epi64(a0, _mm512_set1_epi64(8 * w));
        __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
        uint32_t hit_lanes = 0;
        size_t hit_t[GEAR_LANES];
        const __m512i eight = _mm512_set1_epi64(8);
        for (size_t t = 0; t < b + 64; t += 8) {
            __m512i v0 = _mm512_i64gather_epi64(a0, (const void *)p, 1);
            __m512i v1 = _mm512_i64gather_epi64(a1, (const void *)p, 1);
            a0 = _mm512_add_epi64(a0, eight);
            a1 = _mm512_add_epi64(a1, eight);
            /* The smallest hash of each lane over the eight steps: below thr
             * exactly when one of them is (one min a step, one compare a group). */
            __m512i lo0 = _mm512_set1_epi64(-1), lo1 = lo0;
#define GEAR_STEP(k)                                                                  \
            do {                                                                      \
                __m512i i0 = _mm512_shuffle_epi8(v0, pick[k]);                        \
                __m512i i1 = _mm512_shuffle_epi8(v1, pick[k]);                        \
                __m512i g0 = _mm512_i64gather_epi64(i0, (const void *)gear, 8);       \
                __m512i g1 = _mm512_i64gather_epi64(i1, (const void *)gear, 8);       \
                h0 = _mm512_add_epi64(_mm512_slli_epi64(h0, 1), g0);                  \
                h1 = _mm512_add_epi64(_mm512_slli_epi64(h1, 1), g1);                  \
                lo0 = _mm512_min_epu64(lo0, h0);                                      \
                lo1 = _mm512_min_epu64(lo1, h1);                                      \
            } while (0)
            GEAR_STEP(0); GEAR_STEP(1); GEAR_STEP(2); GEAR_STEP(3);
            GEAR_STEP(4); GEAR_STEP(5); GEAR_STEP(6); GEAR_STEP(7);
#undef GEAR_STEP
            __mmask8 m0 = _mm512_cmplt_epu64_mask(lo0, t_v);
            __mmask8 m1 = _mm512_cmplt_epu64_mask(lo1, t_v);
            if (__builtin_expect((m0 | m1) != 0, 0) && t >= 64) {
                uint32_t fresh = ((uint32_t)m0 | (uint32_t)m1 << 8) & ~hit_lanes;
                hit_lanes |= fresh;
                while (fresh) {
                    int l = __builtin_ctz(fresh);
                    hit_t[l] = t - 64;
                    fresh &= fresh - 1;
                }
                if (hit_lanes & 1)
                    break; /* nothing comes before lane 0's first hit */
            }
        }
        if (hit_lanes) {
            int l = __builtin_ctz(hit_lanes);
            size_t j = s + (size_t)l * b + hit_t[l];
            uint64_t h = gear_window(p, j - 1);
            for (size_t e = j + 8; j < e; j++) {
                h = (h << 1) + gear[p[j]];
                if (h < thr)
                    return j;
            }
            /* unreachable: the lane saw a hit in these eight bytes */
        }
        s += GEAR_LANES * b;
    }
    uint64_t h = gear_window(p, s - 1);
    size_t f = gear_find_scalar(p + s, n - s, &h, thr);
    return s + f;
}
#endif

/* The first byte of p[0..n) after which the hash (continuing from *hp) is
 * below thr, or n; *hp becomes the hash up to it (see gear_find_scalar). */
static size_t gear_find(const unsigned char *p, size_t n, uint64_t *hp, uint64_t thr)
{
#if defined(__x86_64__)
    /* A cut comes every 2^64 / thr bytes or so; a round should be shorter,
     * or most of it is hashed for nothing. */
    size_t lane_bytes = thr ? (size_t)1 << (64 - __builtin_ctzll(thr) - 5) : GEAR_LANE_BYTES;
    if (gear_vector && lane_bytes >= GEAR_LANE_MIN && n >= 64 + GEAR_LANES * GEAR_LANE_MIN) {
        /* The first 64 hashes still see *hp; from p[63] on, the window alone. */
        size_t f = gear_find_scalar(p, 64, hp, thr);
        if (f < 64)
            return f;
        f = gear_find_avx512(p, 64, n, thr,
                             lane_bytes < GEAR_LANE_BYTES ? lane_bytes : GEAR_LANE_BYTES);
        *hp = gear_window(p, f < n ? f : n - 1);
        return f;
    }
#endif
    return gear_find_scalar(p, n, hp, thr);
}

#if defined(__x86_64__)
/* CPU seconds of the fastest of a few scans of buf in the current form
 * (thread CPU time, so a preemption does not count). */
static double gear_scan_seconds(const unsigned char *buf, size_t n)
{
    double best = 1e9;
    for (int r = 0; r < 3; r++) {
        struct timespec a, b;
        uint64_t h = 0;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
        /* thr 1: no hit (h == 0) on random bytes, so both forms scan it all */
        volatile size_t f = gear_find(buf, n, &h, 1);
        (void)f;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
        double s = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
        if (s < best)
            best = s;
    }
    return best;
}

/* Whether the lanes beat the scalar loop on this CPU.  The CPU flags do not
 * say: the lanes are bound by their gathers, fast on Intel's AVX-512 cores
 * (0.30 against 0.60 ms/MiB) and microcoded on AMD's Zen 4 (0.74 against
 * 0.24), so the form is picked by timing both over 256 KiB (under 1 ms). */
static int gear_vector_pays(void)
{
    const size_t n = 256 << 10;
    unsigned char *buf = malloc(n);
    if (!buf)
        return 1;
    uint64_t x = 0x9e3779b97f4a7c15u;
    for (size_t i = 0; i < n; i += 8) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        memcpy(buf + i, &x, 8);
    }
    gear_vector = 0;
    double scalar = gear_scan_seconds(buf, n);
    gear_vector = 1;
    double lanes = gear_scan_seconds(buf, n);
    free(buf);
    return lanes < scalar;
}
#endif

int ckptfs_gear_vector(int on)
{
#if defined(__x86_64__)
    int was = gear_vector;
    if (on >= 0)
        gear_vector = on && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw");
    return was;
#else
    (void)on;
    return 0;
#endif
}


static inline uint64_t min_u64(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

size_t ckptfs_gear_cuts(ckptfs_gear_state *state, const void *buf, size_t len,
                        size_t min_size, size_t avg_size, size_t max_size,
                        size_t *cuts, size_t max_cuts)
{
    if (min_size < 64 || min_size > avg_size || avg_size > max_size ||
        (avg_size & (avg_size - 1)) != 0 || avg_size > ((uint64_t)1 << 40))
        return SIZE_MAX;

    const unsigned char *p = buf;
    const uint64_t mn = min_size, avg = avg_size, mx = max_size;
    const int bits = 63 - __builtin_clzll(avg);
    const uint64_t thr_small = (uint64_t)1 << (64 - bits - 2);
    const uint64_t thr_large = (uint64_t)1 << (64 - bits + 2);
    uint64_t h = state->hash, j = state->pending; /* j: chunk offset of p[i] */
    size_t i = 0, n = 0;

    while (i < len && n < max_cuts) {
        uint64_t left = len - i;
        if (j + 64 < mn) {
            /* No cut can end here and these bytes fall out of the hash
             * window before the first candidate end: skip them. */
            uint64_t k = min_u64(mn - 64 - j, left);
            i += k;
            j += k;
            h = 0;
            continue;
        }
        if (j + 1 < mn) {
            /* The 63 bytes before the first candidate end fill the window. */
            uint64_t k = min_u64(mn - 1 - j, left);
            for (size_t e = i + k; i < e; i++)
                h = (h << 1) + gear[p[i]];
            j += k;
            continue;
        }
        uint64_t span, thr;
        if (j + 1 < avg) {
            span = avg - 1 - j; /* candidate lengths j+1 .. avg-1 */
            thr = thr_small;
        } else {
            span = mx - 1 - j; /* candidate lengths j+1 .. max-1 */
            thr = thr_large;
        }
        if (span == 0) { /* j == max - 1: this byte ends a max-size chunk */
            cuts[n++] = ++i;
            j = h = 0;
            continue;
        }
        uint64_t k = min_u64(span, left);
        size_t f = gear_find(p + i, k, &h, thr);
        if (f < k) {
            i += f + 1;
            cuts[n++] = i;
            j = h = 0;
        } else {
            i += k;
            j += k;
        }
    }
    state->hash = h;
    state->pending = j;
    return n;
}

/* ---- naming chunks as they are cut ---------------------------------------- */

#ifdef CKPTFS_HAVE_BLAKE3
/* The BLAKE3 team's C implementation (SIMD chosen at run time), built from
 * Debian's librust-blake3-dev by ckptfs/_native_build.py when present. */
#include "blake3.h"
_Static_assert(sizeof(blake3_hasher) <= sizeof(((ckptfs_chunk_state *)0)->hasher),
               "ckptfs_chunk_state.hasher too small for blake3_hasher");
#endif

int ckptfs_chunk_hashes(void)
{
#ifdef CKPTFS_HAVE_BLAKE3
    return 1;
#else
    return 0;
#endif
}

static int all_zero(const unsigned char *p, size_t n)
{
    uint64_t acc = 0;
    size_t i = 0;
    /* Random data leaves at the first word; zero runs cost one pass. */
    for (; i + 64 <= n; i += 64) {
        uint64_t w[8];
        memcpy(w, p + i, 64);
        acc = w[0] | w[1] | w[2] | w[3] | w[4] | w[5] | w[6] | w[7];
        if (acc)
            return 0;
    }
    for (; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

static void put_le32(uint8_t *out, uint32_t c)
{
    out[0] = (uint8_t)c;
    out[1] = (uint8_t)(c >> 8);
    out[2] = (uint8_t)(c >> 16);
    out[3] = (uint8_t)(c >> 24);
}

/* Add n bytes to the pending chunk's CRCs and zero flag. */
static void chunk_absorb(ckptfs_chunk_state *st, const unsigned char *p, size_t n,
                         size_t block, int hash)
{
#ifdef CKPTFS_HAVE_BLAKE3
    if (hash && n) {
        blake3_hasher *h = (blake3_hasher *)st->hasher;
        if (!st->hashing) {
            blake3_hasher_init(h);
            st->hashing = 1;
        }
        blake3_hasher_update(h, p, n);
    }
#else
    (void)hash;
#endif
    while (n) {
        size_t in_block = st->absorbed % block;
        size_t take = block - in_block < n ? block - in_block : n;
        st->crc = ckptfs_crc32c(st->crc, p, take);
        if (!st->nonzero && !all_zero(p, take))
            st->nonzero = 1;
        st->absorbed += take;
        p += take;
        n -= take;
        if (st->absorbed % block == 0) {
            put_le32(st->crcs + 4 * (st->absorbed / block - 1), st->crc);
            st->crc = 0;
        }
    }
}

/* Store the pending chunk at slot k and start a new one. */
static void chunk_emit(ckptfs_chunk_state *st, size_t block, size_t k,
                       uint64_t *lengths, uint8_t *zero, uint8_t *crcs, uint8_t *ids)
{
    size_t nblocks = (st->absorbed + block - 1) / block;
    if (ids) {
#ifdef CKPTFS_HAVE_BLAKE3
        if (st->nonzero && st->hashing)
            blake3_hasher_finalize((const blake3_hasher *)st->hasher, ids + 32 * k, 32);
        else
#endif
            memset(ids + 32 * k, 0, 32);
    }
    st->hashing = 0;
    if (st->absorbed % block)
        put_le32(st->crcs + 4 * (nblocks - 1), st->crc);
    lengths[k] = st->absorbed;
    zero[k] = st->nonzero ? 0 : 1;
    memcpy(crcs + 64 * k, st->crcs, 4 * nblocks);
    st->absorbed = 0;
    st->crc = 0;
    st->nonzero = 0;
}

size_t ckptfs_chunk_feed(ckptfs_chunk_state *st, const void *buf, size_t len,
                         const uint64_t *forced, size_t nforced,
                         size_t min_size, size_t avg_size, size_t max_size,
                         size_t crc_block, uint64_t *ends, uint64_t *lengths,
                         uint8_t *zero, uint8_t *crcs, uint8_t *ids, size_t max_out)
{
    if (min_size < 64 || min_size > avg_size || avg_size > max_size ||
        (avg_size & (avg_size - 1)) != 0 || avg_size > ((uint64_t)1 << 40) ||
        crc_block == 0 || max_size > CKPTFS_CHUNK_MAX_CRCS * (uint64_t)crc_block ||
        max_out < len / min_size + nforced + 1)
        return SIZE_MAX;
    for (size_t f = 0; f < nforced; f++)
        if (forced[f] > len || (f && forced[f] < forced[f - 1]))
            return SIZE_MAX;

    const unsigned char *p = buf;
    size_t cuts[64];
    size_t pos = 0, n = 0, f = 0;
    for (;;) {
        size_t seg_end = f < nforced ? forced[f] : len;
        /* Scan [pos, seg_end): the gear cuts, each chunk CRC'd up to its end. */
        while (pos < seg_end) {
            size_t got = ckptfs_gear_cuts(&st->gear, p + pos, seg_end - pos, min_size,
                                          avg_size, max_size, cuts, 64);
            size_t at = pos;
            for (size_t c = 0; c < got; c++) {
                size_t end = pos + cuts[c];
                chunk_absorb(st, p + at, end - at, crc_block, ids != NULL);
                ends[n] = end;
                chunk_emit(st, crc_block, n, lengths, zero, crcs, ids);
                n++;
                at = end;
            }
            if (got < 64) {
                chunk_absorb(st, p + at, seg_end - at, crc_block, ids != NULL);
                pos = seg_end;
            } else {
                pos = at;       /* the cuts buffer filled: scan on from the last cut */
            }
        }
        if (f == nforced)
            break;
        /* A forced cut at seg_end. */
        if (st->absorbed) {
            ends[n] = seg_end;
            chunk_emit(st, crc_block, n, lengths, zero, crcs, ids);
            n++;
        }
        st->gear.hash = 0;
        st->gear.pending = 0;
        f++;
    }
    return n;
}

size_t ckptfs_chunk_finish(ckptfs_chunk_state *st, size_t crc_block,
                           uint64_t *lengths, uint8_t *zero, uint8_t *crcs,
                           uint8_t *ids)
{
    size_t n = 0;
    if (crc_block && st->absorbed) {
        chunk_emit(st, crc_block, 0, lengths, zero, crcs, ids);
        n = 1;
    }
    memset(st, 0, sizeof *st);
    return n;
}

int ckptfs_name_pieces(const void *buf, size_t len, const uint64_t *offs,
                       const uint64_t *lens, size_t n, size_t crc_block,
                       uint8_t *zero, uint8_t *crcs, uint8_t *ids)
{
    if (crc_block == 0)
        return -1;
    for (size_t k = 0; k < n; k++)
        if (lens[k] == 0 || offs[k] > len || lens[k] > len - offs[k] ||
            lens[k] > CKPTFS_CHUNK_MAX_CRCS * (uint64_t)crc_block)
            return -1;
    const unsigned char *p = buf;
    ckptfs_chunk_state st;
    memset(&st, 0, sizeof st);
    for (size_t k = 0; k < n; k++) {
        uint64_t length;
        /* Each piece a stream of its own: absorbed whole, then emitted as
         * ckptfs_chunk_finish would (the state starts clean for the next). */
        chunk_absorb(&st, p + offs[k], lens[k], crc_block, ids != NULL);
        chunk_emit(&st, crc_block, 0, &length, zero + k, crcs + 64 * k,
                   ids ? ids + 32 * k : NULL);
    }
    return 0;
}

size_t ckptfs_find4(const void *buf, size_t len, const void *needle)
{
    const unsigned char *p = buf, *q = needle;
    size_t i = 0;
    if (len < 4)
        return len;
#if defined(__x86_64__)
    /* Compare the first and last needle bytes 16 positions at a time and
     * check the rare positions where both match (W. Mula's generic SIMD
     * substring search); SSE2 is baseline on x86-64. */
    const __m128i first = _mm_set1_epi8((char)q[0]);
    const __m128i last = _mm_set1_epi8((char)q[3]);
    for (; i + 19 <= len; i += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(p + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(p + i + 3));
        unsigned mask = (unsigned)_mm_movemask_epi8(
            _mm_and_si128(_mm_cmpeq_epi8(a, first), _mm_cmpeq_epi8(b, last)));
        while (mask) {
            unsigned bit = (unsigned)__builtin_ctz(mask);
            if (p[i + bit + 1] == q[1] && p[i + bit + 2] == q[2])
                return i + bit;
            mask &= mask - 1;
        }
    }
#endif
    for (; i + 4 <= len; i++)
        if (p[i] == q[0] && p[i + 1] == q[1] && p[i + 2] == q[2] &&
            p[i + 3] == q[3])
            return i;
    return len;
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
    __builtin_cpu_init();
    gear_vector = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    if (gear_vector)
        gear_vector = gear_vector_pays();
    if (have_hw_crc) {
        make_zeros_table(zeros_long, CRC_LONG);
        make_zeros_table(zeros_short, CRC_SHORT);
    }
#endif
}

/* ---- chunk compression: byte planes, float layout, rANS ----------------- *
 *
 * See ckptfs/codec.py and docs/COMPRESSION.md for the payload formats.  The
 * entropy coder is rANS (J. Duda; the arithmetic follows F. Giesen's
 * rans64): 64-bit states kept in [2^31, 2^63), 32-bit renormalisation
 * words, four interleaved states (value i belongs to state i % 4), each with
 * its own word stream so no state waits on another's read pointer,
 * probabilities quantised to 2^12.  A symbol may carry `raw` extra bits,
 * coded as part of a symbol with the same frequency in a 2^(12 + raw)
 * scale: they sit in the state just above the 12 slot bits, so they cost
 * one shift and one mask to decode and never a table entry. */

#include <stdlib.h>

#define RANS_L (UINT64_C(1) << 31)
#define RANS_LANES 4
#define RANS_SCALE_BITS 12
#define RANS_SCALE (1u << RANS_SCALE_BITS)
#define RANS_MAX_SYMBOLS RANS_SCALE

static float log2_frac[1025]; /* log2(1 + i / 1024), set by codec_init */

static inline float flog2(uint32_t c) /* c >= 1, about 1e-3 accurate */
{
    int e = 31 - __builtin_clz(c);
    uint32_t f = e >= 10 ? (c >> (e - 10)) & 1023 : (c << (10 - e)) & 1023;
    return (float)e + log2_frac[f];
}

static inline uint32_t load32_le(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
           (uint32_t)p[3] << 24;
}

static inline void store32_le(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

/* -- byte planes -- */

static void split2(const uint8_t *s, size_t n, uint8_t *d0, uint8_t *d1)
{
    size_t i = 0;
#if defined(__x86_64__)
    const __m128i m = _mm_set1_epi16(0x00ff);
    for (; i + 32 <= n; i += 32) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + 2 * i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 2 * i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 2 * i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(s + 2 * i + 48));
        _mm_storeu_si128((__m128i *)(d0 + i),
                         _mm_packus_epi16(_mm_and_si128(a, m), _mm_and_si128(b, m)));
        _mm_storeu_si128((__m128i *)(d1 + i),
                         _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
        _mm_storeu_si128((__m128i *)(d0 + i + 16),
                         _mm_packus_epi16(_mm_and_si128(c, m), _mm_and_si128(d, m)));
        _mm_storeu_si128((__m128i *)(d1 + i + 16),
                         _mm_packus_epi16(_mm_srli_epi16(c, 8), _mm_srli_epi16(d, 8)));
    }
#endif
    for (; i < n; i++) {
        d0[i] = s[2 * i];
        d1[i] = s[2 * i + 1];
    }
}

static void merge2(const uint8_t *s0, const uint8_t *s1, size_t n, uint8_t *d)
{
    size_t i = 0;
#if defined(__x86_64__)
    for (; i + 32 <= n; i += 32) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s0 + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s1 + i));
        __m128i c = _mm_loadu_si128((const __m128i *)(s0 + i + 16));
        __m128i e = _mm_loadu_si128((const __m128i *)(s1 + i + 16));
        _mm_storeu_si128((__m128i *)(d + 2 * i), _mm_unpacklo_epi8(a, b));
        _mm_storeu_si128((__m128i *)(d + 2 * i + 16), _mm_unpackhi_epi8(a, b));
        _mm_storeu_si128((__m128i *)(d + 2 * i + 32), _mm_unpacklo_epi8(c, e));
        _mm_storeu_si128((__m128i *)(d + 2 * i + 48), _mm_unpackhi_epi8(c, e));
    }
#endif
    for (; i < n; i++) {
        d[2 * i] = s0[i];
        d[2 * i + 1] = s1[i];
    }
}

static void split4(const uint8_t *s, size_t n, uint8_t *d0, uint8_t *d1,
                   uint8_t *d2, uint8_t *d3)
{
    size_t i = 0;
#if defined(__x86_64__)
    /* Two rounds of the 2-way split: 16-bit halves, then bytes. */
    const __m128i m = _mm_set1_epi16(0x00ff);
    for (; i + 16 <= n; i += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + 4 * i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 4 * i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 4 * i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(s + 4 * i + 48));
        __m128i l1 = _mm_packus_epi16(_mm_and_si128(a, m), _mm_and_si128(b, m));
        __m128i h1 = _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8));
        __m128i l2 = _mm_packus_epi16(_mm_and_si128(c, m), _mm_and_si128(d, m));
        __m128i h2 = _mm_packus_epi16(_mm_srli_epi16(c, 8), _mm_srli_epi16(d, 8));
        _mm_storeu_si128((__m128i *)(d0 + i),
                         _mm_packus_epi16(_mm_and_si128(l1, m), _mm_and_si128(l2, m)));
        _mm_storeu_si128((__m128i *)(d2 + i),
                         _mm_packus_epi16(_mm_srli_epi16(l1, 8), _mm_srli_epi16(l2, 8)));
        _mm_storeu_si128((__m128i *)(d1 + i),
                         _mm_packus_epi16(_mm_and_si128(h1, m), _mm_and_si128(h2, m)));
        _mm_storeu_si128((__m128i *)(d3 + i),
                         _mm_packus_epi16(_mm_srli_epi16(h1, 8), _mm_srli_epi16(h2, 8)));
    }
#endif
    for (; i < n; i++) {
        d0[i] = s[4 * i];
        d1[i] = s[4 * i + 1];
        d2[i] = s[4 * i + 2];
        d3[i] = s[4 * i + 3];
    }
}

static void merge4(const uint8_t *s0, const uint8_t *s1, const uint8_t *s2,
                   const uint8_t *s3, size_t n, uint8_t *d)
{
    size_t i = 0;
#if defined(__x86_64__)
    for (; i + 16 <= n; i += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s0 + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s1 + i));
        __m128i c = _mm_loadu_si128((const __m128i *)(s2 + i));
        __m128i e = _mm_loadu_si128((const __m128i *)(s3 + i));
        __m128i ab_lo = _mm_unpacklo_epi8(a, b), ab_hi = _mm_unpackhi_epi8(a, b);
        __m128i ce_lo = _mm_unpacklo_epi8(c, e), ce_hi = _mm_unpackhi_epi8(c, e);
        _mm_storeu_si128((__m128i *)(d + 4 * i), _mm_unpacklo_epi16(ab_lo, ce_lo));
        _mm_storeu_si128((__m128i *)(d + 4 * i + 16), _mm_unpackhi_epi16(ab_lo, ce_lo));
        _mm_storeu_si128((__m128i *)(d + 4 * i + 32), _mm_unpacklo_epi16(ab_hi, ce_hi));
        _mm_storeu_si128((__m128i *)(d + 4 * i + 48), _mm_unpackhi_epi16(ab_hi, ce_hi));
    }
#endif
    for (; i < n; i++) {
        d[4 * i] = s0[i];
        d[4 * i + 1] = s1[i];
        d[4 * i + 2] = s2[i];
        d[4 * i + 3] = s3[i];
    }
}

/* Byte planes: split puts byte p of each width-byte value into plane p (n
 * values, plane-major), merge undoes it; the len % width bytes after the
 * last whole value are copied as they are. */
static void planes(const uint8_t *s, size_t len, size_t width, uint8_t *d, int merge)
{
    if (width <= 1) {
        memcpy(d, s, len);
        return;
    }
    size_t n = len / width, body = n * width;
    if (width == 2 && merge) {
        merge2(s, s + n, n, d);
    } else if (width == 2) {
        split2(s, n, d, d + n);
    } else if (width == 4 && merge) {
        merge4(s, s + n, s + 2 * n, s + 3 * n, n, d);
    } else if (width == 4) {
        split4(s, n, d, d + n, d + 2 * n, d + 3 * n);
    } else if (merge) {
        for (size_t i = 0; i < n; i++)
            for (size_t p = 0; p < width; p++)
                d[i * width + p] = s[p * n + i];
    } else {
        for (size_t i = 0; i < n; i++)
            for (size_t p = 0; p < width; p++)
                d[p * n + i] = s[i * width + p];
    }
    memcpy(d + body, s + body, len - body);
}

void ckptfs_split_planes(const void *src, size_t len, size_t width, void *dst)
{
    planes(src, len, width, dst, 0);
}

void ckptfs_merge_planes(const void *src, size_t len, size_t width, void *dst)
{
    planes(src, len, width, dst, 1);
}

/* -- float layout detection -- */

/* Entropy in bits per symbol of a histogram with total count n. */
static double hist_entropy(const uint32_t *h, size_t bins, uint64_t n)
{
    if (n == 0)
        return 0.0;
    double s = 0.0;
    for (size_t i = 0; i < bins; i++)
        if (h[i])
            s += (double)h[i] * flog2(h[i]);
    double e = (double)flog2((uint32_t)(n > UINT32_MAX ? UINT32_MAX : n)) - s / (double)n;
    return e < 0.0 ? 0.0 : e;
}

#define LAYOUT_SAMPLE 16384
#define LAYOUT_BLOCK 256

/* How much more often neighbouring elements share their top byte than
 * independent draws from the same byte frequencies would (1.0: no
 * sequential structure), over the sampled blocks. */
static unsigned top_runs(const uint8_t *p, size_t len, size_t nblocks,
                         size_t step, size_t block, unsigned w, unsigned phase)
{
    uint32_t h[256] = {0};
    uint64_t n = 0, eq = 0, pairs = 0;
    for (size_t b = 0; b < nblocks; b++) {
        size_t off = b * step, k = off + block <= len ? block : len - off;
        /* block starts are multiples of w: top bytes sit at j = phase + w - 1 mod w */
        size_t j = (phase + w - 1) % w;
        int prev = -1;
        for (; j < k; j += w) {
            uint8_t v = p[off + j];
            h[v]++;
            n++;
            if (prev >= 0) {
                eq += v == (uint8_t)prev;
                pairs++;
            }
            prev = v;
        }
    }
    if (pairs == 0 || n == 0)
        return 1000;
    double sq = 0;
    for (unsigned v = 0; v < 256; v++)
        sq += (double)h[v] * h[v];
    sq /= (double)n * (double)n; /* chance that two draws are equal */
    double r = ((double)eq / (double)pairs) / sq;
    return r > 1e6 ? 1000000000u : (unsigned)(r * 1000 + 0.5);
}

unsigned ckptfs_float_layout(const void *buf, size_t len, unsigned width,
                             unsigned *phase, unsigned *runs)
{
    static const double exp_max = 7.0;   /* sign/exponent byte: at most */
    static const double mant_min = 7.0;  /* lowest mantissa byte: at least */
    static const double tol2 = 0.25;     /* bits per 4 bytes in favour of 2 */
    const uint8_t *p = buf;
    unsigned m = width ? width : 4;
    uint32_t h[16][256];
    uint64_t cnt[16] = {0};
    double H[16];

    *phase = 0;
    *runs = 1000;
    if (width == 1 || width > 16)
        return width;
    if (len < 4 * (size_t)m)
        return width; /* too short to tell */
    memset(h, 0, sizeof(uint32_t) * 256 * m);

    /* Sample whole blocks that start at multiples of m so every sampled byte
     * keeps its position modulo m. */
    size_t block = LAYOUT_BLOCK - LAYOUT_BLOCK % m, nblocks = 1, step = len;
    if (len > LAYOUT_SAMPLE) {
        nblocks = LAYOUT_SAMPLE / block;
        step = (len - block) / (nblocks - 1);
        step -= step % m;
    } else {
        block = len;
    }
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *q = p + b * step;
        size_t k = b * step + block <= len ? block : len - b * step, i = 0;
        if (m == 4)
            for (; i + 4 <= k; i += 4) {
                h[0][q[i]]++;
                h[1][q[i + 1]]++;
                h[2][q[i + 2]]++;
                h[3][q[i + 3]]++;
            }
        for (unsigned pos = 0; i < k; i++) {
            h[pos][q[i]]++;
            if (++pos == m)
                pos = 0;
        }
    }
    for (unsigned q = 0; q < m; q++) {
        for (unsigned v = 0; v < 256; v++)
            cnt[q] += h[q][v];
        H[q] = hist_entropy(h[q], 256, cnt[q]);
    }

    /* The top byte (sign, exponent) is the most predictable position, and
     * the byte after it (the next element's lowest) among the least. */
    unsigned best = 0, w = 0, ph = 0;
    double best_score = 1e9;
    if (width) {
        for (unsigned q = 0; q < m; q++) {
            double sc = H[q] - H[(q + 1) % m];
            if (sc < best_score) {
                best_score = sc;
                best = q;
            }
        }
        w = width;
        ph = (best + 1) % m;
    } else {
        /* Detection: fp32 (4) against 16-bit floats (2).  Pooling positions
         * of equal parity never lowers the entropy sum, so 2 wins only if
         * pooling costs (almost) nothing: both members of each pair look
         * alike. */
        uint32_t pair[2][256];
        double P[2];
        for (unsigned v = 0; v < 256; v++) {
            pair[0][v] = h[0][v] + h[2][v];
            pair[1][v] = h[1][v] + h[3][v];
        }
        P[0] = hist_entropy(pair[0], 256, cnt[0] + cnt[2]);
        P[1] = hist_entropy(pair[1], 256, cnt[1] + cnt[3]);
        double cost4 = H[0] + H[1] + H[2] + H[3], cost2 = 2 * (P[0] + P[1]);
        if (cost2 <= cost4 + tol2) {
            unsigned e = P[0] <= P[1] ? 0 : 1;
            if (P[e] <= exp_max && P[e ^ 1] >= mant_min) {
                w = 2;
                ph = (e + 1) % 2;
            }
        } else {
            for (unsigned q = 0; q < 4; q++) {
                double sc = H[q] - H[(q + 1) % 4];
                if (sc < best_score) {
                    best_score = sc;
                    best = q;
                }
            }
            if (H[best] <= exp_max && H[(best + 1) % 4] >= mant_min &&
                H[(best + 2) % 4] >= mant_min) {
                w = 4;
                ph = (best + 1) % 4;
            }
        }
    }
    if (w) {
        *phase = ph;
        *runs = top_runs(p, len, nblocks, step, block, w, ph);
    }
    return w;
}

/* -- bit I/O for frequency tables (LSB first) -- */

typedef struct {
    uint8_t *p, *end;
    uint64_t acc;
    unsigned n;
    int overflow;
} bitw;

static void bw_put(bitw *w, uint32_t v, unsigned bits) /* bits <= 32 */
{
    w->acc |= (uint64_t)v << w->n;
    w->n += bits;
    while (w->n >= 8) {
        if (w->p < w->end)
            *w->p++ = (uint8_t)w->acc;
        else
            w->overflow = 1;
        w->acc >>= 8;
        w->n -= 8;
    }
}

static void bw_gamma(bitw *w, uint32_t x) /* Elias gamma, x >= 1 */
{
    unsigned k = 31 - (unsigned)__builtin_clz(x);
    bw_put(w, UINT32_C(1) << k, k + 1);
    if (k)
        bw_put(w, x & ((UINT32_C(1) << k) - 1), k);
}

static void bw_flush(bitw *w)
{
    if (w->n)
        bw_put(w, 0, 8 - w->n);
}

typedef struct {
    const uint8_t *p, *end;
    uint64_t acc;
    unsigned n;
    int bad;
} bitr;

static uint32_t br_get(bitr *r, unsigned bits) /* bits <= 32 */
{
    while (r->n < bits) {
        uint64_t b = 0;
        if (r->p < r->end)
            b = *r->p++;
        else
            r->bad = 1;
        r->acc |= b << r->n;
        r->n += 8;
    }
    uint32_t v = (uint32_t)(r->acc & ((UINT64_C(1) << bits) - 1));
    r->acc >>= bits;
    r->n -= bits;
    return v;
}

static uint32_t br_gamma(bitr *r)
{
    unsigned k = 0;
    while (br_get(r, 1) == 0) {
        if (++k > 31 || r->bad) {
            r->bad = 1;
            return 1;
        }
    }
    return (UINT32_C(1) << k) | (k ? br_get(r, k) : 0);
}

/* -- frequency tables --
 *
 * Serialised form: U - 1 in 12 bits (U symbols used, 1..4096), the first
 * symbol in `bits` bits, then per symbol: (but the first) the gap to the
 * previous symbol, Elias gamma; its approximate frequency a in [1, 65535]
 * as e = floor(log2 a), coded as gamma(zigzag(e - e_prev) + 1) with e_prev
 * starting at 4, then the min(e, 3) bits below the leading one (a keeps four
 * significant bits).  Encoder and decoder scale the a to frequencies summing
 * to 2^12 with the same integer procedure (rans_normalize). */

static uint32_t approx_freq(uint64_t c, uint64_t n) /* round(c * 4096 / n), in the code's set */
{
    uint64_t t = (c * RANS_SCALE * 2 + n) / (2 * n);
    if (t < 1)
        t = 1;
    if (t > 65535)
        t = 65535;
    unsigned e = 31 - (unsigned)__builtin_clz((uint32_t)t);
    if (e <= 3)
        return (uint32_t)t;
    unsigned sh = e - 3;
    uint64_t r = (t + (UINT64_C(1) << (sh - 1))) >> sh; /* 4 significant bits, rounded */
    if (r >= 16 && e == 15)
        r = 15; /* 65536 does not fit: stay at 0xf000 */
    return (uint32_t)(r << sh);
}

static int rans_normalize(const uint32_t *a, uint32_t *f, unsigned u)
{
    if (u == 0 || u > RANS_MAX_SYMBOLS)
        return -1;
    uint64_t s = 0;
    for (unsigned k = 0; k < u; k++)
        s += a[k];
    if (s == 0)
        return -1;
    uint32_t total = 0;
    unsigned imax = 0;
    for (unsigned k = 0; k < u; k++) {
        uint64_t v = ((uint64_t)a[k] * RANS_SCALE + s / 2) / s;
        f[k] = v ? (uint32_t)v : 1;
        total += f[k];
        if (f[k] > f[imax])
            imax = k;
    }
    if (total < RANS_SCALE) {
        f[imax] += RANS_SCALE - total;
        return 0;
    }
    while (total > RANS_SCALE) { /* rare: many rounded up to 1 */
        imax = 0;
        for (unsigned k = 1; k < u; k++)
            if (f[k] > f[imax])
                imax = k;
        uint32_t take = total - RANS_SCALE;
        if (take > f[imax] - 1)
            take = f[imax] - 1;
        if (take == 0)
            return -1; /* cannot happen with u <= RANS_SCALE */
        f[imax] -= take;
        total -= take;
    }
    return 0;
}

static void write_table(bitw *w, const uint32_t *syms, const uint32_t *a,
                        unsigned u, unsigned bits)
{
    bw_put(w, u - 1, 12);
    bw_put(w, syms[0], bits);
    unsigned eprev = 4;
    for (unsigned k = 0; k < u; k++) {
        if (k)
            bw_gamma(w, syms[k] - syms[k - 1]);
        unsigned e = 31 - (unsigned)__builtin_clz(a[k]);
        int d = (int)e - (int)eprev;
        bw_gamma(w, (uint32_t)(d >= 0 ? 2 * d : -2 * d - 1) + 1);
        unsigned mb = e < 3 ? e : 3;
        if (mb)
            bw_put(w, (a[k] >> (e - mb)) & ((1u << mb) - 1), mb);
        eprev = e;
    }
}

static int read_table(bitr *r, uint32_t *syms, uint32_t *a, unsigned *u_out,
                      unsigned bits)
{
    unsigned u = br_get(r, 12) + 1;
    uint64_t s = br_get(r, bits), limit = UINT64_C(1) << bits; /* no wrap-around */
    unsigned eprev = 4;
    for (unsigned k = 0; k < u; k++) {
        if (k) {
            s += br_gamma(r);
            if (s >= limit)
                return -1;
        }
        syms[k] = (uint32_t)s;
        uint32_t z = br_gamma(r) - 1;
        int d = (z & 1) ? -(int)((z + 1) / 2) : (int)(z / 2);
        int e = (int)eprev + d;
        if (e < 0 || e > 15 || r->bad)
            return -1;
        unsigned mb = e < 3 ? (unsigned)e : 3;
        uint32_t mant = mb ? br_get(r, mb) : 0;
        a[k] = ((UINT32_C(1) << mb) | mant) << (e - (int)mb);
        eprev = (unsigned)e;
    }
    if (r->bad)
        return -1;
    *u_out = u;
    return 0;
}

/* -- rANS core -- */

/* Value access: a value is hi[i * stride] << 8 | lo[i * stride] (16-bit
 * values), or hi[i * stride] alone when lo is NULL (8-bit values). */
typedef struct {
    const uint8_t *hi, *lo;
    size_t stride;
} vsrc;

static inline uint32_t vget(const vsrc *v, size_t i)
{
    uint32_t x = v->hi[i * v->stride];
    return v->lo ? x << 8 | v->lo[i * v->stride] : x;
}

/* Estimated coded size in bits of a histogram of the top `bits` of values
 * of vbits, U symbols in use: entropy + raw bits + table + states. */
static double est_cost(const uint32_t *h, unsigned bits, unsigned vbits,
                       uint64_t n, unsigned *u_out)
{
    size_t bins = (size_t)1 << bits;
    double s = 0.0;
    unsigned u = 0;
    for (size_t i = 0; i < bins; i++)
        if (h[i]) {
            s += (double)h[i] * flog2(h[i]);
            u++;
        }
    *u_out = u;
    double ent = (double)n * flog2((uint32_t)n) - s;
    if (ent < 0)
        ent = 0;
    return ent + (double)n * (vbits - bits) + 10.0 * u + 12 + 8 * 8 * RANS_LANES;
}

/* Encoder symbol: x -> ((x / f) << T) + x % f + start computed as
 * x + bias + q * (2^T - f) with q = x / f from a reciprocal (Alverson's
 * method, as in F. Giesen's rans64): exact for x < 2^63, no division. */
typedef struct {
    uint64_t rcp, xmax;
    uint32_t cmpl, bias, shift, pad;
} esym;

static inline uint64_t mulhi64(uint64_t a, uint64_t b)
{
#if defined(__SIZEOF_INT128__)
    return (uint64_t)(((unsigned __int128)a * b) >> 64);
#else
    uint64_t a0 = (uint32_t)a, a1 = a >> 32, b0 = (uint32_t)b, b1 = b >> 32;
    uint64_t t = a1 * b0 + ((a0 * b0) >> 32);
    uint64_t w = (uint32_t)t + a0 * b1;
    return a1 * b1 + (t >> 32) + (w >> 32);
#endif
}

static void esym_init(esym *e, uint32_t f, uint32_t start, unsigned tbits)
{
    e->xmax = (uint64_t)f << (63 - tbits);
    e->cmpl = (UINT32_C(1) << tbits) - f;
    if (f < 2) {
        /* q = mulhi(x, 2^64 - 1) = x - 1; the bias makes up the 1. */
        e->rcp = ~UINT64_C(0);
        e->shift = 0;
        e->bias = start + (UINT32_C(1) << tbits) - 1;
    } else {
        uint32_t shift = 0;
        while (f > (UINT32_C(1) << shift))
            shift++;
        /* rcp = ceil(2^(shift + 63) / f), by long division in 64 bits. */
        uint64_t x0 = f - 1, x1 = UINT64_C(1) << (shift + 31);
        uint64_t t1 = x1 / f;
        x0 += (x1 % f) << 32;
        uint64_t t0 = x0 / f;
        e->rcp = t0 + (t1 << 32);
        e->shift = shift - 1;
        e->bias = start;
    }
    e->pad = 0;
}

/* x >= xmax: keep the low word just stored below *w (move *w down over
 * it) and shift it out of x.  Branchless, like rans_renorm. */
static inline __attribute__((always_inline)) void
rans_emit(uint64_t *x, uint8_t **w, uint64_t xmax)
{
    uint64_t hi = *x >> 32;
#if defined(__x86_64__)
    uint8_t *wn = *w - 4;
    __asm__("cmp %[xmax], %[x]\n\t"
            "cmovae %[wn], %[w]\n\t"
            "cmovae %[hi], %[x]"
            : [x] "+r"(*x), [w] "+r"(*w)
            : [xmax] "r"(xmax), [hi] "r"(hi), [wn] "r"(wn)
            : "cc");
#else
    uint64_t c = *x >= xmax;
    *w -= c << 2;
    *x = c ? hi : *x;
#endif
}

enum { RD_U16, RD_PLANES, RD_U8 };

/* The encoding loop, inlined per value layout (mode as in rans_dec_run).
 * Walks the values backwards; lane l = i % 4 keeps its state in a register
 * and its words in [wend[l] - room, wend[l]), written backwards.  Emitting
 * is branchless: the low word is always stored and the pointer moves only
 * if it is kept.  Returns 1, or 0 if a lane runs out of room. */
static inline __attribute__((always_inline)) int
rans_enc_run(const vsrc *v, size_t n, const unsigned raw, const uint32_t *etab,
             const esym *es, size_t room, uint8_t *const *wend, uint8_t **wp_out,
             uint64_t *x_out, const int mode)
{
    const uint32_t rmask = (UINT32_C(1) << raw) - 1;
    const uint8_t *hi = v->hi, *lo = v->lo;
    uint64_t x0 = RANS_L, x1 = RANS_L, x2 = RANS_L, x3 = RANS_L;
    uint8_t *w0 = wend[0], *w1 = wend[1], *w2 = wend[2], *w3 = wend[3];
    uint8_t *b0 = w0 - room, *b1 = w1 - room, *b2 = w2 - room, *b3 = w3 - room;

#define ENC_VAL(i)                                                            \
    (mode == RD_U16      ? (uint32_t)lo[2 * (i)] | (uint32_t)lo[2 * (i) + 1] << 8 \
     : mode == RD_PLANES ? (uint32_t)hi[i] << 8 | lo[i]                        \
                         : (uint32_t)hi[i])
#define ENC_STEP(X, W, i)                                                     \
    do {                                                                      \
        uint32_t val_ = ENC_VAL(i);                                           \
        const esym *e_ = &es[etab[val_ >> raw]];                              \
        store32_le((W)-4, (uint32_t)(X));                                     \
        rans_emit(&(X), &(W), e_->xmax);                                      \
        uint64_t q_ = mulhi64((X), e_->rcp) >> e_->shift; /* X / f */         \
        (X) += e_->bias + q_ * e_->cmpl + ((uint64_t)(val_ & rmask) << RANS_SCALE_BITS); \
    } while (0)

    size_t i = n;
    /* The last n % 4 values first, one lane each; then whole rounds. */
    while (i & (RANS_LANES - 1)) {
        i--;
        if (w0 - b0 < 8 || w1 - b1 < 8 || w2 - b2 < 8 || w3 - b3 < 8)
            return 0;
        switch (i & 3) {
        case 0: ENC_STEP(x0, w0, i); break;
        case 1: ENC_STEP(x1, w1, i); break;
        case 2: ENC_STEP(x2, w2, i); break;
        default: ENC_STEP(x3, w3, i); break;
        }
    }
    while (i) {
        /* Each lane stores at most one word per round, plus the speculative
         * store just below its pointer. */
        if (w0 - b0 < 8 || w1 - b1 < 8 || w2 - b2 < 8 || w3 - b3 < 8)
            return 0;
        i -= 4;
        ENC_STEP(x3, w3, i + 3);
        ENC_STEP(x2, w2, i + 2);
        ENC_STEP(x1, w1, i + 1);
        ENC_STEP(x0, w0, i);
    }
#undef ENC_STEP
#undef ENC_VAL
    x_out[0] = x0; x_out[1] = x1; x_out[2] = x2; x_out[3] = x3;
    wp_out[0] = w0; wp_out[1] = w1; wp_out[2] = w2; wp_out[3] = w3;
    return 1;
}

/* Encode n values with `bits`-bit symbols (the rest of each value's vbits
 * raw) into [o, oend): table, four states, the sizes of the word streams of
 * lanes 0..2 (u32 each), then the four streams.  Returns the size, or 0 if
 * it does not fit.  h is the histogram of the symbols; etab is scratch of
 * 2^bits entries, wbuf of RANS_LANES * (oend - o) bytes. */
static size_t rans_encode(const vsrc *v, size_t n, unsigned vbits,
                          unsigned bits, const uint32_t *h, uint32_t *etab,
                          esym *es, uint8_t *wbuf, uint8_t *o, uint8_t *oend)
{
    uint32_t syms[RANS_MAX_SYMBOLS], a[RANS_MAX_SYMBOLS], f[RANS_MAX_SYMBOLS];
    unsigned u = 0;
    size_t bins = (size_t)1 << bits;
    for (size_t s = 0; s < bins; s++)
        if (h[s]) {
            if (u == RANS_MAX_SYMBOLS)
                return 0;
            syms[u] = (uint32_t)s;
            a[u] = approx_freq(h[s], n);
            u++;
        }
    /* One symbol alone (frequency 2^12) is not codable: the decoder keeps
     * frequencies below 2^12, and a constant is zstd's job anyway. */
    if (u < 2 || rans_normalize(a, f, u) != 0)
        return 0;
    bitw w = {o, oend, 0, 0, 0};
    write_table(&w, syms, a, u, bits);
    bw_flush(&w);
    if (w.overflow)
        return 0;
    uint8_t *states = w.p, *sizes = states + 8 * RANS_LANES;
    uint8_t *streams = sizes + 4 * (RANS_LANES - 1);
    if (streams > oend)
        return 0;
    size_t room = (size_t)(oend - streams); /* all streams together */
    const unsigned raw = vbits - bits, tbits = RANS_SCALE_BITS + raw;
    uint32_t cum = 0;
    for (unsigned k = 0; k < u; k++) {
        etab[syms[k]] = k;
        esym_init(&es[k], f[k], cum, tbits);
        cum += f[k];
    }
    uint64_t x[RANS_LANES];
    uint8_t *wp[RANS_LANES], *wend[RANS_LANES];
    for (unsigned l = 0; l < RANS_LANES; l++)
        wend[l] = wbuf + (l + 1) * room; /* each lane writes backwards */
    int ok;
    if (!v->lo)
        ok = rans_enc_run(v, n, raw, etab, es, room, wend, wp, x, RD_U8);
    else if (v->stride == 2 && v->hi == v->lo + 1)
        ok = rans_enc_run(v, n, raw, etab, es, room, wend, wp, x, RD_U16);
    else if (v->stride == 1)
        ok = rans_enc_run(v, n, raw, etab, es, room, wend, wp, x, RD_PLANES);
    else
        ok = 0;
    if (!ok)
        return 0;
    size_t total = 0;
    for (unsigned l = 0; l < RANS_LANES; l++)
        total += (size_t)(wend[l] - wp[l]);
    if (total > room)
        return 0;
    for (unsigned l = 0; l < RANS_LANES; l++) {
        for (unsigned b = 0; b < 8; b++)
            states[8 * l + b] = (uint8_t)(x[l] >> (8 * b));
        size_t k = (size_t)(wend[l] - wp[l]);
        if (l + 1 < RANS_LANES)
            store32_le(sizes + 4 * l, (uint32_t)k);
        memcpy(streams, wp[l], k);
        streams += k;
    }
    return (size_t)(streams - o);
}

typedef struct {
    /* 8 entries of slack: the fill below writes whole 8-entry vectors. */
    uint16_t symv[RANS_SCALE + 8]; /* slot -> symbol << raw */
    uint16_t freq[RANS_SCALE + 8]; /* slot -> its symbol's frequency */
    uint16_t bias[RANS_SCALE + 8]; /* slot -> slot - its symbol's start */
    uint64_t x[RANS_LANES];
    const uint8_t *p[RANS_LANES], *pe[RANS_LANES];
} rans_dec;

/* Parse the table, states and stream sizes of a rANS body.  0 or -1. */
static int rans_dec_init(rans_dec *d, const uint8_t *in, size_t in_len,
                         unsigned vbits, unsigned bits)
{
    uint32_t syms[RANS_MAX_SYMBOLS], a[RANS_MAX_SYMBOLS], f[RANS_MAX_SYMBOLS];
    unsigned u;
    bitr r = {in, in + in_len, 0, 0, 0};
    if (bits > vbits || bits == 0 || read_table(&r, syms, a, &u, bits) != 0 ||
        r.acc != 0 || u < 2 || rans_normalize(a, f, u) != 0)
        return -1; /* r.acc: the table's padding bits must be zero */
    const unsigned raw = vbits - bits;
    uint32_t slot = 0;
    for (unsigned k = 0; k < u; k++) {
        uint16_t sv = (uint16_t)(syms[k] << raw), fk = (uint16_t)f[k]; /* < 4096: u >= 2 */
#if defined(__x86_64__)
        /* Whole vectors, in slot order: what spills past this symbol's
         * slots is overwritten by the next symbol's (or is slack). */
        const __m128i vs = _mm_set1_epi16((short)sv), vf = _mm_set1_epi16((short)fk);
        const __m128i step = _mm_set1_epi16(8);
        __m128i vb = _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7);
        for (uint32_t j = 0; j < fk; j += 8) {
            _mm_storeu_si128((__m128i *)(d->symv + slot + j), vs);
            _mm_storeu_si128((__m128i *)(d->freq + slot + j), vf);
            _mm_storeu_si128((__m128i *)(d->bias + slot + j), vb);
            vb = _mm_add_epi16(vb, step);
        }
        slot += fk;
#else
        for (uint32_t j = 0; j < fk; j++, slot++) {
            d->symv[slot] = sv;
            d->freq[slot] = fk;
            d->bias[slot] = (uint16_t)j;
        }
#endif
    }
    const uint8_t *q = r.p, *end = in + in_len;
    if ((size_t)(end - q) < 12 * RANS_LANES - 4)
        return -1;
    const uint8_t *sp = q + 12 * RANS_LANES - 4; /* the first stream */
    for (unsigned l = 0; l < RANS_LANES; l++) {
        d->x[l] = (uint64_t)load32_le(q + 8 * l) | (uint64_t)load32_le(q + 8 * l + 4) << 32;
        if (d->x[l] < RANS_L || d->x[l] >> 63)
            return -1;
        size_t k = l + 1 < RANS_LANES ? load32_le(q + 8 * RANS_LANES + 4 * l)
                                      : (size_t)(end - sp);
        if (k > (size_t)(end - sp))
            return -1;
        d->p[l] = sp;
        d->pe[l] = sp + k;
        sp += k;
    }
    return sp == end ? 0 : -1;
}

/* x < 2^31: shift in the next 32-bit word.  Branchless: whether a lane
 * renormalises is a coin flip to the branch predictor, and GCC turns the
 * plain C into a branch, so x86-64 gets one cmp and two cmovs. */
static inline __attribute__((always_inline)) void
rans_renorm(uint64_t *x, const uint8_t **p)
{
    uint64_t alt = *x << 32 | load32_le(*p);
#if defined(__x86_64__)
    const uint8_t *next = *p + 4;
    __asm__("cmp %[lim], %[x]\n\t"
            "cmovb %[alt], %[x]\n\t"
            "cmovb %[next], %[p]"
            : [x] "+r"(*x), [p] "+r"(*p)
            : [lim] "r"(RANS_L), [alt] "r"(alt), [next] "r"(next)
            : "cc");
#else
    uint64_t c = *x < RANS_L;
    *x = c ? alt : *x;
    *p += c << 2;
#endif
}

/* Decode n values into dst (RD_U16: little-endian uint16s at dst;
 * RD_PLANES: high bytes at dst, low bytes at dst2; RD_U8: bytes at dst).
 * Inlined with constant mode and raw, so shifts and masks are immediates.
 * 0, or -1 if the streams do not end exactly where the states do. */
static inline __attribute__((always_inline)) int
rans_dec_run(rans_dec *d, size_t n, const unsigned raw, uint8_t *dst,
             uint8_t *dst2, const int mode)
{
    const unsigned tbits = RANS_SCALE_BITS + raw;
    const uint32_t rmask = (UINT32_C(1) << raw) - 1, smask = RANS_SCALE - 1;
    const uint16_t *symv = d->symv, *freq = d->freq, *bias = d->bias;
#define FREQ(sl) ((uint64_t)freq[sl])

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define RANS_STORE16(ptr, val)                                                \
    do {                                                                      \
        uint16_t v16_ = (uint16_t)(val);                                      \
        memcpy((ptr), &v16_, 2);                                              \
    } while (0)
#else
#define RANS_STORE16(ptr, val)                                                \
    do {                                                                      \
        (ptr)[0] = (uint8_t)(val);                                            \
        (ptr)[1] = (uint8_t)((val) >> 8);                                     \
    } while (0)
#endif
#define RANS_STORE(i, val)                                                    \
    do {                                                                      \
        if (mode == RD_U16) {                                                 \
            RANS_STORE16(dst + 2 * (i), val);                                 \
        } else if (mode == RD_PLANES) {                                       \
            dst[i] = (uint8_t)((val) >> 8);                                   \
            dst2[i] = (uint8_t)(val);                                         \
        } else {                                                              \
            dst[i] = (uint8_t)(val);                                          \
        }                                                                     \
    } while (0)
#define RANS_STEP(X, P, i)                                                    \
    do {                                                                      \
        uint32_t sl_ = (uint32_t)(X)&smask;                                   \
        uint32_t val_ = symv[sl_] | ((uint32_t)((X) >> RANS_SCALE_BITS) & rmask); \
        (X) = FREQ(sl_) * ((X) >> tbits) + bias[sl_];                         \
        RANS_STORE(i, val_);                                                  \
        rans_renorm(&(X), &(P));                                              \
    } while (0)

    size_t i = 0;
    uint64_t x0 = d->x[0], x1 = d->x[1], x2 = d->x[2], x3 = d->x[3];
    const uint8_t *p0 = d->p[0], *p1 = d->p[1], *p2 = d->p[2], *p3 = d->p[3];
    for (;;) {
        /* Each round reads at most one word per lane: run as many rounds
         * unchecked as every lane has words left. */
        size_t k = (n - i) / RANS_LANES, m;
        m = (size_t)(d->pe[0] - p0) / 4; k = m < k ? m : k;
        m = (size_t)(d->pe[1] - p1) / 4; k = m < k ? m : k;
        m = (size_t)(d->pe[2] - p2) / 4; k = m < k ? m : k;
        m = (size_t)(d->pe[3] - p3) / 4; k = m < k ? m : k;
        if (k < 8)
            break;
        for (size_t e = i + k * RANS_LANES; i < e; i += RANS_LANES) {
            RANS_STEP(x0, p0, i);
            RANS_STEP(x1, p1, i + 1);
            RANS_STEP(x2, p2, i + 2);
            RANS_STEP(x3, p3, i + 3);
        }
    }
#undef RANS_STEP
    uint64_t xs[RANS_LANES] = {x0, x1, x2, x3};
    const uint8_t *ps[RANS_LANES] = {p0, p1, p2, p3};
    for (; i < n; i++) {
        unsigned l = i & (RANS_LANES - 1);
        uint64_t x = xs[l];
        uint32_t sl = (uint32_t)x & smask;
        uint32_t val = symv[sl] | ((uint32_t)(x >> RANS_SCALE_BITS) & rmask);
        x = FREQ(sl) * (x >> tbits) + bias[sl];
        RANS_STORE(i, val);
        if (x < RANS_L) {
            if (d->pe[l] - ps[l] < 4)
                return -1;
            x = x << 32 | load32_le(ps[l]);
            ps[l] += 4;
        }
        xs[l] = x;
    }
#undef RANS_STORE
#undef RANS_STORE16
#undef FREQ
    for (unsigned l = 0; l < RANS_LANES; l++)
        if (xs[l] != RANS_L || ps[l] != d->pe[l])
            return -1;
    return 0;
}

#define RANS_RAW_CASES(MODE, DST, DST2)                                       \
    switch (raw) {                                                            \
    case 0: return rans_dec_run(&d, n, 0, DST, DST2, MODE);                   \
    case 1: return rans_dec_run(&d, n, 1, DST, DST2, MODE);                   \
    case 2: return rans_dec_run(&d, n, 2, DST, DST2, MODE);                   \
    case 3: return rans_dec_run(&d, n, 3, DST, DST2, MODE);                   \
    case 4: return rans_dec_run(&d, n, 4, DST, DST2, MODE);                   \
    case 5: return rans_dec_run(&d, n, 5, DST, DST2, MODE);                   \
    case 6: return rans_dec_run(&d, n, 6, DST, DST2, MODE);                   \
    case 7: return rans_dec_run(&d, n, 7, DST, DST2, MODE);                   \
    case 8: return rans_dec_run(&d, n, 8, DST, DST2, MODE);                   \
    default: return -1;                                                       \
    }

static int rans_decode_u16(const uint8_t *in, size_t len, size_t n,
                           unsigned bits, uint8_t *dst)
{
    rans_dec d;
    if (bits < 8 || rans_dec_init(&d, in, len, 16, bits))
        return -1;
    unsigned raw = 16 - bits;
    RANS_RAW_CASES(RD_U16, dst, NULL)
}

static int rans_decode_planes(const uint8_t *in, size_t len, size_t n,
                              unsigned bits, uint8_t *hi, uint8_t *lo)
{
    rans_dec d;
    if (bits < 8 || rans_dec_init(&d, in, len, 16, bits))
        return -1;
    unsigned raw = 16 - bits;
    RANS_RAW_CASES(RD_PLANES, hi, lo)
}
#undef RANS_RAW_CASES

static int rans_decode_u8(const uint8_t *in, size_t len, size_t n, uint8_t *dst)
{
    rans_dec d;
    if (rans_dec_init(&d, in, len, 8, 8))
        return -1;
    return rans_dec_run(&d, n, 0, dst, NULL, RD_U8);
}

/* Histogram of the top `bits` of n values of vbits into h (2^bits, zeroed here). */
static void value_hist(const vsrc *v, size_t n, unsigned vbits, unsigned bits,
                       uint32_t *h)
{
    unsigned sh = vbits - bits;
    memset(h, 0, sizeof(uint32_t) << bits);
    if (!v->lo && v->stride == 1 && bits == 8) {
        /* Bytes: four tables, so runs of one value do not chain every
         * increment through the same counter. */
        uint32_t t[4][256];
        memset(t, 0, sizeof(t));
        const uint8_t *b = v->hi;
        size_t i = 0;
        for (; i + 4 <= n; i += 4) {
            t[0][b[i]]++;
            t[1][b[i + 1]]++;
            t[2][b[i + 2]]++;
            t[3][b[i + 3]]++;
        }
        for (; i < n; i++)
            t[0][b[i]]++;
        for (unsigned k = 0; k < 256; k++)
            h[k] = t[0][k] + t[1][k] + t[2][k] + t[3][k];
    } else if (v->lo && v->stride == 1) {
        const uint8_t *hi = v->hi, *lo = v->lo;
        for (size_t i = 0; i < n; i++)
            h[((uint32_t)hi[i] << 8 | lo[i]) >> sh]++;
    } else if (v->lo && v->stride == 2 && v->hi == v->lo + 1) {
        const uint8_t *b = v->lo;
        for (size_t i = 0; i < n; i++)
            h[((uint32_t)b[2 * i + 1] << 8 | b[2 * i]) >> sh]++;
    } else {
        for (size_t i = 0; i < n; i++)
            h[vget(v, i) >> sh]++;
    }
}

/* Encoder scratch: histogram and symbol index (2^16 words each), the
 * encoder symbols (RANS_MAX_SYMBOLS esyms), then the per-lane word buffers
 * (RANS_LANES times the largest raw section). */
#define FC_SCRATCH_WORDS (2 * ((size_t)1 << 16) + RANS_MAX_SYMBOLS * sizeof(esym) / 4)
#define FC_ESYMS(scratch) ((esym *)((scratch) + 2 * ((size_t)1 << 16)))

static uint32_t *alloc_scratch(size_t max_section)
{
    return malloc(FC_SCRATCH_WORDS * sizeof(uint32_t) + RANS_LANES * max_section);
}

/* A byte plane whose first and middle 2 KiB show more than 7.85 bits of
 * entropy per byte is left raw without a full histogram: the low mantissa
 * bytes of trained weights (7.99 bits) are, and coding would save < 1%. */
static int looks_random(const vsrc *v, size_t n)
{
    if (n < 16384)
        return 0;
    uint32_t h[256] = {0};
    for (size_t i = 0; i < 2048; i++) {
        h[v->hi[i * v->stride]]++;
        h[v->hi[(n / 2 + i) * v->stride]]++;
    }
    return hist_entropy(h, 256, 4096) > 7.85;
}

/* One coded section: u8 mode, u32 size, body.  mode 0 = raw values
 * (16-bit: little-endian uint16s), else rANS with `mode` symbol bits.  Picks
 * the symbol width from 8 to max_bits by estimated size; returns the bytes
 * written or 0 if they do not fit in [o, oend). */
static size_t put_section(const vsrc *v, size_t n, unsigned vbits,
                          unsigned max_bits, uint32_t *scratch, uint8_t *o,
                          uint8_t *oend)
{
    size_t raw_size = n * (vbits / 8);
    if ((size_t)(oend - o) < 5)
        return 0;
    uint8_t *body = o + 5;
    size_t size = 0;
    unsigned mode = 0;
    if (n >= 64 && !(vbits == 8 && looks_random(v, n))) {
        uint32_t *h = scratch, *etab = scratch + ((size_t)1 << 16);
        uint8_t *wbuf = (uint8_t *)(scratch + FC_SCRATCH_WORDS);
        unsigned top = max_bits < vbits ? max_bits : vbits, best = 0, u;
        if (top < 8)
            top = 8;
        double best_cost = 8.0 * (double)raw_size - 256; /* must beat raw clearly */
        value_hist(v, n, vbits, top, h);
        /* Fold a copy down one bit at a time, estimating each width. */
        memcpy(etab, h, sizeof(uint32_t) << top);
        for (unsigned b = top;; b--) {
            double c = est_cost(etab, b, vbits, n, &u);
            if (u >= 2 && u <= RANS_MAX_SYMBOLS && c < best_cost) {
                best_cost = c;
                best = b;
            }
            if (b == 8)
                break;
            for (size_t j = 0; j < ((size_t)1 << (b - 1)); j++) /* fold to b - 1 bits */
                etab[j] = etab[2 * j] + etab[2 * j + 1];
        }
        if (best) {
            for (unsigned b = top; b > best; b--)
                for (size_t j = 0; j < ((size_t)1 << (b - 1)); j++)
                    h[j] = h[2 * j] + h[2 * j + 1];
            size_t lim = raw_size < (size_t)(oend - body) ? raw_size : (size_t)(oend - body);
            size = rans_encode(v, n, vbits, best, h, etab, FC_ESYMS(scratch), wbuf, body,
                               body + lim);
            if (size)
                mode = best;
        }
    }
    if (!mode) {
        if ((size_t)(oend - body) < raw_size)
            return 0;
        if (vbits == 8 && v->stride == 1)
            memcpy(body, v->hi, n);
        else if (vbits == 16 && v->stride == 2 && v->hi == v->lo + 1)
            memcpy(body, v->lo, 2 * n);
        else if (vbits == 16 && v->stride == 1)
            merge2(v->lo, v->hi, n, body);
        else
            for (size_t i = 0; i < n; i++) {
                uint32_t x = vget(v, i);
                if (vbits == 16) {
                    body[2 * i] = (uint8_t)x;
                    body[2 * i + 1] = (uint8_t)(x >> 8);
                } else {
                    body[i] = (uint8_t)x;
                }
            }
        size = raw_size;
    }
    o[0] = (uint8_t)mode;
    store32_le(o + 1, (uint32_t)size);
    return 5 + size;
}

size_t ckptfs_fc_encode(const void *src, size_t len, unsigned width,
                        unsigned phase, unsigned max_bits, void *out,
                        size_t cap)
{
    const uint8_t *s = src;
    uint8_t *o = out, *oend = o + cap;
    if (width < 2 || width > 16 || phase >= width || len < phase + width ||
        len >= (UINT64_C(1) << 32) || max_bits > 16)
        return 0;
    size_t n = (len - phase) / width, body = n * width, r = len - phase - body;
    if (cap < 1 + phase + r)
        return 0;
    *o++ = (uint8_t)phase;
    memcpy(o, s, phase);
    o += phase;
    memcpy(o, s + phase + body, r);
    o += r;

    uint8_t *planes = NULL;
    uint32_t *scratch = alloc_scratch(2 * n);
    if (!scratch)
        return 0;
    vsrc top;
    if (width == 2) {
        top = (vsrc){s + phase + 1, s + phase, 2};
    } else {
        planes = malloc(body);
        if (!planes) {
            free(scratch);
            return 0;
        }
        ckptfs_split_planes(s + phase, body, width, planes);
        top = (vsrc){planes + (width - 1) * n, planes + (width - 2) * n, 1};
    }
    size_t k = put_section(&top, n, 16, max_bits, scratch, o, oend);
    if (!k)
        goto fail;
    o += k;
    for (unsigned j = 0; j + 2 < width; j++) {
        vsrc pl = {planes + j * n, NULL, 1};
        k = put_section(&pl, n, 8, 8, scratch, o, oend);
        if (!k)
            goto fail;
        o += k;
    }
    if (oend - o < 4)
        goto fail;
    store32_le(o, ckptfs_crc32c(0, s, len));
    o += 4;
    free(planes);
    free(scratch);
    return (size_t)(o - (uint8_t *)out);
fail:
    free(planes);
    free(scratch);
    return 0;
}

/* Interleave width planes given by pointers into n elements at d. */
static void merge_ptrs(const uint8_t *const *pl, size_t n, unsigned width, uint8_t *d)
{
    if (width == 2) {
        merge2(pl[0], pl[1], n, d);
    } else if (width == 4) {
        merge4(pl[0], pl[1], pl[2], pl[3], n, d);
    } else {
        for (size_t i = 0; i < n; i++)
            for (unsigned p = 0; p < width; p++)
                d[i * width + p] = pl[p][i];
    }
}

int ckptfs_fc_decode(const void *payload, size_t plen, unsigned width,
                     void *dst, size_t len)
{
    const uint8_t *p = payload, *end = p + plen;
    uint8_t *d = dst;
    if (width < 2 || width > 16 || plen < 1 + 4)
        return -1;
    unsigned phase = p[0];
    if (phase >= width || len < phase)
        return -1;
    size_t n = (len - phase) / width, body = n * width, r = len - phase - body;
    p++;
    if ((size_t)(end - p) < phase + r + 4)
        return -1;
    memcpy(d, p, phase);
    p += phase;
    memcpy(d + phase + body, p, r);
    p += r;

    /* width 2: the top section decodes straight into dst.  Wider: the two
     * top planes and rANS-coded low planes go to scratch, raw low planes
     * stay in the payload, and merge_ptrs interleaves them into dst. */
    const uint8_t *pl[16];
    uint8_t *scratch = NULL;
    if (width > 2) {
        scratch = malloc(body ? body : 1);
        if (!scratch)
            return -2;
    }
    int rc = -1;
    for (unsigned j = 0; j + 1 < width; j++) {
        /* Section order: the top 16 bits first, then planes 0 .. width - 3. */
        unsigned vbits = j == 0 ? 16 : 8, plane = j - 1;
        if (end - p < 5)
            goto out;
        unsigned mode = p[0];
        size_t size = load32_le(p + 1);
        p += 5;
        if ((size_t)(end - p) < size)
            goto out;
        if (vbits == 16) {
            uint8_t *lo = scratch + (width - 2) * n, *hi = scratch + (width - 1) * n;
            pl[width - 2] = lo;
            pl[width - 1] = hi;
            if (mode == 0) {
                if (size != 2 * n)
                    goto out;
                if (width == 2)
                    memcpy(d + phase, p, size);
                else
                    split2(p, n, lo, hi);
            } else if (mode >= 8 && mode <= 16) {
                if (width == 2 ? rans_decode_u16(p, size, n, mode, d + phase)
                               : rans_decode_planes(p, size, n, mode, hi, lo))
                    goto out;
            } else {
                goto out;
            }
        } else if (mode == 0) {
            if (size != n)
                goto out;
            pl[plane] = p;
        } else if (mode == 8) {
            if (rans_decode_u8(p, size, n, scratch + plane * n))
                goto out;
            pl[plane] = scratch + plane * n;
        } else {
            goto out;
        }
        p += size;
    }
    if (end - p != 4)
        goto out;
    if (width > 2)
        merge_ptrs(pl, n, width, d + phase);
    if (ckptfs_crc32c(0, d, len) != load32_le(p))
        goto out;
    rc = 0;
out:
    free(scratch);
    return rc;
}

size_t ckptfs_rans8_encode(const void *src, size_t n, void *out, size_t cap)
{
    size_t lim = cap < n ? cap : n;
    uint32_t *scratch = alloc_scratch(lim);
    if (!scratch)
        return 0;
    vsrc v = {src, NULL, 1};
    value_hist(&v, n, 8, 8, scratch);
    unsigned u;
    if (n && est_cost(scratch, 8, 8, n, &u) >= 8.0 * (double)lim) {
        free(scratch); /* would not fit: skip the encoding */
        return 0;
    }
    size_t k = n ? rans_encode(&v, n, 8, 8, scratch, scratch + ((size_t)1 << 16),
                               FC_ESYMS(scratch), (uint8_t *)(scratch + FC_SCRATCH_WORDS), out,
                               (uint8_t *)out + lim)
                 : 0;
    free(scratch);
    return k;
}

int ckptfs_rans8_decode(const void *in, size_t in_len, void *dst, size_t n)
{
    if (n == 0)
        return in_len == 0 ? 0 : -1;
    return rans_decode_u8(in, in_len, n, dst);
}

/* -- load-time setup for the codec -- */

static double ln_1_to_2(double x) /* ln(x) for x in [1, 2], no libm */
{
    double y = (x - 1) / (x + 1), y2 = y * y, term = y, sum = 0;
    for (int k = 1; k < 60; k += 2) {
        sum += term / k;
        term *= y2;
    }
    return 2 * sum;
}

__attribute__((constructor))
static void codec_init(void)
{
    for (int i = 0; i <= 1024; i++)
        log2_frac[i] = (float)(ln_1_to_2(1.0 + i / 1024.0) / 0.69314718055994531);
}
