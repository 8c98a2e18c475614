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
def _hold_state():
    """The holders' record, read and written under an exclusive lock."""
    with open(HOLD_STATE.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = json.loads(HOLD_STATE.read_text())
        except (OSError, ValueError):
            state = {}
        state["pids"] = [p for p in state.get("pids", []) if not process_exited(p)]
        yield state
        if state["pids"]:
            HOLD_STATE.write_text(json.dumps(state))
        else:
            HOLD_STATE.unlink(missing_ok=True)


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
