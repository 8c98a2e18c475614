"""Dedup across volumes: identical chunks of several nodes are kept once in their store.

Nodes learn each other's chunks from index objects in the store
(chunkindex/), name another volume's pack only once they hold a ref to it
(refs/), and let go of packs through condemned/ marks, so that `ckptfs gc`
on any node is safe while the others publish (ckptfs/chunkindex.py,
docs/STORE.md "Dedup across volumes").
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from pathlib import Path

import pytest

from ckptfs import chunkindex as ci
from ckptfs import packs
from ckptfs.backing.local import LocalBackend

from mounting import run_ckptfs
from posix_helpers import pattern
from test_s3 import bucket  # noqa: F401 - the fixture: a fresh bucket on the gateway
from test_tier import tmpfs_store  # noqa: F401 - the fixture: a tmpfs as the store

MiB = 1 << 20


def store_bytes(store: Path, prefix: str = "packs") -> int:
    return sum(f.stat().st_size for f in (store / prefix).rglob("*") if f.is_file())


def node(make_mount, tmp_path: Path, name: str, store: str, *more: str):
    src = tmp_path / name
    src.mkdir()
    return make_mount(options=["pmem_size=256M", f"backing={store}", f"volume={name}", *more],
                      source=src)


def published(*mounts) -> None:
    for m in mounts:
        run_ckptfs("sync", "--published", str(m.path))


def nodes_paused_at_their_first_pack(make_mount, tmp_path: Path, store: str,
                                     monkeypatch) -> list:
    """nodeA and nodeB, each pausing its first pack write (the debug hook) until
    `release_both_packs` sees both paused: they pack the same bytes at once."""
    nodes = []
    for name in ("nodeA", "nodeB"):
        monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"pack-writing:{tmp_path / name}.paused")
        nodes.append(node(make_mount, tmp_path, name, store))
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    return nodes


def release_both_packs(tmp_path: Path) -> None:
    markers = [tmp_path / "nodeA.paused", tmp_path / "nodeB.paused"]
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in markers):
        assert time.monotonic() < deadline, "the nodes never both started a pack"
        time.sleep(0.05)
    for p in markers:
        p.unlink()


def gc_past_the_heads(nodes) -> None:
    """Five rounds of a tiny commit and gc on every node: past the heads each keeps."""
    for _ in range(5):
        for m in nodes:
            (m.path / "tick").write_bytes(os.urandom(100))
            run_ckptfs("gc", str(m.path))


def recover_and_check(tmp_path: Path, make_mount, store: str, volume: str,
                      want: dict[str, bytes]) -> None:
    """Rebuild the volume on a fresh SOURCE from the store alone; every byte back."""
    src = tmp_path / f"recovered-{volume}-{os.urandom(3).hex()}"
    src.mkdir()
    res = run_ckptfs("recover", str(src), "-o", f"backing={store},volume={volume}",
                     check=False, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    m = make_mount(options=["pmem_size=256M", f"volume={volume}"], source=src)
    for rel, data in want.items():
        got = (m.path / rel).read_bytes()
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest(), rel
    m.umount()
    assert m.fsck().returncode == 0


# ------------------------------------------------------------ the protocol

@pytest.fixture
def store(tmp_path):
    b = LocalBackend.create(tmp_path / "store")
    yield b
    b.close()


def put_pack(store, pack_no: int) -> list[packs.PackEntry]:
    with packs.PackWriter.create(store, packs.pack_name(pack_no)) as w:
        w.add(b"\x01" * 32, 0, 0, b"payload", 7)
        return w.commit()


def test_a_condemned_pack_is_never_taken(store):
    owner = ci.SharedChunks(store, "A", {1})
    taker = ci.SharedChunks(store, "B", {2})
    entries = put_pack(store, 1 << 32)
    owner.announce_blocking([1 << 32], {1 << 32: entries})
    taker.refresh_blocking(force=True)
    assert taker.lookup(b"\x01" * 32)[0] == 1 << 32
    assert owner.delete_pack_blocking(1 << 32)              # no ref: deleted
    assert not taker.adopt_blocking(1 << 32)                # gone: not taken, no ref left
    assert store.list("refs/") == [] and store.list("packs/") == []
    taker.refresh_blocking(force=True)
    assert taker.lookup(b"\x01" * 32) is None               # its index object went too


def test_a_taken_pack_outlives_its_owner_until_released(store):
    owner = ci.SharedChunks(store, "A", {1})
    taker = ci.SharedChunks(store, "B", {2})
    put_pack(store, 1 << 32)
    assert taker.adopt_blocking(1 << 32)
    assert not owner.delete_pack_blocking(1 << 32)          # condemned, kept: B's ref
    assert store.list("packs/") == [packs.pack_name(1 << 32)]
    other = ci.SharedChunks(store, "C", {3})
    assert not other.adopt_blocking(1 << 32)                # condemned: no new takers
    assert other.sweep_blocking() == (0, 1)
    taker.delete_pack_blocking(1 << 32)                     # another's: drops B's ref only
    assert store.list("packs/") == [packs.pack_name(1 << 32)]
    assert other.sweep_blocking() == (1, 0)                 # any node's gc deletes it now
    assert store.list("packs/") == [] and store.list("condemned/") == []


def test_a_taker_between_the_owners_listing_and_its_delete_backs_off(store):
    """The window the condemned mark closes: the owner marked the pack and
    listed no ref; a taker coming now must not use it (the owner deletes it next)."""
    put_pack(store, 1 << 32)
    store.create_once(ci.condemned_name(1 << 32), b"{}")
    assert store.list(ci.refs_prefix(1 << 32)) == []        # the owner's listing
    taker = ci.SharedChunks(store, "B", {2})
    assert not taker.adopt_blocking(1 << 32)
    assert store.list("refs/") == []


def test_the_race_between_a_taker_and_the_owner(store):
    """Taker: ref, condemned?, exists?  Owner: condemn, refs?, delete. Whatever the
    interleaving (threads, many rounds), a pack the taker took is still there,
    and one it did not take goes at the next sweep."""
    for round_no in range(40):
        pack_no = (1 << 32) + round_no
        put_pack(store, pack_no)
        owner = ci.SharedChunks(store, "A", {1})
        taker = ci.SharedChunks(store, "B", {2})
        got: list[bool] = []
        t = threading.Thread(target=lambda: got.append(taker.adopt_blocking(pack_no)))
        t.start()
        time.sleep(random.random() * 0.002)
        owner.delete_pack_blocking(pack_no)
        t.join()
        there = packs.pack_name(pack_no) in store.list("packs/")
        assert there or not got[0], round_no     # taken => still in the store
        if got[0]:
            taker.delete_pack_blocking(pack_no)
        owner.sweep_blocking()                   # kept only for a ref: gone with it
        assert store.list("packs/") == [] and store.list("refs/") == [], round_no


def test_damaged_index_objects_are_refused(store):
    raw = ci.encode_index(5, put_pack(store, 5))
    name = ci.index_name(5)
    assert ci.decode_index(name, raw)[0] == 5
    for bad in (raw[:-1], raw[:30] + bytes([raw[30] ^ 1]) + raw[31:], b""):
        with pytest.raises(ci.BadIndex):
            ci.decode_index(name, bad)
    with pytest.raises(ci.BadIndex, match="says it is"):
        ci.decode_index(ci.index_name(6), raw)


# ---------------------------------------------------------- through mounts

def test_two_nodes_store_a_frozen_layer_once(make_mount, tmp_path, fsck_clean):
    store = tmp_path / "store"
    store.mkdir()
    a = node(make_mount, tmp_path, "nodeA", str(store))
    b = node(make_mount, tmp_path, "nodeB", str(store))
    frozen = os.urandom(24 * MiB)
    own_a, own_b = os.urandom(2 * MiB), os.urandom(2 * MiB)
    (a.path / "frozen.bin").write_bytes(frozen)
    (a.path / "head.bin").write_bytes(own_a)
    published(a)
    (b.path / "frozen.bin").write_bytes(frozen)
    (b.path / "head.bin").write_bytes(own_b)
    published(b)
    held = store_bytes(store)
    assert held < 30 * MiB, held                     # 28 MiB of distinct bytes, not 52
    assert b.stat()["shared_bytes_saved"] >= 23 * MiB
    assert (b.path / "frozen.bin").read_bytes() == frozen
    # B's volume, rebuilt elsewhere from the store alone, has every byte.
    b.umount()
    recover_and_check(tmp_path, make_mount, str(store), "nodeB",
                      {"frozen.bin": frozen, "head.bin": own_b})
    fsck_clean(a)


def test_copies_two_nodes_stored_at_once_become_one(make_mount, tmp_path, fsck_clean,
                                                    monkeypatch):
    """Both nodes pack the same bytes before either learned of the other's
    (each daemon's first pack write pauses, by its debug hook, until both are
    writing): gc (or the next publish round) names the copy in the pack with
    the smaller number on both, and the other copy's pack goes."""
    store = tmp_path / "store"
    store.mkdir()
    nodes = nodes_paused_at_their_first_pack(make_mount, tmp_path, str(store), monkeypatch)
    a, b = nodes
    frozen = os.urandom(16 * MiB)
    (a.path / "frozen.bin").write_bytes(frozen)
    (b.path / "frozen.bin").write_bytes(frozen)
    release_both_packs(tmp_path)
    published(a, b)
    twice = store_bytes(store)
    assert twice > 30 * MiB                              # two copies, as set up
    gc_past_the_heads(nodes)
    once = store_bytes(store)
    assert once < 17 * MiB, (twice, once)
    for m in (a, b):
        m.remount()
        assert (m.path / "frozen.bin").read_bytes() == frozen
    b.umount()
    recover_and_check(tmp_path, make_mount, str(store), "nodeB", {"frozen.bin": frozen})
    fsck_clean(a)


