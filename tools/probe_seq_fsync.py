"""Sequential write + fsync, dedup on against off (seq11, session 11): per rep, one daemon
of this checkout per mode (sync=close, pmem_size=6G, SRC = mount point), 2 GiB of
bench_foundation's kind of data (a 16 MiB random base XORed per 16 MiB) in 1 MiB writes,
then fsync; the write and the fsync timed apart, and every daemon thread's CPU
(utime+stime from /proc/PID/task/*/stat) before, between and after.

    cd CHECKOUT && python tools/probe_seq_fsync.py REPS [on|off]
    PYSPY=/path/prefix  also records the daemon with py-spy (--idle --threads
                        --nonblocking, 250 Hz, raw) for the whole rep; py-spy from
                        $PY_SPY or PATH
    PERF=/path/prefix   also records the daemon with `perf record -F 999 -g` over the
                        write phase only (stopped before the fsync)
    PERTHREAD=1         also prints each daemon thread's CPU (ms/MiB, by name and id)
                        for the write and for the fsync
    STATS=1             also prints the fast path's WRITE counters (`ckptfs stat`:
                        answered in C, passed on) over the rep
    SLEEP=S             waits S seconds between the last write and the fsync
    PROBE_DIR=D         scratch directory (default /var/tmp/probe-seq-fsync): D/p-on,
                        D/p-off, removed after each run
"""
import glob
import os
import shutil
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mounting import Mount  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PY_SPY = os.environ.get("PY_SPY") or shutil.which("py-spy") or "py-spy"
SCRATCH = os.environ.get("PROBE_DIR", "/var/tmp/probe-seq-fsync")
MIB = 1 << 20
MODES = (("on", ["pmem_size=6G", "sync=close"]),
         ("off", ["pmem_size=6G", "sync=close", "dedup=off"]))


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every thread of pid, by thread id."""
    out = {}
    for path in glob.glob(f"/proc/{pid}/task/*/stat"):
        try:
            with open(path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue                    # the thread ended meanwhile
        out[path.split("/")[4]] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def thread_names(pid: int) -> dict[str, str]:
    """The name (comm) of every thread of pid, by thread id."""
    out = {}
    for path in glob.glob(f"/proc/{pid}/task/*/comm"):
        try:
            with open(path) as f:
                out[path.split("/")[4]] = f.read().strip()
        except OSError:
            continue
    return out


def per_thread(a: dict, b: dict, names: dict, mib: int) -> str:
    """ms/MiB of CPU per thread between a and b, by name (tid), the busiest first."""
    rows = sorted(((b[t] - a.get(t, 0.0), t) for t in b), reverse=True)
    return ", ".join(f"{names.get(t, '?')}[{t}] {1000 * d / mib:.3f}" for d, t in rows if d > 0)


def run(root: str, opts: list[str], gib: int = 2) -> None:
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    m = Mount(root, root, opts)
    m.start()
    try:
        # bench_foundation's Pool: a 16 MiB random base XORed with a constant per 16 MiB
        base = np.frombuffer(np.random.default_rng(2).bytes(16 * MIB), dtype=np.uint64)
        out = np.empty(MIB // 8, dtype=np.uint64)
        spy = None
        if os.environ.get("PYSPY"):
            dest = f"{os.environ['PYSPY']}-{os.path.basename(root)}-{time.time():.0f}.txt"
            spy = subprocess.Popen([PY_SPY, "record", "-p", str(m.pid), "--idle", "--threads",
                                    "--nonblocking", "-r", "250", "-f", "raw", "-o", dest],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        perf = None
        if os.environ.get("PERF"):
            dest = f"{os.environ['PERF']}-{os.path.basename(root)}-{time.time():.0f}.data"
            perf = subprocess.Popen(["perf", "record", "-F", "999", "-g", "-p", str(m.pid),
                                     "-o", dest], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        s0 = m.stat() if os.environ.get("STATS") else None
        c0, t0 = thread_cpu(m.pid), time.monotonic()
        fd = os.open(f"{root}/f", os.O_WRONLY | os.O_CREAT, 0o644)
        for i in range(gib * 1024):
            start = (i % 16) * (MIB // 8)
            key = np.uint64(((1000 + i // 16) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1))
            np.bitwise_xor(base[start:start + MIB // 8], key, out=out)
            os.write(fd, memoryview(out).cast("B"))
        if os.environ.get("SLEEP"):
            time.sleep(float(os.environ["SLEEP"]))
        c1, t1 = thread_cpu(m.pid), time.monotonic()
        if perf is not None:
            perf.send_signal(2)
            perf.wait()
            c1, t1 = thread_cpu(m.pid), time.monotonic()
        os.fsync(fd)
        c2, t2 = thread_cpu(m.pid), time.monotonic()
        os.close(fd)
        if spy is not None:
            spy.send_signal(2)
            spy.wait()

        def total(a: dict, b: dict) -> float:
            return sum(b.values()) - sum(a.values())

        def trio(a: dict, b: dict) -> float:     # the daemon's main thread runs trio
            return b.get(str(m.pid), 0.0) - a.get(str(m.pid), 0.0)

        mib = gib * 1024
        print(f"dedup {'off' if 'dedup=off' in opts else 'on'}: write {mib / (t1 - t0):.0f} MiB/s, "
              f"fsync {t2 - t1:.3f} s, total {mib / (t2 - t0):.0f} MiB/s; daemon CPU "
              f"{1000 * total(c0, c2) / mib:.3f} ms/MiB (trio {1000 * trio(c0, c2) / mib:.3f}); "
              f"the fsync's {total(c1, c2):.3f} s (trio {trio(c1, c2):.3f}); "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        if os.environ.get("PERTHREAD"):
            names = thread_names(m.pid)
            print(f"  write, ms/MiB per thread: {per_thread(c0, c1, names, mib)}")
            print(f"  fsync, ms/MiB per thread: {per_thread(c1, c2, names, mib)}", flush=True)
        if s0 is not None:
            s1 = m.stat()
            print("  WRITEs: " + ", ".join(f"{k} {s1.get(k, 0) - s0.get(k, 0)}" for k in (
                "fuse_write_answered_in_c", "fuse_write_passed_on")) + "; requests " + ", ".join(
                f"{k} {v - s0['fuse_requests'].get(k, 0)}"
                for k, v in sorted(s1["fuse_requests"].items())
                if v - s0["fuse_requests"].get(k, 0)), flush=True)
    finally:
        try:
            m.umount()
        finally:
            m.cleanup()                 # a failed unmount leaves no mount or daemon behind
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    only = sys.argv[2] if len(sys.argv) > 2 else None
    for _ in range(reps):
        for name, opts in MODES:
            if only in (None, name):
                run(os.path.join(SCRATCH, f"p-{name}"), opts)


if __name__ == "__main__":
    main()
