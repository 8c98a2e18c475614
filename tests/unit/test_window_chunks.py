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


class _Log:
    """The reader's log, as far as a cold window's load looks at it."""
    dax = False
    fd = -1


def reader(index: Index):
    from ckptfs.chunkread import ChunkReader
    return ChunkReader(index, _Log(), None, None, None)


def window_rows(w):
    return (w.start, w.end, list(w.extents), list(w.ends), list(w.offs), w.chunks,
            w.slow, list(w.chunk_nos))


def test_a_cold_window_moved_on_reads_only_its_new_stretch(tmp_path, monkeypatch):
    """A cold reader's refill moves its window on (`_load_window` with
    reuse): the part it keeps comes from the old window, only the stretch
    past the old end is read from the index, and the window is the one a
    fresh load gives."""
    rng = random.Random(4)
    records = [pack_record(rng, rng.choice((4096, 75_000, 1 << 20))) for _ in range(30)]
    index, size = build(tmp_path, records, seed=4)
    try:
        r = reader(index)
        read = []
        real = ix.window_records
        monkeypatch.setattr(ix, "window_records",
                            lambda idx, ino, a, b: read.append((a, b)) or real(idx, ino, a, b))
        w_start, w_end = 0, size // 5
        window = r._load_window(INO, w_start, w_end, size)
        moves = 0
        while w_end < size:
            # Each move on as cold_refill makes it: back a little, on further.
            w_start = rng.randrange(w_start, w_end + 1)
            w_end = min(size, w_end + rng.choice((1, 4096, size // 7)))
            del r._windows[INO]
            r._drop_window(INO, window, moving=True)
            read.clear()
            old_end = window.end
            window = r._load_window(INO, w_start, w_end, size, reuse=window)
            assert read == [(old_end, w_end)]
            fresh = reader(index)._load_window(INO, w_start, w_end, size)
            assert window_rows(window) == window_rows(fresh), (w_start, w_end)
            moves += 1
        assert moves > 3
    finally:
        index.close()


class _ColdTable:
    """The fast path's cold table calls as the reader makes them: pieces
    published, trims, and replies in flight per epoch (busy until let go)."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, int]] = []
        self.blocking_trims = 0
        self.epoch = 0
        self.busy: set[int] = set()

    def cold_publish(self, ino, offs, lens, addresses, refill_at) -> int:
        self.pieces += zip(offs, lens)
        return len(offs)

    def cold_trim(self, ino, below) -> None:
        self.blocking_trims += 1
        self.pieces = [p for p in self.pieces if p[0] + p[1] > below]

    def cold_trim_later(self, ino, below) -> int:
        before = len(self.pieces)
        self.pieces = [p for p in self.pieces if p[0] + p[1] > below]
        if len(self.pieces) == before:
            return -1
        epoch, self.epoch = self.epoch, (self.epoch + 1) % 4
        self.busy.add(epoch)            # a reply of it is being written
        return epoch

    def cold_drained(self, ino, epoch) -> bool:
        return epoch not in self.busy

    def cold_mark(self, ino, wake_at) -> bool:
        return True

    def cold_forget(self, ino) -> None:
        self.pieces = []
        self.busy.clear()               # it waits for every reply


class _Cache:
    """A cold store holding every chunk."""

    def cached_run(self, chunks):
        return [(i, memoryview(bytes(c.length)), 4096) for i, c in chunks]


def test_a_refill_trims_its_cold_table_without_waiting_for_replies(tmp_path):
    """A refill drops the pieces behind its reader from the cold table
    without waiting for the replies in flight (the trio thread answers no
    READ meanwhile: 0-25 ms per trim, 100-175 ms per GiB read); their pins
    stay until those replies are written, then go."""
    from ckptfs.chunkread import ChunkReader
    rng = random.Random(5)
    records = [pack_record(rng, rng.choice((75_000, 1 << 20))) for _ in range(30)]
    index, size = build(tmp_path, records, seed=5)
    try:
        r = ChunkReader(index, _Log(), None, None, None, cold=_Cache())
        table = _ColdTable()
        r.publish_to(table)
        window = r._load_window(INO, 0, size, size)
        r._publish_cold(window, 0, refill=True)
        published = len(window.cold_pins)
        assert published > 10 and len(table.pieces) == published
        below = window.cold_pins[published // 2][0]
        r._publish_cold(window, below, refill=True, behind=0)
        assert table.blocking_trims == 0
        assert all(p[0] + p[1] > below for p in table.pieces)
        (epoch, gone), = window.cold_retired
        assert gone and all(t <= below for t, _ in gone)
        assert all(t > below for t, _ in window.cold_pins)
        r._publish_cold(window, below, refill=True, behind=0)
        assert len(window.cold_retired) == 1        # still being written: kept
        table.busy.clear()
        r._publish_cold(window, below, refill=True, behind=0)
        assert not window.cold_retired              # written: gone
    finally:
        index.close()
