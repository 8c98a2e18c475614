"""What the benchmark scripts in tools/ share, so none imports another for it:
progress lines, the load average, running commands (a whole process group, when
a command spawns its own children), dropping the page cache, stopping a process
the script started. Mounting ckptfs is tools/mounting.py's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from mounting import REPO

from ckptfs.proc import process_exited, stop_process

# Child processes find this checkout's ckptfs (and tools/) whatever their cwd.
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def drop_caches() -> None:
    """Write back and drop the page cache (needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# A kernel whose virtio balloon reports free pages hands every page freed here back to
# the host; touching one again costs a host page fault. On this workplace's VMs 3 GiB of
# fresh anonymous memory is touched at 530-800 MB/s where pages freed a moment before go
# at 2,800 MB/s, so without a hold a target's figures depend on how much memory the
# target before it freed (much of earlier sessions' noise; part of session 10's "slot").
PAGE_REPORTING_MIN_FREE_MS = Path("/sys/module/page_reporting/parameters/min_free_ms")
HOLD_MS = 300_000     # five minutes: this kernel refuses 600,000 and more
# Who holds the knob, so that runs at once (several engineers' benches) put back the
# value from before the first of them, when the last one ends, and a run killed while
# holding it does not leave its held value to be taken for the original: {"original":
# "0", "pids": [...]}, under an flock. /run is emptied at boot, as the knob is reset.
HOLD_STATE = Path("/run/ckptfs-bench-memory-hold.json")


@contextlib.contextmanager
def _hold_state(record: Path = HOLD_STATE):
    """The holders' record, read and written under an exclusive lock."""
    with open(record.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = json.loads(record.read_text())
        except (OSError, ValueError):
            state = {}
        state["pids"] = [p for p in state.get("pids", []) if not process_exited(p)]
        yield state
        if state["pids"]:
            record.write_text(json.dumps(state))
        else:
            record.unlink(missing_ok=True)


@contextlib.contextmanager
def freed_memory_kept(pool_bytes: int):
    """While in the block, keep freed pages in the guest (a page is reported only
    after five minutes free; a run reuses its pages much sooner) and start from a
    pool of pool_bytes touched once, so that every target of a run gets pages of
    the same kind. A no-op (logged) where the kernel has no such knob. The knob's
    value from before the first of the runs holding it at once is put back when
    the last of them ends. May block for the touch: ~2 s per GiB of memory the host
    had taken back."""
    try:
        with _hold_state() as state:
            if not state["pids"]:
                # No live holder: the knob is the system's, or a killed run's held
                # value whose original the record still has.
                state["original"] = state.get("original") \
                    or PAGE_REPORTING_MIN_FREE_MS.read_text().strip()
            PAGE_REPORTING_MIN_FREE_MS.write_text(str(HOLD_MS))
            state["pids"].append(os.getpid())
            original = state["original"]
    except OSError as e:
        log(f"free page reporting: no knob to hold freed memory ({e.strerror}); "
            "figures may depend on what ran before each target")
        yield False
        return
    try:
        t0 = time.monotonic()
        pool = mmap.mmap(-1, pool_bytes)
        ones = b"\1" * (64 << 20)
        for _ in range(0, pool_bytes, len(ones)):
            pool.write(ones[:pool_bytes - pool.tell()])
        pool.close()
        log(f"free page reporting held ({PAGE_REPORTING_MIN_FREE_MS} {original} -> {HOLD_MS} "
            f"ms); {pool_bytes >> 30} GiB touched in {time.monotonic() - t0:.1f} s")
        yield True
    finally:
        with _hold_state() as state:
            state["pids"] = [p for p in state["pids"] if p != os.getpid()]
            if not state["pids"]:
                PAGE_REPORTING_MIN_FREE_MS.write_text(state.get("original") or original)


# The same for the disk. A file system mounted with -o discard tells the host about every
# block a delete frees; on this workplace's VMs the host then lets go of it, and the next
# write into it goes at ~450-500 MB/s where a block written before takes 1,300-1,600
# (2 GiB O_DIRECT writes, session 12). Each target deletes gigabytes when it ends (its
# files, a ckptfs log, minfs's store), and ext4 hands the freed blocks to whoever
# writes next: the rest of the "slot". The hold remounts the file system nodiscard
# for the run, so freed blocks stay the host's, after a first write over the space a
# rep uses.
DISCARD_HOLD_STATE = "/run/ckptfs-bench-discard-hold-{dev}.json"


def _mount_of(path: Path) -> tuple[str, list[str]]:
    """The mount point holding path and its options (findmnt, util-linux)."""
    out = subprocess.run(["findmnt", "-n", "-o", "TARGET,OPTIONS", "-T", str(path)],
                         check=True, capture_output=True, text=True).stdout.split()
    return out[0], out[1].split(",")


@contextlib.contextmanager
def freed_blocks_kept(scratch: Path, warm_bytes: int):
    """While in the block, the file system holding scratch (a directory) keeps the
    blocks deletes free instead of discarding them to the host, and warm_bytes were
    written once in scratch first so that the space a rep reuses is of one kind. A
    no-op (logged) where the file system is not mounted with discard. -o discard is
    put back when the last of the runs holding it at once ends; the blocks freed
    meanwhile stay allocated on the host until something trims them (`fstrim MOUNT`).
    May block: writes and deletes warm_bytes (~2 s per GiB the host let go of)."""
    mount_point, options = _mount_of(scratch)
    record = Path(DISCARD_HOLD_STATE.format(dev=os.stat(scratch).st_dev))
    with _hold_state(record) as state:
        if not state["pids"]:
            # No live holder: the options are the system's, or a killed run left
            # nodiscard, which the record still says was discard.
            state["discard"] = state.get("discard") or "discard" in options
            if state["discard"]:
                subprocess.run(["mount", "-o", "remount,nodiscard", mount_point], check=True)
        if state["discard"]:
            state["pids"].append(os.getpid())
    if not state["discard"]:
        log(f"{mount_point} is not mounted with discard: no discards to hold")
        yield False
        return
    try:
        t0 = time.monotonic()
        warm = scratch / f".bench-warm-{os.getpid()}"
        chunk = os.urandom(64 << 20)        # random: a host that skips zeros allocates nothing
        fd = os.open(warm, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for off in range(0, warm_bytes, len(chunk)):
                os.write(fd, chunk[:warm_bytes - off])
            os.fsync(fd)
        finally:
            os.close(fd)
            warm.unlink()
        os.sync()
        log(f"discards held ({mount_point} remounted nodiscard for the run); "
            f"{warm_bytes >> 30} GiB written first in {time.monotonic() - t0:.1f} s")
        yield True
    finally:
        with _hold_state(record) as state:
            state["pids"] = [p for p in state["pids"] if p != os.getpid()]
            if not state["pids"]:
                subprocess.run(["mount", "-o", "remount,discard", mount_point], check=True)


def stop_pid(pid: Optional[int]) -> None:
    """SIGTERM, then SIGKILL: only for processes this script started."""
    if pid is not None:
        stop_process(pid)


def run(cmd: list, timeout: float, cwd: Optional[Path] = None,
        env: Optional[dict] = None, check: bool = True) -> subprocess.CompletedProcess:
    """cmd with its output captured; check: a non-zero exit is a RuntimeError
    with the end of what it printed."""
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         cwd=cwd or REPO, env=env or ENV)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {res.returncode}: "
                           f"{(res.stderr or res.stdout).strip()[-2000:]}")
    return res


def run_group(cmd: list, timeout: float) -> str:
    """Run cmd in a session of its own (a generator spawning DCP ranks); on a
    timeout kill that whole process group, not only the child."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=ENV, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {proc.returncode}: "
                           f"{out.strip()[-3000:]}")
    return out
