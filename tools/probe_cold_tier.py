"""Probe (cold16, not a benchmark): the bench's cold_tier steps on one
checkout, with the reader's per-readv latency (--lat: every readv's start and
duration saved), the daemon's CPU, run delay (schedstat) and voluntary
context switches per thread group, `ckptfs stat` deltas; optionally py-spy,
perf record or perf stat on the daemon during each read. Run it under the
bench lock. Thread groups: main (trio), fetch (if the checkout names its
fetch threads), python (the read pool's C threads and the rest), Trio threads.

    python tools/probe_cold_tier.py CHECKOUT DIR LABEL [--reps N] [--cold-only]
        [--lat] [--pyspy PREFIX] [--perf PREFIX] [--pstat]
"""
import argparse, os, sys, time, json, subprocess, signal, collections
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_foundation as bf  # noqa

MiB = 1 << 20


def thread_cpu(pid):
    out = {}
    tck = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            s = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        comm = s[s.index("(") + 1:s.rindex(")")]
        f = s[s.rindex(")") + 2:].split()
        cpu = (int(f[11]) + int(f[12])) / tck
        try:
            ss = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
            st = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            vol = int(st.split("voluntary_ctxt_switches:")[1].split()[0])
        except (OSError, IndexError):
            ss, vol = [0, 0, 0], 0
        out[int(tid)] = (comm, cpu, int(ss[0]) / 1e9, int(ss[1]) / 1e9, vol)
    return out


