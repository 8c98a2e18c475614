"""Simulated power loss inside the log layer, at handler level (no FUSE mount).

The real core runs in-process (tests/inproc.py with a `FaultLog` in place of
the log, the committer in a nursery) and three writer tasks drive `Filesystem`
the way the kernel would: create, write in pieces, flush, release, fsync half way, O_TRUNC
rewrites, writes in place, temp file + rename, truncate of a closed file,
unlink (also of an open file), fsync of a directory. Each task journals its
steps (see `journal_model`). At a seeded random step (a log store, a persist
or an index commit) the power goes off: the step and everything after it fail,
the nursery is cancelled, no shutdown runs, LMDB is closed as it is, and every
log store no persist covered is dropped, kept or torn at 8-byte granularity.

Then the filesystem is opened again from disk, recovered, and:
- every file reads back (Filesystem.read) exactly as its journal allows: the
  committed content, or for a file in flight its old or its new content whole;
  never a mix, never EIO;
- fsck finds nothing but orphans (unlinked-while-open inodes the next mount
  purges), and nothing at all after a clean shutdown.

Each seed chains several power cuts on one filesystem; odd seeds hand freed log
space out again first-fit, so reuse-before-durable bugs show. `-m soak` runs
600 cuts (~2.5 min).

Then failure paths: a log record damaged on disk gives EIO for reads of the
damaged range through a real mount while everything else reads fine, and fsck
reports it; a write cancelled before its bytes reach the log is never
committed; a record without checksums reads as damaged.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import random
import stat
from pathlib import Path
from typing import Optional

import pytest
import trio

from ckptfs.core import Filesystem
from ckptfs.errors import DamagedData, NoSpace, NotFound
from ckptfs.index import ROOT_INO
from faultlog import FaultLog, PowerCut
from inproc import InProcess
from journal_model import check, writer_model
from posix_helpers import flip_log_bit

KiB, MiB = 1 << 10, 1 << 20
LOG_BYTES = 32 * MiB
N_TASKS = 3
MAX_TASK_STEPS = 400      # a round ends at the cut; this only bounds a round without one

SEEDS = range(6)
ROUNDS = 6                # 36 power cuts by default, ~10 s
SOAK_SEEDS = range(1000, 1050)
SOAK_ROUNDS = 12


SHARED = random.Random(4242).randbytes(3 * MiB)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def have_fsck() -> bool:
    import importlib.util
    return importlib.util.find_spec("ckptfs.fsck") is not None


# ------------------------------------------------------------------ one boot

class Boot(InProcess):
    """The filesystem opened from disk in this process, with a FaultLog; no
    tiering (the cuts are in the log layer: a full log is ENOSPC, not a wait)."""

    def __init__(self, source: Path) -> None:
        super().__init__(source, [f"pmem_size={LOG_BYTES >> 20}M", "tiering=off"],
                         log_class=FaultLog)
        self.log: FaultLog
        self.log.hook_index(self.index)


def lookup(fs: Filesystem, parent: int, name: str) -> Optional[int]:
    try:
        return fs.ns.lookup(parent, name.encode()).ino
    except NotFound:
        return None


async def read_all(fs: Filesystem, ino: int) -> bytes:
    fh = fs.open(ino, os.O_RDONLY)
    try:
        size = fs.attrs(ino).size
        out = bytearray()
        while len(out) < size:
            piece = await fs.read(fh, len(out), min(size - len(out), 3 * MiB + 4 * KiB))
            assert piece, f"inode {ino}: short read at {len(out)} of {size}"
            out += piece
        return bytes(out)
    finally:
        await fs.release(fh)


def observe(boot: Boot) -> tuple[dict[str, str], dict[str, bytes]]:
    """Every file under the root: path -> sha (or "error:EIO"), and path -> bytes.

    The committer runs meanwhile, as in a mount: closes wait for durability.
    """
    return boot.run(lambda b: _observe(b.fs))


async def _observe(fs: Filesystem) -> tuple[dict[str, str], dict[str, bytes]]:
    shas: dict[str, str] = {}
    contents: dict[str, bytes] = {}

    async def walk(dino: int, prefix: str) -> None:
        for name, ino, _ in list(fs.ns.entries(dino, 0)):
            path = prefix + name.decode()
            mode = fs.ns.get(ino).mode
            if stat.S_ISDIR(mode):
                await walk(ino, path + "/")
                continue
            try:
                data = await read_all(fs, ino)
            except DamagedData:
                shas[path] = "error:EIO"
                continue
            shas[path] = sha(data)
            contents[path] = data
    await walk(ROOT_INO, "")
    return shas, contents


# ------------------------------------------------------------------ writers

class Task:
    """One writer: owns directory `sub`, does one step at a time, journals it."""

    def __init__(self, boot: Boot, sub: str, rng: random.Random, live: dict[str, bytes]) -> None:
        self.fs = boot.fs
        self.log = boot.log
        self.sub = sub
        self.rng = rng
        self.live = live            # path -> current content (this writer's view)
        self.journal: list[str] = []
        self.tmp_seq = 0
        self.dino = 0

    def j(self, *fields: str) -> None:
        self.journal.append(" ".join(fields))

    def content(self) -> bytes:
        r = self.rng.random()
        hi = 16 * KiB if r < 0.3 else 256 * KiB if r < 0.8 else 2 * MiB
        n = self.rng.randint(1, hi) if self.rng.random() < 0.5 else \
            self.rng.randint(1, hi // 4096) * 4096
        if self.rng.random() < 0.5:
            return self.rng.randbytes(n)
        # Bytes other files and writers have too (frozen weights): shared chunks.
        start = 0 if self.rng.random() < 0.5 else self.rng.randrange(len(SHARED))
        take = min(n, len(SHARED) - start, self.rng.randint(n // 4, n))
        return SHARED[start:start + take] + self.rng.randbytes(n - take)

    def pieces(self, start: int, end: int) -> list[tuple[int, int]]:
        out = []
        pos = start
        while pos < end:
            n = min(end - pos, self.rng.choice((4 * KiB, 60 * KiB, 128 * KiB, 1 * MiB + 5)))
            out.append((pos, n))
            pos += n
        return out

    async def write_range(self, fh: int, data: bytes, start: int, end: int,
                          shuffle: bool = False) -> None:
        """Write data[start:end] at the same offsets; the kernel may send pages out of order."""
        ps = self.pieces(start, end)
        if shuffle:
            self.rng.shuffle(ps)
        for off, n in ps:
            await self.fs.write(fh, off, data[off:off + n])

    async def run(self, cut_scope: trio.CancelScope) -> None:
        try:
            self.dino = lookup(self.fs, ROOT_INO, self.sub) or self._mkdir()
            for _ in range(MAX_TASK_STEPS):
                await self.step()
        except PowerCut:
            cut_scope.cancel()
        except Exception:
            if not self.log.is_cut:
                raise
            cut_scope.cancel()     # a failure caused by the cut (e.g. the commit failed)

    def _mkdir(self) -> int:
        a = self.fs.make_node(ROOT_INO, self.sub.encode(), stat.S_IFDIR | 0o755, 0, 0)
        self.fs.forget(a.inode.ino, 1)
        return a.inode.ino

    async def step(self) -> None:
        r = self.rng.random()
        if r < 0.35:
            await self.write_file(f"f{self.rng.randrange(4)}", self.content(),
                                  mid_commit=self.rng.random() < 0.2)
        elif r < 0.50:
            await self.write_in_place()
        elif r < 0.70:
            await self.write_and_rename()
        elif r < 0.78:
            await self.truncate_closed()
        elif r < 0.86:
            await self.unlink_some()
        elif r < 0.92:
            await self.unlink_while_open()
        else:
            await self.fs.sync_all()
            self.j("dirsync")

    def path(self, name: str) -> str:
        return f"{self.sub}/{name}"

    async def open_for_rewrite(self, name: str) -> tuple[int, int, bool]:
        ino = lookup(self.fs, self.dino, name)
        if ino is None:
            fh, attrs = self.fs.create(self.dino, name.encode(), 0o644,
                                       os.O_WRONLY | os.O_CREAT, 0, 0)
            return fh, attrs.inode.ino, True
        return self.fs.open(ino, os.O_WRONLY | os.O_TRUNC), ino, False

    async def close(self, fh: int, ino: int, created: bool) -> None:
        await self.fs.release(fh)
        if created:
            self.fs.forget(ino, 1)

    async def write_file(self, name: str, data: bytes, mid_commit: bool = False) -> None:
        """open(O_CREAT|O_TRUNC), write, [fsync half way], flush, release."""
        p = self.path(name)
        half = self.rng.randint(1, len(data) - 1) if mid_commit and len(data) > 1 else 0
        # The fsync half way may be durable before it returns: announce it too.
        self.j("begin", p, sha(data[:half] if half else data))
        fh, ino, created = await self.open_for_rewrite(name)
        try:
            if half:
                await self.write_range(fh, data, 0, half)
                await self.fs.fsync(fh)
                self.j("committed", p, sha(data[:half]))
                self.live[p] = data[:half]
                self.j("begin", p, sha(data))
                await self.write_range(fh, data, half, len(data), shuffle=True)
            else:
                await self.write_range(fh, data, 0, len(data), shuffle=self.rng.random() < 0.3)
            if self.rng.random() < 0.2:
                # Rewrite a piece while still open: the first copy is never committed.
                a = self.rng.randrange(len(data))
                await self.write_range(fh, data, a, min(len(data), a + 100 * KiB))
            await self.fs.flush(fh)
        except NoSpace:
            await self.close(fh, ino, created)
            return          # the rewrite is discarded: the old content stays
        self.j("committed", p, sha(data))
        self.live[p] = data
        await self.close(fh, ino, created)

    async def write_in_place(self) -> None:
        """Open without O_TRUNC and overwrite (maybe extend) a range of an existing file."""
        names = sorted(p for p in self.live if not p.rsplit("/", 1)[1].startswith("."))
        if not names:
            return
        p = self.rng.choice(names)
        old = self.live[p]
        off = self.rng.randint(0, len(old) + 8 * KiB)
        patch = self.rng.randbytes(self.rng.randint(1, 300 * KiB))
        new = old.ljust(off, b"\0")[:off] + patch + old[off + len(patch):]
        ino = lookup(self.fs, self.dino, p.rsplit("/", 1)[1])
        assert ino is not None, p
        self.j("begin", p, sha(new))
        fh = self.fs.open(ino, os.O_WRONLY)
        try:
            for a, n in self.pieces(0, len(patch)):
                await self.fs.write(fh, off + a, patch[a:a + n])
            await self.fs.flush(fh)
        except NoSpace:
            await self.fs.release(fh)
            return
        self.j("committed", p, sha(new))
        self.live[p] = new
        await self.fs.release(fh)

    async def write_and_rename(self) -> None:
        """torch.save style: a temp name, committed, then renamed over the checkpoint."""
        self.tmp_seq += 1
        tmp, dst = f".tmp{self.tmp_seq}", f"c{self.rng.randrange(3)}"
        data = self.content()
        await self.write_file(tmp, data)
        if self.live.get(self.path(tmp)) is not data:
            return      # the write was refused (log full)
        self.j("rename", self.path(tmp), self.path(dst), sha(data))
        self.fs.rename(self.dino, tmp.encode(), self.dino, dst.encode(), 0)
        self.live[self.path(dst)] = self.live.pop(self.path(tmp))
        if self.rng.random() < 0.3:
            await self.fs.sync_all()
            self.j("dirsync")

    async def truncate_closed(self) -> None:
        names = sorted(self.live)
        if not names:
            return
        p = self.rng.choice(names)
        old = self.live[p]
        size = self.rng.choice((0, self.rng.randint(0, len(old)), len(old) + self.rng.randint(1, 70000)))
        new = old[:size].ljust(size, b"\0")
        ino = lookup(self.fs, self.dino, p.rsplit("/", 1)[1])
        self.j("set", p, sha(new))
        self.fs.setattr(ino, size=size)
        self.live[p] = new

    async def unlink_some(self) -> None:
        names = sorted(self.live)
        if not names:
            return
        p = self.rng.choice(names)
        self.j("unlink", p)
        self.fs.unlink(self.dino, p.rsplit("/", 1)[1].encode())
        del self.live[p]

    async def unlink_while_open(self) -> None:
        """Rewrite a file, unlink it before closing: its bytes are never committed."""
        name = f"u{self.rng.randrange(2)}"
        p = self.path(name)
        data = self.content()
        self.j("begin", p, sha(data))
        fh, ino, created = await self.open_for_rewrite(name)
        try:
            await self.write_range(fh, data, 0, len(data) // 2)
            self.j("unlink", p)
            self.fs.unlink(self.dino, name.encode())
            self.live.pop(p, None)
            await self.write_range(fh, data, len(data) // 2, len(data))
            await self.fs.flush(fh)
        except NoSpace:
            pass
        await self.close(fh, ino, created)


# ------------------------------------------------------------------ the runs

def run_until_cut(boot: Boot, tasks: list[Task]) -> None:
    async def main() -> None:
        async with trio.open_nursery() as outer:
            outer.start_soon(boot.fs.run_committer)
            async with trio.open_nursery() as inner:
                for t in tasks:
                    inner.start_soon(t.run, outer.cancel_scope)
            boot.log.cut()          # every task ran out of steps: cut now
            outer.cancel_scope.cancel()
    trio.run(main)
    assert boot.log.is_cut


def fsck_findings(source: Path) -> tuple[int, list[str]]:
    from ckptfs.fsck import run_fsck
    out = io.StringIO()
    code = run_fsck(str(source), [], out=out)
    return code, [ln for ln in out.getvalue().splitlines() if ln.startswith("problem")]


def power_cut_chain(source: Path, seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    live: dict[str, bytes] = {}          # what survived the last cut, all writers
    baseline: dict[str, str] = {}
    for rnd in range(rounds + 1):
        last = rnd == rounds
        boot = Boot(source)
        what = f"seed {seed} round {rnd}"
        try:
            shas, contents = observe(boot)
            if rnd:
                check(models, shas, f"{what}: after the power cut ({fates})")
            assert set(shas) == set(contents), f"{what}: unreadable files {shas}"
            baseline, live = shas, contents
            if last:
                break
            tasks = []
            for i in range(N_TASKS):
                sub = f"w{i}"
                mine = {p: d for p, d in live.items() if p.startswith(sub + "/")}
                tasks.append(Task(boot, sub, random.Random(rng.randrange(1 << 32)), mine))
            boot.log.cut_at = rng.randint(1, 400)
            boot.log.first_fit = seed % 2 == 1
            run_until_cut(boot, tasks)
        except BaseException:
            boot.close()
            raise
        boot.close()
        fates = boot.log.lose_unpersisted(rng)
        models = {t.sub: writer_model(baseline, t.sub, t.journal) for t in tasks}
        if have_fsck():
            code, problems = fsck_findings(source)
            unexpected = [p for p in problems if not p.startswith("problem [orphans]")]
            assert not unexpected, f"{what}: fsck after the cut:\n" + "\n".join(problems)
    # The last boot: verified; now a clean shutdown, then fsck must be clean and
    # every file exactly as its writer last left it.
    boot.shutdown()
    if have_fsck():
        code, problems = fsck_findings(source)
        assert code == 0, f"seed {seed}: fsck after a clean shutdown:\n" + "\n".join(problems)
    boot = Boot(source)
    try:
        shas, _ = observe(boot)
    finally:
        boot.close()
    assert shas == baseline, f"seed {seed}: a clean shutdown changed files"


@pytest.mark.parametrize("seed", SEEDS)
def test_power_cut(tmp_path, seed):
    power_cut_chain(tmp_path, seed, ROUNDS)


@pytest.mark.soak
@pytest.mark.parametrize("seed", SOAK_SEEDS)
def test_power_cut_soak(tmp_path, seed):
    power_cut_chain(tmp_path, seed, SOAK_ROUNDS)


# ---------------------------------------------------------- damaged record

def test_damaged_log_record_gives_eio(make_mount):
    m = make_mount(options=["pmem_size=64M"])
    rng = random.Random(5)
    files = {"damaged.bin": rng.randbytes(8 * MiB), "other.bin": rng.randbytes(3 * MiB + 5),
             "small.json": b'{"step": 1}'}
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    m.umount()

    bad_off = 6 * MiB + 12345
    flip_log_bit(m.source, "damaged.bin", bad_off)

    m.start()
    fd = os.open(m.path / "damaged.bin", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as err:
            os.pread(fd, 4096, bad_off)
        assert err.value.errno == errno.EIO
        # Far from the damage the same file still reads, and reads right.
        assert os.pread(fd, 1 * MiB, 0) == files["damaged.bin"][:1 * MiB]
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:
        (m.path / "damaged.bin").read_bytes()
    assert err.value.errno == errno.EIO
    for name in ("other.bin", "small.json"):
        assert (m.path / name).read_bytes() == files[name]
    # Damage is not a reason to stop taking writes.
    (m.path / "after.bin").write_bytes(b"x" * 70000)
    assert (m.path / "after.bin").read_bytes() == b"x" * 70000
    m.umount()

    if not have_fsck():
        pytest.skip("ckptfs.fsck does not exist yet")
    res = m.fsck()
    assert res.returncode != 0, res.stdout
    assert "[data]" in res.stdout and "checksum" in res.stdout, res.stdout


# ------------------------------------------- small commits: bytes in the index

def test_small_fsync_is_durable_in_the_index_alone(tmp_path):
    """An fsync of a few 4 KiB overwrites persists no log range: the bytes
    ride in the batch's own index transaction (logredo). A power cut that
    loses every log store no persist covered loses none of them: fsck counts
    the index's copy, the next mount writes it back, the file reads exactly."""
    boot = Boot(tmp_path)
    rng = random.Random(14)
    base = rng.randbytes(2 * MiB)
    patches = {off: rng.randbytes(4 * KiB) for off in (0, 12 * 4 * KiB, 300 * 4 * KiB)}

    async def main() -> int:
        async with trio.open_nursery() as n:
            n.start_soon(boot.fs.run_committer)
            fh, _ = boot.fs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
            await boot.fs.write(fh, 0, base)
            await boot.fs.fsync(fh)             # 2 MiB: too big to ride along
            before = boot.log.persist_calls
            for off, data in patches.items():
                await boot.fs.write(fh, off, data)
            await boot.fs.fsync(fh)
            persists = boot.log.persist_calls - before
            boot.log.cut()                      # the power goes, nothing more is written
            n.cancel_scope.cancel()
        return persists

    try:
        persists = trio.run(main)
    finally:
        boot.close()
    assert persists == 0
    fates = boot.log.lose_unpersisted(rng, choices=("dropped",))
    assert fates["dropped"] >= len(patches)
    if have_fsck():
        code, problems = fsck_findings(tmp_path)
        assert not problems, "\n".join(problems)
    want = bytearray(base)
    for off, data in patches.items():
        want[off:off + len(data)] = data
    boot = Boot(tmp_path)
    try:
        shas, contents = observe(boot)
    finally:
        boot.close()
    assert contents == {"f": bytes(want)}


