/* Checking cold chunks read back from a pack (ckptfs/coldstore.py). */

#include "ckptfs_native.h"

#include <string.h>

#ifdef CKPTFS_HAVE_BLAKE3
#include "blake3.h"
#endif

int ckptfs_verify_payloads(const void *buf, size_t buf_len, size_t n,
                           const uint64_t *offs, const uint64_t *lens,
                           const uint32_t *crcs, const uint8_t *ids, int *what)
{
    const unsigned char *p = buf;
    *what = 0;
#ifndef CKPTFS_HAVE_BLAKE3
    if (ids)
        return -1;
#endif
    for (size_t k = 0; k < n; k++) {
        if (offs[k] > buf_len || lens[k] > buf_len - offs[k]) {
            *what = CKPTFS_VERIFY_RANGE;
            return (int)k;
        }
#ifdef CKPTFS_HAVE_BLAKE3
        /* A payload whose id is given is checked by its id alone: a BLAKE3
         * over all of its bytes equal to the id the index names proves them
         * to be that chunk's, which a CRC-32C of the same bytes (from the
         * same record) adds nothing to. An all-zero id asks for no id check
         * (the payload is encoded: the caller checks its decoded bytes), so
         * its CRC is checked, as the decoder's input. */
        static const uint8_t none[32];
        if (ids && memcmp(ids + 32 * k, none, 32) != 0) {
            uint8_t got[32];
            blake3_hasher h;
            blake3_hasher_init(&h);
            blake3_hasher_update(&h, p + offs[k], lens[k]);
            blake3_hasher_finalize(&h, got, 32);
            if (memcmp(got, ids + 32 * k, 32) != 0) {
                *what = CKPTFS_VERIFY_ID;
                return (int)k;
            }
            continue;
        }
#endif
        if (ckptfs_crc32c(0, p + offs[k], lens[k]) != crcs[k]) {
            *what = CKPTFS_VERIFY_CRC;
            return (int)k;
        }
    }
    return (int)n;
}
