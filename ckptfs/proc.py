"""Waiting for and stopping processes: the daemon, for `ckptfs umount`, tests and tools."""

from __future__ import annotations

import os
import signal
import time


def process_exited(pid: int) -> bool:
    """Gone, or a zombie: it has exited even if its parent has not reaped it yet."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_exit(pid: int, timeout_s: float, poll_s: float = 0.02) -> bool:
    """True once pid has exited, False if it is still running after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process_exited(pid):
            return True
        time.sleep(poll_s)
    return process_exited(pid)


def stop_process(pid: int, term_wait_s: float = 10.0, kill_wait_s: float = 5.0) -> None:
    """SIGTERM, and SIGKILL if it is still there after term_wait_s."""
    for sig, wait_s in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, kill_wait_s)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if wait_exit(pid, wait_s, poll_s=0.05):
            return
