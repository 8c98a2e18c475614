#!/usr/bin/env python3
"""Foundation benchmark (issue 2): ckptfs against the raw directory, bindfs and minfs.

    python tools/bench_foundation.py --dir /var/tmp/ckbench --reps 3 [--quick]
        [--json out.json] [--profile DIR]

Runs as root (mounts, drop_caches). Five targets, all on the same disk:

  raw           a plain directory under --dir
  bindfs        `bindfs -f -o big_writes SRC MNT` (a C FUSE passthrough; libfuse 2,
                so 128 KiB requests at most and no writeback cache)
  minfs         the bare pyfuse3 + trio daemon ../shared/tools/minfs.py (--minfs):
                one flat directory, data in one store file (pwrite backend,
                writeback cache, read-ahead raised as ckptfs raises it): the
                ceiling of any pyfuse3 filesystem here. It has no directories
                (no small_files) and forgets its files when unmounted, so its
                "cold" reads follow a drop of the page cache without a remount
  ckptfs-close  mount.ckptfs SRC SRC -o pmem_size=...,sync=close (log in SRC/.ckptfs)
  ckptfs-lazy   the same with sync=lazy

Workloads (full sizes; --quick shrinks them):

  seq_write     2 GiB in 1 MiB writes, then fsync and close
  cold_read     read that file back in 1 MiB reads after unmount, drop caches, remount
  write_8k      64 MiB in 8 KiB writes, then fsync and close
  randwrite_4k  4 KiB writes at random 4 KiB-aligned offsets of a 256 MiB file written
                before (untimed), an fsync after every 16: IOPS
  small_files   create + write 4 KiB + close of 5,000 files in one directory (no fsync:
                what users call; ckptfs sync=close makes every close durable, raw and
                bindfs do not); raw also as small_files_fdatasync: the same files with
                fdatasync before each close, what this disk allows a flushing close
  torch_save    torch.save of a ~1 GB state dict of 32 float32 tensors, as users call
                it: no fsync (an fsync right after is timed separately, for information)
  torch_load    torch.load(weights_only=True) after unmount, drop caches, remount
  shards8       8 files of 256 MiB written (untimed) in one checkpoint directory (the
                mount root for minfs, which has none), then after unmount, drop caches,
                remount, 8 processes each read their own at once in 1 MiB reads:
                aggregate MB/s (a sharded restore). One directory, as a sharded save
                writes them: in ckptfs's root each file would be a checkpoint version of
                its own, and tiering keeps only the 2 newest versions in the log
  cold_tier     ckptfs only: a 1 GiB file moved to the backing store (`ckptfs tier
                --now --all`), then read after unmount, drop caches, remount (every
                chunk fetched from packs, decompressed, verified): MB/s, against
                the same file read hot (in the log) after the same remount
  sync_file     stress-ng's sync-file stressor (0.15.06): a 64 MiB file, created and
                unlinked, then per bogo op three times: ftruncate to 0, fdatasync,
                fallocate 64 MiB (where fallocate is not supported - every FUSE target
                here - stress-ng writes the 64 MiB as zeros in 8 KiB writes instead),
                then sync_file_range over forward, reverse and random 128 KiB ranges
                with a random mode. Measured twice: `sync_file` re-enacts those calls
                from this script on every target (minfs has no directories for
                stress-ng's temp dir); `stress_sync_file` runs
                `stress-ng --sync-file 1 --sync-file-bytes 64M --timeout Ns` itself

Every (rep, workload, target) gets a fresh directory (and a fresh ckptfs log). Reps
are interleaved: rep 1 of every workload on every target, then rep 2, ...; within a
workload the target order rotates from rep to rep. Data is incompressible and never
repeats at 4 KiB granularity, so later dedup cannot flatter the numbers. Everything
read back is verified after the timed part. Results: the median of the reps, with
ratios ckptfs/raw and ckptfs/bindfs checked against the issue's targets.

A separate step writes 4 GiB (1 GiB with --quick) to each ckptfs mode and reports the
daemon's peak RSS (VmHWM from /proc/PID/status). --profile DIR runs one more, untimed
pass of the ckptfs workloads with `py-spy record` attached to the daemon and prints
where its CPU time goes.

On a VM whose balloon takes back freed pages (free page reporting: this workplace's),
a page the host took back costs ~5x to touch again, so a target that runs after one
that freed a lot of memory pays for it (much of earlier runs' noise; part, not all, of
the slow first ckptfs mount after minfs). For the run the tool keeps freed pages in the guest
(/sys/module/page_reporting/parameters/min_free_ms, put back afterwards) and first
touches a pool as large as a rep uses, so every target gets the same kind of page;
--no-memory-hold leaves the knob alone.

The disk has its like: on a file system mounted with -o discard every delete tells the
host the blocks are free, and the next write into them goes at a third of the speed
(2 GiB O_DIRECT: ~500 against 1,300-1,600 MB/s). Every target deletes gigabytes when
it ends and the next target is given those blocks: the rest of the slot. For the run
the tool remounts --dir's file system nodiscard (put back afterwards; the blocks
freed meanwhile stay allocated on the host until `fstrim`) and first writes as much
as a rep puts on disk; --no-discard-hold leaves it alone.

Mounts are always cleaned up, also on failure or Ctrl-C: unmount, lazy unmount, then
SIGTERM and SIGKILL of the daemon.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import errno
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from benchlib import drop_caches, freed_blocks_kept, freed_memory_kept, loadavg, log, stop_pid
from mounting import REPO, Mount, force_unmount, is_mounted, mount_device, mounted_paths

from ckptfs.options import parse_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MB = 1_000_000                # throughput is reported in MB/s (10^6 bytes)


@dataclass(frozen=True)
class Sizes:
    seq_bytes: int
    seq_block: int
    small_bytes: int
    small_block: int
    files: int
    file_bytes: int
    torch_bytes: int
    torch_tensors: int
    rss_bytes: int
    pmem_size: str
    sync_file_s: float = 20.0
    rand_file_bytes: int = 256 * MiB
    rand_writes: int = 8192
    shard_bytes: int = 256 * MiB
    tier_bytes: int = 1 * GiB


FULL = Sizes(seq_bytes=2 * GiB, seq_block=1 * MiB, small_bytes=64 * MiB, small_block=8 * KiB,
             files=5000, file_bytes=4 * KiB, torch_bytes=1_000_000_000, torch_tensors=32,
             rss_bytes=4 * GiB, pmem_size="6G")
QUICK = Sizes(seq_bytes=256 * MiB, seq_block=1 * MiB, small_bytes=16 * MiB, small_block=8 * KiB,
              files=500, file_bytes=4 * KiB, torch_bytes=200_000_000, torch_tensors=24,
              rss_bytes=1 * GiB, pmem_size="2G", sync_file_s=6.0,
              rand_file_bytes=64 * MiB, rand_writes=2048, shard_bytes=32 * MiB,
              tier_bytes=128 * MiB)

TARGETS = ("raw", "bindfs", "minfs", "ckptfs-close", "ckptfs-lazy", "ckptfs-nodedup",
           "base-close", "base-lazy")
# ckptfs-nodedup (sync=close, dedup=off) when asked for; base-close and base-lazy
# (another checkout's ckptfs, --ckptfs-base DIR: before and after a change in one run)
DEFAULT_TARGETS = TARGETS[:5]
CKPTFS_TARGETS = ("ckptfs-close", "ckptfs-lazy")
BASELINES = ("raw", "bindfs", "minfs")
WORKLOADS = ("seq", "write_8k", "randwrite_4k", "small_files", "torch", "shards8", "cold_tier",
             "sync_file")
# ../shared/tools/minfs.py from the main checkout (one level more from a worktree)
MINFS = next((p for p in (REPO.parent / "shared" / "tools" / "minfs.py",
                          REPO.parent.parent / "shared" / "tools" / "minfs.py") if p.is_file()),
             REPO.parent / "shared" / "tools" / "minfs.py")
READ_AHEAD_KB = 16384             # what the ckptfs daemon sets for its mount
SYNC_FILE_BYTES = 64 * MiB

# metric -> (unit, higher is better, [(baseline, minimum ratio ckptfs/baseline)]):
# issue 14's targets (issue 2's raw-ratio targets for writes and reads are above
# what the bare pyfuse3 daemon itself reaches here: see docs/BENCHMARKS.md).
METRICS: dict[str, tuple[str, list[tuple[str, float]]]] = {
    "seq_write": ("MB/s", [("minfs", 0.8), ("bindfs", 1.2)]),
    "cold_read": ("MB/s", [("minfs", 0.9), ("bindfs", 1.0)]),
    "write_8k": ("MB/s", [("bindfs", 2.0)]),
    "randwrite_4k": ("IOPS", [("bindfs", 0.5)]),
    "small_files": ("files/s", [("bindfs", 0.5)]),
    "small_files_fdatasync": ("files/s", []),     # raw only: fdatasync before each close
    "torch_save": ("MB/s", []),
    "torch_load": ("MB/s", [("raw", 0.8)]),
    "shards8_read": ("MB/s", [("raw", 0.75)]),
    "tier_hot_read": ("MB/s", []),
    "tier_cold_read": ("MB/s", []),
    "sync_file": ("ops/s", []),
    "stress_sync_file": ("ops/s", []),
}
RSS_LIMIT_MB = 300.0


# ------------------------------------------------------------------ system helpers

def proc_status_kb(pid: int, field: str) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def daemon_cpu_s(pid: Optional[int]) -> Optional[tuple[float, float]]:
    """(main thread, whole process) CPU seconds, user + system, so far.

    The process figure includes threads that have exited."""
    if pid is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for path in (f"/proc/{pid}/task/{pid}/stat", f"/proc/{pid}/stat"):
        try:
            with open(path) as f:
                raw = f.read()
        except OSError:
            return None
        fields = raw[raw.rindex(")") + 2:].split()
        out.append((int(fields[11]) + int(fields[12])) / tick)
    return out[0], out[1]


def run(cmd: list[str], timeout: float = 600) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: "
                           f"{(res.stderr or res.stdout).strip()}")
    return res.stdout


# ------------------------------------------------------------------------ targets

class Target:
    """A place to run a workload: prepare() a fresh directory, remount() it cold."""

    name = "?"
    cannot = {"cold_tier": "has no cold tier"}      # workload -> why this target skips it

    def __init__(self, root: Path) -> None:
        self.root = root
        self.workdir: Optional[Path] = None
        self.pid: Optional[int] = None     # the FUSE daemon, when there is one

    def prepare(self, tag: str) -> Path:
        raise NotImplementedError

    def remount(self) -> None:
        """Unmount (committing everything), drop caches, mount again."""
        self._unmount()
        drop_caches()
        self._mount()

    def _mount(self) -> None:
        """Mount the current workdir (nothing to do for a plain directory)."""

    def _unmount(self) -> None:
        """Unmount it, waiting for the daemon to finish."""

    def finish(self) -> None:
        """Unmount and delete everything this tag made."""
        raise NotImplementedError

    def cleanup(self) -> None:
        """Emergency: nothing of ours may stay mounted or running."""

    def daemon_stats(self) -> dict:
        return {}


class RawTarget(Target):
    name = "raw"

    def prepare(self, tag: str) -> Path:
        self.workdir = self.root / f"raw-{tag}"
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True)
        return self.workdir

    def finish(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


class FuseChildTarget(Target):
    """A FUSE daemon run in the foreground as our child (bindfs, minfs): its pid
    is known, its stderr says why it failed to mount."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.proc: Optional[subprocess.Popen] = None

    def _start_child(self, cmd: list[str], what: str, err_tail: Optional[int] = None) -> None:
        """Run cmd, serving workdir; return once it is mounted (RuntimeError with
        the last err_tail characters of its stderr if it exits first)."""
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 30
        while not is_mounted(self.workdir):
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip()
                raise RuntimeError(f"{what} exited {self.proc.returncode}: "
                                   f"{err if err_tail is None else err[-err_tail:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not mount within 30 s")
            time.sleep(0.02)

    def _stop_child(self, fusermount: str) -> None:
        """Unmount workdir and wait for the child to exit (stopped after 30 s)."""
        if self.workdir is not None and is_mounted(self.workdir):
            run([fusermount, "-u", str(self.workdir)])
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                stop_pid(self.proc.pid)
            self.proc.stderr.close()
            self.proc = None
            self.pid = None

    def cleanup(self) -> None:
        if self.workdir is not None:
            force_unmount(self.workdir)
        if self.proc is not None:
            stop_pid(self.proc.pid)


