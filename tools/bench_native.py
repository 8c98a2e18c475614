#!/usr/bin/env python3
"""Speed of the native byte loops, one thread, each against a baseline that
does the same job without ckptfs's native code.

  crc32c   native.crc32c over 64 MiB random bytes (best of 5) and
           crc32c_blocks(4096) (best of 3);  baseline: zlib.crc32 (the CRC a
           Python program has without native code), best of 5
  gear     native.gear_cut_points over 64 MiB random bytes with the default chunk
           sizes (16/64/256 KiB), best of 3;  baseline: a copy of the same bytes
           (memory bandwidth: the ceiling of any one-pass scan)
           chunk_id (BLAKE3) over the chunks it cut, best of 3;  baseline:
           hashlib.sha256 over the same chunks
  planes   the C split/merge of byte planes (widths 2, 4, 8) over one 256 KiB
           buffer from cache, as the codec uses it: 200 calls, best of 3;
           baseline: numpy's transposed copy (reshape(-1, w).T, and back)
  codec    encode_chunk / decode_chunk of 64 KiB chunks: 32 MiB of bf16 and
           32 MiB of fp32 normal(0, 0.02) values (best of 2 encodes, 3 decodes),
           with the stored/original size;  baseline: zstd level 3 of the same
           chunks (encode_chunk's default level for bytes it does not transform)

These were four tests (tests/unit/test_native.py::test_crc32c_throughput,
test_chunker.py::test_gear_and_blake3_throughput, test_codec.py::
test_split_merge_throughput and ::test_codec_throughput) that printed GB/s
and asserted nothing; the ckptfs measurements are the same (same data, same
repeats), the baselines are new.

GB/s are 10^9 bytes per second of wall time. The ratio is ckptfs's speed over
the baseline's, both per second of this thread's CPU time: on a machine shared
with other work the CPU time is what the loop cost, where the wall time also
counts waiting for a CPU. Prints the load average with the results.

  python3 tools/bench_native.py [crc32c|gear|planes|codec ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptfs import native  # noqa: E402
from ckptfs.chunker import DEFAULT_AVG_SIZE, DEFAULT_MAX_SIZE, DEFAULT_MIN_SIZE, chunk_id  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20


@dataclass
class Timing:
    """The best of a few runs over nbytes: wall seconds and this thread's CPU seconds."""

    nbytes: int
    wall_s: float
    cpu_s: float

    @property
    def gb_s(self) -> float:
        return self.nbytes / self.wall_s / 1e9

    @property
    def gb_per_cpu_s(self) -> float:
        return self.nbytes / max(self.cpu_s, 1e-9) / 1e9


def best(nbytes: int, fn: Callable[[], object], repeat: int) -> Timing:
    wall = cpu = float("inf")
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall = min(wall, time.perf_counter() - w0)
        cpu = min(cpu, time.thread_time() - c0)
    return Timing(nbytes, wall, cpu)


@dataclass
class Row:
    what: str
    ckptfs: Timing
    baseline_name: str
    baseline: Timing
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.ckptfs.gb_per_cpu_s / self.baseline.gb_per_cpu_s

    def line(self) -> str:
        return (f"{self.what:<34} {self.ckptfs.gb_s:7.2f} GB/s   {self.baseline_name:<18} "
                f"{self.baseline.gb_s:7.2f} GB/s   x{self.ratio:6.2f}"
                + (f"   {self.note}" if self.note else ""))

    def record(self) -> dict:
        return {"what": self.what, "ckptfs": asdict(self.ckptfs), "baseline": self.baseline_name,
                "baseline_timing": asdict(self.baseline), "ckptfs_gb_s": self.ckptfs.gb_s,
                "baseline_gb_s": self.baseline.gb_s, "ratio_per_cpu_s": self.ratio,
                "note": self.note}


def bench_crc32c() -> list[Row]:
    data = os.urandom(64 * MIB)
    native.crc32c(data)                     # fault in / warm up
    n = len(data)
    zlib_crc = best(n, lambda: zlib.crc32(data), 5)
    return [Row("crc32c 64 MiB", best(n, lambda: native.crc32c(data), 5), "zlib.crc32", zlib_crc),
            Row("crc32c_blocks(4096) 64 MiB", best(n, lambda: native.crc32c_blocks(data, 4096), 3),
                "zlib.crc32", zlib_crc)]


