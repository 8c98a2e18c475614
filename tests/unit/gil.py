"""Check that a long native call lets other Python threads run."""

from __future__ import annotations

import threading
import time
from array import array
from typing import Callable

# The call must keep its thread busy this long for the answer to be clear.
MIN_CALL_CPU_S = 0.02
# This thread's steps count only while the call's thread is in the first half
# of the call (by its own CPU time), and past its first millisecond: where a
# held GIL can be handed over is the Python around the native work, before it
# (the lambda, a wrapper's allocations: microseconds) and after it (copying or
# freeing a large result, which can take a large part of a short call).
EDGE_CPU_S = 0.001
# A step of this thread longer than this was a wait for the GIL, not Python.
MAX_STEP_CPU_S = 0.002


def assert_releases_gil(make_call: Callable[[int], Callable[[], object]],
                        max_scale: int = 16) -> None:
    """Check make_call(scale)'s call, growing its input until the call is long enough.

    make_call(scale) returns one native call over about scale times a base amount
    of work. A fixed size that takes 25 ms on one machine took 18.6 ms on a faster
    one (CI), too short to tell; so the scale doubles from 1 until the call uses
    MIN_CALL_CPU_S of CPU, up to max_scale.
    """
    scale = 1
    while _check_call(make_call(scale), final=scale * 2 > max_scale) is None:
        scale *= 2


def _check_call(call: Callable[[], object], final: bool) -> float | None:
    """Run call in a thread while this thread keeps running Python; compare CPU times.

    Returns the call's CPU time, or None when it was too short to tell and
    final is false (the caller gives it more work).

    While a native call holds the GIL no other thread runs Python, so this
    thread makes no step while the call's thread is inside it. While the call
    has released the GIL, both threads are runnable and the kernel shares the
    CPUs between them, on an idle machine as on a loaded one: this thread gets
    about as much CPU time during the call as the call itself. Each step of this
    thread reads both threads' CPU clocks; a step counts when the call's thread
    was inside the first half of the call (by its own CPU time) both before and
    after it. Wall time cannot tell the two cases apart on a busy machine, where
    this thread may wait for a CPU longer than the call takes.

    call must be one native call: a Python loop of calls hands the GIL over
    between them, so calls that each hold it would pass.

    Passes when this thread ran Python for at least a twentieth of the CPU time
    the call used in that half (measured: 0.2 to 2.9 times as much, median 1.7,
    at load averages of 11 to 12 on 2 CPUs); calls that hold the GIL (bytes.count,
    bytes.translate of 128 MiB) gave it exactly none.
    """
    window: list[float] = []     # the call's thread CPU time before and after the call

    def worker() -> None:
        window.append(time.thread_time())
        result = call()
        window.append(time.thread_time())
        del result               # freeing a large result is not the call

    mine, theirs = array("d"), array("d")      # per step: this thread's, the call's CPU time
    t = threading.Thread(target=worker)
    t.start()
    try:
        clock = time.pthread_getcpuclockid(t.ident)
    except ProcessLookupError:   # the thread ended before this one could watch it
        t.join()
        assert not final, "the call ended before it could be watched: too short, or it held the GIL"
        return None
    while t.is_alive():
        try:
            their_cpu = time.clock_gettime(clock)
        except OSError:          # the call's thread has just exited
            break
        mine.append(time.thread_time())
        theirs.append(their_cpu)
    t.join()
    start, end = window
    call_cpu = end - start
    if call_cpu < MIN_CALL_CPU_S and not final:
        return None
    assert call_cpu >= MIN_CALL_CPU_S, \
        f"the call took {call_cpu * 1000:.1f} ms of CPU: too short to tell; give it more data"
    lo, hi = start + EDGE_CPU_S, start + call_cpu / 2
    other_cpu = sum(b - a for a, b, x, y in zip(mine, mine[1:], theirs, theirs[1:])
                    if lo < x and y < hi and b - a < MAX_STEP_CPU_S)
    assert other_cpu >= 0.05 * (hi - lo), \
        (f"another thread ran {other_cpu * 1000:.1f} ms of Python while the call used "
         f"{(hi - lo) * 1000:.1f} ms of CPU (the first half of the call): the call "
         f"holds the GIL")
    return call_cpu
