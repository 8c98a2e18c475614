/* The read executor: see ckptfs_readx.h for what and why. */
#define _GNU_SOURCE

#include "ckptfs_readx.h"
#include "ckptfs_native.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/uio.h>

/* One extent's part of the read, in its chunk's coordinates: bytes [ca, cb)
 * go to dst + dst_at; the whole blocks around them are [bs, be). */
typedef struct {
    uint64_t ca, cb, bs, be;
    size_t dst_at;
} piece_t;

static int fail(ckptfs_rx_error *err, int kind, int e, uint64_t log_off, uint64_t block)
{
    err->kind = kind;
    err->err = e;
    err->log_off = log_off;
    err->block = block;
    return -1;
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* preadv until every iovec is full; 0, or -1 with *err filled. */
static int read_full(int fd, struct iovec *iov, int cnt, uint64_t pos, int nowait,
                     ckptfs_rx_error *err)
{
    while (cnt > 0) {
        ssize_t n = preadv2(fd, iov, cnt, (off_t)pos, nowait ? RWF_NOWAIT : 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (nowait && (errno == EAGAIN || errno == EOPNOTSUPP))
                return fail(err, 5, errno, pos, 0);
            return fail(err, 4, errno, pos, 0);
        }
        if (n == 0)
            return fail(err, 2, 0, pos, 0);
        pos += (uint64_t)n;
        while (cnt > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    return 0;
}

/* Check every block of piece p of extent e: its bytes are the head in
 * scratch (before ca, first block only), dst, and the tail in scratch +
 * block_bytes (after cb, last block only). */
static int verify(const ckptfs_rx_extent *e, const piece_t *p, const uint8_t *crcs,
                  uint64_t B, const uint8_t *dst, const uint8_t *scratch,
                  ckptfs_rx_error *err)
{
    for (uint64_t k0 = p->bs; k0 < p->be; k0 += B) {
        uint64_t k1 = k0 + B < e->chunk_len ? k0 + B : e->chunk_len;
        uint32_t crc = 0;
        if (k0 < p->ca)
            crc = ckptfs_crc32c(crc, scratch, (size_t)(p->ca - k0));
        uint64_t a = k0 > p->ca ? k0 : p->ca;
        uint64_t b = k1 < p->cb ? k1 : p->cb;
        if (b > a)
            crc = ckptfs_crc32c(crc, dst + p->dst_at + (a - p->ca), (size_t)(b - a));
        if (k1 > p->cb)
            crc = ckptfs_crc32c(crc, scratch + B, (size_t)(k1 - p->cb));
        uint64_t blk = k0 / B;
        if (crc != le32(crcs + 4 * (e->crc_at + blk)))
            return fail(err, 1, 0, e->log_off, blk);
    }
    return 0;
}

int ckptfs_read_extents(int fd, const ckptfs_rx_extent *ext, size_t n,
                        const uint8_t *crcs, size_t n_crcs, uint64_t block_bytes,
                        uint64_t off, uint8_t *dst, size_t len,
                        uint8_t *scratch, int nowait, ckptfs_rx_error *err)
{
    const uint64_t B = block_bytes;
    const uint64_t end = off + len;
    uint64_t filled = off;          /* dst holds file bytes [off, filled) */
    uint64_t prev_end = 0;
    /* The run being gathered: extents [r0, r1) whose pieces are one preadv. */
    size_t r0 = 0, r1 = 0;
    piece_t first = {0}, last = {0};

    if (B == 0 || end < off)
        return fail(err, 3, 0, 0, 0);
    for (size_t i = 0; i <= n; i++) {
        piece_t p = {0};
        int have = 0;
        if (i < n) {
            const ckptfs_rx_extent *e = &ext[i];
            uint64_t nblocks = e->chunk_len / B + (e->chunk_len % B != 0);
            if (e->length == 0 || e->file_off < prev_end
                    || e->length > UINT64_MAX - e->file_off
                    || e->chunk_off > e->chunk_len || e->length > e->chunk_len - e->chunk_off
                    || e->crc_at > n_crcs || nblocks > n_crcs - e->crc_at)
                return fail(err, 3, 0, e->log_off, i);
            prev_end = e->file_off + e->length;
            uint64_t a = e->file_off > off ? e->file_off : off;
            uint64_t b = prev_end < end ? prev_end : end;
            if (a < b) {
                have = 1;
                p.ca = e->chunk_off + (a - e->file_off);
                p.cb = p.ca + (b - a);
                p.bs = p.ca - p.ca % B;
                p.be = p.cb % B ? p.cb - p.cb % B + B : p.cb;
                if (p.be > e->chunk_len)
                    p.be = e->chunk_len;
                p.dst_at = (size_t)(a - off);
                /* Does it continue the run: no tail before it, no head in
                 * it, next in the log and in the file? */
                if (r1 > r0 && last.be == last.cb && p.bs == p.ca
                        && ext[r1 - 1].log_off + last.cb == e->log_off + p.ca
                        && last.dst_at + (last.cb - last.ca) == p.dst_at) {
                    last = p;
                    r1 = i + 1;
                    filled = b;
                    continue;
                }
            }
        }
        if (r1 > r0) {
            /* Read the run [r0, r1): head, the dst span, tail, then check it. */
            struct iovec iov[3];
            int cnt = 0;
            uint64_t head = first.ca - first.bs, tail = last.be - last.cb;
            if (head) {
                iov[cnt].iov_base = scratch;
                iov[cnt++].iov_len = (size_t)head;
            }
            iov[cnt].iov_base = dst + first.dst_at;
            iov[cnt++].iov_len = last.dst_at + (size_t)(last.cb - last.ca) - first.dst_at;
            if (tail) {
                iov[cnt].iov_base = scratch + B;
                iov[cnt++].iov_len = (size_t)tail;
            }
            if (read_full(fd, iov, cnt, ext[r0].log_off + first.bs, nowait, err))
                return -1;
            if (r1 - r0 == 1) {
                if (verify(&ext[r0], &first, crcs, B, dst, scratch, err))
                    return -1;
            } else {
                /* Only the first piece has a head and only the last a tail;
                 * the middle ones are their chunks' whole tails/heads. */
                if (verify(&ext[r0], &first, crcs, B, dst, scratch, err))
                    return -1;
                size_t at = first.dst_at + (size_t)(first.cb - first.ca);
                for (size_t j = r0 + 1; j + 1 < r1; j++) {
                    const ckptfs_rx_extent *e = &ext[j];
                    uint64_t a = e->file_off > off ? e->file_off : off;
                    uint64_t b = e->file_off + e->length < end ? e->file_off + e->length : end;
                    piece_t m;
                    m.ca = e->chunk_off + (a - e->file_off);
                    m.cb = m.ca + (b - a);
                    m.bs = m.ca;            /* continuation rule: no head, no tail */
                    m.be = m.cb;
                    m.dst_at = at;
                    at += (size_t)(b - a);
                    if (verify(e, &m, crcs, B, dst, scratch, err))
                        return -1;
                }
                if (verify(&ext[r1 - 1], &last, crcs, B, dst, scratch, err))
                    return -1;
            }
            r0 = r1;
        }
        if (have) {
            /* A hole before this piece reads as zeros. */
            uint64_t a = off + p.dst_at;
            if (a > filled)
                memset(dst + (filled - off), 0, (size_t)(a - filled));
            filled = a + (p.cb - p.ca);
            first = last = p;
            r0 = i;
            r1 = i + 1;
        } else {
            r0 = r1 = i + 1;
        }
    }
    if (end > filled)
        memset(dst + (filled - off), 0, (size_t)(end - filled));
    return 0;
}

/* POSIX_FADV_WILLNEED of [at, at + len) in calls of at most HINT_PIECE,
 * aligned to it.  One call reads at most the file's read-ahead window
 * (force_page_cache_ra: 8 MiB with this disk's read_ahead_kb), so the rest
 * of a longer one was never read (the fast path's 16-17 MiB hints read 8),
 * and its 4 KiB pages fill a disk request only up to max_segments (254:
 * ~1 MiB); a 2 MiB call is read whole, in ~2 MiB requests. */
#define HINT_PIECE (2ull << 20)

static size_t advise_pieces(int fd, uint64_t at, uint64_t len)
{
    size_t calls = 0;
    uint64_t end = len > UINT64_MAX - at ? UINT64_MAX : at + len;
    while (at < end) {
        uint64_t b = (at / HINT_PIECE + 1) * HINT_PIECE;
        if (b > end)
            b = end;
        posix_fadvise(fd, (off_t)at, (off_t)(b - at), POSIX_FADV_WILLNEED);
        calls++;
        at = b;
    }
    return calls;
}

size_t ckptfs_hint_extents(int fd, const ckptfs_rx_extent *ext, size_t n,
                           uint64_t off, uint64_t len)
{
    size_t calls = 0;
    uint64_t end = off + len < off ? UINT64_MAX : off + len;
    uint64_t run_at = 0, run_len = 0;
    for (size_t i = 0; i < n; i++) {
        const ckptfs_rx_extent *e = &ext[i];
        uint64_t e_end = e->file_off + e->length;
        if (e_end <= off || e->file_off >= end || e_end < e->file_off)
            continue;
        uint64_t a = e->file_off > off ? e->file_off : off;
        uint64_t b = e_end < end ? e_end : end;
        uint64_t at = e->log_off + e->chunk_off + (a - e->file_off);
        if (run_len && run_at + run_len == at) {
            run_len += b - a;
            continue;
        }
        if (run_len)
            calls += advise_pieces(fd, run_at, run_len);
        run_at = at;
        run_len = b - a;
    }
    if (run_len)
        calls += advise_pieces(fd, run_at, run_len);
    return calls;
}

/* ---- a read window's rows from the index's records ---- */

static uint64_t le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static uint64_t be64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | p[i];
    return v;
}

/* index.py's chunk record: kind (u8), refcount (u32), length (u64), then for
 * LOG chunks the log offset (u64) and the chunk id (32 bytes); a copied one
 * has its pack location (u64 pack, u64 offset, u32 stored length, u8 codec,
 * u8 param, u32 CRC) before the CRCs. */
#define REC_HEAD 13
#define REC_LOG_FIXED (REC_HEAD + 8 + 32)
#define REC_PACKLOC 26
#define REC_KIND_LOG 1
#define REC_KIND_LOG_COPIED 4

int64_t ckptfs_window_rows(const uint8_t *keys, const uint8_t *vals, const uint8_t *recs,
                           const uint32_t *rec_lens, size_t n, uint64_t max_chunk,
                           uint64_t block_bytes, ckptfs_rx_extent *rows, uint8_t *crcs,
                           size_t crcs_cap)
{
    size_t at = 0;          /* bytes of crcs written */
    if (block_bytes == 0)
        return -1;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *rec = recs;
        size_t len = rec_lens[i];
        recs += len;
        if (len < REC_LOG_FIXED)
            return -1 - (int64_t)i;
        uint64_t chunk_len = le64(rec + 5);
        if (chunk_len > max_chunk)
            return -1 - (int64_t)i;
        size_t crcs_at;
        if (rec[0] == REC_KIND_LOG) {
            crcs_at = REC_LOG_FIXED;
        } else if (rec[0] == REC_KIND_LOG_COPIED) {
            crcs_at = REC_LOG_FIXED + REC_PACKLOC;
            if (len < crcs_at || le32(rec + REC_LOG_FIXED + 16) > chunk_len)
                return -1 - (int64_t)i;
        } else {
            return -1 - (int64_t)i;
        }
        uint64_t blocks = chunk_len / block_bytes + (chunk_len % block_bytes != 0);
        if ((uint64_t)(len - crcs_at) != 4 * blocks)
            return -1 - (int64_t)i;
        const uint8_t *v = vals + 24 * i;
        uint64_t chunk_off = le64(v + 8), length = le64(v + 16);
        if (chunk_off > chunk_len || length > chunk_len - chunk_off)
            return -1 - (int64_t)i;
        if (len - crcs_at > crcs_cap - at)
            return -1 - (int64_t)i;
        rows[i].file_off = be64(keys + 16 * i + 8);
        rows[i].length = length;
        rows[i].log_off = le64(rec + REC_HEAD);
        rows[i].chunk_off = chunk_off;
        rows[i].chunk_len = chunk_len;
        rows[i].crc_at = at / 4;
        memcpy(crcs + at, rec + crcs_at, len - crcs_at);
        at += len - crcs_at;
    }
    return (int64_t)(at / 4);
}
