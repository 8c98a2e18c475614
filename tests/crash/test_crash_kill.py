"""Crash tests with real processes: SIGKILL the daemon while writers are busy.

Three writer processes (tests/crash/helpers/crash_writer.py) write checkpoint-like
files into a real mount: new files, O_TRUNC rewrites, temp file + os.replace,
fsync half way, unlinks. Each keeps a journal outside the mount. At a seeded
random moment (0.2-3 s) the daemon is killed with SIGKILL, then the writers,
then the dead mount is detached (`crash`: in that order, so that no writer
writes into SOURCE below it); the filesystem is mounted again and every path
must be in a state its journal allows (`journal_model.Model`):

- last record "committed": exactly that content;
- a write in flight ("begin" after the last "committed"): the previous
  committed content or the whole new content, never anything else;
- a file that never committed: absent or empty;
- a rename or unlink not yet followed by a durable commit of the same writer
  (or an fsync of its directory): the state before or after it;
- no file the journals do not explain.

Then a clean unmount and `ckptfs fsck` must exit 0. Each seed runs a chain of
crash rounds on one filesystem, so recovery is also tested on top of
recovery. `-m soak` runs hundreds of crash points (40 seeds x 8, ~25 min).

sync=lazy runs the same way, with writers that fsync before most closes
("committed") and journal the other closes as "closed" (old or new, whole).
Tiering rounds (sync=lazy, hot_versions=0): the mover's debug hook stops a
tiering pass at a named point (a pack about to be written, half written,
committed but not named, a pass just done, a dead pack not yet deleted) while
the writers go on renaming; the daemon is killed there, and the next mount
must finish or undo what the pass left by itself: each point once by default,
each twice under `-m soak`. `-m soak` also adds chains of sync=lazy rounds with the mover at work killed at random moments (0.5-12 s),
each remount checked the same way and the store left with nothing fsck cannot
explain (a snapshot's temporary a crash left may stay until `ckptfs gc`, which
the chain runs at its end).

Smaller tests: a clean unmount keeps every lazy close, a lazy close is durable
after lazy_delay, and SIGTERM under a writer keeps its file's old content.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptfs.packs import pack_name
from ckptfs.proc import process_exited
from mounting import Mount, run_ckptfs
from journal_model import ABSENT, Model, check, short, writer_model
from store_state import store_packs

WRITER = Path(__file__).resolve().parent / "helpers" / "crash_writer.py"
N_WRITERS = 3
LOG_SIZE = "pmem_size=512M"

# Default run: 8 seeds x 3 crashes (sync=close) + 2 x 3 (sync=lazy), about two minutes.
CLOSE_SEEDS = range(8)
LAZY_SEEDS = range(2)
ROUNDS = 3
SOAK_SEEDS = range(1000, 1040)
SOAK_ROUNDS = 8
TIER_SOAK_SEEDS = range(3000, 3010)


def read_journal(path: Path) -> list[str]:
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    return [ln for ln in lines[:-1] if ln.strip()]    # a line without "\n" never finished


def journal_models(journals: dict[str, Path], baseline: dict[str, str]) -> dict[str, Model]:
    """Each writer's model (subdir -> Model): its paths in baseline, then its journal."""
    return {subdir: writer_model(baseline, subdir, read_journal(journal))
            for subdir, journal in journals.items()}


def observe(top: Path) -> dict[str, str]:
    """path (relative to top) -> sha256 of its content, or "error:ERRNO"."""
    seen: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        if Path(dirpath) == top and ".ckptfs" in dirnames:
            dirnames.remove(".ckptfs")
        for name in filenames:
            full = Path(dirpath) / name
            rel = str(full.relative_to(top))
            h = hashlib.sha256()
            try:
                with open(full, "rb", buffering=0) as f:
                    while True:
                        block = f.read(4 << 20)
                        if not block:
                            break
                        h.update(block)
                seen[rel] = h.hexdigest()
            except OSError as e:
                seen[rel] = f"error:{e.errno}"
    return seen


def start_writers(m: Mount, journals: dict[str, Path], rng: random.Random, lazy: bool,
                  steps: int = 0) -> list[subprocess.Popen]:
    procs = []
    for subdir, journal in journals.items():
        cmd = [sys.executable, str(WRITER), str(m.path), subdir, str(journal),
               str(rng.randrange(1 << 32))]
        if lazy:
            cmd.append("--lazy")
        if steps:
            cmd += ["--steps", str(steps)]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE))
    return procs


def stop_writers(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=30)
        p.stderr.close()