def py_thread_names(pid):
    """OS thread id -> Python thread name, from py-spy dump (the fetch
    threads are Python threads whose OS name stays "python")."""
    try:
        out = subprocess.run(["/work/venvs/speed/bin/py-spy", "dump", "--pid", str(pid)],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    names = {}
    for line in out.splitlines():
        if line.startswith("Thread ") and '"' in line:
            try:
                names[int(line.split()[1])] = line.split('"')[1]
            except ValueError:
                pass
    return names


PYNAMES = {}


def group(pid, a, b, field=1):
    g = collections.Counter()
    for tid, v in b.items():
        comm, cpu = v[0], v[field]
        d = cpu - a.get(tid, (comm, 0.0, 0.0, 0.0, 0))[field]
        name = PYNAMES.get(tid, "")
        if tid == pid:
            k = "main"
        elif comm.startswith("ckptfs-prefetc") or comm == "ckfetch" or name.startswith("ckptfs-prefetch"):
            k = "fetch"
        elif comm == "python" and name:
            k = "py:" + name.rstrip("0123456789_-")
        else:
            k = comm
        g[k] += d
    return g


def pack_files(pid):
    """The pack files the daemon has open, as /proc/PID/fd/N paths (the
    state directory lies under the mount point, hidden by it)."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if "pack" in target and target not in out:
            out[target] = f"/proc/{pid}/fd/{fd}"
    return list(out.values())


def drop(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def ceiling(paths):
    """The disk's own cold read rate of these files (MB/s): their pages
    dropped (POSIX_FADV_DONTNEED, not a machine-wide drop), then read
    sequentially buffered in 1 MiB reads; again with O_DIRECT, 8 threads
    of 1 MiB reads in flight, as the fetch threads do."""
    import threading, mmap
    res = {}
    drop(paths)
    total, t0 = 0, time.perf_counter()
    buf = bytearray(MiB)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        while True:
            n = os.readv(fd, [buf])
            if not n:
                break
            total += n
        os.close(fd)
    res["buffered_MBps"] = round(total / 1e6 / (time.perf_counter() - t0))
    drop(paths)
    for threads in (8, 16):
        jobs = []
        for p in paths:
            size = os.stat(p).st_size
            jobs += [(p, off) for off in range(0, size, MiB)]
        lock = threading.Lock()
        got = [0]

        def work():
            m = mmap.mmap(-1, MiB)
            fds = {}
            while True:
                with lock:
                    if not jobs:
                        break
                    p, off = jobs.pop(0)
                if p not in fds:
                    fds[p] = os.open(p, os.O_RDONLY | os.O_DIRECT)
                n = os.preadv(fds[p], [m], off)
                with lock:
                    got[0] += n
            for fd in fds.values():
                os.close(fd)
        t0 = time.perf_counter()
        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        res[f"direct{threads}x1M_MBps"] = round(got[0] / 1e6 / (time.perf_counter() - t0))
    res["pack_bytes"] = total
    res["packs"] = len(paths)
    return res


def block_device(path):
    """The kernel's name of the block device holding path (vda1, nvme0n1p2)."""
    st = os.stat(path)
    link = os.readlink(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    return os.path.basename(link)


def diskstats(dev):
    """(reads, sectors read, ms reading, ms busy, weighted ms) of dev."""
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if f[2] == dev:
            return (int(f[3]), int(f[5]), int(f[6]), int(f[12]), int(f[13]))
    return (0, 0, 0, 0, 0)


def read_timed(fd, buf):
    mv = memoryview(buf)
    lat = []
    total = 0
    while True:
        t0 = time.perf_counter()
        n = os.readv(fd, [mv])
        lat.append(time.perf_counter() - t0)
        STARTS.append(t0)
        if n == 0:
            return total, lat
        total += n


def one(args, rep):
    root = Path(args.dir)
    t = bf.CkptfsTarget(root, "close", "6G", checkout=Path(args.checkout))
    t.name = args.label
    pool = POOL
    path = t.prepare(f"r{rep}") / "tiered.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    bf.write_stream(fd, pool.view, 1 << 30, MiB)
    os.fsync(fd)
    os.close(fd)
    buf = bytearray(MiB)
    res = {}
    try:
        for label in (("cold",) if args.cold_only else ("hot", "cold")):
            if label == "cold":
                if args.cold_only:
                    t.remount()
                t.mount.tier_now("--all", timeout_s=1200)
            t.remount()
            st0 = t.daemon_stats()
            fd = os.open(path, os.O_RDONLY)
            spy = None
            if args.pyspy:
                spy = subprocess.Popen(["/work/venvs/speed/bin/py-spy", "record", "--pid", str(t.pid),
                                        "--rate", "500", "--idle", "--threads",
                                        "--native", "--format", "raw", "--output",
                                        f"{args.pyspy}-{args.label}-r{rep}-{label}.txt"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.5)
            perf = None
            if args.perf:
                perf = subprocess.Popen(["perf", "record", "-F", "1999", "-p", str(t.pid), "-o",
                                         f"{args.perf}-{args.label}-r{rep}-{label}.data"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            if args.pstat:
                perf = subprocess.Popen(["perf", "stat", "-e", "syscalls:sys_enter_mmap,syscalls:sys_enter_munmap,page-faults,context-switches,syscalls:sys_enter_futex", "-p", str(t.pid), "-o",
                                         f"{args.dir}/pstat-{args.label}-r{rep}-{label}.txt"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            PYNAMES.clear()
            PYNAMES.update(py_thread_names(t.pid))
            c0 = thread_cpu(t.pid)
            r0 = os.times()
            k0 = diskstats(block_device(args.dir))
            t0 = time.perf_counter()
            STARTS.clear()
            got, lat = read_timed(fd, buf)
            d_starts = list(STARTS)
            wall = time.perf_counter() - t0
            r1 = os.times()
            k1 = diskstats(block_device(args.dir))
            c1 = thread_cpu(t.pid)
            if perf:
                perf.send_signal(signal.SIGINT)
                perf.wait(timeout=60)
            if spy:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
            os.close(fd)
            st1 = t.daemon_stats()
            assert got == 1 << 30, got
            g = group(t.pid, c0, c1)
            mib = got / MiB
            lat_ms = sorted(x * 1000 for x in lat)
            stall = sum(x for x in lat_ms if x > 0.5)
            d = {
                "MBps": round(got / 1e6 / wall),
                "wall_s": round(wall, 3),
                "reader_cpu_ms_per_MiB": round(1000 * ((r1.user - r0.user) + (r1.system - r0.system)) / mib, 3),
                "readv_p50_ms": round(lat_ms[len(lat_ms) // 2], 3),
                "readv_p90_ms": round(lat_ms[int(len(lat_ms) * .9)], 3),
                "readv_p99_ms": round(lat_ms[int(len(lat_ms) * .99)], 3),
                "readv_max_ms": round(lat_ms[-1], 2),
                "stall_ms(>0.5)": round(stall), "n_stalls": sum(1 for x in lat_ms if x > 0.5),
                "cpu_ms_per_MiB": {k: round(1000 * v / mib, 3) for k, v in g.most_common() if v > 0},
                "cpu_total_ms_per_MiB": round(1000 * sum(g.values()) / mib, 3),
                "exec_ms_per_MiB": {k: round(1000 * v / mib, 3) for k, v in group(t.pid, c0, c1, 2).most_common() if v > 0},
                "rundelay_ms_per_MiB": {k: round(1000 * v / mib, 3) for k, v in group(t.pid, c0, c1, 3).most_common() if v > 0},
                "volcsw_per_MiB": {k: round(v / mib, 2) for k, v in group(t.pid, c0, c1, 4).most_common() if v > 0},
                "load": os.getloadavg()[0],
                # the disk during the read (every reader of it, not only ours):
                # busy share of the wall, mean reads in flight, KiB per read
                "disk_busy": round((k1[3] - k0[3]) / 1000 / wall, 2),
                "disk_inflight": round((k1[2] - k0[2]) / 1000 / wall, 1),
                "disk_read_MB": round((k1[1] - k0[1]) * 512 / 1e6),
                "disk_KiB_per_read": round((k1[1] - k0[1]) / 2 / max(1, k1[0] - k0[0])),
            }
            for k in ("fuse_read_answered_in_c", "fuse_read_passed_on", "fuse_cold_read_answered_in_c",
                      "fuse_cold_read_passed_on", "fuse_cold_read_in_pool", "fuse_cold_read_waited",
                      "fuse_cold_read_waited_then_passed", "cold_fetches",
                      "fuse_requests"):
                if k in st1 and isinstance(st1[k], (int, float)):
                    d[k] = (st1.get(k) or 0) - (st0.get(k) or 0)
            if args.ceiling and label == "cold":
                d["ceiling"] = ceiling(pack_files(t.pid))
            if args.lat:
                d["lat_ms"] = [(round(t, 6), round(x * 1000, 3)) for t, x in zip(d_starts, lat)]
                d["pid"] = t.pid
            res[label] = d
        bf.verify_file(path, pool.view, 1 << 30)
    finally:
        t.finish()
    return res


p = argparse.ArgumentParser()
p.add_argument("checkout")
p.add_argument("dir")
p.add_argument("label")
p.add_argument("--pyspy")
p.add_argument("--perf")
p.add_argument("--pstat", action="store_true")
p.add_argument("--lat", action="store_true")
p.add_argument("--ceiling", action="store_true")
p.add_argument("--cold-only", action="store_true")
p.add_argument("--reps", type=int, default=1)
args = p.parse_args()
POOL = bf.Pool(1 << 30)
STARTS = []
for rep in range(args.reps):
    r = one(args, rep)
    for k, d in r.items():
        lat = d.pop("lat_ms", None)
        print(args.label, rep, k, json.dumps(d), flush=True)
        if lat:
            Path(f"{args.dir}/{args.label}-r{rep}-{k}.lat.json").write_text(json.dumps(lat))
