#!/usr/bin/env python3
"""Speed of the chunking building blocks on 256 MiB of random data.

  native gear scan (ckptfs.native.gear_cut_points) per chunk-size setting
  find4 (the zip hint parser's descriptor search) against bytes.find
  chunk_id (BLAKE3-256) per input size, max_threads=1 against blake3.AUTO
  the whole streaming path: Chunker fed 1 MiB pieces + chunk_id per chunk

Reports GB/s of wall time and of CPU time (best of --repeat runs each): on a
shared machine the CPU-time figure is the one to trust for single-threaded
work; for blake3.AUTO it is the total over its threads.

  python tools/bench_chunking.py [--mib 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

from blake3 import blake3

from ckptfs import native
from ckptfs.chunker import Chunker, chunk_id

KIB = 1024
SETTINGS = [(4, 16, 64), (8, 32, 128), (16, 64, 256), (32, 64, 256), (64, 64, 1024),
            (32, 128, 512), (64, 256, 1024)]


def best(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds), each the best of ``repeat`` runs."""
    wall = cpu = float("inf")
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - w0)
        cpu = min(cpu, time.process_time() - c0)
    return wall, cpu


def line(label: str, size: int, times: tuple[float, float], extra: str = "") -> None:
    wall, cpu = times
    print(f"| {label} | {size / wall / 1e9:.2f} | {size / cpu / 1e9:.2f} | {extra} |")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    data = os.urandom(args.mib << 20)
    view = memoryview(data)
    n, r = len(data), args.repeat

    print("| what | GB/s wall | GB/s CPU | notes |")
    print("| --- | ---: | ---: | --- |")
    for s in SETTINGS:
        sizes = tuple(x * KIB for x in s)
        cuts = native.gear_cut_points(data, *sizes)
        line(f"gear scan {'/'.join(map(str, s))} KiB", n,
             best(lambda: native.gear_cut_points(data, *sizes), r),
             f"{len(cuts)} chunks, mean {n / len(cuts) / KIB:.1f} KiB")
    line("gear scan, every byte hashed (min 64 B)", n,
         best(lambda: native.gear_cut_points(data, 64, 1 << 30, 1 << 30), r))
    line("find4 `PK\\x07\\x08`", n, best(lambda: native.find4(data, b"PK\x07\x08"), r))
    line("bytes.find `PK\\x07\\x08`", n, best(lambda: data.find(b"PK\x07\x08"), r))

    for piece in (16 * KIB, 64 * KIB, 256 * KIB, 1 << 20, n):
        for threads in (1, blake3.AUTO):
            def run(piece: int = piece, threads: int = threads) -> None:
                for off in range(0, n, piece):
                    blake3(view[off : off + piece], max_threads=threads).digest()
            name = "1" if threads == 1 else "AUTO"
            label = f"{piece // KIB} KiB" if piece < n else f"one {n >> 20} MiB input"
            line(f"blake3 {label}, max_threads={name}", n, best(run, r))

    for s in [(16, 64, 256), (32, 64, 256), (64, 64, 1024)]:
        sizes = tuple(x * KIB for x in s)

        def pipeline(sizes: tuple[int, ...] = sizes) -> None:
            chunker = Chunker(*sizes)
            for off in range(0, n, 1 << 20):
                for o, k in chunker.feed(view[off : off + (1 << 20)]):
                    chunk_id(view[o : o + k])
            for o, k in chunker.finish():
                chunk_id(view[o : o + k])

        line(f"Chunker (1 MiB feeds) + chunk_id, {'/'.join(map(str, s))} KiB", n,
             best(pipeline, r))


if __name__ == "__main__":
    main()