def crash(m: Mount, procs: list[subprocess.Popen]) -> None:
    """The crash: SIGKILL the daemon, then the writers, then detach the dead mount.

    In that order. While the dead mount is attached, every call a writer makes
    there fails (ENOTCONN); once it is detached, the mount's path leads to the
    directory below it (SOURCE itself: the tests mount it over itself). A
    writer still running then (one that started late, under load) writes
    there, where the next mount never looks, and its journal claims files the
    mount does not have (seed 7 at load 9: a writer whose first step came
    after the detach renamed its checkpoint into SOURCE/w0/c1.pt)."""
    m.kill(detach=False)
    stop_writers(procs)
    m.detach()
    below = sorted(set(os.listdir(m.path)) - {".ckptfs"})
    assert not below, f"a writer wrote below the mount after the crash: {below}"


def fsck_clean(m: Mount) -> None:
    if importlib.util.find_spec("ckptfs.fsck") is None:
        return      # fsck not written yet: the clean unmount is still checked
    res = m.fsck()
    assert res.returncode == 0, f"fsck exit {res.returncode}:\n{res.stdout}\n{res.stderr}"


def crash_chain(make_mount, tmp_path: Path, seed: int, rounds: int, lazy: bool,
                tiering: bool = False) -> None:
    """tiering: hot_versions=0 and crashes late enough (0.5-12 s) that the mover
    is often at work: a pass, its snapshot, a cleanup may be anywhere."""
    rng = random.Random(seed)
    options = [LOG_SIZE] + (["sync=lazy"] if lazy else []) + (["hot_versions=0"] if tiering
                                                               else [])
    m: Mount = make_mount(options=options)
    baseline: dict[str, str] = {}
    procs: list[subprocess.Popen] = []
    packs_seen: set[str] = set()
    try:
        for rnd in range(rounds):
            journals = {f"w{i}": tmp_path / f"journal-{rnd}-w{i}" for i in range(N_WRITERS)}
            procs = start_writers(m, journals, rng, lazy)
            time.sleep(rng.uniform(0.5, 12.0) if tiering else rng.uniform(0.2, 3.0))
            died = [(p.returncode, p.stderr.read().decode(errors="replace"))
                    for p in procs if p.poll() is not None]
            assert not died, f"a writer failed before the crash: {died}"
            crash(m, procs)
            m.start()
            observed = observe(m.path)
            check(journal_models(journals, baseline), observed,
                  f"seed {seed} round {rnd} after SIGKILL")
            baseline = observed
            if tiering:
                _wait_until(lambda: m.stat()["tier_leftover_packs"] == 0, 60,
                            f"seed {seed} round {rnd}: the leftovers were never removed")
            m.umount()
            if tiering:
                packs_seen |= _store_explained(m, f"seed {seed} round {rnd}")
            fsck_clean(m)
            if rnd + 1 < rounds:
                m.start()
    finally:
        stop_writers([p for p in procs if p.returncode is None])
    assert packs_seen or not tiering, f"seed {seed}: the mover never wrote a pack"
    if tiering:
        _gc_leaves_no_temporaries(m, f"seed {seed}")


@pytest.mark.parametrize("seed", CLOSE_SEEDS)
def test_sigkill_sync_close(make_mount, tmp_path, seed):
    crash_chain(make_mount, tmp_path, seed, ROUNDS, lazy=False)


@pytest.mark.parametrize("seed", LAZY_SEEDS)
def test_sigkill_sync_lazy(make_mount, tmp_path, seed):
    """sync=lazy: what was fsync'ed survives; what was only closed is old or new, whole."""
    crash_chain(make_mount, tmp_path, seed, ROUNDS, lazy=True)


TIER_PAUSE_POINTS = ("pack-begin", "pack-writing", "pack-written", "pass-done", "pack-dead")


def _wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _renames(journals: dict[str, Path]) -> int:
    return sum(1 for j in journals.values() for ln in read_journal(j) if ln.startswith("rename"))


def test_sigkill_at_tiering_pause_points(make_mount, tmp_path, monkeypatch):
    """sync=lazy, writers renaming checkpoints over each other every few hundred
    ms, and SIGKILL exactly where a tiering pass is: a pack's intent durable and
    none of its bytes written, a pack half written (upload in flight), a pack
    committed but not yet named (before the index commit), a pass just
    finished, a dead pack whose blob waits for the next snapshot; each point
    once, as a chain of rounds on one filesystem (recovery on top of recovery:
    each round's mount recovers from the point before). The mover's debug hook
    (CKPTFS_DEBUG_PAUSE) stops it there and says so; no sleep hopes to hit the
    window. After each remount every path holds what its journal allows and
    the mount removes what the pass left, by itself; at the end the store
    keeps only named packs, no temporaries, and fsck is clean. A round waits
    for the mover's first pass (5 s after the mount), so `-m soak` runs the
    chain with each point twice (test_sigkill_at_tiering_pause_points_twice)."""
    tier_pause_chain(make_mount, tmp_path, monkeypatch, TIER_PAUSE_POINTS)


