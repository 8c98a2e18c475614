"""Generated bad packs: every decode stays within the chunk size limit, every
lie is a clear error.

The family: truncated packs, bit flips, trailers and footers that lie (with
their CRCs made right again, as a crafted store would have them), payloads
damaged behind a correct CRC (so the codecs' own length fields are what is
tested), zstd bombs, bad codec params, and cold-chunk index records that claim
more than a chunk. Each pack goes through `packs.read_pack_index` (what
`recover` and fsck trust) and every entry it accepts through
`coldstore.ColdStore` (what the daemon's cold reads and fsck's data check decode
with), in a child process whose address space is capped a little above what
it uses at the start: an allocation anywhere near what a bomb claims fails
the test, as does any exception other than BlobDamaged / FormatError (from
the index) or DamagedData (from a read).

The same family through a real mount: `test_damaged_packs_through_fsck_and_reads`;
and through `ckptfs recover`, which rebuilds an index from the pack trailers
alone: `test_recover_names_what_damaged_packs_cost_and_nothing_more`.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import random
import resource
import shutil
import struct
import traceback
from pathlib import Path

import blake3
import pytest
import zstandard

from ckptfs import codec, native
from ckptfs.backing import LocalBackend
from ckptfs.chunker import MAX_CHUNK_BYTES
from ckptfs.errors import BlobDamaged, DamagedData, FormatError
from ckptfs.index import CHUNK_PACK, Chunk
from ckptfs.packs import (ENTRY_BYTES, FOOTER_BYTES, HEADER_BYTES, MAGIC, END_MAGIC, VERSION,
                          PackWriter, pack_name, read_pack_index)
from ckptfs.coldstore import ColdStore
from mounting import run_ckptfs
from posix_helpers import read_file, write_file

KIB = 1 << 10
MIB = 1 << 20
# What the child may allocate beyond its size at the start: a few chunks'
# worth of buffers, far below any bomb.
HEADROOM_BYTES = 160 * MIB
BOMB_BYTES = 512 * MIB

np = pytest.importorskip("numpy")

_ENTRY = struct.Struct("<32sQQQBBHI")
_FOOTER = struct.Struct("<QQII8s")


# ------------------------------------------------------------------ the data

def sample_chunks(seed: int) -> list[bytes]:
    """Chunks that take every codec: fp32 (FLOAT), optimizer-like runs
    (PLANES), text (ZSTD), random (RAW), a tiny one, the largest size."""
    rng = np.random.default_rng(seed)
    fp32 = rng.normal(0, 0.02, 16 * KIB).astype(np.float32).tobytes()
    bf16 = (rng.normal(0, 0.02, 32 * KIB).astype(np.float32).view(np.uint32) >> 16) \
        .astype(np.uint16).tobytes()
    runs = np.repeat(rng.normal(0, 1e-3, 512), 64).astype(np.float32).tobytes()
    text = json.dumps([{"step": i, "lr": 1e-4 * i} for i in range(3000)]).encode()[:96 * KIB]
    return [fp32, bf16, runs, text, os.urandom(40 * KIB), b"x" * 17,
            rng.normal(0, 1, MAX_CHUNK_BYTES // 4).astype(np.float32).tobytes()]


def good_pack(seed: int) -> tuple[bytes, dict[bytes, bytes]]:
    """A pack as the mover writes it, as bytes, and its chunks by id."""
    parts: list[bytes] = []

    class Sink:
        name = "mem"

        def write(self, data) -> None:
            parts.append(bytes(data))

        def commit(self) -> None:
            pass

        def abort(self) -> None:
            pass

    pw = PackWriter(Sink())
    chunks = {}
    for data in sample_chunks(seed):
        cid = blake3.blake3(data).digest()
        enc = codec.encode_chunk(data)
        pw.add(cid, enc.codec, enc.param, enc.payload, len(data))
        chunks[cid] = data
    pw.commit()
    return b"".join(parts), chunks


def forge(items: list[tuple[bytes, int, int, bytes, int]]) -> bytes:
    """A pack whose every CRC is right: (chunk id, codec, param, payload,
    claimed logical length) as a crafted store would hold them."""
    out = bytearray(struct.pack("<8sII", MAGIC, VERSION, 0))
    trailer = bytearray()
    for cid, cdc, param, payload, length in items:
        trailer += _ENTRY.pack(cid, len(out), len(payload), length, cdc, param, 0,
                               native.crc32c(payload))
        out += payload
    return _close(out, trailer, len(items))


def _close(body: bytearray, trailer: bytearray, count: int, t_off: int | None = None) -> bytes:
    t_off = len(body) if t_off is None else t_off
    head = struct.pack("<QQI", t_off, count, VERSION)
    crc = native.crc32c(head, native.crc32c(trailer))
    return bytes(body + trailer + _FOOTER.pack(t_off, count, VERSION, crc, END_MAGIC))


def split(pack: bytes) -> tuple[bytearray, list[list], int]:
    """(header + payloads, entries as lists of fields, trailer offset)."""
    t_off, count, *_ = _FOOTER.unpack(pack[-FOOTER_BYTES:])
    entries = [list(f) for f in _ENTRY.iter_unpack(pack[t_off:t_off + count * ENTRY_BYTES])]
    return bytearray(pack[:t_off]), entries, t_off


def join(body: bytearray, entries: list[list], count: int | None = None,
         t_off: int | None = None) -> bytes:
    trailer = bytearray(b"".join(_ENTRY.pack(*e) for e in entries))
    return _close(body, trailer, len(entries) if count is None else count, t_off)


def zstd_bomb(content_size: bool, window_log: int) -> bytes:
    """One frame of BOMB_BYTES zeros, compressed to a few KiB."""
    params = zstandard.ZstdCompressionParameters(window_log=window_log, compression_level=1,
                                                 write_content_size=content_size)
    sink = bytearray()

    class Out:
        def write(self, data) -> int:
            sink.extend(data)
            return len(data)

    zero = bytes(MIB)
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(
            Out(), size=BOMB_BYTES if content_size else -1, closefd=False) as w:
        for _ in range(BOMB_BYTES // MIB):
            w.write(zero)
    return bytes(sink)


def cases(seed: int) -> list[tuple[str, bytes]]:
    """(what, pack bytes): the generated family."""
    rng = random.Random(seed)
    pack, chunks = good_pack(seed)
    body, entries, t_off = split(pack)
    out: list[tuple[str, bytes]] = [("intact", pack)]
    for _ in range(40):
        cut = rng.randrange(len(pack))
        out.append((f"truncated at {cut}", pack[:cut]))
    for _ in range(60):
        b = bytearray(pack)
        for _ in range(rng.randint(1, 8)):
            pos = rng.randrange(len(b))
            b[pos] ^= 1 << rng.randrange(8)
        out.append(("bit flips", bytes(b)))
    # Trailer lies, CRCs made right again.
    huge = (MAX_CHUNK_BYTES + 1, 1 << 31, (1 << 32) + 5, 1 << 40, (1 << 64) - 1)
    for i in range(len(entries)):
        for field, values in ((3, huge), (2, huge), (1, (0, 7, 1 << 40)),
                              (4, (4, 9, 200, 255)), (5, (0, 1, 17, 255))):
            for v in values:
                e = [list(x) for x in entries]
                e[i][field] = v
                out.append((f"entry {i} field {field} = {v}", join(body, e)))
    # Footer lies, CRC made right again.
    for count in (len(entries) + 1, len(entries) - 1, 1 << 20, (1 << 64) - 1, 0):
        out.append((f"footer count {count}", join(body, entries, count=count)))
    for shift in (-64, -1, 1, 64, 1 << 40):
        out.append((f"footer trailer offset {t_off}+{shift}",
                    join(body, entries, t_off=max(t_off + shift, 0))))
    # Payloads damaged behind a correct CRC: the codecs' own lengths and tables.
    ordered = list(chunks.items())
    for i, e in enumerate(entries):
        cid, cdc, param = e[0], e[4], e[5]
        payload = bytes(body[e[1]:e[1] + e[2]])
        for _ in range(12):
            p = bytearray(payload)
            if p and rng.random() < 0.7:
                for _ in range(rng.randint(1, 4)):
                    pos = rng.randrange(len(p))
                    p[pos] ^= 1 << rng.randrange(8)
            elif p:
                p = p[:rng.randrange(len(p))]
            out.append((f"payload {i} (codec {cdc}) damaged behind its CRC",
                        forge([(cid, cdc, param, bytes(p), e[3])])))
        # The same payload with another codec or param.
        for other, oparam in ((codec.CODEC_ZSTD, 0), (codec.CODEC_PLANES, 4),
                              (codec.CODEC_PLANES, 1), (codec.CODEC_FLOAT, 2),
                              (codec.CODEC_FLOAT, 17), (codec.CODEC_RAW, 3)):
            if (other, oparam) != (cdc, param):
                out.append((f"payload {i} as codec {other} param {oparam}",
                            forge([(cid, other, oparam, payload, e[3])])))
    # zstd bombs: a frame that announces BOMB_BYTES, one that does not say
    # (window 1 MiB, or one that asks for a 128 MiB window), under a trailer
    # that claims the bomb's size or the largest chunk.
    fake = ordered[0][0]
    for content_size, window_log in ((True, 22), (False, 20), (False, 27)):
        bomb = zstd_bomb(content_size, window_log)
        for claim in (BOMB_BYTES, MAX_CHUNK_BYTES, 64 * KIB):
            out.append((f"zstd bomb (content size {content_size}, window 2^{window_log}) "
                        f"claiming {claim}", forge([(fake, codec.CODEC_ZSTD, 0, bomb, claim)])))
        # A planes payload whose zstd plane is the bomb.
        sect = struct.pack("<BI", codec.PLANE_ZSTD, len(bomb))
        planes = bytes([0]) + sect + bomb + struct.pack("<BI", 0, 0) + bytes(4)
        out.append((f"planes with a bombed plane (content size {content_size})",
                    forge([(fake, codec.CODEC_PLANES, 2, planes, MAX_CHUNK_BYTES)])))
    return out


# ----------------------------------------------------------- the child side

def _fuzz_child(root: str, seed: int, conn) -> None:
    """Runs in a forked child with a capped address space; reports
    (failures, stats) through conn."""
    failures: list[str] = []
    stats = {"cases": 0, "rejected_by_index": 0, "decoded": 0, "eio": 0}
    try:
        all_cases = cases(seed)           # built before the cap: the bombs' input
        backend = LocalBackend.open(root)
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * KIB for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + HEADROOM_BYTES, vm + HEADROOM_BYTES))
        for n, (what, blob) in enumerate(all_cases):
            stats["cases"] += 1
            name = pack_name(n + 1)
            with backend.writer(name) as w:
                w.write(blob)
                w.commit()
            try:
                entries = read_pack_index(backend, name)
            except (BlobDamaged, FormatError):
                stats["rejected_by_index"] += 1
                backend.delete(name)
                continue
            except BaseException as e:      # noqa: BLE001 - the point of the test
                failures.append(f"{what}: read_pack_index raised {e!r}")
                backend.delete(name)
                continue
            for e in entries:
                if e.length > MAX_CHUNK_BYTES or e.stored_length > e.length:
                    failures.append(f"{what}: read_pack_index accepted {e}")
                    continue
                chunk = Chunk(n, CHUNK_PACK, 1, e.length, pack_no=n + 1, pack_off=e.offset,
                              stored_length=e.stored_length, codec=e.codec, codec_param=e.param,
                              payload_crc=e.crc, chunk_id=e.chunk_id)
                try:
                    data = ColdStore(backend, 0).get(chunk)
                except DamagedData:
                    stats["eio"] += 1
                    continue
                except BaseException as exc:  # noqa: BLE001
                    failures.append(f"{what}: ColdStore.get raised {exc!r}\n"
                                    + traceback.format_exc(limit=4))
                    continue
                stats["decoded"] += 1
                if blake3.blake3(data).digest() != e.chunk_id or len(data) != e.length:
                    failures.append(f"{what}: wrong bytes returned")
            backend.delete(name)
    except BaseException:  # noqa: BLE001
        failures.append("the fuzz itself failed:\n" + traceback.format_exc())
    conn.send((failures, stats))
    conn.close()


def run_fuzz(root: Path, seed: int) -> tuple[list[str], dict]:
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_fuzz_child, args=(str(root), seed, there))
    child.start()
    there.close()
    try:
        result = here.recv() if here.poll(600) else None
    except EOFError:
        result = None
    child.join(60)
    if child.is_alive():
        child.kill()
    assert result is not None, f"the fuzz child died (exit {child.exitcode})"
    return result


@pytest.mark.parametrize("seed", [1, 2])
def test_bad_packs_are_refused_within_the_chunk_limit(tmp_path, seed):
    LocalBackend.create(tmp_path / "store").close()
    failures, stats = run_fuzz(tmp_path / "store", seed)
    assert not failures, f"{len(failures)} of {stats['cases']} cases:\n" + "\n".join(failures[:20])
    # The family reached every layer: the index refused some, reads others.
    assert stats["rejected_by_index"] > 100 and stats["eio"] > 50 and stats["decoded"] > 7, stats


def test_records_that_claim_more_than_a_chunk_read_nothing(tmp_path):
    """A cold chunk's index record (not the pack) lies: refused before any read."""
    backend = LocalBackend.create(tmp_path / "store")
    data = sample_chunks(3)[0]
    cid = blake3.blake3(data).digest()
    enc = codec.encode_chunk(data)
    name = pack_name(1)
    with backend.writer(name) as w:
        w.write(forge([(cid, enc.codec, enc.param, enc.payload, len(data))]))
        w.commit()
    good = Chunk(1, CHUNK_PACK, 1, len(data), pack_no=1, pack_off=HEADER_BYTES,
                 stored_length=len(enc.payload), codec=enc.codec, codec_param=enc.param,
                 payload_crc=native.crc32c(enc.payload), chunk_id=cid)
    assert ColdStore(backend, 0).get(good) == data
    for change in ({"length": 1 << 31}, {"length": MAX_CHUNK_BYTES + 1},
                   {"stored_length": 1 << 40}, {"stored_length": len(data) + 1},
                   {"pack_off": 1 << 40}, {"codec": 9}, {"codec_param": 17},
                   {"chunk_id": cid[:5]}, {"kind": 7}):
        bad = dataclasses.replace(good, **change)
        with pytest.raises(DamagedData):
            ColdStore(backend, 0).get(bad)
    backend.close()


