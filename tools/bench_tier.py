#!/usr/bin/env python3
"""Tiering benchmark (issue 5 item 6): compression in the store, cold restores, writer stalls.

    python tools/bench_tier.py [--dir /var/tmp/bench-tier] [--quick] [--json out.json]

Runs as root (mounts). Checkpoint series come from tools/make_ckpt_series.py
(GPT pretraining on the CPU, AdamW), fp32 and pure bf16 (model and optimizer
state in bf16), into a plain directory first:

  fp32  --scenarios pretrain      --files pt,safetensors,optim --versions S --steps 1
  bf16  --scenarios pretrain-bf16 --files pt,safetensors,optim --versions 2 --steps S-1

so both dtypes' last version is step_{50*S} (S optimizer steps). Every mount is
fresh: SOURCE, MOUNTPOINT and backing store are three directories under --dir
(`ckptfs mount SRC MNT -o pmem_size=...,backing=STORE`, tiering on).

(a) Stored bytes. For each dtype the last version goes into two mounts: "torch"
    (step_N.pt, torch.save of the model, and step_N.optim.pt, torch.save of the
    AdamW state) and "safetensors" (step_N.safetensors). Two mounts, because the
    .pt and .safetensors models hold the same tensor bytes and ckptfs would
    store them once; split this way the store holds exactly the bytes the
    per-file compressors see. After `ckptfs tier --now --all`, `ckptfs stat`
    gives cold_bytes (compressed chunk payloads in the store) and
    cold_logical_bytes (what they hold); the backing directory's size on disk
    (packs with headers and trailers, manifests) is reported too. Compared with
    each whole file compressed by zstd -3 (python zstandard) and by zipnn (if
    importable), both via tools/bench_compress.py's `measure`, which also gives
    the ckptfs codec's ratio on the same files offline (chunker + encode_chunk
    in-process: a cross-check of what the store holds). Target: ckptfs stores
    less than zipnn, for fp32 and for bf16.

(b) Restore throughput, the same mounts. Hot: files written, unmounted and
    mounted again (ckptfs's caches empty), `sync; echo 3 > drop_caches`, then
    the framework's load, timed in a child process: torch.load(weights_only=True)
    of the model .pt and the optimizer .pt (the "torch" mount), safetensors
    load_file of the .safetensors. Cold: after `tier --now --all` (nothing left
    in the log), remounted, caches dropped, the same load. Median of --reps
    loads, each after its own remount; the same load from the plain ext4 copy
    (caches dropped) is given for scale. Target: cold >= 0.5x hot. Then every
    file's sha256 through the mount against the plain copy, unmount, fsck.

(c) Writer stalls. The fp32 series' S versions are saved into one mount whose
    pmem_size is a quarter of the series' total size (hot_versions=2), one
    Trainer-style directory per version (checkpoint-N/model.safetensors +
    optimizer.pt), by a child process: pre-generated files, written with 4 MiB
    write()s and closed (sync=close: durable at close), one version every
    --period seconds (start to start; a save that overruns the period delays
    the next). Every save is timed; the stall is the longest save minus the
    median save, next to stat's tier_longest_writer_wait_s (the longest wait
    of a writer for log room). Target: no stall over 1 s. Then: caches dropped,
    sha256 of every file through the mount against the plain copy; unmount;
    `ckptfs fsck SRC` must exit 0. A save still running after --hang-timeout
    seconds (default 120) is a hang: stat and the daemon log's tail are
    recorded, the mount's FUSE connection aborted, the saver killed, and fsck
    run on what is left.

--report FILE prints the tables of an earlier run from its --json file.

Everything (mounts, logs, stores, plain copies) is under --dir and deleted at
the end, also on failure, Ctrl-C or SIGTERM (unmount, lazy unmount after
aborting the mount's own FUSE connection, SIGTERM/SIGKILL of the daemons this
script started); --keep keeps the plain copies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(TOOLS))

MB = 1_000_000
MiB = 1 << 20
WRITE_BLOCK = 4 * MiB          # torch.save writes about one 4 MiB write() per tensor
STALL_TARGET_S = 1.0
FULL_READ_AHEAD_KB = 16384     # what the daemon sets (ckptfs/daemon.py READ_AHEAD_KB)
COLD_HOT_TARGET = 0.5

SIZES = {  # generator sizes and run lengths: defaults / --quick
    "full": dict(layers=8, d_model=512, vocab=8192, series=16, reps=3, period=5.0),
    "quick": dict(layers=4, d_model=256, vocab=4096, series=16, reps=1, period=3.0),
}
DTYPES = {"fp32": "pretrain", "bf16": "pretrain-bf16"}
GROUPS = {  # mount of part (a)/(b) -> files of the last version (suffixes) and loader
    "torch": ((".pt", ".optim.pt"), "torch"),
    "safetensors": ((".safetensors",), "safetensors"),
}


# ----------------------------------------------------------- child processes
# These run in their own process (python bench_tier.py --_load/--_save), so a
# hung FUSE request can be timed out and killed without taking this script.


def child_load(kind: str, paths: list[str]) -> None:
    """Load checkpoint files; print seconds and bytes as JSON.

    torch: torch.load(weights_only=True); safetensors: load_file. Then every
    tensor is copied into a fresh one, as load_state_dict does (safetensors
    tensors may still be backed by the file mapping, so this is what makes a
    restore read every byte), inside the timed part. read: the plain bytes,
    in 1 MiB read()s (no framework)."""
    if kind != "read":
        import torch
        torch.set_num_threads(1)
    if kind == "safetensors":
        from safetensors.torch import load_file

    def copy_all(o: object) -> None:
        if isinstance(o, torch.Tensor):
            torch.empty_like(o).copy_(o)
        elif isinstance(o, dict):
            for v in o.values():
                copy_all(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                copy_all(v)

    per_file = []
    t_all = time.perf_counter()
    for p in paths:
        t0 = time.perf_counter()
        if kind == "read":
            with open(p, "rb", buffering=0) as f:
                buf = bytearray(MiB)
                while f.readinto(buf):
                    pass
        else:
            obj = (torch.load(p, map_location="cpu", weights_only=True) if kind == "torch"
                   else load_file(p))
            copy_all(obj)
            del obj
        per_file.append([os.path.basename(p), os.path.getsize(p), time.perf_counter() - t0])
    print(json.dumps({"seconds": time.perf_counter() - t_all,
                      "bytes": sum(b for _, b, _ in per_file), "files": per_file}))


def child_save(plan_path: str, result_path: str) -> None:
    """Save pre-generated versions at a fixed cadence; record every save.

    plan: {"period": s, "versions": [{"dir": DST, "files": [[SRC, NAME], ...]}]}.
    A version's bytes are read into memory before its slot (untimed); the save
    is mkdir + for each file: open, write() in WRITE_BLOCK pieces, close. The
    result file is rewritten before and after every save ("current" names the
    save in progress), so the parent sees how far it got, even if one hangs."""
    plan = json.loads(Path(plan_path).read_text())
    period = float(plan["period"])
    out: dict = {"period": period, "saves": [], "current": None, "error": None}

    def dump() -> None:
        tmp = Path(result_path + ".tmp")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, result_path)

    t0 = time.perf_counter()
    for i, version in enumerate(plan["versions"]):
        blobs = [(Path(src).read_bytes(), name) for src, name in version["files"]]
        slot = t0 + i * period
        now = time.perf_counter()
        if now < slot:
            time.sleep(slot - now)
        start, start_epoch = time.perf_counter(), time.time()
        dst = Path(version["dir"])
        out["current"] = {"index": i, "dir": str(dst), "start_epoch": start_epoch}
        dump()
        files: list = []
        rec = {"dir": str(dst), "slot_s": slot - t0, "start_s": start - t0,
               "start_epoch": start_epoch, "late_s": max(0.0, start - slot), "files": files}
        try:
            dst.mkdir(parents=True, exist_ok=True)
            for data, name in blobs:
                f0 = time.perf_counter()
                fd = os.open(dst / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    view = memoryview(data)
                    off = 0
                    while off < len(view):
                        off += os.write(fd, view[off:off + WRITE_BLOCK])
                finally:
                    os.close(fd)
                files.append([name, len(data), time.perf_counter() - f0])
        except OSError as e:
            rec.update(seconds=time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
            out["saves"].append(rec)
            out["error"] = f"save {i} ({dst.name}) failed after {rec['seconds']:.1f} s: {e}"
            out["current"] = None
            dump()
            sys.exit(1)
        rec.update(seconds=time.perf_counter() - start, bytes=sum(b for _, b, _ in files))
        out["saves"].append(rec)
        out["current"] = None
        dump()
        del blobs


if __name__ == "__main__" and sys.argv[1:2] in (["--_load"], ["--_save"]):
    # A child: none of the imports below (ckptfs, zipnn, ...) are needed.
    if sys.argv[1] == "--_load":
        child_load(sys.argv[2], sys.argv[3:])
    else:
        child_save(sys.argv[2], sys.argv[3])
    sys.exit(0)


# ------------------------------------------------------------------- helpers

from benchlib import loadavg, log, run, run_group  # noqa: E402
from mounting import Mount, is_mounted, mount_device, mounted_paths  # noqa: E402

try:
    import bench_compress  # tools/bench_compress.py: zstd -3, zipnn, ckptfs codec per file
except Exception as e:  # noqa: BLE001 - in progress elsewhere; fall back to zstd alone
    bench_compress = None
    BENCH_COMPRESS_ERROR = f"{type(e).__name__}: {e}"
else:
    BENCH_COMPRESS_ERROR = None

CKPTFS = [sys.executable, "-m", "ckptfs.cli"]
GENERATOR = TOOLS / "make_ckpt_series.py"
SELF = Path(__file__).resolve()


def drop_caches() -> None:
    run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], timeout=300)


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            p = os.path.join(root, n)
            if os.path.isfile(p) and not os.path.islink(p):
                total += os.stat(p).st_size
    return total


def sha256_files(paths: list[Path], timeout: float) -> dict[str, str]:
    """sha256 of each path, by sha256sum in a child process (bounded by timeout)."""
    if not paths:
        return {}
    out = run(["sha256sum", "--", *map(str, paths)], timeout=timeout).stdout
    got = {}
    for line in out.splitlines():
        digest, _, name = line.partition("  ")
        got[name] = digest
    return {str(p): got[str(p)] for p in paths}


def median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def load(kind: str, paths: list[Path], timeout: float) -> dict:
    res = run([sys.executable, str(SELF), "--_load", kind, *map(str, paths)], timeout=timeout)
    return json.loads(res.stdout.strip().splitlines()[-1])


# -------------------------------------------------------------------- ckptfs


class BenchMount:
    """A fresh ckptfs: NAME.src (state, log), NAME.mnt, NAME.store (backing) under root."""

    def __init__(self, root: Path, name: str, pmem_size: int, extra: str = "") -> None:
        self.name = name
        self.src = root / f"{name}.src"
        self.mnt = root / f"{name}.mnt"
        self.store = root / f"{name}.store"
        self.pmem_size = pmem_size
        self.options = f"pmem_size={pmem_size // MiB}M,backing={self.store}" + extra
        self.mounted = Mount(self.src, self.mnt, self.options.split(","),
                             command=CKPTFS + ["mount"])

    @property
    def pid(self) -> Optional[int]:
        return self.mounted.pid

    @property
    def mounts(self) -> int:
        return self.mounted.mounts

    def mount(self) -> None:
        self.src.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.mounted.start(timeout_s=300)

    def stats(self) -> dict:
        return self.mounted.stat()

    def read_ahead_kb(self) -> Optional[int]:
        """The kernel's read-ahead for this mount (the daemon raises it after mounting)."""
        try:
            return int(Path(f"/sys/class/bdi/{mount_device(self.mnt)}/read_ahead_kb").read_text())
        except (OSError, ValueError):
            return None

    def load(self, kind: str, paths: list[Path], timeout: float) -> dict:
        """Remount (ckptfs's caches empty), drop the page cache, then load."""
        self.remount()
        drop_caches()
        ra = self.read_ahead_kb()
        res = load(kind, paths, timeout)
        res["read_ahead_kb"] = ra
        return res

    def umount(self) -> None:
        if is_mounted(self.mnt):
            self.mounted.umount(timeout_s=600)

    def remount(self) -> None:
        self.umount()
        self.mount()

    def tier_all(self, timeout: float) -> float:
        t0 = time.perf_counter()
        self.mounted.tier_now("--all", timeout_s=timeout)
        return time.perf_counter() - t0

    def fsck(self, timeout: float) -> dict:
        t0 = time.perf_counter()
        res = self.mounted.fsck(timeout_s=timeout)
        return {"exit": res.returncode, "seconds": time.perf_counter() - t0,
                "output": (res.stdout + res.stderr).strip()[-1500:]}

    def cleanup(self) -> None:
        """Emergency: nothing of ours may stay mounted or running."""
        if is_mounted(self.mnt):
            with contextlib.suppress(Exception):
                self.mounted.umount(timeout_s=60)
        # Still mounted: abort this mount's FUSE connection (only ours), detach
        # it, stop the daemon (only if it is still a ckptfs daemon).
        self.mounted.cleanup(abort=True)

    def remove(self) -> None:
        if is_mounted(self.mnt):
            return                   # never delete through (or below) a live mount
        for p in (self.src, self.store):
            shutil.rmtree(p, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.mnt.rmdir()


class Sampler:
    """Polls the daemon's stat over the control socket while a series runs."""

    def __init__(self, mnt: Path, every_s: float = 1.0) -> None:
        self.mnt = str(mnt)
        self.every_s = every_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.perf_counter()

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        from ckptfs import control
        keys = ("hot_bytes", "pmem_free_bytes", "cold_bytes", "cold_logical_bytes",
                "tier_state", "tier_backlog_bytes", "tier_longest_writer_wait_s",
                "tier_last_error", "tier_moved_bytes", "logical_bytes")
        while not self._stop.wait(self.every_s):
            t, epoch = time.perf_counter() - self.t0, time.time()
            try:
                st = control.request(self.mnt, "stat", timeout_s=10)
            except Exception as e:  # noqa: BLE001 - a sample is optional
                self.samples.append({"t": round(t, 2), "epoch": epoch, "error": str(e)})
                continue
            self.samples.append({"t": round(t, 2), "epoch": epoch,
                                 **{k: st.get(k) for k in keys}})


# ------------------------------------------------------------------ the data


def generate(args: argparse.Namespace, sizes: dict, plain: Path) -> dict:
    """Train and save both series into plain/; return the generator's timings."""
    S = sizes["series"]
    common = ["--files", "pt,safetensors,optim", "--threads", str(args.threads),
              "--layers", str(sizes["layers"]), "--d-model", str(sizes["d_model"]),
              "--vocab", str(sizes["vocab"])]
    out = {}
    for dtype in args.dtypes:
        scenario = DTYPES[dtype]
        # fp32 is also the long series of part (c): S versions one step apart.
        # Other dtypes: the same number of steps, 2 versions (only the last is used).
        versions, steps = ((S, 1) if dtype == args.series_dtype else (2, S - 1))
        timings = plain / f"timings-{dtype}.json"
        t0 = time.perf_counter()
        run_group([sys.executable, str(GENERATOR), str(plain), "--scenarios", scenario,
                   "--versions", str(versions), "--steps", str(steps),
                   "--timings", str(timings)] + common, timeout=args.timeout)
        tim = json.loads(timings.read_text())["scenarios"][scenario]
        out[dtype] = {"scenario": scenario, "versions": tim["versions"],
                      "train_seconds": tim["train_seconds"],
                      "seconds": time.perf_counter() - t0}
        log(f"generated {scenario}: {len(tim['versions'])} versions "
            f"({tim['versions'][-1]}), training {tim['train_seconds']:.0f} s, "
            f"{time.perf_counter() - t0:.0f} s in all")
        # .pt models of earlier versions are not used: free the disk.
        if dtype == args.series_dtype:
            for tag in tim["versions"][:-1]:
                with contextlib.suppress(FileNotFoundError):
                    (plain / scenario / f"{tag}.pt").unlink()
    return out


def write_plan(dirs_files: list[tuple[Path, list[tuple[Path, str]]]], period: float,
               path: Path) -> None:
    path.write_text(json.dumps({"period": period, "versions": [
        {"dir": str(d), "files": [[str(s), n] for s, n in files]} for d, files in dirs_files]}))


def save_child(plan: Path, result: Path, timeout: float) -> dict:
    run([sys.executable, str(SELF), "--_save", str(plan), str(result)], timeout=timeout)
    return json.loads(result.read_text())


# -------------------------------------------------------------- parts (a)+(b)


def compress_baselines(files: list[Path], use_zipnn: bool) -> dict[str, dict]:
    """Per file: zstd -3 and zipnn of the whole file, and the ckptfs codec offline."""
    out = {}
    for p in files:
        t0 = time.perf_counter()
        if bench_compress is not None:
            r = bench_compress.measure(p, 1, use_zipnn and bench_compress.zipnn is not None, 1)
            out[p.name] = {"logical": r.logical, "zstd": r.zstd, "zipnn": r.zipnn,
                           "codec": r.stored, "chunks": r.chunks, "codecs": dict(r.codecs),
                           "kind": f"{r.dtype} {r.fmt} {r.kind}",
                           "seconds": time.perf_counter() - t0}
        else:
            import zstandard
            data = p.read_bytes()
            out[p.name] = {"logical": len(data), "zipnn": None, "codec": None,
                           "zstd": len(zstandard.ZstdCompressor(level=3).compress(data)),
                           "seconds": time.perf_counter() - t0}
    return out


def run_group_mount(args: argparse.Namespace, work: Path, dtype: str, group: str,
                    files: list[Path], reps: int, mounts: list[BenchMount]) -> dict:
    """One mount of parts (a)+(b): write, hot loads, tier all, cold loads, verify."""
    _, loader = GROUPS[group]
    nbytes = sum(p.stat().st_size for p in files)
    pmem = max(512 * MiB, -(-2 * nbytes // MiB) * MiB)
    m = BenchMount(work, f"{dtype}-{group}", pmem, ",hot_versions=2")
    mounts.append(m)
    rec: dict = {"files": [p.name for p in files], "bytes": nbytes, "options": m.options}
    m.mount()
    plan = work / f"plan-{m.name}.json"
    write_plan([(m.mnt / "ckpt", [(p, p.name) for p in files])], 0.0, plan)
    saved = save_child(plan, work / f"saved-{m.name}.json", args.timeout)
    rec["write"] = saved["saves"][0]
    rec["stat_written"] = m.stats()
    inside = [m.mnt / "ckpt" / p.name for p in files]

    rec["hot"] = [m.load(loader, inside, args.timeout) for _ in range(reps)]
    rec["hot_read"] = m.load("read", inside, args.timeout)
    rec["stat_hot"] = m.stats()
    rec["tier_seconds"] = m.tier_all(args.timeout)
    rec["stat_tiered"] = m.stats()
    rec["cold"] = []
    for _ in range(reps):
        rec["cold"].append(m.load(loader, inside, args.timeout))
        rec.setdefault("stat_cold", []).append(m.stats())
    rec["cold_read"] = m.load("read", inside, args.timeout)
    rec["stat_cold_read"] = m.stats()
    m.remount()
    drop_caches()
    got = sha256_files(inside, args.timeout)
    want = sha256_files(files, args.timeout)
    rec["sha256_ok"] = [got[str(i)] == want[str(p)] for i, p in zip(inside, files)]
    m.umount()
    rec["store_bytes_on_disk"] = tree_bytes(m.store)
    rec["packs_bytes_on_disk"] = tree_bytes(m.store / "packs")
    rec["fsck"] = m.fsck(args.timeout)
    m.remove()
    return rec


def part_ab(args: argparse.Namespace, work: Path, plain: Path, gen: dict, reps: int,
            mounts: list[BenchMount]) -> dict:
    out: dict = {}
    for dtype in args.dtypes:
        scenario = DTYPES[dtype]
        tag = gen[dtype]["versions"][-1]
        rec: dict = {"version": tag, "groups": {}, "plain": {}}
        out[dtype] = rec
        base = plain / scenario / tag
        group_files = {g: [Path(f"{base}{suffix}") for suffix in GROUPS[g][0]] for g in GROUPS}
        # the plain ext4 copy, for scale
        for group, files in group_files.items():
            rec["plain"][group] = []
            for _ in range(reps):
                drop_caches()
                rec["plain"][group].append(load(GROUPS[group][1], files, args.timeout))
            drop_caches()
            rec.setdefault("plain_read", {})[group] = load("read", files, args.timeout)
        for group, files in group_files.items():
            log(f"(a)(b) {dtype} {group}: {', '.join(p.name for p in files)}")
            load0 = loadavg()
            g = run_group_mount(args, work, dtype, group, files, reps, mounts)
            g["loadavg"] = [load0, loadavg()]
            rec["groups"][group] = g
            hot = median([r["bytes"] / r["seconds"] / MB for r in g["hot"]])
            cold = median([r["bytes"] / r["seconds"] / MB for r in g["cold"]])
            st = g["stat_tiered"]
            log(f"    hot {hot:,.0f} MB/s, cold {cold:,.0f} MB/s; store "
                f"{st['cold_bytes'] / max(st['cold_logical_bytes'], 1):.4f} of "
                f"{st['cold_logical_bytes'] / MB:,.1f} MB; tier {g['tier_seconds']:.1f} s; "
                f"sha256 {'ok' if all(g['sha256_ok']) else 'MISMATCH'}; "
                f"fsck exit {g['fsck']['exit']}")
        all_files = [p for files in group_files.values() for p in files]
        log(f"(a) {dtype}: zstd -3, zipnn and the ckptfs codec offline on "
            f"{len(all_files)} files")
        rec["baselines"] = compress_baselines(all_files, not args.no_zipnn)
    return out


# ------------------------------------------------------------------- part (c)


def part_c(args: argparse.Namespace, work: Path, plain: Path, gen: dict, period: float,
           mounts: list[BenchMount]) -> dict:
    dtype = args.series_dtype
    scenario = DTYPES[dtype]
    tags = gen[dtype]["versions"]
    versions = []
    for tag in tags:
        versions.append((tag, [(plain / scenario / f"{tag}.safetensors", "model.safetensors"),
                               (plain / scenario / f"{tag}.optim.pt", "optimizer.pt")]))
    total = sum(p.stat().st_size for _, files in versions for p, _ in files)
    pmem = -(-total // 4 // MiB) * MiB
    m = BenchMount(work, "series", pmem, ",hot_versions=2")
    mounts.append(m)
    rec: dict = {"dtype": dtype, "versions": len(versions), "total_bytes": total,
                 "pmem_size": pmem, "period_s": period, "options": m.options, "error": None}
    log(f"(c) {len(versions)} versions of {dtype} ({total / MB:,.0f} MB) into a "
        f"{pmem / MB:,.0f} MB log, hot_versions=2, one save every {period:g} s")
    m.mount()
    plan, result = work / "plan-series.json", work / "saved-series.json"
    dirs_files = [(m.mnt / f"checkpoint-{tag.split('_')[1]}", files) for tag, files in versions]
    write_plan(dirs_files, period, plan)
    load0 = loadavg()
    t0 = time.perf_counter()
    # The saver runs in a session of its own. A save that takes longer than
    # --hang-timeout is a hang: the daemon's state is recorded, then the
    # mount's FUSE connection is aborted (which is what gets a writer stuck in
    # the kernel out), and the saver killed.
    hung = False
    with Sampler(m.mnt) as sampler:
        proc = subprocess.Popen([sys.executable, str(SELF), "--_save", str(plan), str(result)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                with contextlib.suppress(OSError, ValueError):
                    cur = json.loads(result.read_text()).get("current")
                    if cur and time.time() - cur["start_epoch"] > args.hang_timeout:
                        hung = True
                        break
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    rec["wall_seconds"] = time.perf_counter() - t0
    rec["loadavg"] = [load0, loadavg()]
    rec["samples"] = sampler.samples
    saved = json.loads(result.read_text()) if result.exists() else {"saves": []}
    rec["saves"] = saved["saves"]
    save_stats(rec, sampler.samples)
    if hung:
        cur = saved["current"]
        rec["error"] = (f"hang: save {cur['index']} ({Path(cur['dir']).name}) still running "
                        f"after {time.time() - cur['start_epoch']:.1f} s")
        log(f"    {rec['error']}; recording the daemon's state, then aborting the mount")
        with contextlib.suppress(Exception):
            rec["stat_end"] = m.stats()
        rec["daemon_log_tail"] = daemon_log_tail(m)
        m.cleanup()                  # aborts this mount's connection if it must
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=60)
        rec["fsck"] = m.fsck(args.timeout)
        log(f"    fsck after the abort: exit {rec['fsck']['exit']}")
        m.remove()
        return rec
    child_out = proc.communicate()[0]
    if proc.returncode != 0:
        rec["error"] = saved.get("error") or f"saver exited {proc.returncode}: {child_out[-1500:]}"
        log(f"    FAILED: {rec['error']}")
        rec["daemon_log_tail"] = daemon_log_tail(m)
    rec["stat_end"] = m.stats()
    done = [x for x in rec["saves"] if "error" not in x]
    rec["longest_writer_wait_s"] = rec["stat_end"]["tier_longest_writer_wait_s"]
    if done:
        log(f"    saves: median {rec['save_median_s']:.2f} s, longest {rec['save_max_s']:.2f} s; "
            f"tier_longest_writer_wait_s {rec['longest_writer_wait_s']}")
    # every file saved reads back: through the mount (log and packs), caches dropped
    drop_caches()
    inside = [Path(x["dir"]) / name for x in done for name, _, _ in x["files"]]
    srcs = [p for (d, files) in dirs_files for p, name in files if d / name in set(inside)]
    t0 = time.perf_counter()
    got = sha256_files(inside, args.timeout)
    rec["verify_seconds"] = time.perf_counter() - t0
    want = sha256_files(srcs, args.timeout)
    bad = [str(i) for i, p in zip(inside, srcs) if got[str(i)] != want[str(p)]]
    rec["files_checked"] = len(inside)
    rec["files_bad"] = bad
    rec["stat_verified"] = m.stats()
    m.umount()
    rec["store_bytes_on_disk"] = tree_bytes(m.store)
    rec["fsck"] = m.fsck(args.timeout)
    log(f"    sha256: {len(inside) - len(bad)}/{len(inside)} files match; "
        f"fsck exit {rec['fsck']['exit']} ({rec['fsck']['seconds']:.0f} s)")
    m.remove()
    return rec


def save_stats(rec: dict, samples: list[dict]) -> None:
    """Median, longest and stall over the completed saves; which overlapped a pass."""
    for x in rec["saves"]:
        x["mover_overlap"] = mover_overlap(samples, x["start_epoch"],
                                          x["start_epoch"] + x["seconds"])
    secs = [x["seconds"] for x in rec["saves"] if "error" not in x]
    if secs:
        rec["save_median_s"] = median(secs)
        rec["save_max_s"] = max(secs)
        rec["stall_s"] = rec["save_max_s"] - rec["save_median_s"]


def daemon_log_tail(m: BenchMount, lines: int = 15) -> list[str]:
    try:
        with open(m.src / ".ckptfs" / "daemon.log", errors="replace") as f:
            return f.read().splitlines()[-lines:]
    except OSError as e:
        return [f"(cannot read the daemon log: {e})"]


def mover_overlap(samples: list[dict], start: float, end: float) -> bool:
    """Did a tiering pass run during [start, end]? (1 s samples: a sample inside
    says "moving", or tier_moved_bytes grew from the sample before to the one after.)"""
    ok = [s for s in samples if "error" not in s]
    if any(start <= s["epoch"] <= end and s["tier_state"] == "moving" for s in ok):
        return True
    before = [s for s in ok if s["epoch"] < start]
    after = [s for s in ok if s["epoch"] > end]
    if before and after:
        return (after[0]["tier_moved_bytes"] != before[-1]["tier_moved_bytes"]
                or before[-1]["tier_state"] == "moving" or after[0]["tier_state"] == "moving")
    return False


# -------------------------------------------------------------------- report


def ratio(a: Optional[float], b: Optional[float], nd: int = 4) -> str:
    return "—" if a is None or not b else f"{a / b:.{nd}f}"


def report_a(ab: dict) -> list[tuple[str, str, str]]:
    checks = []
    for dtype, rec in ab.items():
        base = rec["baselines"]
        rows = []
        for group, g in rec["groups"].items():
            st = g["stat_tiered"]
            b = [base[f] for f in g["files"]]
            rows.append((GROUP_LABEL[group], g["bytes"], st["cold_bytes"], st["cold_logical_bytes"],
                         g["packs_bytes_on_disk"], g["store_bytes_on_disk"],
                         _sum([x["codec"] for x in b]), _sum([x["zstd"] for x in b]),
                         _sum([x["zipnn"] for x in b])))
        tot = ("**all**",) + tuple(_sum([r[i] for r in rows]) for i in range(1, 9))
        rows.append(tot)
        print()
        print(f"### (a) {dtype}: stored / logical after `tier --now --all` "
              f"({rec['version']}; lower is better)")
        print()
        print("| files | MB | ckptfs cold_bytes / cold_logical_bytes | ckptfs cold_bytes / "
              "file bytes | backing dir on disk / file bytes | ckptfs codec offline | "
              "zstd -3 | zipnn | ckptfs < zipnn |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for label, nb, cold, cold_l, _packs, store, codec_b, zstd_b, zipnn_b in rows:
            v = "—" if zipnn_b is None else verdict(cold < zipnn_b)
            print(f"| {label} | {nb / MB:,.1f} | {ratio(cold, cold_l)} | {ratio(cold, nb)} | "
                  f"{ratio(store, nb)} | {ratio(codec_b, nb)} | {ratio(zstd_b, nb)} | "
                  f"{ratio(zipnn_b, nb)} | {v} |")
        _, nb, cold, cold_l, _p, store, _c, _z, zipnn_b = tot
        if zipnn_b is None:
            checks.append((f"(a) {dtype}", "ckptfs store < zipnn", "n/a (zipnn not run)"))
        else:
            checks.append((f"(a) {dtype}", f"ckptfs cold_bytes {cold / nb:.4f} < zipnn "
                           f"{zipnn_b / nb:.4f} of {nb / MB:,.0f} MB (backing dir on disk "
                           f"{store / nb:.4f})", verdict(cold < zipnn_b)))
        for group, g in rec["groups"].items():
            st = g["stat_tiered"]
            if st["cold_logical_bytes"] != g["bytes"]:
                print(f"- note: {group}: cold_logical_bytes {st['cold_logical_bytes']:,} != "
                      f"file bytes {g['bytes']:,} (dedup or holes inside the files)")
            if st["hot_bytes"]:
                print(f"- note: {group}: {st['hot_bytes']:,} bytes still in the log after "
                      f"tier --now --all")
    return checks


GROUP_LABEL = {"torch": "torch.save: model .pt + optimizer .pt",
               "safetensors": "safetensors model"}


def _sum(xs: list) -> Optional[int]:
    return None if any(x is None for x in xs) else sum(xs)


def mbps(runs: list[dict]) -> Optional[float]:
    return median([r["bytes"] / r["seconds"] / MB for r in runs])


def report_b(ab: dict) -> list[tuple[str, str, str]]:
    checks = []
    print()
    print("### (b) restore throughput, hot vs cold (MB/s of file bytes, median of the reps)")
    print()
    print("| dtype | load | MB | plain ext4 | ckptfs hot | ckptfs cold | cold / hot | "
          "target ≥ 0.5 | hot, cold, cold / hot: loads with 16 MiB read-ahead only | "
          "1 MiB read()s: plain / hot / cold | tier --now --all |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for dtype, rec in ab.items():
        for group, g in rec["groups"].items():
            plain, hot, cold = mbps(rec["plain"][group]), mbps(g["hot"]), mbps(g["cold"])
            r = cold / hot
            tier_rate = g["stat_tiered"]["cold_logical_bytes"] / g["tier_seconds"] / MB
            reads = " / ".join(f"{mbps([x]):,.0f}" for x in
                               (rec["plain_read"][group], g["hot_read"], g["cold_read"]))
            full_ra = [mbps([x for x in g[k] if x.get("read_ahead_kb") == FULL_READ_AHEAD_KB])
                       for k in ("hot", "cold")]
            ra_cells = " / ".join("—" if v is None else f"{v:,.0f}" for v in full_ra)
            ra_cells += (f" / {full_ra[1] / full_ra[0]:.2f}" if None not in full_ra else " / —")
            print(f"| {dtype} | {LOAD_LABEL[group]} | {g['bytes'] / MB:,.1f} | {plain:,.0f} | "
                  f"{hot:,.0f} | {cold:,.0f} | {r:.2f} | {verdict(r >= COLD_HOT_TARGET)} | "
                  f"{ra_cells} | {reads} | {g['tier_seconds']:.1f} s ({tier_rate:,.0f} MB/s) |")
            checks.append((f"(b) {dtype} {group}", f"cold/hot = {r:.2f} (≥ {COLD_HOT_TARGET})",
                           verdict(r >= COLD_HOT_TARGET)))
    print()
    for dtype, rec in ab.items():
        for group, g in rec["groups"].items():
            each = lambda runs: ", ".join(f"{r['bytes'] / r['seconds'] / MB:,.0f}" for r in runs)  # noqa: E731
            fetch = [(x["cold_fetches"], x["cold_cache_hits"])
                     for x in g.get("stat_cold", []) + [g["stat_cold_read"]]]
            print(f"- {dtype} {group}: plain [{each(rec['plain'][group])}], hot "
                  f"[{each(g['hot'])}], cold [{each(g['cold'])}] MB/s. "
                  f"{g['stat_tiered']['chunks']:,} chunks; cold_fetches / cold_cache_hits per "
                  f"cold load, then the read()s: "
                  f"{', '.join(f'{f:,} / {h:,}' for f, h in fetch)}. read_ahead_kb per "
                  f"hot, cold load, then the read()s: "
                  f"{[x.get('read_ahead_kb') for x in g['hot'] + [g['hot_read']]]}, "
                  f"{[x.get('read_ahead_kb') for x in g['cold'] + [g['cold_read']]]}. "
                  f"sha256 {'ok' if all(g['sha256_ok']) else 'MISMATCH'}; "
                  f"fsck exit {g['fsck']['exit']}; load average {g['loadavg'][0]:.1f} → "
                  f"{g['loadavg'][1]:.1f}")
            checks.append((f"(b) {dtype} {group}", "sha256 through the mount, fsck",
                           "PASS" if all(g["sha256_ok"]) and g["fsck"]["exit"] == 0
                           else "FAIL"))
    return checks


LOAD_LABEL = {"torch": "torch.load model .pt + optimizer .pt",
              "safetensors": "safetensors load_file"}


def report_c(c: dict) -> list[tuple[str, str, str]]:
    saves = c["saves"]
    done = [x for x in saves if "error" not in x]
    print()
    print(f"### (c) writer stalls: {c['versions']} {c['dtype']} versions, "
          f"{c['total_bytes'] / MB:,.0f} MB, log {c['pmem_size'] / MB:,.0f} MB "
          f"(a quarter), hot_versions=2, a save every {c['period_s']:g} s")
    print()
    checks = []
    if c.get("error"):
        print(f"**The series did not complete: {c['error']}** ({len(done)} of {c['versions']} "
              f"saves done)")
        print()
        checks.append(("(c)", f"all {c['versions']} saves complete", f"FAIL: {c['error']}"))
    print("| | value | target |")
    print("| --- | ---: | --- |")
    if done:
        stall_ok = c["stall_s"] <= STALL_TARGET_S and not c.get("error")
        print(f"| save (model + optimizer, {done[0]['bytes'] / MB:,.0f} MB), median | "
              f"{c['save_median_s']:.2f} s ({done[0]['bytes'] / c['save_median_s'] / MB:,.0f} "
              f"MB/s) | |")
        print(f"| longest save | {c['save_max_s']:.2f} s | |")
        print(f"| stall: longest − median save | {c['stall_s']:.2f} s | ≤ 1 s "
              f"{verdict(stall_ok)} |")
        checks.append(("(c)", f"stall longest − median save = {c['stall_s']:.2f} s (≤ 1 s)",
                       verdict(stall_ok)))
    st = c.get("stat_end")
    if st:
        wait = st["tier_longest_writer_wait_s"]
        wait_ok = wait <= STALL_TARGET_S and not c.get("error")
        print(f"| stat tier_longest_writer_wait_s | {wait:.2f} s | ≤ 1 s {verdict(wait_ok)} |")
        checks.append(("(c)", f"tier_longest_writer_wait_s = {wait:.2f} s (≤ 1 s)",
                       verdict(wait_ok)))
    if done:
        late = max(x["late_s"] for x in done)
        print(f"| latest save start after its slot | {late:.2f} s | |")
        for label, sel in (("during a tiering pass", True), ("with no tiering pass", False)):
            xs = [x["seconds"] for x in done if x.get("mover_overlap") == sel]
            if xs:
                print(f"| saves {label}: count, median, longest | {len(xs)}, "
                      f"{median(xs):.2f} s, {max(xs):.2f} s | |")
    if st:
        print(f"| at the end: log in use / cold stored for | "
              f"{st['hot_bytes'] / MB:,.0f} MB / {st['cold_bytes'] / MB:,.0f} MB for "
              f"{st['cold_logical_bytes'] / MB:,.0f} MB | |")
    if "files_checked" in c:
        ok = not c["files_bad"]
        print(f"| files read back (sha256 vs plain copy) | "
              f"{c['files_checked'] - len(c['files_bad'])} / {c['files_checked']} "
              f"({c['verify_seconds']:.0f} s) | all {verdict(ok)} |")
        checks.append(("(c)", f"sha256 of {c['files_checked']} files", "PASS" if ok else "FAIL"))
    if "fsck" in c:
        print(f"| `ckptfs fsck` after unmount | exit {c['fsck']['exit']} | 0 "
              f"{verdict(c['fsck']['exit'] == 0)} |")
        checks.append(("(c)", "fsck exit 0", "PASS" if c["fsck"]["exit"] == 0 else "FAIL"))
    print()
    print("Every save, seconds (* = a tiering pass ran during it): "
          + ", ".join(f"{x['seconds']:.2f}{'*' if x.get('mover_overlap') else ''}"
                      + (" (failed)" if "error" in x else "") for x in saves))
    if st and st.get("tier_last_error"):
        print(f"- tier_last_error: {st['tier_last_error']}")
    peak = max((x.get("hot_bytes") or 0 for x in c["samples"]), default=0)
    print(f"- log in use, peak of the 1 s samples: {peak / MB:,.0f} MB of "
          f"{c['pmem_size'] / MB:,.0f} MB; load average {c['loadavg'][0]:.1f} → "
          f"{c['loadavg'][1]:.1f}")
    if c.get("error"):
        if c["fsck"]["exit"] != 0:
            print(f"- fsck: {c['fsck']['output'][-600:]}")
        print("- daemon log, last lines:")
        print()
        for line in c.get("daemon_log_tail", []):
            print(f"      {line}")
    return checks


def environment() -> dict:
    def git(*a: str) -> str:
        return run(["git", *a], timeout=30, check=False).stdout.strip()

    import torch
    from importlib.metadata import PackageNotFoundError, version
    try:
        zipnn_v = version("zipnn")
    except PackageNotFoundError:
        zipnn_v = "not installed"
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": git("rev-parse", "--short", "HEAD"),
            "ckptfs_dirty": bool(git("status", "--porcelain", "--", "ckptfs", "native")),
            "python": platform.python_version(), "torch": torch.__version__,
            "kernel": platform.release(), "cpus": os.cpu_count(), "zipnn": zipnn_v,
            "bench_compress": BENCH_COMPRESS_ERROR or "imported"}


# ---------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/bench-tier"),
                    help="work directory (plain copies, mounts, logs, stores; emptied at the end)")
    ap.add_argument("--quick", action="store_true", help="smaller model, shorter series: ~3 min")
    for name, what in (("layers", "generator --layers"), ("d_model", "generator --d-model"),
                       ("vocab", "generator --vocab"),
                       ("series", "versions in the long series (c); also the optimizer steps"),
                       ("reps", "loads per (hot, cold, plain) measurement"),
                       ("period", "seconds between saves in (c)")):
        ap.add_argument("--" + name.replace("_", "-"), type=float if name == "period" else int,
                        help=f"{what} (default {SIZES['full'][name]}, --quick "
                             f"{SIZES['quick'][name]})")
    ap.add_argument("--dtypes", default="fp32,bf16", help="for (a) and (b): fp32, bf16")
    ap.add_argument("--series-dtype", default="fp32", help="the dtype of the series in (c)")
    ap.add_argument("--parts", default="a,b,c", help="a and b run together; c alone")
    ap.add_argument("--threads", type=int, default=2, help="generator torch threads")
    ap.add_argument("--no-zipnn", action="store_true", help="skip zipnn even if installed")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per command")
    ap.add_argument("--hang-timeout", type=float, default=120,
                    help="(c): a save running this long is a hang (default 120 s)")
    ap.add_argument("--keep", action="store_true", help="keep the plain copies under --dir")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--report", type=Path, metavar="JSON",
                    help="only print the tables of an earlier run from its --json file")
    args = ap.parse_args()
    if args.report:
        return report(json.loads(args.report.read_text()))
    if os.geteuid() != 0:
        ap.error("run as root (it mounts)")
    args.dir = args.dir.resolve()
    if args.dir == REPO or REPO in args.dir.parents:
        ap.error("--dir must be outside the repository")
    sizes = dict(SIZES["quick" if args.quick else "full"])
    for name in sizes:
        if getattr(args, name) is not None:
            sizes[name] = getattr(args, name)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    parts = set(args.parts.split(","))
    for d in args.dtypes + [args.series_dtype]:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d} (fp32, bf16)")
    if "c" in parts and args.series_dtype not in args.dtypes:
        args.dtypes.append(args.series_dtype)
    if sizes["series"] < 3:
        ap.error("--series must be at least 3")

    # SIGTERM (e.g. from timeout(1)) unwinds through the finally blocks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.dir.exists():
        stale = [p for p in mounted_paths() if p == str(args.dir) or p.startswith(f"{args.dir}/")]
        if stale:
            ap.error(f"something is mounted under {args.dir}: {stale}")
        shutil.rmtree(args.dir)
    args.dir.mkdir(parents=True)
    plain, work = args.dir / "plain", args.dir / "work"
    plain.mkdir()
    work.mkdir()

    env = environment()
    log(f"ckptfs {env['commit']}{' + uncommitted changes' if env['ckptfs_dirty'] else ''}, "
        f"torch {env['torch']}, zipnn {env['zipnn']}, bench_compress {env['bench_compress']}; "
        f"sizes {sizes}; free on {args.dir}: "
        f"{shutil.disk_usage(args.dir).free / 2**30:.0f} GiB; load average {loadavg():.1f}")
    out: dict = {"environment": env, "sizes": sizes, "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    mounts: list[BenchMount] = []
    t_start = time.perf_counter()
    try:
        out["generator"] = generate(args, sizes, plain)
        if parts & {"a", "b"}:
            out["ab"] = part_ab(args, work, plain, out["generator"], sizes["reps"], mounts)
        if "c" in parts:
            out["c"] = part_c(args, work, plain, out["generator"], sizes["period"], mounts)
    except (RuntimeError, subprocess.SubprocessError, OSError, KeyError, ValueError) as e:
        log(f"FAILED: {type(e).__name__}: {e}")
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        for m in mounts:
            m.cleanup()
        for m in mounts:
            m.remove()
        leftover = [p for p in mounted_paths() if p.startswith(f"{args.dir}/")]
        if leftover:
            log(f"NOT deleting {args.dir}: still mounted: {leftover}")
        elif args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            shutil.rmtree(args.dir, ignore_errors=True)
        out["seconds"] = time.perf_counter() - t_start
        if args.json:
            args.json.write_text(json.dumps(out, indent=1) + "\n")
    out["loadavg_end"] = loadavg()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return report(out)


def report(out: dict) -> int:
    """Print every table of a run (also from its --json file: --report)."""
    checks: list[tuple[str, str, str]] = []
    if "ab" in out:
        checks += report_a(out["ab"])
        checks += report_b(out["ab"])
    if "c" in out:
        checks += report_c(out["c"])
    env = out["environment"]
    print()
    print(f"### Targets ({out['seconds'] / 60:.1f} min; ckptfs {env['commit']}"
          f"{' + uncommitted changes' if env['ckptfs_dirty'] else ''}; {env['time']}; "
          f"load average at the end {out.get('loadavg_end', 0):.1f})")
    print()
    print("| part | target | result |")
    print("| --- | --- | --- |")
    for part, what, v in checks:
        print(f"| {part} | {what} | {v} |")
    if out.get("error"):
        print(f"| — | the run | FAIL: {out['error']} |")
    return 1 if out.get("error") or any(v.startswith("FAIL") for _, _, v in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