@pytest.mark.soak
def test_sigkill_at_tiering_pause_points_twice(make_mount, tmp_path, monkeypatch):
    """The chain of test_sigkill_at_tiering_pause_points with each point twice:
    every point also recovered from the last one (pack-begin after pack-dead)."""
    tier_pause_chain(make_mount, tmp_path, monkeypatch, TIER_PAUSE_POINTS * 2)


def tier_pause_chain(make_mount, tmp_path: Path, monkeypatch, points: tuple[str, ...]) -> None:
    """SIGKILL at each of points in turn (test_sigkill_at_tiering_pause_points)."""
    rng = random.Random(17)
    m: Mount = make_mount(options=[LOG_SIZE, "sync=lazy", "hot_versions=0"], start=False)
    baseline: dict[str, str] = {}
    journals: dict[str, Path] = {}
    for rnd, point in enumerate(points):
        marker = tmp_path / f"paused-{rnd}"
        monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"{point}:{marker}")
        m.start()
        monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
        if journals:
            _check_round(m, journals, baseline, f"SIGKILL at {points[rnd - 1]}")
            baseline = observe(m.path)
        journals = {f"w{i}": tmp_path / f"journal-{rnd}-w{i}" for i in range(N_WRITERS)}
        procs = start_writers(m, journals, rng, lazy=True)
        try:
            # hot_versions=0: the background pass takes whatever is committed.
            _wait_until(marker.exists, 180, f"round {rnd}: the mover never reached {point}")
            seen = _renames(journals)
            _wait_until(lambda: _renames(journals) > seen, 60,
                        f"round {rnd}: no rename while the pass waited at {point}")
            died = [(p.returncode, p.stderr.read().decode(errors="replace"))
                    for p in procs if p.poll() is not None]
            assert not died, f"round {rnd}: a writer failed before the crash: {died}"
            crash(m, procs)
        finally:
            stop_writers(procs)
        named, intents, blobs, temps, dead = store_packs(m)
        if point == "pack-begin":
            assert intents and not temps and not {pack_name(n) for n in intents} & blobs, \
                f"round {rnd}: no pack about to be written at the crash"
        elif point == "pack-writing":
            assert intents and temps, f"round {rnd}: no pack being written at the crash"
        elif point == "pack-written":
            assert intents and blobs - named, f"round {rnd}: no unnamed pack at the crash"
        elif point == "pass-done":
            assert blobs and not intents, f"round {rnd}: the pass was not over"
        else:
            assert dead and blobs - named, f"round {rnd}: no dead pack waiting"
    m.start()
    _check_round(m, journals, baseline, f"SIGKILL at {points[-1]}")
    m.umount()
    named, intents, blobs, temps, dead = store_packs(m)
    assert blobs <= named and not intents and not temps and not dead, \
        (blobs - named, intents, temps, dead)
    res = m.fsck()
    assert res.returncode == 0 and "interrupted" not in res.stdout, res.stdout + res.stderr


def _check_round(m: Mount, journals: dict[str, Path], baseline: dict[str, str],
                 what: str) -> None:
    """After a remount: every path as its journal allows, and the mount's
    cleanup of what the interrupted pass left done (by itself)."""
    check(journal_models(journals, baseline), observe(m.path), what)
    _wait_until(lambda: m.stat()["tier_leftover_packs"] == 0, 60,
                f"{what}: the leftovers were never removed")


# Waits for the daemon (argv[1]) to die, then writes below argv[2] until killed:
# a writer whose first step comes after the crash.
LATE_WRITER = r"""
import os, sys, time
pid, top = sys.argv[1], sys.argv[2]
def dead():
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
while not dead():
    time.sleep(0.001)
while True:
    try:
        os.makedirs(os.path.join(top, "late"), exist_ok=True)
        with open(os.path.join(top, "late", "c1.pt"), "wb") as f:
            f.write(b"written after the crash")
    except OSError:
        pass
"""


