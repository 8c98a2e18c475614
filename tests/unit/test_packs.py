"""Pack files (ckptfs.packs): layout, round trips, damage and truncation, streaming."""

from __future__ import annotations

import dataclasses
import os
import random
import struct
import tracemalloc

import blake3
import pytest

from ckptfs import native
from ckptfs.chunker import MAX_CHUNK_BYTES
from ckptfs.backing import LocalBackend
from ckptfs.backing.base import validate_name
from ckptfs.backing.faulty import FaultyBackend
from ckptfs.errors import (BackingFull, BlobDamaged, BlobMissing, FormatError,
                           InvalidArgument)
from ckptfs.packs import (ENTRY_BYTES, FOOTER_BYTES, HEADER_BYTES, PackEntry, PackWriter,
                          pack_name, read_pack_index, read_payload, verify_pack)

KIB = 1024
MIB = 1024 * KIB


@pytest.fixture
def backend(tmp_path):
    b = FaultyBackend(LocalBackend.create(tmp_path / "store"))
    yield b
    b.close()


def cid(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def make_chunks(n: int, seed: int = 0, max_len: int = 20 * KIB) -> list[tuple]:
    """(chunk id, codec, param, payload, logical length) tuples."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        logical = rng.randbytes(rng.randrange(1, max_len))
        codec = rng.randrange(3)
        payload = logical if codec == 0 else rng.randbytes(rng.randrange(0, len(logical) + 1))
        out.append((cid(logical + i.to_bytes(4, "little")), codec, rng.randrange(256),
                    payload, len(logical)))
    return out


def write_pack(backend, name: str, chunks) -> list[PackEntry]:
    with PackWriter.create(backend, name) as pw:
        for c in chunks:
            pw.add(*c)
        return pw.commit()


def rewrite(backend, src: str, dst: str, fn) -> int:
    """Copy blob src to dst through fn(bytearray) -> bytes-like; return the new size."""
    data = bytearray(backend.read(src, 0, backend.size(src)))
    new = fn(data)
    with backend.writer(dst) as w:
        w.write(new)
        w.commit()
    return len(new)


def test_round_trip_many_entries(backend):
    chunks = make_chunks(600)
    name = pack_name(7)
    entries = write_pack(backend, name, chunks)
    assert len(entries) == 600
    assert read_pack_index(backend, name) == entries
    assert read_pack_index(backend, name, size=backend.size(name)) == entries
    offset = HEADER_BYTES
    for (chunk_id, codec, param, payload, length), e in zip(chunks, entries):
        assert e == PackEntry(chunk_id, offset, len(payload), length, codec, param,
                              native.crc32c(payload))
        offset += len(payload)
        assert read_payload(backend, name, e) == payload
    assert backend.size(name) == offset + 600 * ENTRY_BYTES + FOOTER_BYTES
    assert verify_pack(backend, name) == entries
    # entries are found in any order, by a reader that kept only the entry
    for e in random.Random(1).sample(entries, 50):
        assert cid(b"") != e.chunk_id
        assert read_payload(backend, name, e) == chunks[entries.index(e)][3]


def test_exact_layout(backend):
    """The bytes on disk are exactly what the module docstring says."""
    a, b = cid(b"a"), cid(b"b")
    name = pack_name(b"\x12\x34")
    with PackWriter.create(backend, name) as pw:
        pw.add(a, 1, 3, b"PAYLOAD-A", 100)
        pw.add(b, 0, 0, [b"PAY", memoryview(b"LOAD-B")], 9)       # streamed in pieces
        assert pw.bytes_written == 16 + 9 + 9 and pw.payload_bytes == 18 and len(pw) == 2
        assert a in pw and cid(b"c") not in pw
        pw.commit()
        assert pw.bytes_written == backend.size(name) and pw.payload_bytes == 18
    raw = backend.read(name, 0, backend.size(name))
    assert len(raw) == 16 + 18 + 2 * 64 + 32
    assert raw[:16] == b"CKPTPAK1" + struct.pack("<II", 1, 0)
    assert raw[16:34] == b"PAYLOAD-APAYLOAD-B"
    e0 = struct.unpack("<32sQQQBBHI", raw[34:98])
    e1 = struct.unpack("<32sQQQBBHI", raw[98:162])
    assert e0 == (a, 16, 9, 100, 1, 3, 0, native.crc32c(b"PAYLOAD-A"))
    assert e1 == (b, 25, 9, 9, 0, 0, 0, native.crc32c(b"PAYLOAD-B"))
    t_off, count, version, crc, end = struct.unpack("<QQII8s", raw[-32:])
    assert (t_off, count, version, end) == (34, 2, 1, b"CKPTEND1")
    assert crc == native.crc32c(raw[34:162] + raw[-32:-12])


def test_empty_pack(backend):
    name = pack_name(0)
    assert write_pack(backend, name, []) == []
    assert backend.size(name) == HEADER_BYTES + FOOTER_BYTES
    assert read_pack_index(backend, name) == []
    assert verify_pack(backend, name) == []


def test_trailer_damage_detected(backend):
    chunks = make_chunks(3, seed=2, max_len=100)
    good = pack_name(1)
    write_pack(backend, good, chunks)
    size = backend.size(good)
    t_off = size - FOOTER_BYTES - 3 * ENTRY_BYTES
    for pos in list(range(t_off, size)) + list(range(HEADER_BYTES)):
        def flip(data, pos=pos):
            data[pos] ^= 0x01
            return data
        rewrite(backend, good, "damaged/p.pack", flip)
        with pytest.raises(BlobDamaged, match="damaged pack"):
            read_pack_index(backend, "damaged/p.pack")
    assert len(read_pack_index(backend, good)) == 3


def test_trailer_lies_consistently_detected(backend):
    """A trailer whose CRC was recomputed over wrong entries still fails the layout checks."""
    chunks = make_chunks(3, seed=3, max_len=100)
    good = pack_name(1)
    entries = write_pack(backend, good, chunks)
    size = backend.size(good)
    t_off = size - FOOTER_BYTES - 3 * ENTRY_BYTES

    def forge(new_entries: list[bytes]):
        def fn(data):
            trailer = b"".join(new_entries)
            head = struct.pack("<QQI", t_off, len(new_entries), 1)
            crc = native.crc32c(head, native.crc32c(trailer))
            return bytes(data[:t_off]) + trailer + head + struct.pack("<I", crc) + b"CKPTEND1"
        return fn

    e = [x.encode() for x in entries]
    shifted = dataclasses.replace(entries[1], offset=entries[1].offset + 1).encode()
    twice = dataclasses.replace(entries[1], chunk_id=entries[0].chunk_id).encode()
    reserved = bytearray(e[1])
    reserved[58] = 1
    for forged in ([e[0], shifted, e[2]], [e[0], twice, e[2]], [e[0], e[1]],
                   [e[0], bytes(reserved), e[2]]):
        rewrite(backend, good, "forged/p.pack", forge(forged))
        with pytest.raises(BlobDamaged):
            read_pack_index(backend, "forged/p.pack")


def test_other_version_is_a_format_error(backend):
    good = pack_name(1)
    write_pack(backend, good, make_chunks(2, seed=4, max_len=50))

    def version2(data):
        t_off, count, _v, _crc, end = struct.unpack("<QQII8s", bytes(data[-32:]))
        trailer = bytes(data[t_off:-32])
        head = struct.pack("<QQI", t_off, count, 2)
        crc = native.crc32c(head, native.crc32c(trailer))
        return bytes(data[:-32]) + head + struct.pack("<I", crc) + end

    rewrite(backend, good, "v2/p.pack", version2)
    with pytest.raises(FormatError, match="version 2"):
        read_pack_index(backend, "v2/p.pack")


def test_payload_damage_detected(backend, tmp_path):
    chunks = make_chunks(20, seed=5)
    name = pack_name(b"\xaa" * 16)
    entries = write_pack(backend, name, chunks)
    victim = next(e for e in entries if e.stored_length > 0)
    # on disk: one flipped bit in the payload region
    path = tmp_path / "store" / name
    with open(path, "r+b") as f:
        f.seek(victim.offset + victim.stored_length // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    assert read_pack_index(backend, name) == entries       # the trailer does not cover payloads
    with pytest.raises(BlobDamaged, match=victim.chunk_id.hex()):
        read_payload(backend, name, victim)
    with pytest.raises(BlobDamaged):
        verify_pack(backend, name)
    others = [e for e in entries if e != victim]
    assert all(read_payload(backend, name, e) == chunks[entries.index(e)][3] for e in others)
    # in transit: the store returns a flipped byte
    with backend.injected("damage", times=1):
        with pytest.raises(BlobDamaged, match="payload CRC"):
            read_payload(backend, name, others[0])
    with backend.injected("damage", times=1):
        with pytest.raises(BlobDamaged):
            read_pack_index(backend, name)


@pytest.mark.parametrize("cut", ["empty", "tiny", "header+1", "mid-payload", "mid-trailer",
                                 "no-footer", "one-short", "one-long"])
def test_truncated_pack_detected(backend, cut):
    good = pack_name(2)
    entries = write_pack(backend, good, make_chunks(10, seed=6))
    size = backend.size(good)
    keep = {"empty": 0, "tiny": 10, "header+1": HEADER_BYTES + 1,
            "mid-payload": entries[5].offset + 3, "mid-trailer": size - FOOTER_BYTES - 100,
            "no-footer": size - FOOTER_BYTES, "one-short": size - 1}.get(cut)
    if cut == "one-long":
        rewrite(backend, good, "cut/p.pack", lambda d: bytes(d) + b"\0")
    else:
        rewrite(backend, good, "cut/p.pack", lambda d: bytes(d[:keep]))
    with pytest.raises(BlobDamaged):
        read_pack_index(backend, "cut/p.pack")
    if cut == "mid-payload":                            # a reader with a cached entry
        with pytest.raises(BlobDamaged):
            read_payload(backend, "cut/p.pack", entries[9])


def test_missing_pack(backend):
    with pytest.raises(BlobMissing):
        read_pack_index(backend, pack_name(99))
    with pytest.raises(BlobMissing):
        read_payload(backend, pack_name(99), PackEntry(bytes(32), 16, 1, 1, 0, 0, 0))


def test_large_payloads_are_streamed(backend):
    """64 MiB of payload through the writer without holding it: 64 chunks of
    the largest size, each streamed in 64 KiB pieces; peak Python memory
    stays a few MiB (payload pieces are produced one at a time)."""
    piece = 64 * KIB
    per_chunk = MAX_CHUNK_BYTES // piece

    def pieces(seed: int):
        rng = random.Random(seed)
        for _ in range(per_chunk):
            yield rng.randbytes(piece)

    name = pack_name(3)
    tracemalloc.start()
    try:
        with PackWriter.create(backend, name) as pw:
            entries = [pw.add(cid(i.to_bytes(4, "little")), 0, 0, pieces(i), MAX_CHUNK_BYTES)
                       for i in range(64)]
            assert pw.payload_bytes == 64 * MIB
            assert pw.commit() == entries
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MIB, f"writer held {peak / MIB:.1f} MiB"
    tracemalloc.start()
    try:
        assert read_pack_index(backend, name) == entries
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 * MIB, "the index read more than the trailer"
    for i in (0, 63):
        assert read_payload(backend, name, entries[i]) == b"".join(pieces(i))


def test_writer_misuse(backend):
    with PackWriter.create(backend, pack_name(4)) as pw:
        pw.add(cid(b"x"), 0, 0, b"x", 1)
        with pytest.raises(ValueError, match="32 bytes"):
            pw.add(b"short", 0, 0, b"x", 1)
        with pytest.raises(ValueError, match="twice"):
            pw.add(cid(b"x"), 0, 0, b"x", 1)
        with pytest.raises(ValueError, match="byte"):
            pw.add(cid(b"y"), 256, 0, b"y", 1)
        with pytest.raises(ValueError, match="byte"):
            pw.add(cid(b"y"), 0, -1, b"y", 1)
        with pytest.raises(ValueError, match="outside"):
            pw.add(cid(b"y"), 0, 0, b"y", -1)
        with pytest.raises(ValueError, match="outside"):
            pw.add(cid(b"y"), 0, 0, b"y", MAX_CHUNK_BYTES + 1)
        pw.commit()
        with pytest.raises(InvalidArgument):
            pw.add(cid(b"z"), 0, 0, b"z", 1)
        with pytest.raises(InvalidArgument):
            pw.commit()
    assert len(read_pack_index(backend, pack_name(4))) == 1


def test_writer_refuses_a_payload_longer_than_its_chunk(backend):
    """Readers refuse such entries, so the writer never makes one: it aborts."""
    with PackWriter.create(backend, pack_name(5)) as pw:
        with pytest.raises(ValueError, match="payload of 2 bytes"):
            pw.add(cid(b"y"), 1, 0, b"yy", 1)
    assert backend.list("packs/") == []


def test_abort_and_failures_leave_no_pack(backend, tmp_path):
    def leftovers():
        return [f for _d, _s, fs in os.walk(tmp_path / "store") for f in fs if f.startswith(".")]

    with PackWriter.create(backend, pack_name(5)) as pw:
        pw.add(cid(b"a"), 0, 0, b"a" * 1000, 1000)         # never committed
    pw2 = PackWriter.create(backend, pack_name(6))
    pw2.add(cid(b"a"), 0, 0, b"a", 1)
    pw2.abort()
    with pytest.raises(InvalidArgument):
        pw2.add(cid(b"b"), 0, 0, b"b", 1)
    # the store fills up in the middle of a pack
    with backend.injected("full", ops={"write"}, after=3):
        pw3 = PackWriter.create(backend, pack_name(7))
        pw3.add(cid(b"1"), 0, 0, b"1", 1)
        pw3.add(cid(b"2"), 0, 0, b"2", 1)
        with pytest.raises(BackingFull):
            pw3.add(cid(b"3"), 0, 0, [b"3", b"3"], 2)
        with pytest.raises(InvalidArgument, match="aborted"):
            pw3.add(cid(b"4"), 0, 0, b"4", 1)
    # a payload iterator that fails half way
    def broken():
        yield b"part"
        raise RuntimeError("source vanished")
    pw4 = PackWriter.create(backend, pack_name(8))
    with pytest.raises(RuntimeError):
        pw4.add(cid(b"x"), 0, 0, broken(), 8)
    # the commit itself fails
    with backend.injected("full", ops={"commit"}):
        pw5 = PackWriter.create(backend, pack_name(9))
        pw5.add(cid(b"x"), 0, 0, b"x", 1)
        with pytest.raises(BackingFull):
            pw5.commit()
    assert backend.list() == []
    assert leftovers() == []


def test_pack_name():
    assert pack_name(0) == "packs/00/0000000000000000.pack"
    assert pack_name(0x1234) == "packs/34/0000000000001234.pack"
    assert pack_name(2**64 - 1) == "packs/ff/ffffffffffffffff.pack"
    h = bytes(range(32))
    assert pack_name(h) == f"packs/00/{h.hex()}.pack"
    assert pack_name(b"\xab\xcd") == "packs/ab/abcd.pack"
    for n in (pack_name(5), pack_name(h), pack_name(b"\xff" * 64)):
        assert validate_name(n) == n
    for bad in (-1, 2**64, b"", True, "abc", 1.5):
        with pytest.raises((ValueError, TypeError)):
            pack_name(bad)
