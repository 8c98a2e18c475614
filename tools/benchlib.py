"""What the benchmark scripts in tools/ share, so none imports another for it:
progress lines, the load average, running commands (a whole process group, when
a command spawns its own children), dropping the page cache, stopping a process
the script started. Mounting ckptfs is tools/mounting.py's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from mounting import REPO

from ckptfs.proc import stop_process

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