class BindfsTarget(FuseChildTarget):
    name = "bindfs"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.src: Optional[Path] = None

    def prepare(self, tag: str) -> Path:
        self.src = self.root / f"bindfs-src-{tag}"
        self.workdir = self.root / f"bindfs-mnt-{tag}"
        for d in (self.src, self.workdir):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        self._mount()
        return self.workdir

    def _mount(self) -> None:
        # -f keeps it a child whose pid we know; it stays multi-threaded as usual.
        self._start_child(["bindfs", "-f", "-o", "big_writes", str(self.src),
                           str(self.workdir)], "bindfs")

    def _unmount(self) -> None:
        self._stop_child("fusermount")

    def finish(self) -> None:
        self._unmount()
        for d in (self.workdir, self.src):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        self.workdir = self.src = None


class MinfsTarget(FuseChildTarget):
    """The bare pyfuse3 daemon: a flat directory that forgets its files at unmount."""

    name = "minfs"
    cannot = {"small_files": "has no directories", "cold_tier": "has no cold tier"}

    def __init__(self, root: Path, script: Path, store_size: str) -> None:
        super().__init__(root)
        self.script = script
        self.store_size = store_size
        self.store: Optional[Path] = None

    def prepare(self, tag: str) -> Path:
        self.workdir = self.root / f"minfs-mnt-{tag}"
        self.store = self.root / f"minfs-{tag}.store"
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True)
        self._start_child(
            [sys.executable, str(self.script), str(self.workdir), "--store", str(self.store),
             "--store-size", self.store_size, "--writeback", "1", "--backend", "pwrite"],
            "minfs", err_tail=500)
        set_read_ahead(self.workdir, READ_AHEAD_KB)
        return self.workdir

    def remount(self) -> None:
        """It forgets its files at unmount: cold means the page cache dropped
        (its own pages and the store's), the daemon and its state kept."""
        drop_caches()

    def finish(self) -> None:
        self._stop_child("fusermount3")
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        if self.store is not None:
            self.store.unlink(missing_ok=True)
            self.store = None


