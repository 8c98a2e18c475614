"""Damaged index records, planted with a direct LMDB transaction: fsck finds
each one (exit 4, the record named, no traceback); a mount over them reads
every other file exactly, gives EIO (or the exact bytes) for the files they
touch, and the daemon neither crashes nor logs an unexpected error.

The family, generated from a seed over the records of real files: chunk
records (LOG and PACK) truncated, scrambled, claiming 2 GiB or 4 GiB, with
fewer block CRCs, moved in the log or out of it, with another stored length,
pack offset, codec, codec param, pack or payload CRC, or pointing at a zstd
bomb in a crafted pack; extents truncated or naming a missing chunk or bytes
past their chunk; inodes truncated or with an impossible size; pack records
truncated.
"""

from __future__ import annotations

import dataclasses
import random
import re
import shutil
from dataclasses import dataclass, field
from typing import Callable

import pytest

from ckptfs import codec, native
from ckptfs import index as ix
from ckptfs.backing import LocalBackend
from ckptfs.chunker import MAX_CHUNK_BYTES
from ckptfs.index import CHUNK_LOG, CHUNK_PACK, Chunk, DirectTxn, Index
from ckptfs.packs import pack_name
from mounting import run_ckptfs
from posix_helpers import read_file, write_file
from test_fuzz_packs import forge, sample_chunks, zstd_bomb

KIB, MIB = 1 << 10, 1 << 20
MAX = ix.u64((1 << 64) - 1)
FILES = ("cold/a.bin", "cold/b.bin", "hot/c.bin", "hot/d.bin", "e.bin")
DAMAGES_PER_ROUND = 3
ROUNDS = 8


@dataclass
class Damage:
    what: str
    targets: frozenset[str]           # the files it touches
    token: str                        # fsck must name this ("chunk 12", "inode 5", ...)
    plant: Callable[[DirectTxn], None]
    store: Callable[[LocalBackend], None] = field(default=lambda backend: None)


def _resolve(kv, rel: str) -> int:
    ino = ix.ROOT_INO
    for part in rel.split("/"):
        ino = ix.dirent_decode(kv._get("dirents", ix.dirent_key(ino, part.encode())))[0]
    return ino


def _put(db: str, key: bytes, value: bytes) -> Callable[[DirectTxn], None]:
    return lambda txn: txn._put(db, key, value)


def _chunk_value(c: Chunk, **change) -> bytes:
    return dataclasses.replace(c, **change).encode()


def damages(rng: random.Random, kv, chunks_of: dict[str, set[int]]) -> list[Damage]:
    """Every kind of damage, each on a random record of a random file."""
    out: list[Damage] = []
    for rel in FILES:
        mine = frozenset({rel})
        ino = _resolve(kv, rel)
        extents = list(ix.iter_extents(kv, ino))
        e = rng.choice(extents)
        ekey = ix.extent_key(ino, e.file_off)
        evalue = kv._get("extents", ekey)
        c = ix.get_chunk(kv, e.chunk_no)
        ckey = ix.u64(c.chunk_no)
        cvalue = kv._get("chunks", ckey)
        ctok = f"chunk {c.chunk_no}"
        sharing = frozenset(f for f in FILES if c.chunk_no in chunks_of[f])   # dedup

        def chunk(what: str, value: bytes, token: str = ctok) -> None:
            out.append(Damage(f"{rel}: {what}", sharing, token, _put("chunks", ckey, value)))

        chunk("chunk record truncated", cvalue[:rng.randrange(len(cvalue))])
        chunk("chunk record scrambled", cvalue[:1] + rng.randbytes(len(cvalue) - 1))
        chunk("chunk claims 2 GiB", _chunk_value(c, length=1 << 31))
        chunk("chunk claims 4 GiB - 1", _chunk_value(c, length=(1 << 32) - 1))
        chunk("chunk claims one byte over the limit", _chunk_value(c, length=MAX_CHUNK_BYTES + 1))
        if c.kind == CHUNK_LOG:
            chunk("LOG chunk lost a block CRC", _chunk_value(c, crcs=c.crcs[:-4]))
            chunk("LOG chunk moved 4 KiB", _chunk_value(c, log_off=c.log_off + 4096))
            chunk("LOG chunk moved out of the log", _chunk_value(c, log_off=1 << 40))
        else:
            assert c.kind == CHUNK_PACK
            chunk("PACK chunk with a huge stored length",
                  _chunk_value(c, stored_length=(1 << 32) - 1))
            chunk("PACK chunk at a huge offset", _chunk_value(c, pack_off=1 << 40))
            chunk("PACK chunk with codec 200", _chunk_value(c, codec=200))
            chunk("PACK chunk with param 99", _chunk_value(c, codec_param=99))
            chunk("PACK chunk in a pack that is not there", _chunk_value(c, pack_no=7777))
            chunk("PACK chunk with another payload CRC",
                  _chunk_value(c, payload_crc=c.payload_crc ^ 1))
            # A crafted pack with a zstd bomb, and the record pointing at it.
            bomb = zstd_bomb(False, 20)
            bomb_no = 9000 + len(out)
            value = _chunk_value(c, pack_no=bomb_no, pack_off=16, stored_length=len(bomb),
                                 codec=codec.CODEC_ZSTD, codec_param=0,
                                 payload_crc=native.crc32c(bomb),
                                 length=min(c.length, MAX_CHUNK_BYTES))

            def put_bomb(backend: LocalBackend, bomb=bomb, bomb_no=bomb_no, cid=c.chunk_id,
                         length=min(c.length, MAX_CHUNK_BYTES)) -> None:
                with backend.writer(pack_name(bomb_no)) as w:
                    w.write(forge([(cid, codec.CODEC_ZSTD, 0, bomb, length)]))
                    w.commit()
            out.append(Damage(f"{rel}: PACK chunk pointing at a zstd bomb", sharing, ctok,
                              _put("chunks", ckey, value), put_bomb))
        itok = f"inode {ino}"
        out.append(Damage(f"{rel}: extent truncated", mine, itok,
                          _put("extents", ekey, evalue[:rng.randrange(len(evalue))])))
        for what, ex in (
                ("extent names a missing chunk", ix.Extent(e.file_off, e.length, 10**9, 0)),
                ("extent starts past its chunk",
                 ix.Extent(e.file_off, e.length, e.chunk_no, 1 << 40)),
                ("extent longer than its chunk",
                 ix.Extent(e.file_off, 1 << 40, e.chunk_no, e.chunk_off))):
            out.append(Damage(f"{rel}: {what}", mine, itok, _put("extents", ekey,
                                                                ix.extent_encode(ex))))
        inode = ix.get_inode(kv, ino)
        ivalue = kv._get("inodes", ix.ino_key(ino))
        out.append(Damage(f"{rel}: inode truncated", mine, itok,
                          _put("inodes", ix.ino_key(ino), ivalue[:rng.randrange(len(ivalue))])))
        huge = dataclasses.replace(inode, size=(1 << 64) - 1)
        out.append(Damage(f"{rel}: inode of 2^64-1 bytes", mine, itok,
                          _put("inodes", ix.ino_key(ino), huge.encode())))
        if c.kind == CHUNK_PACK:
            praw = kv._get("packs", ix.u64(c.pack_no))
            out.append(Damage(f"{rel}: pack record truncated", mine, f"pack {c.pack_no}",
                              _put("packs", ix.u64(c.pack_no), praw[:rng.randrange(len(praw))])))
    return out


