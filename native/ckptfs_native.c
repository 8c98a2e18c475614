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

static size_t gear_find(const unsigned char *p, size_t n, uint64_t *hp,
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
    if (have_hw_crc) {
        make_zeros_table(zeros_long, CRC_LONG);
        make_zeros_table(zeros_short, CRC_SHORT);
    }
#endif
}
