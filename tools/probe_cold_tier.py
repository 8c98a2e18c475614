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


def group(pid, a, b, field=1):
    g = collections.Counter()
    for tid, v in b.items():
        comm, cpu = v[0], v[field]
        d = cpu - a.get(tid, (comm, 0.0, 0.0, 0.0, 0))[field]
        if tid == pid:
            k = "main"
        elif comm.startswith("ckptfs-prefetc") or comm == "ckfetch":
            k = "fetch"
        else:
            k = comm
        g[k] += d
    return g


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
                                        "--rate", "500", "--nonblocking", "--idle", "--threads",
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
            c0 = thread_cpu(t.pid)
            r0 = os.times()
            t0 = time.perf_counter()
            STARTS.clear()
            got, lat = read_timed(fd, buf)
            d_starts = list(STARTS)
            wall = time.perf_counter() - t0
            r1 = os.times()
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
            }
            for k in ("fuse_read_answered_in_c", "fuse_read_passed_on", "fuse_cold_read_answered_in_c",
                      "fuse_cold_read_passed_on", "fuse_cold_read_in_pool", "fuse_cold_read_waited",
                      "fuse_cold_read_waited_then_passed", "cold_fetches",
                      "fuse_requests"):
                if k in st1 and isinstance(st1[k], (int, float)):
                    d[k] = (st1.get(k) or 0) - (st0.get(k) or 0)
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
