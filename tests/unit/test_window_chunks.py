"""A cold file's read window built from the index records as stored
(`index.window_records`, `index.window_chunks`) against the decoding
loader's (iter_extents, window_chunk): the same chunk records, extent by
extent; records decoded ahead taken from there; None whenever a chunk has
a log location or a record is damaged (the decoding loader handles those).
Real LMDB, no FUSE."""

from __future__ import annotations

import random

from ckptfs import index as ix
from ckptfs.index import CHUNK_LOG, CHUNK_PACK, CHUNK_SOURCE, Chunk, Extent, Index

INO = 7
B = ix.CRC_BLOCK_BYTES


def pack_record(rng: random.Random, length: int) -> bytes:
    return Chunk(0, CHUNK_PACK, 1, length, pack_no=rng.randrange(1, 9),
                 pack_off=rng.randrange(1 << 30), stored_length=rng.randrange(1, length + 1),
                 chunk_id=rng.randbytes(32), payload_crc=rng.randrange(1 << 32),
                 codec=rng.choice((0, 1)), codec_param=rng.randrange(3)).encode()


def log_record(rng: random.Random, length: int) -> bytes:
    return Chunk(0, CHUNK_LOG, 1, length, log_off=rng.randrange(1 << 40),
                 crcs=rng.randbytes(4 * -(-length // B))).encode()


def build(tmp_path, records: list[bytes], seed: int) -> tuple[Index, int]:
    """INO's map: 300 extents of the chunks 100.. (records), some holes."""
    rng = random.Random(seed)
    index = Index(str(tmp_path / f"index{seed}"))
    size = [0]

    def fill(txn) -> None:
        for no, raw in enumerate(records, start=100):
            txn._put("chunks", ix.u64(no), raw)
        off = 0
        for k in range(300):
            # The last record (the odd one, if any) is named at least once.
            no = len(records) - 1 if k == 150 else rng.randrange(len(records))
            try:
                clen = Chunk.decode(0, records[no]).length
            except ix.FormatError:
                clen = 4096                 # a damaged record's extent
            coff = rng.randrange(clen) if rng.random() < 0.3 else 0
            off += rng.choice((0, 0, 0, 7, 1 << 20))       # holes
            txn._put("extents", ix.extent_key(INO, off),
                     ix.extent_encode(Extent(off, clen - coff, 100 + no, coff)))
            off += clen - coff
        txn._put("extents", ix.extent_key(INO + 1, 0), ix.extent_encode(Extent(0, 9, 100, 0)))
        size[0] = off
    index.write_direct(fill)
    return index, size[0]


def decoded(index: Index, start: int, end: int) -> tuple[list[Extent], list]:
    """The decoding loader's extents and records (None: a log location)."""
    extents = list(ix.iter_extents(index, INO, start, end))
    return extents, [ix.window_chunk(index, e.chunk_no)[1] for e in extents]


def cold_records(rng: random.Random) -> list[bytes]:
    out = [pack_record(rng, rng.choice((1, 4096, 75_000, 1 << 20))) for _ in range(30)]
    out.append(Chunk(0, CHUNK_SOURCE, 1, 5000, source_path=b"/a/b", source_fs=1).encode())
    return out


def test_cold_windows_from_records_are_the_decoded_ones(tmp_path):
    rng = random.Random(1)
    index, size = build(tmp_path, cold_records(rng), seed=1)
    try:
        cases = [(0, size), (0, 1), (size - 1, size), (0, 1 << 63)]
        cases += [(a, min(size, a + rng.choice((1, 1 << 20, 16 << 20))))
                  for a in (rng.randrange(size) for _ in range(40))]
        for start, end in cases:
            recs = ix.window_records(index, INO, start, end)
            assert recs is not None
            got = ix.window_chunks(recs, {})
            extents, want = decoded(index, start, end)
            assert got == want, (start, end)
            assert [Extent(*t) for t in zip(recs.offs, recs.lens, recs.chunk_nos,
                                            recs.chunk_offs)] == extents
        assert len(decoded(index, 0, size)[0]) == 300
    finally:
        index.close()


def test_records_decoded_ahead_are_taken_and_removed(tmp_path):
    rng = random.Random(2)
    index, size = build(tmp_path, cold_records(rng), seed=2)
    try:
        recs = ix.window_records(index, INO, 0, size)
        first = recs.chunk_nos[0]
        marker = Chunk(first, CHUNK_PACK, 1, 1, pack_no=1, stored_length=1,
                       chunk_id=bytes(32))
        known = {first: marker, 12345: marker}
        got = ix.window_chunks(recs, known)
        assert got[0] is marker
        assert known == {12345: marker}         # the window's own went, no other
    finally:
        index.close()


def test_a_chunk_in_the_log_or_a_damaged_record_gives_none(tmp_path):
    rng = random.Random(3)
    records = cold_records(rng)
    good = pack_record(rng, 4096)
    for k, odd in enumerate((log_record(rng, 4096),          # a log location: C or decoding
                             bytes([9]) + good[1:],          # unknown kind
                             good[:20])):                    # truncated
        index, size = build(tmp_path / str(k), records + [odd], seed=3)
        try:
            odd_no = 100 + len(records)
            extents, _ = decoded(index, 0, size) if k == 0 else (
                list(ix.iter_extents(index, INO, 0, size)), None)
            at = [e for e in extents if e.chunk_no == odd_no]
            assert at, "the odd record is in the map"
            recs = ix.window_records(index, INO, 0, size)
            assert recs is not None
            assert ix.window_chunks(recs, {}) is None
            # A window without it still loads from the records.
            e = next(e for e in extents if e.chunk_no != odd_no)
            one = ix.window_records(index, INO, e.file_off, e.file_off + 1)
            assert ix.window_chunks(one, {}) == [ix.window_chunk(index, e.chunk_no)[1]]
        finally:
            index.close()