def set_read_ahead(mountpoint: Path, kb: int) -> None:
    """The read-ahead of a FUSE mount, as ckptfs sets its own (best effort)."""
    dev = mount_device(mountpoint)
    if dev is not None:
        with contextlib.suppress(OSError):
            Path(f"/sys/class/bdi/{dev}/read_ahead_kb").write_text(str(kb))


class CkptfsTarget(Target):
    cannot: dict = {}

    def __init__(self, root: Path, sync: str, pmem_size: str, dedup: bool = True,
                 checkout: Optional[Path] = None) -> None:
        super().__init__(root)
        self.sync = sync
        self.dedup = dedup
        self.name = f"ckptfs-{sync}" if dedup else "ckptfs-nodedup"
        if checkout is not None:
            self.name = f"base-{sync}"
        self.checkout = checkout    # mount with that checkout's mount.ckptfs (its ckptfs)
        self.pmem_size = pmem_size
        self.mount: Optional[Mount] = None

    def prepare(self, tag: str) -> Path:
        self.workdir = self.root / f"{self.name}-{tag}"
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True)
        self.mount = Mount(self.workdir, self.workdir,
                           [f"pmem_size={self.pmem_size}", f"sync={self.sync}"]
                           + ([] if self.dedup else ["dedup=off"]))
        if self.checkout is not None:
            self.mount.command = (sys.executable, str(self.checkout / "mount.ckptfs"))
        self._mount()
        return self.workdir

    def _mount(self) -> None:
        self.mount.start(timeout_s=300)
        self.pid = self.mount.pid

    def _unmount(self) -> None:
        if self.mount is not None and is_mounted(self.mount.path):
            self.mount.umount()
        self.pid = None

    def daemon_stats(self) -> dict:
        return self.mount.stat()

    def finish(self) -> None:
        self._unmount()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def cleanup(self) -> None:
        if self.mount is not None:
            self.mount.cleanup()        # lazy unmount, then the daemon stopped
        self.pid = None


# --------------------------------------------------------------------------- data

