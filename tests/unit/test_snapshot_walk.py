"""The snapshot walk's per-extent loop from the records as stored
(`index.extent_store_ids`, `snapshot_format.extent_fragment`) against the
decoding path it replaces (iter_extents, get_chunk, packed_chunk_id,
fragment(encode_extent(...))): the same ids, the same bytes, the same
FormatError for damaged records. Real LMDB in a temp dir, no FUSE."""

from __future__ import annotations

import random
from typing import Optional

import pytest

from ckptfs import index as ix
from ckptfs import snapshot_format as sf
from ckptfs.errors import FormatError
from ckptfs.index import CHUNK_LOG, CHUNK_PACK, CHUNK_SOURCE, Chunk, Extent, Index
from ckptfs.snapshots import packed_chunk_id

INO = 7


def old_walk(kv, ino: int) -> list[tuple[bytes, bool]]:
    """What Publisher._file did per extent before: (fragment, in the store)."""
    out = []
    for e in ix.iter_extents(kv, ino):
        chunk = ix.get_chunk(kv, e.chunk_no)
        cid = packed_chunk_id(chunk) if chunk is not None else None
        out.append((sf.fragment(sf.encode_extent(sf.Extent(e.file_off, e.length, cid,
                                                           e.chunk_off))), cid is not None))
    return out


def new_walk(kv, ino: int) -> list[tuple[bytes, bool]]:
    return [(sf.extent_fragment(off, length, cid, coff), cid is not None)
            for off, length, cid, coff in ix.extent_store_ids(kv, ino)]


def chunk_records(rng: random.Random) -> list[bytes]:
    """One record of every kind the walk meets, ids random."""
    cid = lambda: rng.randbytes(ix.CHUNK_ID_BYTES)        # noqa: E731
    crcs = bytes(4 * 2)
    return [
        Chunk(0, CHUNK_LOG, 1, 100_000, log_off=4096, crcs=crcs).encode(),        # no id
        Chunk(0, CHUNK_LOG, 2, 100_000, log_off=8192, crcs=crcs, chunk_id=cid()).encode(),
        Chunk(0, CHUNK_LOG, 1, 100_000, log_off=12288, crcs=crcs, chunk_id=cid(), copied=True,
              pack_no=3, pack_off=77, stored_length=900, codec=1, payload_crc=5).encode(),
        Chunk(0, CHUNK_LOG, 1, 65536, log_off=0, crcs=bytes(4), chunk_id=bytes(32),
              copied=True, pack_no=1).encode(),                   # a copied one, all-zero id
        Chunk(0, CHUNK_PACK, 1, 70_000, pack_no=9, pack_off=1, stored_length=10,
              chunk_id=cid()).encode(),
        Chunk(0, CHUNK_PACK, 1, 70_000, pack_no=9, pack_off=1, stored_length=10).encode(),
        Chunk(0, CHUNK_SOURCE, 1, 5000, source_path=b"/a/b", source_fs=1).encode(),
        Chunk(0, CHUNK_SOURCE, 1, 5000, source_path=b"/a/" + bytes(80), source_fs=1).encode(),
    ]


def build(tmp_path, records: list[Optional[bytes]], n: int = 300, seed: int = 3) -> Index:
    """A file of n extents naming chunks with these records (None: missing)."""
    rng = random.Random(seed)
    index = Index(str(tmp_path / "index"))

    def fill(txn) -> None:
        for no, raw in enumerate(records, start=100):
            if raw is not None:
                txn._put("chunks", ix.u64(no), raw)
        off = 0
        for _ in range(n):
            no = 100 + rng.randrange(len(records))
            length = rng.choice((1, 4096, 65536, 100_000))
            off += rng.choice((0, 0, 1, 1 << 33))        # holes, some far apart
            e = Extent(off, length, no, rng.choice((0, 5, 65536)))
            txn._put("extents", ix.extent_key(INO, off), ix.extent_encode(e))
            off += length
        # Another file's extents on either side, never in INO's walk.
        for ino in (INO - 1, INO + 1):
            txn._put("extents", ix.extent_key(ino, 0), ix.extent_encode(Extent(0, 9, 100, 0)))
    index.write_direct(fill)
    return index


def test_store_ids_and_fragments_are_what_the_decoding_walk_gives(tmp_path):
    rng = random.Random(5)
    records: list[Optional[bytes]] = chunk_records(rng) + [None]
    index = build(tmp_path, records)
    try:
        want = old_walk(index, INO)
        assert len(want) == 300 and any(w[1] for w in want) and not all(w[1] for w in want)
        assert new_walk(index, INO) == want
        # Through a read view (what the publisher walks) and with pending
        # changes over LMDB (an extent put, one deleted, a chunk changed).
        keys = [k for k, _ in index._items("extents", *ix.prefix_range(INO))]
        index._delete("extents", keys[10])
        index._put("extents", ix.extent_key(INO, 1 << 40),
                   ix.extent_encode(Extent(1 << 40, 3, 104, 0)))
        index._put("chunks", ix.u64(100), records[2])
        assert new_walk(index, INO) == old_walk(index, INO)
        with index.read_view() as view:
            assert new_walk(view, INO) == old_walk(view, INO)
    finally:
        index.close()


def test_extent_fragment_is_the_canonical_json_of_an_extent():
    rng = random.Random(9)
    for _ in range(2000):
        x = sf.Extent(rng.randrange(1 << rng.choice((1, 20, 63))), rng.randrange(1 << 31),
                      rng.choice((None, rng.randbytes(32), bytes(32))),
                      rng.randrange(1 << rng.choice((1, 30))))
        assert sf.extent_fragment(x.file_off, x.length, x.chunk_id, x.chunk_off) \
            == sf.fragment(sf.encode_extent(x))


@pytest.mark.parametrize("damage", ["short_copied", "unknown_kind", "short_log", "short_pack",
                                    "extent_value", "extent_key"])
def test_damaged_records_raise_format_error_as_the_decoding_walk_does(tmp_path, damage):
    rng = random.Random(1)
    records: list[Optional[bytes]] = chunk_records(rng)
    copied = records[2]
    bad = {"short_copied": copied[:60], "unknown_kind": bytes([9]) + copied[1:],
           "short_log": records[0][:15], "short_pack": records[4][:30]}.get(damage)
    records.append(bad if bad is not None else records[0])
    index = build(tmp_path, records, n=60, seed=2)
    try:
        if damage == "extent_value":
            index._put("extents", ix.extent_key(INO, 5 << 40), b"\1" * 23)
        elif damage == "extent_key":
            index._put("extents", ix.extent_key(INO, 5 << 40) + b"\0", ix.extent_encode(
                Extent(0, 1, 100, 0)))
        else:
            index._put("extents", ix.extent_key(INO, 5 << 40), ix.extent_encode(
                Extent(5 << 40, 1, 100 + len(records) - 1, 0)))
        with pytest.raises(FormatError):
            old_walk(index, INO)
        with pytest.raises(FormatError):
            new_walk(index, INO)
    finally:
        index.close()