def test_crash_stops_the_writers_before_it_detaches_the_mount(make_mount, tmp_path,
                                                              monkeypatch):
    """Writers still running when the dead mount is detached write into the
    directory below it (SOURCE), where the next mount never looks: seed 7
    failed so at load 9 ("w0/c1.pt: holds absent", its rename and dirsync in
    the journal, the file in SOURCE/w0/). `crash` kills every writer, even one
    that starts only once the daemon is dead, before it detaches."""
    rng = random.Random(12)
    m: Mount = make_mount(options=[LOG_SIZE])
    journals = {f"w{i}": tmp_path / f"journal-w{i}" for i in range(N_WRITERS)}
    procs = start_writers(m, journals, rng, lazy=False)
    procs.append(subprocess.Popen([sys.executable, "-c", LATE_WRITER, str(m.pid), str(m.path)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE))
    alive_at_detach: list[list[int]] = []
    detach = Mount.detach

    def watched_detach(self: Mount) -> None:
        alive_at_detach.append([p.pid for p in procs if p.poll() is None])
        detach(self)

    monkeypatch.setattr(Mount, "detach", watched_detach)
    try:
        _wait_until(lambda: all(read_journal(j) for j in journals.values()), 60,
                    "the writers never began")
        crash(m, procs)
    finally:
        stop_writers([p for p in procs if p.returncode is None])
    assert alive_at_detach == [[]], f"writers alive when the mount was detached: {alive_at_detach}"
    m.start()
    check(journal_models(journals, {}), observe(m.path), "after the crash")
    m.umount()
    fsck_clean(m)


def test_lazy_clean_umount_keeps_every_close(make_mount, tmp_path):
    """sync=lazy without a crash: after a clean unmount every closed file is there."""
    rng = random.Random(7)
    m: Mount = make_mount(options=[LOG_SIZE, "sync=lazy", "lazy_delay=30"])
    journals = {f"w{i}": tmp_path / f"journal-w{i}" for i in range(N_WRITERS)}
    procs = start_writers(m, journals, rng, lazy=True, steps=25)
    try:
        for p in procs:
            assert p.wait(timeout=300) == 0, p.stderr.read().decode(errors="replace")
    finally:
        stop_writers(procs)
    m.umount()
    m.start()
    observed = observe(m.path)
    problems = []
    expected: dict[str, str] = {}
    for journal in journals.values():
        model = Model({})
        for line in read_journal(journal):
            model.apply(line)
        expected.update({p: s for p, s in model.final.items() if s != ABSENT})
    for p in sorted(set(expected) | set(observed)):
        if observed.get(p, ABSENT) != expected.get(p, ABSENT):
            problems.append(f"{p}: holds {short(observed.get(p, ABSENT))}, last close wrote "
                            f"{short(expected.get(p, ABSENT))}")
    assert not problems, "\n".join(problems)
    m.umount()
    fsck_clean(m)


@pytest.mark.soak
@pytest.mark.parametrize("seed", SOAK_SEEDS)
def test_sigkill_soak(make_mount, tmp_path, seed):
    crash_chain(make_mount, tmp_path, seed, SOAK_ROUNDS, lazy=seed % 4 == 3)


@pytest.mark.soak
@pytest.mark.parametrize("seed", TIER_SOAK_SEEDS)
def test_sigkill_soak_lazy_tiering(make_mount, tmp_path, seed):
    """sync=lazy with the mover at work and SIGKILL at a seeded random moment:
    the windows test_sigkill_at_tiering_pause_points stops at, and every one
    in between (the flip's batch, the snapshot, the cleanup itself)."""
    crash_chain(make_mount, tmp_path, seed, SOAK_ROUNDS, lazy=True, tiering=True)


def _store_explained(m: Mount, what: str) -> set[str]:
    """After a clean unmount every pack in the store is named by the index, or
    explained by it: an intent (a pass the unmount cut short: the next mount
    deletes it) or a dead mark (deleted with the next snapshot); a pack's
    temporary only beside an intent. A temporary of a snapshot's objects or
    head (a publish the crash cut short) may stay: it goes with `ckptfs gc`
    (docs/CONSISTENCY.md, "snapshot: crash after the head number is reserved").
    Returns the packs the index names."""
    named, intents, blobs, temps, dead = store_packs(m)
    unexplained = blobs - named - {pack_name(n) for n in intents | dead}
    root = m.source / ".ckptfs" / "store"
    pack_temps = [t for t in temps if t.relative_to(root).parts[0] == "packs"]
    assert not unexplained and (intents or not pack_temps), (what, unexplained, pack_temps)
    return named


def _gc_leaves_no_temporaries(m: Mount, what: str) -> None:
    """`ckptfs gc` removes every temporary a crash left in the store."""
    m.start()
    run_ckptfs("gc", str(m.path))
    m.umount()
    temps = store_packs(m)[3]
    assert not temps, f"{what}: ckptfs gc left temporaries: {temps}"


def test_snapshot_temporaries_are_left_to_gc(make_mount):
    """A snapshot publish cut short by SIGKILL leaves its object's temporary in
    the store (seed 3001 at load 5: `.0a1b1e66...tmp-...` below
    volumes/vm/objects/, written 0.1 s before the kill); the next mount writes
    the object again and never removes the temporary: `ckptfs gc` does. The
    soak's store check allowed temporaries only beside a pack intent."""
    m: Mount = make_mount(options=[LOG_SIZE, "sync=lazy", "hot_versions=0"])
    (m.path / "a.pt").write_bytes(os.urandom(1 << 20))
    m.umount()
    objects = m.source / ".ckptfs" / "store" / "volumes"
    leftover = next(objects.rglob("objects")) / "0a" / ".0a1b1e66.tmp-090449ba639f520e"
    leftover.parent.mkdir(exist_ok=True)
    leftover.write_bytes(b"half an object")
    _store_explained(m, "a snapshot object's temporary")
    _gc_leaves_no_temporaries(m, "a snapshot object's temporary")


def test_sigterm_while_writing_keeps_old_content(make_mount):
    """The daemon stopped by SIGTERM under a writer (an unmount the writer did not
    ask for): files still open were never closed or fsync'ed, so they keep their
    last committed content, like after a crash; closed files are all there."""
    m: Mount = make_mount(options=["pmem_size=64M"])
    old, new = os.urandom(3 << 20), os.urandom(5 << 20)
    (m.path / "ckpt.pt").write_bytes(old)
    (m.path / "fresh.pt").write_bytes(b"")
    (m.path / "done.pt").write_bytes(new)           # closed: committed
    rewrite = os.open(m.path / "ckpt.pt", os.O_WRONLY | os.O_TRUNC)
    fresh = os.open(m.path / "fresh.pt", os.O_WRONLY)
    try:
        for fd in (rewrite, fresh):
            os.write(fd, new[:2 << 20])
            # Start writeback (no flush, no fsync): the bytes reach the daemon.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        time.sleep(0.3)
        dfd = os.open(m.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)       # fsyncdir: durable namespace, but commits no open file
        finally:
            os.close(dfd)
        pid = m.pid
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not process_exited(pid):
            assert time.monotonic() < deadline, "daemon ignored SIGTERM"
            time.sleep(0.02)
    finally:
        for fd in (rewrite, fresh):
            try:
                os.close(fd)
            except OSError:
                pass        # ENOTCONN: the daemon is gone
    subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True)
    m.pid = None
    m.start()
    assert (m.path / "done.pt").read_bytes() == new
    assert (m.path / "fresh.pt").read_bytes() == b""
    got = (m.path / "ckpt.pt").read_bytes()
    assert got == old, f"ckpt.pt holds {len(got)} bytes, not its committed {len(old)}"
    m.umount()
    fsck_clean(m)