def _files_of(kv) -> dict[str, set[int]]:
    return {rel: {e.chunk_no for e in ix.iter_extents(kv, _resolve(kv, rel))} for rel in FILES}


@pytest.mark.parametrize("seed", [5])
def test_damaged_index_records_are_findings_and_eio(make_mount, seed):
    rng = random.Random(seed)
    m = make_mount(options=["pmem_size=128M", "hot_versions=3"])
    content: dict[str, bytes] = {}
    for rel in FILES:
        (m.path / rel).parent.mkdir(exist_ok=True)
        content[rel] = b"".join(sample_chunks(seed + len(content))[:5]) + rng.randbytes(300 * KIB)
        write_file(m.path / rel, content[rel])
        if rel == "cold/b.bin":
            run_ckptfs("tier", str(m.path), "--now", "--all", timeout=600)   # cold/ in packs
    m.umount()
    state = m.source / ".ckptfs"
    # Each round starts from this filesystem as it was: its index and its
    # store together. An index restored over a store that rounds published
    # snapshots to is an index older than its store, which fsck rightly
    # reports (and the mount refuses to publish over).
    pristine = state.parent / "pristine"
    for part in ("index", "store"):
        shutil.copytree(state / part, pristine / part)

    def restore() -> None:
        for part in ("index", "store"):
            shutil.rmtree(state / part)
            shutil.copytree(pristine / part, state / part)

    kv = Index(str(state / "index"))
    try:
        chunks_of = _files_of(kv)
        all_damages = damages(rng, kv, chunks_of)
        kinds = {ix.get_chunk(kv, next(iter(chunks_of[rel]))).kind for rel in FILES}
    finally:
        kv.close()
    assert kinds == {CHUNK_LOG, CHUNK_PACK}, "the files must cover hot and cold chunks"
    rng.shuffle(all_damages)
    rounds = 0
    while all_damages and rounds < ROUNDS:
        rounds += 1
        planted: list[Damage] = []
        for d in list(all_damages):
            if len(planted) < DAMAGES_PER_ROUND and \
                    all(not p.targets & d.targets for p in planted):
                planted.append(d)
                all_damages.remove(d)
        restore()
        kv = Index(str(state / "index"))
        try:
            kv.write_direct(lambda txn: [d.plant(txn) for d in planted])
        finally:
            kv.close()
        with LocalBackend.open(state / "store") as store:
            for d in planted:
                d.store(store)
        what = "; ".join(d.what for d in planted)
        res = m.fsck()
        out = res.stdout + res.stderr
        assert "Traceback" not in out, f"{what}: fsck crashed\n{out}"
        assert res.returncode == 4, f"{what}: fsck exit {res.returncode}\n{out}"
        for d in planted:
            assert re.search(rf"\b{d.token}\b", res.stdout), \
                f"{d.what}: fsck did not name {d.token}\n{res.stdout}"
        (state / "daemon.log").unlink(missing_ok=True)
        m.start()
        touched = set().union(*(d.targets for d in planted))
        for rel, data in content.items():
            try:
                got = read_file(m.path / rel)
            except OSError as e:
                assert rel in touched and e.errno == 5, f"{what}: {rel} gave {e!r}"
                continue
            assert got == data, f"{what}: {rel} read back wrong bytes"
        assert m.stat()["pid"] == m.pid, f"{what}: the daemon went away"
        m.umount()
        log_text = (state / "daemon.log").read_text()
        assert "Traceback" not in log_text, f"{what}: the daemon hit an unexpected error\n" \
            + log_text[-3000:]
    assert rounds == ROUNDS
    restore()
    res = m.fsck()
    assert res.returncode == 0, res.stdout