# ------------------------------------------------------- through a real mount

DAMAGE_KINDS = ("truncate", "payload", "trailer", "footer", "lie")


def _damage(rng: random.Random, pack: bytes, kind: str) -> tuple[str, bytes]:
    """One generated damage of a real pack: everything fsck must find."""
    body, entries, t_off = split(pack)
    if kind == "truncate":
        cut = rng.randrange(HEADER_BYTES, len(pack) - 1)
        return f"truncated at {cut}", pack[:cut]
    if kind == "payload":
        b = bytearray(pack)
        e = rng.choice([e for e in entries if e[2]])
        pos = e[1] + rng.randrange(e[2])
        b[pos] ^= 1 << rng.randrange(8)
        return f"bit flip in a payload at {pos}", bytes(b)
    if kind == "trailer":
        b = bytearray(pack)
        pos = t_off + rng.randrange(len(entries) * ENTRY_BYTES)
        b[pos] ^= 1 << rng.randrange(8)
        return f"bit flip in the trailer at {pos}", bytes(b)
    if kind == "footer":
        return "footer claims a million entries", join(body, entries, count=1 << 20)
    e = [list(x) for x in entries]
    i = rng.randrange(len(e))
    e[i][3] = 1 << 31
    return f"entry {i} claims 2 GiB (CRC made right)", join(body, e)