def test_lazy_close_is_durable_within_the_delay(make_mount):
    """sync=lazy: a close that returned is durable once lazy_delay has passed."""
    m: Mount = make_mount(options=["pmem_size=64M", "sync=lazy", "lazy_delay=1"])
    files = {f"f{i}.bin": os.urandom(1 << 20) for i in range(3)}
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    (m.path / "f0.bin").rename(m.path / "renamed.bin")
    files["renamed.bin"] = files.pop("f0.bin")
    time.sleep(2.5)
    m.kill()
    m.start()
    for name, data in files.items():
        assert (m.path / name).read_bytes() == data, name
    assert not (m.path / "f0.bin").exists()
    m.umount()
    fsck_clean(m)


def test_full_log_keeps_committed_content(make_mount):
    """A rewrite that runs out of log space fails at close (ENOSPC) and loses
    nothing already committed: the old content is what the index keeps."""
    m: Mount = make_mount(options=["pmem_size=16M"])
    old = os.urandom(6 << 20)
    (m.path / "a.pt").write_bytes(old)
    with pytest.raises(OSError) as err:
        with open(m.path / "a.pt", "wb") as f:      # O_TRUNC rewrite that cannot fit
            for _ in range(12):
                f.write(os.urandom(1 << 20))
    assert err.value.errno == errno.ENOSPC
    (m.path / "b.pt").write_bytes(b"b" * (1 << 20))     # the space came back
    m.kill()
    m.start()
    assert (m.path / "a.pt").read_bytes() == old
    assert (m.path / "b.pt").read_bytes() == b"b" * (1 << 20)
    m.umount()
    fsck_clean(m)