# ------------------------------------------------------- failure paths

def test_cancelled_write_is_never_committed(tmp_path):
    """A write cancelled before its bytes reach the log (a request aborted at
    unmount) must not end up in a commit: the file reads back as before, no EIO."""
    boot = Boot(tmp_path)
    old = b"a" * 100_000

    async def main() -> bytes:
        async with trio.open_nursery() as n:
            n.start_soon(boot.fs.run_committer)
            fh, attrs = boot.fs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
            ino = attrs.inode.ino
            await boot.fs.write(fh, 0, old)
            await boot.fs.flush(fh)
            with trio.CancelScope() as cs:
                cs.cancel()
                await boot.fs.write(fh, 50_000, b"b" * 200_000)
            try:
                await boot.fs.flush(fh)     # may report the lost write; must not commit it
            except Exception:
                pass
            await boot.fs.release(fh)
            data = await read_all(boot.fs, ino)
            await boot.fs.shutdown()
            boot.fs.index.stop()
        return data

    try:
        data = trio.run(main)
    finally:
        boot.close()
    assert data == old
    boot = Boot(tmp_path)
    try:
        shas, contents = observe(boot)
    finally:
        boot.close()
    assert contents == {"f": old}


def test_record_without_checksums_reads_as_damaged(tmp_path):
    """A chunk whose CRCs are missing (its bytes never stored) is EIO, not a crash."""
    from ckptfs.pmemlog import PmemLog
    plog = PmemLog.open(str(tmp_path / "log"), 1 * MiB, b"u" * 16)
    try:
        plog.init_free_space([])
        (off, n), = plog.allocate(100_000)
        crcs = plog.store(off, memoryview(b"z" * n))
        buf = memoryview(bytearray(n))
        plog.read_into(buf, off, n, crcs, 0)
        assert bytes(buf) == b"z" * n
        for bad in (b"", crcs[:4]):
            with pytest.raises(DamagedData):
                plog.read_into(buf, off, n, bad, 0)
    finally:
        plog.close()