class Pool:
    """Incompressible bytes that never repeat at 4 KiB granularity.

    A 16 MiB random base, XORed with a different 64-bit constant per 16 MiB
    block; cheap to make (memory bandwidth), unlike 2 GiB of fresh randomness.
    """

    BASE = 16 * MiB

    def __init__(self, nbytes: int, seed: int = 2) -> None:
        rng = np.random.default_rng(seed)
        self.base = np.frombuffer(rng.bytes(self.BASE), dtype=np.uint64)
        nbytes = -(-nbytes // self.BASE) * self.BASE
        arr = np.empty(nbytes // 8, dtype=np.uint64)
        for i, start in enumerate(range(0, arr.size, self.base.size)):
            np.bitwise_xor(self.base, self._key(i), out=arr[start:start + self.base.size])
        self.arr = arr
        self.view = memoryview(arr).cast("B")

    @staticmethod
    def _key(i: int) -> np.uint64:
        return np.uint64(((i + 1) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1))

    def block(self, i: int, size: int, out: np.ndarray) -> memoryview:
        """Block i of a stream longer than the pool, written into out (size bytes)."""
        words = size // 8
        n_base = self.BASE // size
        start = (i % n_base) * words
        np.bitwise_xor(self.base[start:start + words], self._key(1000 + i // n_base),
                       out=out[:words])
        return memoryview(out[:words]).cast("B")


# One shard reader of the shards8 workload: 1 MiB reads, prints the bytes read.
SHARD_READER = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
buf = memoryview(bytearray(1 << 20))
total = 0
while True:
    n = os.readv(fd, [buf])
    if not n:
        break
    total += n
print(total)
"""


def write_stream(fd: int, view: memoryview, total: int, block: int) -> None:
    for off in range(0, total, block):
        chunk = view[off:off + block]
        done = 0
        while done < len(chunk):
            done += os.write(fd, chunk[done:])


def read_stream(fd: int, buf: bytearray) -> int:
    mv = memoryview(buf)
    total = 0
    while True:
        n = os.readv(fd, [mv])
        if n == 0:
            return total
        total += n


def verify_file(path: Path, view: memoryview, total: int) -> None:
    got = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            data = f.read(8 * MiB)
            if not data:
                break
            if data != view[got:got + len(data)]:
                raise RuntimeError(f"{path}: wrong bytes near offset {got}")
            got += len(data)
    if got != total:
        raise RuntimeError(f"{path}: read back {got} bytes, wrote {total}")


# ---------------------------------------------------------------- sync-file

_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
# stress-ng's sync_modes: WAIT_BEFORE|WRITE, WAIT_BEFORE|WRITE|WAIT_AFTER, WRITE,
# WAIT_BEFORE, WAIT_AFTER, none.
SYNC_MODES = (1 | 2, 1 | 2 | 4, 2, 1, 4, 0)


def _libc_call(name: str, *args) -> None:
    if getattr(_libc, name)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}: {os.strerror(e)}")


def _sync_file_allocate(fd: int, nbytes: int, zeros: bytes) -> None:
    """stress-ng's stress_sync_allocate: ftruncate 0, fdatasync, then its
    shim_fallocate (fallocate, else the same zeros written 8 KiB at a time)."""
    os.ftruncate(fd, 0)
    os.fdatasync(fd)
    try:
        _libc_call("fallocate", fd, 0, 0, nbytes)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise
    os.lseek(fd, 0, os.SEEK_SET)
    left = nbytes
    while left > 0:
        left -= os.write(fd, zeros[:min(left, len(zeros))])


def sync_file_ops(wd: Path, seconds: float, rng: random.Random,
                  nbytes: int = SYNC_FILE_BYTES) -> tuple[int, float]:
    """stress-ng's sync-file stressor's calls (0.15.06), for `seconds`: (bogo ops, s)."""
    path = wd / "sync-file.tmp"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.unlink(path)
    zeros = bytes(8 * KiB)
    ops = 0
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            mode = rng.choice(SYNC_MODES)
            for direction in ("forward", "reverse"):
                _sync_file_allocate(fd, nbytes, zeros)
                off = 0
                while off < nbytes:
                    n = (rng.getrandbits(32) & 0x1fc00) + KiB
                    start = off if direction == "forward" else nbytes - off
                    _libc_call("sync_file_range", fd, start, n, mode)
                    off += n
            _sync_file_allocate(fd, nbytes, zeros)
            for _ in range(nbytes // (128 * KiB)):
                start = rng.randrange(nbytes) & ~(128 * KiB - 1)
                _libc_call("sync_file_range", fd, start, 128 * KiB, mode)
            ops += 1
    finally:
        os.close(fd)
    return ops, time.perf_counter() - t0


def stress_ng_sync_file(wd: Path, seconds: float) -> float:
    """stress-ng --sync-file 1 in wd for `seconds`: its bogo ops per second (real time)."""
    out = wd.parent / f"{wd.name}.stress-ng.yaml"
    res = subprocess.run(["stress-ng", "--sync-file", "1", "--sync-file-bytes",
                          f"{SYNC_FILE_BYTES // MiB}M", "--timeout", f"{seconds:.0f}s",
                          "--metrics-brief", "--temp-path", str(wd), "--yaml", str(out)],
                         capture_output=True, text=True, timeout=seconds + 300, cwd=wd)
    try:
        text = out.read_text() if out.exists() else ""
    finally:
        out.unlink(missing_ok=True)
    if res.returncode != 0 or " fail: " in res.stdout + res.stderr:
        raise RuntimeError(f"stress-ng failed ({res.returncode}): "
                           f"{(res.stderr or res.stdout).strip()[-500:]}")
    found = re.search(r"stressor: sync-file\s.*?bogo-ops-per-second-real-time: ([0-9.]+)",
                      text, re.S)
    if found is None:
        raise RuntimeError(f"no sync-file metrics in stress-ng's output: {text[-300:]}")
    return float(found.group(1))


# ---------------------------------------------------------------------- profiling

class Profiler:
    """py-spy record attached to a daemon for the length of a with-block."""

    def __init__(self, out_dir: Optional[Path]) -> None:
        self.out_dir = out_dir
        self.files: list[tuple[str, Path]] = []

    @contextlib.contextmanager
    def attach(self, target: Target, label: str) -> Iterator[None]:
        if self.out_dir is None or target.pid is None:
            yield
            return
        out = self.out_dir / f"{target.name}-{label}.txt"
        proc = subprocess.Popen(["py-spy", "record", "--pid", str(target.pid), "--rate", "200",
                                 "--nonblocking", "--gil", "--threads", "--format", "raw",
                                 "--output", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)       # let it attach before the timed part starts
        try:
            yield
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                stop_pid(proc.pid)
                err = b""
            if out.exists():
                self.files.append((f"{target.name} {label}", out))
            else:
                log(f"py-spy wrote nothing for {label}: {err.decode(errors='replace')[-300:]}")


def summarize_profile(path: Path, top: int = 12) -> dict:
    """Where the GIL-holding samples are, from py-spy's collapsed stacks (--gil --threads):
    share per thread kind, per function (self) and per ckptfs/pyfuse3 function
    (inclusive). pyfuse3's Cython internals show as its async_wrapper frame."""
    leaf: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        kind = frames[0].split(": ", 1)[-1]
        threads["trio worker threads" if kind.startswith("Trio thread") else kind] += n
        leaf[frames[-1]] += n
        for fr in set(frames[1:]):
            if "ckptfs/" in fr or "pyfuse3" in fr:
                inclusive[fr] += n
    def pct(c: collections.Counter) -> list:
        return [(k, round(100 * v / total, 1)) for k, v in c.most_common(top)] if total else []
    return {"samples": total, "threads": pct(threads), "self": pct(leaf),
            "inclusive_ckptfs": pct(inclusive)}


# ---------------------------------------------------------------------- workloads

class Bench:
    def __init__(self, args: argparse.Namespace, sizes: Sizes) -> None:
        self.args = args
        self.sizes = sizes
        self.root = Path(args.dir).resolve()
        self.pool = Pool(max(sizes.seq_bytes, sizes.small_bytes, sizes.files * sizes.file_bytes))
        self.targets: dict[str, Target] = {
            "raw": RawTarget(self.root),
            "bindfs": BindfsTarget(self.root),
            "minfs": MinfsTarget(self.root, Path(args.minfs), args.pmem_size or sizes.pmem_size),
            "ckptfs-close": CkptfsTarget(self.root, "close", args.pmem_size or sizes.pmem_size),
            "ckptfs-lazy": CkptfsTarget(self.root, "lazy", args.pmem_size or sizes.pmem_size),
            "ckptfs-nodedup": CkptfsTarget(self.root, "close", args.pmem_size or sizes.pmem_size,
                                           dedup=False),
            **{f"base-{sync}": CkptfsTarget(self.root, sync, args.pmem_size or sizes.pmem_size,
                                            checkout=args.ckptfs_base)
               for sync in ("close", "lazy") if args.ckptfs_base is not None},
        }
        self.samples: dict[str, dict[str, list[float]]] = {
            m: {t: [] for t in TARGETS} for m in METRICS}
        self.extra: list[dict] = []        # per-run details for --json
        self.loads: list[float] = []
        self._state_dict = None
        self.profiler = Profiler(None)
        self.recording = True

    # --- one timed phase
    @contextlib.contextmanager
    def timed(self, target: Target, label: str, into: dict) -> Iterator[None]:
        if self.recording:
            self.loads.append(loadavg())
        with self.profiler.attach(target, label):
            cpu0 = daemon_cpu_s(target.pid)
            t0 = time.perf_counter()
            yield
            wall = into[label + "_s"] = time.perf_counter() - t0
            cpu1 = daemon_cpu_s(target.pid)
        if cpu0 and cpu1:
            # The daemon's CPU use over the phase, in % of one CPU: its main thread
            # (for ckptfs the trio loop, which also reads and answers /dev/fuse) and
            # all its other threads.
            main, total = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
            into[label + "_daemon_cpu_pct"] = {"main": round(100 * main / wall),
                                               "other": round(100 * (total - main) / wall)}

    def record(self, metric: str, target: Target, value: float) -> None:
        if self.recording:
            self.samples[metric][target.name].append(value)

    def _timed_write(self, t: Target, tag: str, metric: str, name: str, total: int,
                     block: int, d: dict) -> Path:
        """Write total bytes in block-sized writes, then fsync and close, timed as metric."""
        path = t.prepare(tag) / name
        os.sync()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with self.timed(t, metric, d):
            write_stream(fd, self.pool.view, total, block)
            os.fsync(fd)
            os.close(fd)
        d.update(self._daemon_info(t, "write"))
        return path

    # --- the workloads; each returns the per-run detail dict
    def run_seq(self, t: Target, tag: str) -> dict:
        s, d = self.sizes, {}
        path = self._timed_write(t, tag, "seq_write", "seq.bin", s.seq_bytes, s.seq_block, d)
        t.remount()
        buf = bytearray(s.seq_block)
        fd = os.open(path, os.O_RDONLY)
        with self.timed(t, "cold_read", d):
            got = read_stream(fd, buf)
            os.close(fd)
        if got != s.seq_bytes:
            raise RuntimeError(f"{t.name}: cold read got {got} bytes, wrote {s.seq_bytes}")
        verify_file(path, self.pool.view, s.seq_bytes)
        d.update(self._daemon_info(t, "read"))
        t.finish()
        self.record("seq_write", t, s.seq_bytes / MB / d["seq_write_s"])
        self.record("cold_read", t, s.seq_bytes / MB / d["cold_read_s"])
        return d

    def run_write_8k(self, t: Target, tag: str) -> dict:
        s, d = self.sizes, {}
        path = self._timed_write(t, tag, "write_8k", "w8k.bin", s.small_bytes, s.small_block, d)
        verify_file(path, self.pool.view, s.small_bytes)
        t.finish()
        self.record("write_8k", t, s.small_bytes / MB / d["write_8k_s"])
        return d

    def run_randwrite_4k(self, t: Target, tag: str) -> dict:
        s, d = self.sizes, {}
        path = t.prepare(tag) / "rand.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write_stream(fd, self.pool.view, s.rand_file_bytes, MiB)
        os.fsync(fd)
        os.close(fd)
        rng = random.Random(tag)
        pages = s.rand_file_bytes // (4 * KiB)
        offsets = [rng.randrange(pages) * 4 * KiB for _ in range(s.rand_writes)]
        expect = {}
        view = self.pool.view
        fd = os.open(path, os.O_WRONLY)
        os.sync()
        with self.timed(t, "randwrite_4k", d):
            for i, off in enumerate(offsets):
                src = (i * 4 * KiB) % (len(view) - 4 * KiB)
                os.pwrite(fd, view[src:src + 4 * KiB], off)
                expect[off] = src
                if i % 16 == 15:
                    os.fsync(fd)
            os.fsync(fd)
        os.close(fd)
        d.update(self._daemon_info(t, "write"))
        with open(path, "rb") as f:
            for off, src in list(expect.items())[:256]:
                f.seek(off)
                if f.read(4 * KiB) != view[src:src + 4 * KiB]:
                    raise RuntimeError(f"{t.name}: random write at {off} reads back wrong")
        t.finish()
        self.record("randwrite_4k", t, s.rand_writes / d["randwrite_4k_s"])
        return d

    def run_small_files(self, t: Target, tag: str) -> dict:
        s, d = self.sizes, {}
        wd = t.prepare(tag) / "small"
        wd.mkdir()
        view, n, size = self.pool.view, s.files, s.file_bytes
        names = [str(wd / f"f{i:05d}") for i in range(n)]
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        os.sync()
        with self.timed(t, "small_files", d):
            for i, name in enumerate(names):
                fd = os.open(name, flags, 0o644)
                os.write(fd, view[i * size:(i + 1) * size])
                os.close(fd)
        d.update(self._daemon_info(t, "write"))
        for i in (0, n // 2, n - 1):
            with open(names[i], "rb") as f:
                if f.read() != view[i * size:(i + 1) * size]:
                    raise RuntimeError(f"{t.name}: small file {i} reads back wrong")
        if t.name == "raw":
            # What this disk allows a file system that flushes at close: the
            # same files in the plain directory, fdatasync before each close.
            fd_dir = wd.parent / "small-fdatasync"
            fd_dir.mkdir()
            os.sync()
            t0 = time.perf_counter()
            for i in range(n):
                fd = os.open(str(fd_dir / f"f{i:05d}"), flags, 0o644)
                os.write(fd, view[i * size:(i + 1) * size])
                os.fdatasync(fd)
                os.close(fd)
            d["small_files_fdatasync_s"] = time.perf_counter() - t0
            log(f"small_files: raw with fdatasync per file {n / d['small_files_fdatasync_s']:,.0f}"
                " files/s")
            self.record("small_files_fdatasync", t, n / d["small_files_fdatasync_s"])
        t.finish()
        self.record("small_files", t, n / d["small_files_s"])
        return d

    def run_sync_file(self, t: Target, tag: str) -> dict:
        s, d = self.sizes, {}
        wd = t.prepare(tag)
        os.sync()
        with self.timed(t, "sync_file", d):
            ops, elapsed = sync_file_ops(wd, s.sync_file_s, random.Random(tag))
        d["sync_file_ops"] = ops
        self.record("sync_file", t, ops / elapsed)
        if not isinstance(t, MinfsTarget):
            with self.timed(t, "stress_sync_file", d):
                ops_s = stress_ng_sync_file(wd, s.sync_file_s)
            d["stress_sync_file_ops_s"] = ops_s
            self.record("stress_sync_file", t, ops_s)
        t.finish()
        return d

    def state_dict(self):
        if self._state_dict is None:
            import torch
            g = torch.Generator().manual_seed(0)
            per = self.sizes.torch_bytes // self.sizes.torch_tensors // 4
            cols = 1024
            sd = {}
            for i in range(self.sizes.torch_tensors):
                rows = max(1, (per + (i % 5 - 2) * 4096) // cols)   # a little variety
                sd[f"layers.{i}.weight"] = torch.randn(rows, cols, generator=g)
            self._state_dict = sd
        return self._state_dict

    def run_shards8(self, t: Target, tag: str) -> dict:
        s, d = self.sizes, {}
        wd = t.prepare(tag)
        if not isinstance(t, MinfsTarget):      # minfs has no directories
            wd = wd / "step-1000"
            wd.mkdir()
        paths = [wd / f"shard{i}.bin" for i in range(8)]
        for i, path in enumerate(paths):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            # Each shard its own bytes: 8 slices of the pool, none a copy of another.
            write_stream(fd, self.pool.view[i * s.shard_bytes:], s.shard_bytes, MiB)
            os.fsync(fd)
            os.close(fd)
        t.remount()
        with self.timed(t, "shards8_read", d):
            procs = [subprocess.Popen([sys.executable, "-c", SHARD_READER, str(p)],
                                      stdout=subprocess.PIPE) for p in paths]
            got = [int(proc.communicate()[0]) for proc in procs]
        if any(g != s.shard_bytes for g in got) or any(p.returncode for p in procs):
            raise RuntimeError(f"{t.name}: shard readers got {got}")
        for i, path in enumerate(paths[:2]):
            verify_file(path, self.pool.view[i * s.shard_bytes:], s.shard_bytes)
        d.update(self._daemon_info(t, "read"))
        t.finish()
        self.record("shards8_read", t, 8 * s.shard_bytes / MB / d["shards8_read_s"])
        return d

    def run_cold_tier(self, t: Target, tag: str) -> dict:
        s, d = self.sizes, {}
        path = t.prepare(tag) / "tiered.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write_stream(fd, self.pool.view, s.tier_bytes, MiB)
        os.fsync(fd)
        os.close(fd)
        buf = bytearray(MiB)
        for label in ("tier_hot_read", "tier_cold_read"):
            if label == "tier_cold_read":
                t.mount.tier_now("--all", timeout_s=1200)
            t.remount()
            fd = os.open(path, os.O_RDONLY)
            with self.timed(t, label, d):
                got = read_stream(fd, buf)
            os.close(fd)
            if got != s.tier_bytes:
                raise RuntimeError(f"{t.name}: {label} got {got} bytes")
            d.update(self._daemon_info(t, label))      # each read its own counters
            d[label + "_cold_fetches"] = t.daemon_stats().get("cold_fetches")
        verify_file(path, self.pool.view, s.tier_bytes)
        t.finish()
        for label in ("tier_hot_read", "tier_cold_read"):
            self.record(label, t, s.tier_bytes / MB / d[label + "_s"])
        return d

    def run_torch(self, t: Target, tag: str) -> dict:
        import torch
        sd, d = self.state_dict(), {}
        nbytes = sum(v.numel() * v.element_size() for v in sd.values())
        d["state_dict_bytes"] = nbytes
        path = t.prepare(tag) / "model.pt"
        os.sync()
        with self.timed(t, "torch_save", d):
            torch.save(sd, path)
        # For information only: what making it durable costs on top (ckptfs
        # sync=close is durable at close already, so this is near zero there).
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        d["torch_fsync_after_save_s"] = time.perf_counter() - t0
        d.update(self._daemon_info(t, "write"))
        t.remount()
        with self.timed(t, "torch_load", d):
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        bad = [k for k in sd if not torch.equal(sd[k], loaded[k])]
        del loaded
        if bad:
            raise RuntimeError(f"{t.name}: torch.load gave different tensors: {bad[:3]}")
        d.update(self._daemon_info(t, "read"))
        t.finish()
        self.record("torch_save", t, nbytes / MB / d["torch_save_s"])
        self.record("torch_load", t, nbytes / MB / d["torch_load_s"])
        return d

    def _daemon_info(self, t: Target, phase: str) -> dict:
        if not isinstance(t, CkptfsTarget):
            return {}
        st = t.daemon_stats()
        return {f"{phase}_fuse_requests": st.get("fuse_requests"),
                f"{phase}_getxattr_answered_in_c": st.get("fuse_getxattr_answered_in_c"),
                f"{phase}_read_answered_in_c": st.get("fuse_read_answered_in_c"),
                f"{phase}_read_passed_on": st.get("fuse_read_passed_on"),
                f"{phase}_cold_read_answered_in_c": st.get("fuse_cold_read_answered_in_c"),
                f"{phase}_commits": st.get("commits"),
                f"{phase}_commit_ms_avg": round(1000 * st.get("commit_seconds_avg", 0), 3),
                f"{phase}_daemon_hwm_mb": round((proc_status_kb(t.pid, "VmHWM") or 0) * KiB / MB, 1)}

    # --- orchestration
    def run_one(self, workload: str, t: Target, tag: str) -> dict:
        fn: Callable[[Target, str], dict] = getattr(self, f"run_{workload}")
        try:
            d = fn(t, tag)
        finally:
            if t.workdir is not None:       # failed half-way: make sure it is gone
                try:
                    t.finish()
                except Exception:
                    t.cleanup()
        os.sync()          # the deletes and their discards settle before the next run
        return d

    def run_reps(self) -> None:
        reps, targets = self.args.reps, [t for t in TARGETS if t in self.args.targets]
        for rep in range(1, reps + 1):
            for workload in self.args.workloads:
                k = (rep - 1) % len(targets)
                for name in targets[k:] + targets[:k]:
                    t = self.targets[name]
                    tag = f"r{rep}-{workload}"
                    why = getattr(t, "cannot", {}).get(workload)
                    if why:
                        if rep == 1:
                            log(f"{workload}: {name} skipped, it {why}")
                        continue
                    d = self.run_one(workload, t, tag)
                    shown = ", ".join(f"{k2}={v:.2f}" for k2, v in d.items()
                                      if k2.endswith("_s"))
                    shown += "".join(f", {k2[:-16]} cpu main/other {v['main']}/{v['other']}%"
                                     for k2, v in d.items() if k2.endswith("_daemon_cpu_pct"))
                    log(f"rep {rep} {workload:<11} {name:<13} {shown}")
                    self.extra.append({"rep": rep, "workload": workload, "target": name, **d})

    def run_rss(self) -> dict:
        """Peak daemon RSS while writing rss_bytes sequentially, per ckptfs mode."""
        out = {}
        s = self.sizes
        for name in CKPTFS_TARGETS:
            if name not in self.args.targets:
                continue
            t = self.targets[name]
            wd = t.prepare("rss")
            pid = t.pid
            before = proc_status_kb(pid, "VmHWM") or 0
            peak_rss = [0]
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    peak_rss[0] = max(peak_rss[0], proc_status_kb(pid, "VmRSS") or 0)
                    stop.wait(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            buf = np.empty(s.seq_block // 8, dtype=np.uint64)
            t0 = time.perf_counter()
            try:
                fd = os.open(wd / "big.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                for i in range(s.rss_bytes // s.seq_block):
                    write_stream(fd, self.pool.block(i, s.seq_block, buf), s.seq_block,
                                 s.seq_block)
                os.fsync(fd)
                os.close(fd)
                elapsed = time.perf_counter() - t0
                hwm = proc_status_kb(pid, "VmHWM") or 0
            finally:
                stop.set()
                sampler.join()
                try:
                    t.finish()
                except Exception:
                    t.cleanup()
                    raise
            out[name] = {"bytes": s.rss_bytes, "MBps": round(s.rss_bytes / MB / elapsed, 1),
                         "vmhwm_before_mb": round(before * KiB / MB, 1),
                         "vmhwm_mb": round(hwm * KiB / MB, 1),
                         "max_vmrss_sampled_mb": round(peak_rss[0] * KiB / MB, 1),
                         "pass": hwm * KiB / MB < RSS_LIMIT_MB}
            log(f"rss {name}: VmHWM {out[name]['vmhwm_mb']} MB after writing "
                f"{s.rss_bytes / GiB:.0f} GiB at {out[name]['MBps']} MB/s")
        return out

    def run_profile(self, out_dir: Path) -> dict:
        """One more pass of the ckptfs workloads under py-spy; its timings are not kept."""
        out_dir.mkdir(parents=True, exist_ok=True)
        self.profiler = Profiler(out_dir)
        self.recording = False
        try:
            for workload in self.args.workloads:
                for name in CKPTFS_TARGETS:
                    if name in self.args.targets:
                        self.run_one(workload, self.targets[name], f"prof-{workload}")
                        log(f"profiled {workload} on {name}")
        finally:
            files, self.profiler, self.recording = self.profiler.files, Profiler(None), True
        return {label: {"file": str(p), **summarize_profile(p)} for label, p in files}

    def cleanup(self) -> None:
        for t in self.targets.values():
            try:
                t.cleanup()
            except Exception as e:  # keep going: every mount must go
                log(f"cleanup of {t.name} failed: {e}")


# ------------------------------------------------------------------------ report

def median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarize(samples: dict[str, dict[str, list[float]]]) -> dict:
    table = {}
    for metric, (unit, targets) in METRICS.items():
        med = {t: median(v) for t, v in samples[metric].items()}
        if not any(v is not None for v in med.values()):
            continue
        row = {"unit": unit, "median": med,
               "reps": samples[metric], "ratios": {}, "checks": {}}
        for ck in CKPTFS_TARGETS:
            for base in BASELINES:
                if med.get(ck) and med.get(base):
                    row["ratios"][f"{ck}/{base}"] = med[ck] / med[base]
            for base, minimum in targets:
                r = row["ratios"].get(f"{ck}/{base}")
                if r is not None:
                    row["checks"][f"{ck}/{base}"] = {"min": minimum, "ratio": round(r, 3),
                                                     "pass": r >= minimum}
        table[metric] = row
    return table


def cpu_summary(runs: list[dict]) -> dict:
    """phase -> target -> median daemon CPU % of one core (main thread, other threads)."""
    acc: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: ([], [])))
    for r in runs:
        for k, v in r.items():
            if k.endswith("_daemon_cpu_pct"):
                main, other = acc[k[:-len("_daemon_cpu_pct")]][r["target"]]
                main.append(v["main"])
                other.append(v["other"])
    return {phase: {t: {"main": median(m), "other": median(o)} for t, (m, o) in per.items()}
            for phase, per in acc.items()}


def peak_rss_summary(runs: list[dict]) -> dict:
    """ckptfs target -> its daemon's largest VmHWM over every timed phase of
    every workload (the bar is for all of them, not only the RSS step's write)."""
    peaks: dict = {}
    for r in runs:
        if r.get("target") not in CKPTFS_TARGETS:
            continue
        for k, v in r.items():
            if k.endswith("_daemon_hwm_mb") and v > peaks.get(r["target"], {}).get("mb", 0):
                peaks[r["target"]] = {"mb": v, "where": f"{r['workload']} {k[:-len('_daemon_hwm_mb')]}",
                                      "pass": v < RSS_LIMIT_MB}
    return peaks


def render_cpu(cpu: dict) -> str:
    names = [t for t in TARGETS if t != "raw"]
    lines = ["daemon CPU during the timed phase, % of one core, median (main thread / others):",
             "  " + "phase".ljust(12) + "".join(n.rjust(16) for n in names)]
    for phase, per in cpu.items():
        cells = [f"{per[n]['main']:.0f} / {per[n]['other']:.0f}" if n in per else "-"
                 for n in names]
        lines.append("  " + phase.ljust(12) + "".join(c.rjust(16) for c in cells))
    return "\n".join(lines)


def fmt(v: Optional[float], nd: int = 0) -> str:
    if v is None:
        return "-"
    if nd == 0 and 0 < abs(v) < 10:
        nd = 2                      # ops/s of slow targets
    return f"{v:,.{nd}f}"


def render_table(table: dict, rss: dict) -> str:
    cols = ["metric", "unit", *TARGETS] + [f"{ck[7:]}/{base}" for ck in CKPTFS_TARGETS
                                            for base in BASELINES]
    rows = [cols]
    for metric, row in table.items():
        r = [metric, row["unit"]] + [fmt(row["median"].get(t)) for t in TARGETS]
        for ck in CKPTFS_TARGETS:
            for base in BASELINES:
                ratio = row["ratios"].get(f"{ck}/{base}")
                check = row["checks"].get(f"{ck}/{base}")
                cell = fmt(ratio, 2)
                if check:
                    cell += f" {'PASS' if check['pass'] else 'MISS'}(>={check['min']})"
                r.append(cell)
        rows.append(r)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = []
    for n, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("every rep (same unit):")
    for metric, row in table.items():
        lines.append(f"  {metric:<16} " + "  ".join(
            f"{t} [{', '.join(fmt(x) for x in row['reps'][t])}]" for t in TARGETS
            if row["reps"].get(t)))
    for metric in ("seq_write", "torch_save"):
        row = table.get(metric)
        if row and row["median"].get("ckptfs-close") and row["median"].get("ckptfs-nodedup"):
            r = row["median"]["ckptfs-close"] / row["median"]["ckptfs-nodedup"]
            lines.append(f"{metric} dedup on / off (sync=close): {r:.2f} "
                         f"{'PASS' if r >= 0.9 else 'MISS'} (>= 0.9)")
    hot, cold = table.get("tier_hot_read"), table.get("tier_cold_read")
    if hot and cold:
        for ck in CKPTFS_TARGETS:
            if hot["median"].get(ck) and cold["median"].get(ck):
                r = cold["median"][ck] / hot["median"][ck]
                lines.append(f"cold-tier restore / hot read {ck}: {r:.2f} "
                             f"{'PASS' if r >= 0.9 else 'MISS'} (>= 0.9)")
    for name, v in rss.items():
        lines.append(f"daemon peak RSS {name}: VmHWM {v['vmhwm_mb']:.0f} MB while writing "
                     f"{v['bytes'] / GiB:.0f} GiB ({v['MBps']:.0f} MB/s) -> "
                     f"{'PASS' if v['pass'] else 'MISS'} (< {RSS_LIMIT_MB:.0f} MB)")
    return "\n".join(lines)


def machine_info(root: Path) -> dict:
    info = {"nproc": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version()}
    with open("/proc/meminfo") as f:
        info["mem_total_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    with contextlib.suppress(Exception):
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                           if line.startswith("model name"))
    with contextlib.suppress(Exception):
        info["df"] = subprocess.run(["df", "-hT", str(root)], capture_output=True,
                                    text=True).stdout.strip().splitlines()[-1]
        src = subprocess.run(["findmnt", "-no", "SOURCE", "-T", str(root)], capture_output=True,
                             text=True).stdout.strip()
        info["disk"] = subprocess.run(["lsblk", "-dno", "NAME,ROTA,SIZE,MODEL", src],
                                      capture_output=True, text=True).stdout.strip()
    with contextlib.suppress(Exception):
        import torch
        info["torch"] = torch.__version__
    with contextlib.suppress(Exception):
        info["bindfs"] = subprocess.run(["bindfs", "--version"], capture_output=True,
                                        text=True).stdout.strip()
    return info


def memory_pool_bytes(sizes: Sizes, args: argparse.Namespace) -> int:
    """What a rep can have in use at once (a file cached above and below a FUSE mount,
    a ckptfs log mapped beside it), capped at 60 % of the memory available now."""
    largest = max(sizes.seq_bytes, 0 if args.no_rss else sizes.rss_bytes)
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * KiB for line in f
                         if line.startswith("MemAvailable:"))
    return min(3 * largest + 4 * GiB, int(0.6 * available)) // GiB * GiB


def disk_warm_bytes(sizes: Sizes, args: argparse.Namespace) -> int:
    """What a rep can have on disk at once: a ckptfs log and the files beside it."""
    largest = max(sizes.seq_bytes, 0 if args.no_rss else sizes.rss_bytes)
    return parse_size(args.pmem_size or sizes.pmem_size) + 2 * largest


# -------------------------------------------------------------------------- main

def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="scratch directory on the disk to measure")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3, --quick 1)")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--json", help="write every sample and the summary here")
    p.add_argument("--pmem-size", help="ckptfs log size (default 6G, --quick 2G)")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                   help=f"comma-separated subset of {','.join(TARGETS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS step")
    p.add_argument("--no-memory-hold", action="store_true",
                   help="let the VM's balloon take freed pages back during the run (the "
                        "default holds them, so no target pays for what the one before freed)")
    p.add_argument("--no-discard-hold", action="store_true",
                   help="leave -o discard on for --dir's file system during the run (the "
                        "default remounts it nodiscard, so no target writes into blocks the "
                        "host let go of when the one before deleted its files)")
    p.add_argument("--ckptfs-base", type=Path, metavar="DIR",
                   help="another checkout (its native modules built): adds the targets "
                        "base-close and base-lazy, mounted with its mount.ckptfs")
    p.add_argument("--minfs", default=str(MINFS),
                   help="the bare pyfuse3 daemon for the minfs target (default %(default)s)")
    p.add_argument("--profile", metavar="DIR",
                   help="extra untimed pass of the ckptfs workloads under py-spy; "
                        "collapsed stacks go to DIR")
    args = p.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 3)
    args.targets = [t for t in args.targets.split(",") if t]
    args.workloads = [w for w in args.workloads.split(",") if w]
    if args.ckptfs_base is not None:
        args.ckptfs_base = args.ckptfs_base.resolve()
        if not (args.ckptfs_base / "mount.ckptfs").is_file():
            p.error(f"--ckptfs-base {args.ckptfs_base}: no mount.ckptfs there")
        if "--targets" not in " ".join(argv if argv is not None else sys.argv):
            args.targets += ["base-close", "base-lazy"]
    for t in args.targets:
        if t not in TARGETS:
            p.error(f"unknown target {t}")
        if t.startswith("base-") and args.ckptfs_base is None:
            p.error(f"target {t} needs --ckptfs-base DIR")
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_foundation: needs root (mounts, drop_caches)", file=sys.stderr)
        return 2
    sizes = QUICK if args.quick else FULL
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    for path in sorted(mounted_paths()):        # leftovers of an interrupted run of ours
        if path.startswith(str(root) + "/"):
            log(f"unmounting leftover {path}")
            force_unmount(Path(path))
    # The peak-RSS step writes the largest file; --no-rss skips it.
    need = 3 * max(sizes.seq_bytes, 0 if args.no_rss else sizes.rss_bytes) + 8 * GiB
    if shutil.disk_usage(root).free < need:
        print(f"bench_foundation: need {need / GiB:.0f} GiB free in {root}", file=sys.stderr)
        return 2
    if "torch" in args.workloads:
        import torch  # noqa: F401  (fail now, not after an hour)
    if "minfs" in args.targets and not Path(args.minfs).is_file():
        print(f"bench_foundation: no minfs at {args.minfs} (--minfs PATH, or leave out the "
              "minfs target)", file=sys.stderr)
        return 2
    if "sync_file" in args.workloads and shutil.which("stress-ng") is None:
        print("bench_foundation: the sync_file workload needs stress-ng "
              "(tools/setup-debian.sh --with-bench)", file=sys.stderr)
        return 2

    # SIGTERM/SIGHUP become exceptions so that the finally below unmounts.
    def _raise(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _raise)
    signal.signal(signal.SIGHUP, _raise)

    started = time.time()
    log(f"sizes: {asdict(sizes)}; reps {args.reps}; targets {args.targets}; "
        f"workloads {args.workloads}")
    bench = Bench(args, sizes)
    rss: dict = {}
    profile: dict = {}
    held = contextlib.nullcontext(False) if args.no_memory_hold \
        else freed_memory_kept(memory_pool_bytes(sizes, args))
    blocks_held = contextlib.nullcontext(False) if args.no_discard_hold \
        else freed_blocks_kept(root, disk_warm_bytes(sizes, args))
    try:
        with held as memory_held, blocks_held as discards_held:
            bench.run_reps()
            if not args.no_rss:
                rss = bench.run_rss()
            if args.profile:
                profile = bench.run_profile(Path(args.profile).resolve())
    finally:
        bench.cleanup()
    table = summarize(bench.samples)
    print()
    print(render_table(table, rss))
    print(f"\nmedian of {args.reps} rep(s); MB = 10^6 bytes; load average during timed "
          f"phases: mean {statistics.mean(bench.loads):.2f}, max {max(bench.loads):.2f} "
          f"(on {os.cpu_count()} CPUs); total {time.time() - started:.0f} s")
    cpu = cpu_summary(bench.extra)
    if cpu:
        print("\n" + render_cpu(cpu))
    peak_rss = peak_rss_summary(bench.extra)
    for name, v in peak_rss.items():
        print(f"daemon peak RSS {name} over every workload: VmHWM {v['mb']:.0f} MB "
              f"({v['where']}) -> {'PASS' if v['pass'] else 'MISS'} (< {RSS_LIMIT_MB:.0f} MB)")
    for label, prof in profile.items():
        print(f"\nprofile {label} (py-spy --gil): {prof['samples']} samples ({prof['file']})")
        print("  by thread: " + ", ".join(f"{k} {v}%" for k, v in prof["threads"]))
        for name, share in prof["self"][:8]:
            print(f"  self {share:5.1f}%  {name}")
        for name, share in prof["inclusive_ckptfs"][:8]:
            print(f"  incl {share:5.1f}%  {name}")
    if args.json:
        doc = {"command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
               "machine": dict(machine_info(root), freed_memory_held=memory_held,
                            discards_held=discards_held),
               "sizes": asdict(sizes), "reps": args.reps,
               "summary": table, "daemon_cpu": cpu, "rss": rss, "peak_rss": peak_rss,
               "runs": bench.extra, "profile": profile,
               "loadavg": {"mean": statistics.mean(bench.loads), "max": max(bench.loads),
                           "all": bench.loads},
               "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
        Path(args.json).write_text(json.dumps(doc, indent=2))
        log(f"wrote {args.json}")
    misses = [f"{m} {k}" for m, row in table.items() for k, c in row["checks"].items()
              if not c["pass"]] + [f"rss {k}" for k, v in rss.items() if not v["pass"]] \
        + [f"peak rss {k}" for k, v in peak_rss.items() if not v["pass"]]
    if misses:
        print("targets missed: " + "; ".join(misses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
