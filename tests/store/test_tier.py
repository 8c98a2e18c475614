"""Tiering through the real mount: cold versions move, compressed, to the
backing store; every file stays readable at its path (verified against the
bytes written); writers wait instead of failing when the log is full; faults
of the backing store never cost hot data or give wrong bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from mounting import run_ckptfs
from posix_helpers import (check_clean, pattern, read_file, remount_and_check, wait_until,
                           write_file)
from store_state import kill_in_tier_pass, store_packs, tier_in_background

MiB = 1 << 20
KiB = 1 << 10


def floats(n_bytes: int, seed: int) -> bytes:
    """Checkpoint-like bytes: float32 weights (compressible exponents)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return rng.normal(0, 0.02, n_bytes // 4).astype(np.float32).tobytes()


def write_version(top: Path, step: int, size: int = 4 * MiB) -> dict[str, bytes]:
    d = top / f"step_{step}"
    d.mkdir()
    files = {f"step_{step}/model.bin": floats(size, step),
             f"step_{step}/optim.bin": floats(size // 2, 1000 + step),
             f"step_{step}/meta.json": json.dumps({"step": step}).encode()}
    for rel, data in files.items():
        write_file(top / rel, data)
    return files


def verify(top: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert read_file(top / rel) == data, f"{rel} differs"


def tier_now(m, *extra: str) -> subprocess.CompletedProcess:
    return run_ckptfs("tier", str(m.path), "--now", *extra, timeout=600)


def test_cold_versions_move_out_and_read_back(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=256M", "hot_versions=1"])
    files: dict[str, bytes] = {}
    for step in range(1, 5):
        files.update(write_version(m.path, step))
        time.sleep(0.01)
    before = m.stat()
    tier_now(m)
    st = m.stat()
    assert st["cold_bytes"] > 0
    assert st["cold_logical_bytes"] >= 3 * 6 * MiB       # three cold versions' data
    assert st["cold_bytes"] < st["cold_logical_bytes"], "nothing compressed"
    assert st["hot_bytes"] < before["hot_bytes"] - 12 * MiB
    assert st["logical_bytes"] == before["logical_bytes"]
    verify(m.path, files)
    m.remount()                       # empty read cache: every cold byte from the packs
    verify(m.path, files)
    m.umount()                        # the store is below the mount (SOURCE/.ckptfs/store)
    heads = list((m.source / ".ckptfs" / "store" / "volumes").glob("*/heads/*"))
    assert any(h.is_file() for h in heads), "a snapshot of the namespace was published"
    check_clean(fsck_clean, m)


def test_tier_all_moves_the_newest_too(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=128M"])
    files = write_version(m.path, 1)
    tier_now(m, "--all")
    st = m.stat()
    assert st["cold_logical_bytes"] >= 6 * MiB
    verify(m.path, files)
    check_clean(fsck_clean, m)


def test_writers_wait_for_tiering_instead_of_failing(make_mount, fsck_clean):
    """Four times the log's size of checkpoints through a 64 MiB log."""
    m = make_mount(options=["pmem_size=64M", "hot_versions=1"])
    files: dict[str, bytes] = {}
    for step in range(1, 15):
        files.update(write_version(m.path, step, size=14 * MiB))
    st = m.stat()
    assert st["logical_bytes"] > 4 * 64 * MiB
    assert st["cold_bytes"] > 0
    m.remount()
    verify(m.path, files)
    check_clean(fsck_clean, m)


def test_cold_chunks_are_dedup_targets(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=128M", "hot_versions=0"])
    data = floats(8 * MiB, 7)
    write_file(m.path / "a.bin", data)
    tier_now(m)
    cold = m.stat()["cold_bytes"]
    write_file(m.path / "b.bin", data)        # the same bytes again: nothing new stored
    st = m.stat()
    assert st["stored_bytes"] <= cold + 256 * KiB
    remount_and_check(fsck_clean, m, m.path / "b.bin", data)


def test_vanished_backing_store_keeps_hot_data_and_gives_eio_for_cold(make_mount, tmp_path,
                                                                     fsck_clean):
    store = tmp_path / "store"
    m = make_mount(options=["pmem_size=128M", "hot_versions=0", f"backing={store}"])
    cold = floats(4 * MiB, 1)
    write_file(m.path / "cold.bin", cold)
    tier_now(m)
    m.umount()
    moved = tmp_path / "store.away"
    store.rename(moved)
    m.start()                                  # mounts anyway: hot data needs no store
    hot = pattern(3 * MiB, 2)
    write_file(m.path / "hot.bin", hot)
    assert read_file(m.path / "hot.bin") == hot
    with pytest.raises(OSError) as err:
        read_file(m.path / "cold.bin")
    assert err.value.errno == 5
    res = run_ckptfs("tier", str(m.path), "--now", check=False)
    assert res.returncode == 1 and "tiering failed" in res.stderr
    assert m.stat()["tier_last_error"]
    assert not store.exists(), "a vanished store must not be recreated empty"
    m.umount()
    moved.rename(store)
    m.start()
    assert read_file(m.path / "cold.bin") == cold
    assert read_file(m.path / "hot.bin") == hot
    check_clean(fsck_clean, m)


def test_damaged_pack_gives_eio_and_an_fsck_finding(make_mount):
    m = make_mount(options=["pmem_size=128M", "hot_versions=0"])
    data = floats(4 * MiB, 3)
    other = floats(2 * MiB, 4)
    write_file(m.path / "d.bin", data)
    tier_now(m)
    write_file(m.path / "other.bin", other)      # hot, untouched by the damage
    m.umount()
    pack = next((m.source / ".ckptfs" / "store" / "packs").rglob("*.pack"))
    with open(pack, "r+b") as f:
        f.seek(4096)
        b = f.read(1)
        f.seek(4096)
        f.write(bytes([b[0] ^ 0x55]))
    res = m.fsck()
    assert res.returncode == 4, res.stdout + res.stderr
    assert "[data]" in res.stdout
    m.start()
    with pytest.raises(OSError) as err:
        read_file(m.path / "d.bin")
    assert err.value.errno == 5
    assert read_file(m.path / "other.bin") == other
    m.umount()


def test_sigkill_during_tiering_loses_nothing(make_mount, tmp_path, monkeypatch, fsck_clean):
    """SIGKILL while `ckptfs tier --now` is half way through a pack (the mover's
    debug hook stops it there: no sleep that hopes to hit the window)."""
    marker = tmp_path / "paused"
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"pack-writing:{marker}")
    m = make_mount(options=["pmem_size=512M", "hot_versions=0"])
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    files: dict[str, bytes] = {}
    for step in range(1, 6):
        files.update(write_version(m.path, step, size=12 * MiB))
    kill_in_tier_pass(m, marker, "the mover never started a pack")
    m.start()
    verify(m.path, files)
    tier_now(m)                                 # finish the job after the crash
    m.remount()
    verify(m.path, files)
    check_clean(fsck_clean, m)


def test_recover_rebuilds_every_tiered_file_from_the_store_alone(make_mount, fsck_clean):
    m = make_mount(options=["pmem_size=128M"])
    files: dict[str, bytes] = {}
    for step in range(1, 4):
        files.update(write_version(m.path, step, size=2 * MiB))
    os.link(m.path / "step_1/model.bin", m.path / "step_1/model-link.bin")
    files["step_1/model-link.bin"] = files["step_1/model.bin"]
    os.setxattr(m.path / "step_2/meta.json", "user.step", b"2")
    tier_now(m, "--all")
    m.umount()
    state = m.source / ".ckptfs"
    shutil.rmtree(state / "index")               # the index and the log are lost
    os.unlink(state / "pmem.log")
    res = run_ckptfs("recover", str(m.source))
    assert "recovered 9 files" in res.stdout, res.stdout     # 9 inodes, 10 names
    assert "1 further hard links" in res.stdout, res.stdout
    m.start()
    verify(m.path, files)
    assert os.stat(m.path / "step_1/model.bin").st_nlink == 2
    assert os.getxattr(m.path / "step_2/meta.json", "user.step") == b"2"
    check_clean(fsck_clean, m)
    res = run_ckptfs("recover", str(m.source), check=False)
    assert res.returncode == 1 and "holds an index" in res.stderr


@pytest.fixture
def tmpfs_store(tmp_path):
    """Factory: tmpfs_store(size) -> a tmpfs of that size as the backing store
    (root only), unmounted afterwards."""
    made: list[Path] = []

    def make(size: str) -> Path:
        store = tmp_path / f"smallstore{len(made)}"
        store.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(store)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        made.append(store)
        return store

    yield make
    for store in made:
        subprocess.run(["umount", "-l", str(store)], capture_output=True)


@pytest.fixture
def small_store(tmpfs_store):
    """A 4 MiB tmpfs as the backing store."""
    return tmpfs_store("4m")


def test_store_smaller_than_a_pack_still_takes_data(make_mount, tmpfs_store, fsck_clean):
    """A store with less room than one 64 MiB pack takes smaller packs: the
    writes that the log alone cannot hold all succeed, and the store fills up
    to its margin, not just to nothing (before: every pack failed, ENOSPC)."""
    store = tmpfs_store("40m")
    m = make_mount(options=["pmem_size=64M", "hot_versions=0", f"backing={store}/s"])
    files: dict[str, bytes] = {}
    for i in range(20):                                # 80 MiB: more than the log
        data = pattern(4 * MiB, 300 + i)               # random: nothing compresses
        write_file(m.path / f"f{i}.bin", data)
        files[f"f{i}.bin"] = data
    st = m.stat()
    assert st["cold_logical_bytes"] >= 16 * MiB, st
    assert not st["tier_last_error"] or "space" in st["tier_last_error"].lower(), st
    packs = list((store / "s" / "packs").rglob("*.pack"))
    assert sum(p.stat().st_size for p in packs) <= 38 * MiB     # the margin stays free
    m.remount()
    verify(m.path, files)
    check_clean(fsck_clean, m)


def test_full_store_and_full_log_give_enospc_not_a_hang(make_mount, small_store, fsck_clean):
    m = make_mount(options=["pmem_size=64M", "hot_versions=0", f"backing={small_store}/s"])
    kept: dict[str, bytes] = {}
    err = None
    t0 = time.monotonic()
    try:
        for i in range(12):
            data = pattern(10 * MiB, 100 + i)          # random: nothing compresses
            write_file(m.path / f"f{i}.bin", data)
            kept[f"f{i}.bin"] = data
    except OSError as e:
        err = e
    assert err is not None and err.errno == 28, f"expected ENOSPC, got {err!r}"
    assert time.monotonic() - t0 < 300
    st = m.stat()
    assert st["tier_last_error"] and "space" in st["tier_last_error"].lower()
    verify(m.path, kept)                               # everything committed is intact
    m.remount()
    verify(m.path, kept)
    check_clean(fsck_clean, m)


def test_read_only_store_fails_tiering_and_keeps_hot_data(make_mount, small_store, fsck_clean):
    m = make_mount(options=["pmem_size=128M", "hot_versions=0", f"backing={small_store}/s"])
    data = floats(1 * MiB, 9)
    write_file(m.path / "a.bin", data)
    subprocess.run(["mount", "-o", "remount,ro", str(small_store)], check=True)
    try:
        res = run_ckptfs("tier", str(m.path), "--now", check=False)
        assert res.returncode == 1 and "read-only" in res.stderr.lower(), res.stderr
        write_file(m.path / "b.bin", data[::-1])
        assert read_file(m.path / "a.bin") == data
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_store)], check=True)
    tier_now(m)
    assert m.stat()["cold_bytes"] > 0
    m.remount()
    assert read_file(m.path / "a.bin") == data and read_file(m.path / "b.bin") == data[::-1]
    check_clean(fsck_clean, m)


def test_fsck_tells_an_interrupted_pass_from_damage(make_mount, tmp_path, monkeypatch,
                                                    fsck_clean):
    """SIGKILL after a pack is committed, before the index names it (the mover
    stopped there by its debug hook): fsck notes the pack as a leftover of an
    interrupted pass (exit 0), while a pack nothing names or intends is a
    problem (exit 4); the next mount deletes the leftover by itself."""
    marker = tmp_path / "paused"
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"pack-written:{marker}")
    m = make_mount(options=["pmem_size=128M", "hot_versions=0"])
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    files = write_version(m.path, 1, size=2 * MiB)
    kill_in_tier_pass(m, marker, "the mover never committed a pack")
    named, intents, blobs, temps, dead_marks = store_packs(m)
    (leftover,) = blobs - named
    assert intents, "no intent names the pack being written"
    res = m.fsck()
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"note: {leftover} was left by an interrupted tiering pass" in res.stdout
    from ckptfs.packs import pack_name, pack_number
    store = m.source / ".ckptfs" / "store"
    # In the volume's own pack space (another space's packs are other volumes').
    stray_name = pack_name((pack_number(leftover) >> 32 << 32) | 0xdeadbeef)
    stray = store / stray_name
    stray.parent.mkdir(exist_ok=True)
    shutil.copy(store / leftover, stray)                 # neither named nor intended
    res = m.fsck()
    assert res.returncode == 4 and f"{stray_name} is named by nothing" in res.stdout
    stray.unlink()
    m.start()
    wait_until(lambda: m.stat()["tier_leftover_packs"] == 0, 60, "leftover never removed")
    verify(m.path, files)
    m.umount()
    named, intents, blobs, temps, dead_marks = store_packs(m)
    assert leftover not in blobs and blobs <= named and not intents and not temps
    res = m.fsck()
    assert res.returncode == 0 and "note:" not in res.stdout, res.stdout
    check_clean(fsck_clean, m)


def test_dead_pack_survives_a_crash_only_until_the_next_snapshot(make_mount, tmp_path,
                                                                  monkeypatch, fsck_clean):
    """A pack whose last chunk went leaves the index at once, its blob only
    after the next snapshot. SIGKILL in between (the mover's debug hook stops
    it there): fsck notes the blob as dead, waiting for a snapshot (exit 0);
    the next mount's first snapshot deletes it by itself."""
    marker = tmp_path / "paused"
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"pack-dead:{marker}")
    m = make_mount(options=["pmem_size=128M", "hot_versions=0"])
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    write_version(m.path, 1, size=2 * MiB)
    tier_now(m, "--all")
    kept = write_version(m.path, 2, size=1 * MiB)
    shutil.rmtree(m.path / "step_1")                    # its pack has no live chunk left
    kill_in_tier_pass(m, marker, "no pack died")
    named, intents, blobs, temps, dead_marks = store_packs(m)
    (dead,) = blobs - named
    res = m.fsck()
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"note: {dead} holds no live chunk" in res.stdout
    m.start()
    wait_until(lambda: not (m.source / ".ckptfs" / "store" / dead).exists(), 120,
               "the dead pack was never deleted")
    verify(m.path, kept)
    m.umount()
    named, intents, blobs, temps, dead_marks = store_packs(m)
    assert blobs <= named and not intents and not temps and not dead_marks
    res = m.fsck()
    assert res.returncode == 0 and "note:" not in res.stdout, res.stdout
    check_clean(fsck_clean, m)