def test_copies_packed_at_once_beside_chunks_of_their_own_become_one(make_mount, tmp_path,
                                                                     fsck_clean, monkeypatch):
    """What made the RGW series keep every node's copy: nodes that save the same
    frozen layers at the same moment (as a synchronous job's nodes do) each
    pack them in one pack with their own trained layers, before any of them
    announced its pack. Renaming to the smallest-numbered copy then leaves the
    other packs mostly unused but alive (their trained chunks); gc rewrites
    what is still used of them into a new pack, and the old packs go."""
    store = tmp_path / "store"
    store.mkdir()
    nodes = nodes_paused_at_their_first_pack(make_mount, tmp_path, str(store), monkeypatch)
    frozen = os.urandom(16 * MiB)
    own = {}
    for m in nodes:
        own[m.path.name] = os.urandom(2 * MiB)
        (m.path / "frozen.bin").write_bytes(frozen)
        (m.path / "trained.bin").write_bytes(own[m.path.name])
    release_both_packs(tmp_path)
    published(*nodes)
    twice = store_bytes(store)
    assert twice > 34 * MiB                              # two copies, as set up
    gc_past_the_heads(nodes)
    once = store_bytes(store)
    assert once < 21 * MiB, (twice, once)                # 16 + 2 + 2 MiB, and framing
    for m in nodes:
        m.remount()
        assert (m.path / "frozen.bin").read_bytes() == frozen
        assert (m.path / "trained.bin").read_bytes() == own[m.path.name]
    a, b = nodes
    b.umount()
    res = b.fsck()                                         # the repacked index, as left
    assert res.returncode == 0, res.stdout + res.stderr
    recover_and_check(tmp_path, make_mount, str(store), "nodeB",
                      {"frozen.bin": frozen, "trained.bin": own[b.path.name]})
    a.umount()
    res = a.fsck()
    assert res.returncode == 0, res.stdout + res.stderr
    recover_and_check(tmp_path, make_mount, str(store), "nodeA",
                      {"frozen.bin": frozen, "trained.bin": own[a.path.name]})