def bench_gear() -> list[Row]:
    data = os.urandom(64 * MIB)
    sizes = (DEFAULT_MIN_SIZE, DEFAULT_AVG_SIZE, DEFAULT_MAX_SIZE)
    cuts = native.gear_cut_points(data, *sizes)
    n = len(data)
    copy = best(n, lambda: bytearray(data), 3)
    gear = best(n, lambda: native.gear_cut_points(data, *sizes), 3)
    view = memoryview(data)
    spans = list(zip([0] + cuts, cuts))     # the cut points end every chunk, the last at the end

    def blake3_chunks() -> None:
        for start, end in spans:
            chunk_id(view[start:end])

    def sha256_chunks() -> None:
        for start, end in spans:
            hashlib.sha256(view[start:end]).digest()

    return [Row(f"gear scan {sizes}", gear, "copy (memory)", copy),
            Row(f"chunk_id over its {len(spans)} chunks", best(n, blake3_chunks, 3),
                "hashlib.sha256", best(n, sha256_chunks, 3))]


def bench_planes() -> list[Row]:
    import numpy as np
    from ckptfs._native import ffi, lib

    size, reps = 256 * KIB, 200     # the largest chunk, from cache as the codec uses it
    raw = os.urandom(size)
    src = ffi.new("uint8_t[]", raw)
    dst = ffi.new("uint8_t[]", size)
    arr = np.frombuffer(raw, dtype=np.uint8)
    rows = []
    for width in (2, 4, 8):
        split_np = arr.reshape(-1, width).T.copy()          # plane k: byte k of every value
        lib.ckptfs_split_planes(src, size, width, dst)
        assert bytes(ffi.buffer(dst)) == split_np.tobytes(), "the baseline does another job"
        numpy_ops = {"split": lambda w=width: arr.reshape(-1, w).T.copy(),
                     "merge": lambda p=split_np: p.T.copy()}
        for name, fn in (("split", lib.ckptfs_split_planes), ("merge", lib.ckptfs_merge_planes)):
            def native_run(fn=fn, width=width) -> None:
                for _ in range(reps):
                    fn(src, size, width, dst)

            def numpy_run(op=numpy_ops[name]) -> None:
                for _ in range(reps):
                    op()
            rows.append(Row(f"planes {name} {width} of 256 KiB", best(size * reps, native_run, 3),
                            "numpy transpose", best(size * reps, numpy_run, 3)))
    return rows


def bench_codec() -> list[Row]:
    import numpy as np
    import zstandard

    from ckptfs.codec import decode_chunk, encode_chunk

    rng = np.random.default_rng(0xC0DEC)
    f32 = lambda n: (rng.standard_normal(n) * 0.02).astype("<f4")   # noqa: E731
    u = f32(16 * MIB).view("<u4").astype(np.uint64)                  # 16 Mi bf16 values
    bf16 = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()   # round to even
    zc, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    rows = []
    for name, data in (("bf16", bf16), ("fp32", f32(8 * MIB).tobytes())):
        chunks = [data[i:i + 64 * KIB] for i in range(0, len(data), 64 * KIB)]
        encs = [encode_chunk(c) for c in chunks]
        zstds = [zc.compress(c) for c in chunks]
        n = len(data)

        def enc_all() -> None:
            for c in chunks:
                encode_chunk(c)

        def dec_all() -> None:      # outputs dropped at once: no page faults timed
            for e in encs:
                decode_chunk(e.codec, e.param, e.payload, 64 * KIB)

        def zstd_enc() -> None:
            for c in chunks:
                zc.compress(c)

        def zstd_dec() -> None:
            for z in zstds:
                zd.decompress(z)

        stored = sum(len(e.payload) for e in encs) / n
        zstd_stored = sum(len(z) for z in zstds) / n
        note = f"stored {stored:.3f} of the bytes, zstd -3 {zstd_stored:.3f}"
        rows.append(Row(f"codec encode {name} 64 KiB chunks", best(n, enc_all, 2),
                        "zstd -3", best(n, zstd_enc, 2), note))
        rows.append(Row(f"codec decode {name} 64 KiB chunks", best(n, dec_all, 3),
                        "zstd -3", best(n, zstd_dec, 3)))
    return rows


BENCHES: dict[str, Callable[[], list[Row]]] = {
    "crc32c": bench_crc32c, "gear": bench_gear, "planes": bench_planes, "codec": bench_codec}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="*", metavar="|".join(BENCHES),
                    help="what to measure (default: all)")
    ap.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    args = ap.parse_args(argv)
    unknown = [w for w in args.which if w not in BENCHES]
    if unknown:
        ap.error(f"unknown measurement {unknown[0]!r} (choose from {', '.join(BENCHES)})")
    load_before = os.getloadavg()[0]
    records = []
    print(f"{'ckptfs':<34} {'':>12}   {'baseline':<18} {'':>12}   ratio per CPU s", flush=True)
    for name in args.which or list(BENCHES):
        for row in BENCHES[name]():
            print(row.line(), flush=True)
            records.append(row.record())
    load_after = os.getloadavg()[0]
    print(f"load average {load_before:.2f} before, {load_after:.2f} after, "
          f"on {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": records, "load_before": load_before,
                                               "load_after": load_after,
                                               "cpus": os.cpu_count()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
