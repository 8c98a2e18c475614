"""A read window's table built in C from the index records as stored
(`index.window_records`, `native.ExtentTable.from_records`) against the
decoding loader's rows (iter_extents, window_chunk, the executor's fast
test): the same rows for windows of LOG extents, None whenever an extent is
anything else or LMDB alone is not the live map. Real LMDB, no FUSE."""

from __future__ import annotations

import random
from typing import Optional

from ckptfs import index as ix
from ckptfs import native
from ckptfs._native import ffi
from ckptfs.index import CHUNK_LOG, CHUNK_PACK, CHUNK_SOURCE, Chunk, Extent, Index

INO = 7
B = ix.CRC_BLOCK_BYTES


def decoded_rows(index, ino: int, start: int, end: int) -> Optional[list[tuple]]:
    """The rows chunkread's decoding loader gives, or None if any is slow."""
    rows = []
    for e in ix.iter_extents(index, ino, start, end):
        try:
            loc, _ = ix.window_chunk(index, e.chunk_no)
        except Exception:  # noqa: BLE001 - damaged: a slow extent
            return None
        if loc is None or e.chunk_off + e.length > loc[1]:
            return None
        log_off, chunk_len, crcs = loc
        rows.append((e.file_off, e.length, log_off, e.chunk_off, chunk_len, bytes(crcs)))
    return rows


