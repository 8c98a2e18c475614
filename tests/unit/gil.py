"""Check that a long native call lets other Python threads run."""

from __future__ import annotations

import threading
import time
from typing import Callable


def assert_releases_gil(call: Callable[[], object]) -> None:
    """Run call in a thread while this thread keeps taking timestamps.

    If the call held the GIL, the timestamps would show one gap as long as the
    call itself.
    """
    window: list[float] = []

    def worker() -> None:
        window.append(time.perf_counter())
        call()
        window.append(time.perf_counter())

    stamps: list[float] = []
    t = threading.Thread(target=worker)
    t.start()
    while t.is_alive():
        stamps.append(time.perf_counter())
    t.join()
    start, end = window
    inside = [start] + [s for s in stamps if start < s < end] + [end]
    longest_gap = max(b - a for a, b in zip(inside, inside[1:]))
    assert longest_gap < 0.5 * (end - start) or end - start < 0.01