def test_gc_on_a_nearly_full_store_repacks_later_and_still_collects(make_mount, tmpfs_store):
    """Repacking writes before it frees: on a store without room for it, gc
    skips it (one warning) and still publishes and deletes what it can; with
    room again, the next gc repacks the half-dead pack."""
    store = tmpfs_store("24m")
    m = make_mount(options=["pmem_size=256M", f"backing={store}/s"])
    (m.path / "a.bin").write_bytes(pattern(5 * MiB, 1))   # random: nothing compresses
    (m.path / "b.bin").write_bytes(pattern(3 * MiB, 2))
    published(m)
    assert len(list((store / "s" / "packs").rglob("*.pack"))) == 1, "a and b in one pack"
    (m.path / "a.bin").unlink()                           # the pack is now 3/8 used
    run_ckptfs("sync", str(m.path))
    st = os.statvfs(store)
    with open(store / "filler", "wb") as f:              # 1 MiB left: under the 2 MiB margin
        f.truncate(st.f_bavail * st.f_frsize - MiB)
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - MiB)
    res = run_ckptfs("gc", str(m.path), check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "; 0 chunks rewritten" in res.stdout, res.stdout
    (store / "filler").unlink()
    res = run_ckptfs("gc", str(m.path), check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "; 0 chunks rewritten" not in res.stdout, res.stdout
    assert store_bytes(store / "s") < 4 * MiB
    m.remount()
    assert (m.path / "b.bin").read_bytes() == pattern(3 * MiB, 2)
    m.umount()
    res = m.fsck()
    assert res.returncode == 0, res.stdout + res.stderr


def test_an_owner_deleting_a_shared_pack_keeps_it_for_the_other(make_mount, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    a = node(make_mount, tmp_path, "nodeA", str(store))
    b = node(make_mount, tmp_path, "nodeB", str(store))
    frozen = os.urandom(8 * MiB)
    (a.path / "frozen.bin").write_bytes(frozen)
    published(a)
    (b.path / "frozen.bin").write_bytes(frozen)
    published(b)
    (a.path / "frozen.bin").unlink()
    for _ in range(5):                          # past the heads A keeps
        (a.path / "tick").write_bytes(os.urandom(100))
        run_ckptfs("gc", str(a.path))
    assert list((store / "condemned").iterdir())         # A let go; B holds a ref
    b.tier_now("--all")                                    # B's copy leaves its log
    b.remount()
    assert (b.path / "frozen.bin").read_bytes() == frozen
    b.umount()
    recover_and_check(tmp_path, make_mount, str(store), "nodeB", {"frozen.bin": frozen})


# ------------------------------------------ gc while two nodes publish (slow)

def _saves(m, frozen: bytes, tag: str, rounds: int, errors: list, done: dict) -> None:
    """A fine-tune's saves: each step a directory with the frozen layers and a
    new trained part, then the step before the last is removed."""
    try:
        for step in range(rounds):
            d = m.path / f"step-{step}"
            d.mkdir()
            trained = hashlib.sha256(f"{tag}{step}".encode()).digest() * (MiB // 32)
            (d / "frozen.bin").write_bytes(frozen)
            (d / "trained.bin").write_bytes(trained)
            if step >= 2:
                for f in (m.path / f"step-{step - 2}").iterdir():
                    f.unlink()
                (m.path / f"step-{step - 2}").rmdir()
            done[m.path.name] = (step, trained)
            time.sleep(0.3)
    except BaseException as e:   # noqa: BLE001 - reported by the test
        errors.append(e)


@pytest.mark.cluster
@pytest.mark.parametrize("store_kind", ["dir", "rgw"])
def test_gc_while_two_nodes_publish(store_kind, make_mount, tmp_path, request, monkeypatch):
    if store_kind == "rgw":
        bucket_name = request.getfixturevalue("bucket")
        for k, v in request.getfixturevalue("rgw").env().items():
            monkeypatch.setenv(k, v)
        store = f"s3://{bucket_name}/shared"
    else:
        (tmp_path / "store").mkdir()
        store = str(tmp_path / "store")
    a = node(make_mount, tmp_path, "nodeA", store, "publish_delay=0.5")
    b = node(make_mount, tmp_path, "nodeB", store, "publish_delay=0.5")
    frozen = os.urandom(16 * MiB)
    errors: list = []
    done: dict = {}
    savers = [threading.Thread(target=_saves, args=(m, frozen, m.path.name, 12, errors, done))
              for m in (a, b)]
    for t in savers:
        t.start()
    gcs = 0
    while any(t.is_alive() for t in savers):
        for m in (a, b):                     # gc on both nodes, in turns, all along
            run_ckptfs("gc", str(m.path), timeout=300)
            gcs += 1
    for t in savers:
        t.join()
    assert not errors, errors
    assert gcs >= 4
    published(a, b)
    for m in (a, b):
        for _ in range(4):
            run_ckptfs("gc", str(m.path), timeout=300)
    want = {}
    for m in (a, b):
        step, trained = done[m.path.name]
        want[m.path.name] = {f"step-{step}/frozen.bin": frozen,
                             f"step-{step}/trained.bin": trained,
                             f"step-{step - 1}/frozen.bin": frozen}
        for rel, data in want[m.path.name].items():
            assert (m.path / rel).read_bytes() == data, rel
    for m in (a, b):
        m.umount()
        assert m.fsck().returncode == 0
    for name in ("nodeA", "nodeB"):
        recover_and_check(tmp_path, make_mount, store, name, want[name])