@pytest.mark.parametrize("seed", [11])
def test_damaged_packs_through_fsck_and_reads(make_mount, seed):
    """A real store's pack, damaged in generated ways: fsck finds each (exit 4,
    no traceback); reads of the affected files give EIO or their exact bytes,
    every other file reads exactly, and the daemon stays up."""
    rng = random.Random(seed)
    m = make_mount(options=["pmem_size=128M", "hot_versions=1"])
    files = {f"c{i}.bin": b"".join(sample_chunks(seed + i)[:5]) for i in range(3)}
    for name, data in files.items():
        write_file(m.path / name, data)
    run_ckptfs("tier", str(m.path), "--now", "--all", timeout=600)
    hot = os.urandom(3 * MIB)
    write_file(m.path / "hot.bin", hot)
    m.umount()
    store = m.source / ".ckptfs" / "store"
    pack_path = next((store / "packs").rglob("*.pack"))
    pristine = pack_path.read_bytes()
    for kind in DAMAGE_KINDS + ("payload",):
        what, damaged = _damage(rng, pristine, kind)
        pack_path.write_bytes(damaged)
        res = m.fsck()
        out = res.stdout + res.stderr
        assert res.returncode == 4 and "problem [" in res.stdout, f"{what}: fsck said\n{out}"
        assert "Traceback" not in out, f"{what}: fsck crashed\n{out}"
        m.start()
        for name, data in files.items():
            try:
                got = read_file(m.path / name)
            except OSError as e:
                assert e.errno == 5, f"{what}: {name} gave {e!r}, not EIO"
                continue
            assert got == data, f"{what}: {name} read back wrong bytes"
        assert read_file(m.path / "hot.bin") == hot
        assert m.stat()["pid"] == m.pid, "the daemon went away"
        m.umount()
        log_text = (m.source / ".ckptfs" / "daemon.log").read_text()
        assert "Traceback" not in log_text, f"{what}: the daemon logged a traceback"
    pack_path.write_bytes(pristine)
    res = m.fsck()
    assert res.returncode == 0, res.stdout