def c_rows(index, ino: int, start: int, end: int) -> Optional[list[tuple]]:
    recs = ix.window_records(index, ino, start, end)
    if recs is None:
        return None
    table = native.ExtentTable.from_records(recs.keys, recs.vals, recs.recs, recs.rec_lens,
                                            recs.count, ix.MAX_CHUNK_BYTES, B)
    if table is None:
        return None
    ext, n, crcs, n_crcs = table.addresses()
    rows = ffi.cast("ckptfs_rx_extent *", ext)
    crc = ffi.buffer(ffi.cast("uint8_t *", crcs), 4 * max(n_crcs, 1))
    out = []
    for i in range(n):
        r = rows[i]
        blocks = -(-r.chunk_len // B)
        assert r.crc_at + blocks <= n_crcs
        out.append((r.file_off, r.length, r.log_off, r.chunk_off, r.chunk_len,
                    crc[4 * r.crc_at:4 * (r.crc_at + blocks)]))
        # The columns the window keeps beside the table.
        assert (recs.offs[i], recs.lens[i], recs.chunk_offs[i]) == \
            (r.file_off, r.length, r.chunk_off)
    return out


def log_record(rng: random.Random, length: int, copied: bool = False) -> bytes:
    crcs = rng.randbytes(4 * -(-length // B))
    return Chunk(0, CHUNK_LOG, 1, length, log_off=rng.randrange(1 << 40), crcs=crcs,
                 chunk_id=rng.randbytes(32) if copied or rng.random() < 0.7 else b"", copied=copied,
                 pack_no=4, pack_off=9, stored_length=length // 2 if copied else 0).encode()


def odd_records(rng: random.Random) -> list[bytes]:
    """Records the executor does not read: the decoding path's slow extents."""
    good = log_record(rng, 100_000)
    return [
        Chunk(0, CHUNK_PACK, 1, 70_000, pack_no=9, stored_length=10,
              chunk_id=rng.randbytes(32)).encode(),
        Chunk(0, CHUNK_SOURCE, 1, 5000, source_path=b"/a/" + bytes(90), source_fs=1).encode(),
        good[:-4],                                                   # a CRC short
        good + bytes(4),                                             # a CRC too many
        bytes([9]) + good[1:],                                       # unknown kind
        Chunk(0, CHUNK_LOG, 1, ix.MAX_CHUNK_BYTES + 1, log_off=0,
              crcs=bytes(4 * (ix.MAX_CHUNK_BYTES // B + 1))).encode(),   # too long
        Chunk(0, CHUNK_LOG, 1, 65536, log_off=0, crcs=bytes(4), chunk_id=bytes(32), copied=True,
              pack_no=1, stored_length=65537).encode(),          # copy longer than the chunk
        good[:40],                                                   # truncated
    ]


def build(tmp_path, odd: bool, seed: int) -> tuple[Index, int]:
    rng = random.Random(seed)
    index = Index(str(tmp_path / f"index{seed}{odd}"))
    lengths = [rng.choice((1, 4096, B, B + 1, 3 * B, 1 << 20)) for _ in range(40)]
    records = [log_record(rng, n, copied=rng.random() < 0.4) for n in lengths]
    if odd:
        records += odd_records(rng)

    size = [0]

    def fill(txn) -> None:
        for no, raw in enumerate(records, start=100):
            txn._put("chunks", ix.u64(no), raw)
        off = 0
        for _ in range(400):
            no = rng.randrange(len(records)) if odd and rng.random() < 0.02 \
                else rng.randrange(len(lengths))
            raw = records[no]
            clen = Chunk.decode(0, raw).length if no < len(lengths) else 4096
            coff = rng.randrange(clen) if rng.random() < 0.3 else 0
            n = max(1, rng.randrange(clen - coff + 1)) if rng.random() < 0.3 else clen - coff
            if rng.random() < 0.01:
                n = clen - coff + 1                        # past its chunk: slow
            off += rng.choice((0, 0, 0, 7, 1 << 20))       # holes
            txn._put("extents", ix.extent_key(INO, off),
                     ix.extent_encode(Extent(off, n, 100 + no, coff)))
            off += n
        for ino in (INO - 1, INO + 1):                     # neighbours, never in INO's windows
            txn._put("extents", ix.extent_key(ino, 0), ix.extent_encode(Extent(0, 9, 100, 0)))
        size[0] = off
    index.write_direct(fill)
    return index, size[0]


def windows(rng: random.Random, size: int) -> list[tuple[int, int]]:
    out = [(0, size), (0, 1), (size - 1, size), (size, size + 100), (0, 1 << 63)]
    for _ in range(60):
        a = rng.randrange(size)
        out.append((a, min(size, a + rng.choice((1, 4096, 1 << 20, 64 << 20)))))
    return out


def test_rows_from_records_are_the_decoded_rows(tmp_path):
    rng = random.Random(3)
    index, size = build(tmp_path, odd=False, seed=1)
    try:
        for start, end in windows(rng, size):
            want = decoded_rows(index, INO, start, end)
            got = c_rows(index, INO, start, end)
            if want is None:
                assert got is None, (start, end)     # an extent past its chunk
            else:
                assert got == want, (start, end)
        assert c_rows(index, INO, 0, size) is not None or decoded_rows(index, INO, 0, size) \
            is None
    finally:
        index.close()


def test_any_extent_the_executor_cannot_read_gives_none(tmp_path):
    rng = random.Random(4)
    index, size = build(tmp_path, odd=True, seed=2)
    try:
        seen_none = seen_rows = 0
        for start, end in windows(rng, size):
            want = decoded_rows(index, INO, start, end)
            got = c_rows(index, INO, start, end)
            assert got == want, (start, end)
            seen_none += want is None
            seen_rows += want is not None and len(want) > 0
        assert seen_none > 5 and seen_rows > 5
    finally:
        index.close()


def test_pending_changes_of_the_file_or_its_chunks_give_none(tmp_path):
    index, size = build(tmp_path, odd=False, seed=5)
    try:
        assert c_rows(index, INO, 0, size) == decoded_rows(index, INO, 0, size) is not None \
            or decoded_rows(index, INO, 0, size) is None
        # Another file's extent and a chunk no extent of the window names: still LMDB's.
        index._put("extents", ix.extent_key(INO + 1, 5), ix.extent_encode(Extent(5, 1, 100, 0)))
        index._put("chunks", ix.u64(999), log_record(random.Random(1), 10))
        e0 = next(ix.iter_extents(index, INO))
        first = ix.window_records(index, INO, e0.file_off, e0.file_off + 1)
        assert first is not None and first.chunk_nos == (e0.chunk_no,)
        # A chunk of the window changed, pending: not LMDB's alone.
        index._put("chunks", ix.u64(e0.chunk_no), log_record(random.Random(2), B))
        assert ix.window_records(index, INO, e0.file_off, e0.file_off + 1) is None
    finally:
        index.close()


def test_a_pending_extent_of_the_file_anywhere_gives_none(tmp_path):
    index, size = build(tmp_path, odd=False, seed=6)
    try:
        assert ix.window_records(index, INO, 0, 1 << 20) is not None
        index._put("extents", ix.extent_key(INO, size + (1 << 30)),
                   ix.extent_encode(Extent(size + (1 << 30), 1, 100, 0)))
        assert ix.window_records(index, INO, 0, 1 << 20) is None
    finally:
        index.close()


def test_damaged_extent_records_give_none(tmp_path):
    for value, key_extra in ((b"\1" * 23, b""), (ix.extent_encode(Extent(0, 1, 100, 0)), b"\0")):
        index, size = build(tmp_path / str(len(key_extra)), odd=False, seed=7)
        try:
            def damage(txn) -> None:
                txn._put("extents", ix.extent_key(INO, 5 << 40) + key_extra, value)
            index.write_direct(damage)
            assert ix.window_records(index, INO, 0, 6 << 40) is None
            assert ix.window_records(index, INO, 0, 1 << 20) is not None
        finally:
            index.close()