def _store_state(root: Path) -> dict[str, str]:
    """Every blob of a local store (temporaries too) -> sha256 of its bytes."""
    import hashlib
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in root.rglob("*") if f.is_file()}


def _copy_index(src: Path, dst: Path) -> None:
    """A consistent copy of a live index: LMDB in one read transaction and
    the journal beside it (ckptfs/journal.py), whose records past the seq the
    LMDB copy holds its opening replays. Taken again if a checkpoint started
    the journal over meanwhile (its records would then belong to a newer
    generation than the copy's LMDB names, and be skipped)."""
    import lmdb
    from ckptfs import journal as jr

    def generation(env) -> bytes:
        with env.begin() as txn:
            return txn.get(b"journal", db=env.open_db(b"meta", txn=txn, create=False))

    for _ in range(20):
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir()
        env = lmdb.open(str(src), readonly=True, max_dbs=32)
        try:
            before = generation(env)
            env.copy(str(dst))
            if (src / jr.JOURNAL_NAME).exists():
                shutil.copyfile(src / jr.JOURNAL_NAME, dst / jr.JOURNAL_NAME)
            if generation(env) == before:
                return
        finally:
            env.close()
    raise AssertionError(f"no copy of {src} between two checkpoints")


def test_an_index_older_than_the_store_deletes_and_overwrites_no_pack(make_mount, tmp_path,
                                                                     monkeypatch, fsck_clean):
    """An index restored from a copy taken while a pass had pack N committed
    and not yet named (its intent durable), mounted over a store where that
    pass went on: N's chunks are named by the store's newest snapshot, and
    pack N+1 holds newer data. The mount must not take N for a leftover of
    its own: it publishes no snapshot below the store's newest, deletes no
    pack and overwrites none (the whole store stays byte for byte), and
    recover of the store still gives the newer state. fsck names both
    counters (exit 4); after --repair raises them, the mount's own snapshot
    is the newest and N goes like any leftover."""
    marker = tmp_path / "paused"
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"pack-written:{marker}")
    # Not over itself: the index is copied while mounted.
    m = make_mount(options=["pmem_size=128M", "hot_versions=0"], over_itself=False)
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    state = m.source / ".ckptfs"
    old = write_version(m.path, 1, size=2 * MiB)
    proc = tier_in_background(m)
    try:
        wait_until(marker.exists, 120, "the mover never committed a pack")
        _copy_index(state / "index", tmp_path / "index.old")
    finally:
        marker.unlink(missing_ok=True)          # the pass goes on: N named, a snapshot
        assert proc.wait(timeout=120) == 0
    newer = dict(old, **write_version(m.path, 2, size=2 * MiB))
    tier_now(m)                                 # pack N+1, another snapshot
    m.umount()
    before = _store_state(state / "store")
    shutil.rmtree(state / "index")
    shutil.copytree(tmp_path / "index.old", state / "index")
    named, intents, blobs, temps, _ = store_packs(m)
    (leftover,) = intents
    assert len(blobs - named) >= 2, "pack N and N+1 are not in the store"
    res = m.fsck()
    assert res.returncode == 4, res.stdout + res.stderr
    assert "next_head is" in res.stdout and "next_pack is" in res.stdout, res.stdout

    m.start()                                   # the old index over the newer store
    wait_until(lambda: "no pack is written" in str(m.stat()["tier_last_error"]), 60,
               "the mover went on writing packs")
    assert "could not remove packs left by an interrupted tiering pass" in \
        (state / "daemon.log").read_text()
    stat = m.stat()
    assert stat["tier_leftover_packs"] == 1 and stat["snapshot_seq"] is None, stat
    verify(m.path, old)
    m.umount()
    assert "no snapshot published at unmount" in (state / "daemon.log").read_text()
    assert _store_state(state / "store") == before, "the store changed under an old index"

    copy = tmp_path / "copy"                    # recover of that store: the newer state
    shutil.copytree(m.source, copy, ignore=shutil.ignore_patterns("index", "pmem.log"))
    res = run_ckptfs("recover", str(copy), check=False, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    c = make_mount(source=copy, options=["pmem_size=64M"])
    verify(c.path, newer)
    c.umount()

    res = m.fsck("--repair")                    # the operator keeps the old index
    assert res.returncode == 3 and "published snapshot" in res.stdout, res.stdout
    m.start()
    wait_until(lambda: m.stat()["tier_leftover_packs"] == 0, 60, "the leftover stayed")
    verify(m.path, old)
    m.umount()
    named, intents, blobs, temps, _ = store_packs(m)
    assert blobs <= named and not intents and not temps, (blobs - named, intents, temps)
    check_clean(fsck_clean, m)


def test_a_pack_name_the_store_holds_is_never_written_over(make_mount, fsck_clean):
    """Pack numbers come from a never-reused counter, so a blob already under
    the next pack's name (another filesystem's, or a newer state's than this
    index knows) means the index is behind the store: the mover refuses to
    write, the blob stays as it is, hot data reads on; fsck names the counter
    (exit 4) and --repair raises it, after which tiering works again."""
    from ckptfs import index as ix
    from ckptfs.packs import pack_name
    m = make_mount(options=["pmem_size=128M", "hot_versions=0"])
    files = write_version(m.path, 1, size=2 * MiB)
    m.umount()
    idx = ix.Index(str(m.source / ".ckptfs" / "index"))
    try:
        next_pack = idx.counters[b"next_pack"]
    finally:
        idx.close()
    foreign = m.source / ".ckptfs" / "store" / pack_name(next_pack)
    foreign.parent.mkdir(parents=True, exist_ok=True)
    foreign.write_bytes(b"a pack this index never wrote" * 1000)
    before = foreign.read_bytes()
    res = m.fsck()
    assert res.returncode == 4 and f"next_pack is {next_pack}" in res.stdout, res.stdout
    m.start()
    res = run_ckptfs("tier", str(m.path), "--now", check=False, timeout=600)
    assert res.returncode == 1 and "is in the store already" in res.stderr, res.stderr
    assert "is in the store already" in m.stat()["tier_last_error"]
    verify(m.path, files)
    m.umount()
    assert foreign.read_bytes() == before
    res = m.fsck("--repair")
    assert res.returncode == 3, res.stdout
    assert not foreign.exists()                 # named by nothing: gone after a snapshot
    m.start()
    tier_now(m)
    assert m.stat()["cold_bytes"] > 0
    m.remount()
    verify(m.path, files)
    check_clean(fsck_clean, m)


def test_gc_deletes_dead_packs_and_old_snapshots(make_mount, tmp_path, fsck_clean):
    store = tmp_path / "gcstore"
    m = make_mount(options=["pmem_size=128M", f"backing={store}"])
    first = write_version(m.path, 1, size=2 * MiB)
    tier_now(m, "--all")
    first_pack = sorted((store / "packs").rglob("*.pack"))
    second = write_version(m.path, 2, size=2 * MiB)
    tier_now(m, "--all")
    stray = first_pack[0].with_name("00000000deadbeef.pack")
    shutil.copy(first_pack[0], stray)                  # a pack nothing names
    shutil.rmtree(m.path / "step_1")                   # its chunks and its pack are dead
    for _ in range(4):                                 # more heads than gc keeps
        res = run_ckptfs("gc", str(m.path))
    assert "published snapshot" in res.stdout and "older snapshot heads" in res.stdout
    assert not stray.exists()
    assert not first_pack[0].exists()
    heads = [p for p in (store / "volumes").glob("*/heads/*") if p.is_file()]
    assert len(heads) == 3
    m.remount()
    verify(m.path, second)
    assert not (m.path / "step_1").exists() and first
    check_clean(fsck_clean, m)


def test_data_written_without_dedup_tiers_and_checks_clean(make_mount, fsck_clean):
    """dedup=off stores twins; tiering names them; fsck notes them, finds no fault."""
    m = make_mount(options=["pmem_size=128M", "dedup=off", "hot_versions=0"])
    block = floats(MiB, 5)
    write_file(m.path / "a.bin", block * 4)
    write_file(m.path / "b.bin", block * 4)
    tier_now(m, "--all")
    m.umount()
    res = m.fsck()
    assert res.returncode == 0, res.stdout
    assert "note:" in res.stdout
    m.start()
    assert read_file(m.path / "b.bin") == block * 4
    check_clean(fsck_clean, m)


def test_saves_into_one_directory_are_separate_versions(make_mount):
    """Saves into one flat directory: each is a version, not one version forever
    (versions span at most 120 s from their first file, so they never chain)."""
    from ckptfs import daemon as dmod
    from ckptfs.core import CommitPolicy, Filesystem
    from ckptfs.options import parse_options
    from ckptfs.tierplan import TierPolicy, TierSetup

    m = make_mount(options=["pmem_size=128M", "tiering=off"])
    d = m.path / "ckpts"
    d.mkdir()
    now = time.time()
    for i in range(4):
        write_file(d / f"step_{i}.pt", pattern(64 * KiB, i))
        t = now - (4 - i) * 180                         # written 3 minutes apart
        os.utime(d / f"step_{i}.pt", (t, t))
    m.umount()
    state = dmod.open_state(parse_options(str(m.source), str(m.path), ["tiering=off"]))
    try:
        fs = Filesystem(state.index, state.log, state.sources, CommitPolicy(),
                        tiering=TierSetup(state.backend, TierPolicy()))
        versions = fs.tierer.planner.versions()
        assert sorted(len(v.files) for v in versions) == [1, 1, 1, 1], versions
    finally:
        state.close()


def test_a_plan_with_no_cold_version_walks_no_extent(inproc, monkeypatch):
    """The planner runs on the trio thread after every commit: with every version
    hot and the log under its watermark it must not walk the files' extents
    (a 2 GiB file is 32,000 of them, read while the file is being restored)."""
    from ckptfs import tierplan

    fs = inproc(["pmem_size=64M", "hot_versions=2"])

    async def save_two_versions(fs) -> None:
        for i in range(2):
            fs.mkdir(f"v{i}")
            await fs.write_file(f"v{i}/model.pt", pattern(MiB, i))

    fs.run(save_two_versions, mover=False)
    walked = []
    real_iter_extents = tierplan.ix.iter_extents

    def counting_iter_extents(index, ino, *args, **kwargs):
        walked.append(ino)
        return real_iter_extents(index, ino, *args, **kwargs)

    monkeypatch.setattr(tierplan.ix, "iter_extents", counting_iter_extents)
    planner = fs.fs.tierer.planner
    assert planner.log_use() < planner.policy.high_watermark
    assert planner.plan(set(), set()).chunks == [] and walked == []
    # One version cold: now the walk happens and chooses that version's chunks.
    planner.policy.hot_versions = 1
    assert sum(c.length for c in planner.plan(set(), set()).chunks) == MiB and walked
