#!/usr/bin/env python3
"""Cut the log underneath a daemon that is reading it through its mapping.

    python3 tools/log_fault_race.py --dir /var/tmp/lfr --attempts 10 [--code DIR]

Each attempt mounts a fresh ckptfs (the daemon of --code, default this
checkout, in the foreground so its exit status is seen), writes and commits a
32 MiB file, rereads it in 1 MiB READs (its log pages cached: READs answered
from the log's mapping, native/ckptfs_fuse.c) and meanwhile truncates the log
file to its superblock at a random moment. No hook: the truncation lands
inside a READ's populate..check window by chance. Without the log-fault guard
(native/ckptfs_logfault.c) such an attempt kills the daemon with SIGBUS
(exit -7); with it, the reader gets EIO and `log_faults` counts the pages.
Prints one line per attempt and a summary. Runs as root (mounts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FILE_BYTES = 32 << 20
READ_BYTES = 1 << 20


def ckptfs(code: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptfs.cli", *args], cwd=code,
                          capture_output=True, text=True, timeout=120)


def attempt(code: Path, work: Path, k: int) -> dict:
    src, mnt = work / f"src{k}", work / f"mnt{k}"
    src.mkdir(parents=True)
    mnt.mkdir(parents=True)
    with open(work / f"daemon{k}.err", "w") as err:
        daemon = subprocess.Popen([sys.executable, "-m", "ckptfs.cli", "mount", "-f", str(src),
                                   str(mnt), "-o", "pmem_size=128M,tiering=off"],
                                  cwd=code, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the mount did not come up (see {work}/daemon{k}.err)")
            time.sleep(0.05)
        data = os.urandom(FILE_BYTES)
        (mnt / "f").write_bytes(data)           # committed at close (sync=close)
        stop = threading.Event()
        errnos: dict[int, int] = {}

        def reader() -> None:
            fd = os.open(mnt / "f", os.O_RDONLY)
            try:
                while not stop.is_set():
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        for off in range(0, FILE_BYTES, READ_BYTES):
                            os.pread(fd, READ_BYTES, off)
                    except OSError as e:
                        errnos[e.errno] = errnos.get(e.errno, 0) + 1
                        if e.errno != 5:
                            return      # the daemon is gone (ENOTCONN, ECONNABORTED)
            finally:
                try:
                    os.close(fd)
                except OSError:
                    pass

        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.3 + random.random() * 0.3)
        os.truncate(src / ".ckptfs" / "pmem.log", 4096)
        time.sleep(0.5)
        stop.set()
        t.join(30)
        alive = daemon.poll() is None
        faults = None
        if alive:
            res = ckptfs(code, "stat", str(mnt), "--json")
            faults = json.loads(res.stdout).get("log_faults") if res.returncode == 0 else None
        return {"attempt": k, "daemon": "alive" if alive else f"exit {daemon.returncode}",
                "reader_errnos": errnos, "log_faults": faults}
    finally:
        if daemon.poll() is None:
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(mnt, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="work directory (made if missing)")
    p.add_argument("--attempts", type=int, default=10)
    p.add_argument("--code", type=Path, default=REPO,
                   help="the ckptfs checkout whose daemon runs (default: this one)")
    args = p.parse_args()
    if args.attempts < 1:
        p.error("--attempts must be at least 1")
    args.dir.mkdir(parents=True, exist_ok=True)
    died = 0
    for k in range(args.attempts):
        out = attempt(args.code.resolve(), args.dir, k)
        died += out["daemon"] != "alive"
        print(out, flush=True)
    print(f"{args.code}: {died} of {args.attempts} daemons died")
    return 0


if __name__ == "__main__":
    sys.exit(main())