def _liar(rng: random.Random, pack: bytes) -> bytes:
    """A pack that lists the chunk ids of `pack` over other bytes, every CRC
    right: only the BLAKE3 check of a read can tell."""
    body, entries, _ = split(pack)
    return forge([(e[0], codec.CODEC_RAW, 0, rng.randbytes(e[3]), e[3]) for e in entries])


def test_recover_names_what_damaged_packs_cost_and_nothing_more(make_mount, tmp_path):
    """`ckptfs recover` over a store one of whose packs is damaged in each
    generated way: no traceback, exit 4 or 0; a pack whose trailer is
    unusable is named and skipped, and so are the files only it held (`not
    recovered`); every other file comes back exactly, or gives EIO where a
    payload behind an intact trailer is bad (never wrong bytes); fsck then
    names what is left (exit 4), and the pack counter is above every pack
    name in the store, readable or not (the mover never writes over one).
    A crafted pack that lists another pack's chunk ids over other bytes, and
    sorts first, is found out: recover checks the copies of an id several
    packs list and restores from the one that holds its bytes (named in a
    note), so every file reads exactly and fsck is clean."""
    from ckptfs import index as ix
    from ckptfs.packs import pack_number
    rng = random.Random(13)
    m = make_mount(options=["pmem_size=128M", "hot_versions=1"])
    files = {f"c{i}.bin": b"".join(sample_chunks(20 + i)[:5]) for i in range(3)}
    for name, data in files.items():           # one pack per file
        write_file(m.path / name, data)
        run_ckptfs("tier", str(m.path), "--now", "--all", timeout=600)
    m.umount()
    state = m.source / ".ckptfs"
    idx = ix.Index(str(state / "index"))
    try:
        pack_of = {}
        for name in files:
            ino = ix.dirent_decode(idx._get("dirents", ix.dirent_key(ix.ROOT_INO,
                                                                     name.encode())))[0]
            (pack_of[name],) = {pack_name(ix.get_chunk(idx, e.chunk_no).pack_no)
                                for e in ix.iter_extents(idx, ino)}
    finally:
        idx.close()
    assert len(set(pack_of.values())) == 3, pack_of
    victim = pack_of["c2.bin"]                 # the highest pack number
    assert pack_number(victim) == max(map(pack_number, pack_of.values()))
    shutil.copytree(state / "store", tmp_path / "store.pristine")
    pristine = (state / "store" / victim).read_bytes()
    # packs/00/...: listed before c1.bin's pack, in the volume's own pack space
    liar_name = pack_name(pack_number(pack_of["c1.bin"]) >> 32 << 32 | 0x100)
    assert liar_name < pack_of["c1.bin"]
    damaged = [_damage(rng, pristine, kind) + (victim,) for kind in DAMAGE_KINDS]
    damaged.append(("a pack listing c1.bin's chunk ids over other bytes",
                    _liar(rng, (state / "store" / pack_of["c1.bin"]).read_bytes()), liar_name))
    for what, blob, where in damaged:
        shutil.rmtree(state / "store")
        shutil.copytree(tmp_path / "store.pristine", state / "store")
        shutil.rmtree(state / "index", ignore_errors=True)
        (state / "pmem.log").unlink(missing_ok=True)
        (state / "store" / where).parent.mkdir(parents=True, exist_ok=True)
        (state / "store" / where).write_bytes(blob)
        res = run_ckptfs("recover", str(m.source), check=False, timeout=600)
        out = res.stdout + res.stderr
        assert "Traceback" not in out and res.returncode in (0, 4), f"{what}:\n{out}"
        liar = where == liar_name
        if liar:
            assert res.returncode == 0 and f"{liar_name} lists it but does not hold its " \
                "bytes" in res.stdout, f"{what}:\n{out}"
        skipped = f"skipping pack {where}" in res.stdout
        lost = {n for n in files if f"not recovered: {n}" in res.stdout}
        assert lost == ({n for n, p in pack_of.items() if p == where} if skipped else set()), \
            f"{what}:\n{out}"
        m.start()
        eio = set()
        for name, data in files.items():
            if name in lost:
                assert not (m.path / name).exists(), f"{what}: {name} came back"
                continue
            try:
                got = read_file(m.path / name)
            except OSError as e:
                assert e.errno == 5, f"{what}: {name} gave {e!r}"
                eio.add(name)
                continue
            assert got == data, f"{what}: {name} read back wrong bytes"
        assert eio <= {"c2.bin"} and (skipped or eio or liar), f"{what}: {eio}, {out}"
        m.umount()
        res = m.fsck()
        out = res.stdout + res.stderr
        assert "Traceback" not in out and res.returncode == (0 if liar else 4), \
            f"{what}:\n{out}"
        assert "next_pack" not in res.stdout, f"{what}:\n{out}"
