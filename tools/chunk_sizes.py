#!/usr/bin/env python3
"""How much does each chunk-size setting store for a series of checkpoint versions?

For each (min, avg, max) setting, with and without format hints (forced cuts at
tensor boundaries), chunks every version with ckptfs.chunker and reports the
bytes of new unique chunks each version adds given all earlier versions, next
to the tensor-level ideal: the bytes of tensors whose content is not already
stored (same bytes anywhere in an earlier version).  Non-tensor bytes
(safetensors header; torch.save pickle, member headers, zip directory) are not
in the ideal and are shown apart as "meta".

  python tools/chunk_sizes.py /tmp/ckseries/lora/step_{50,200,350}.pt
  python tools/chunk_sizes.py --sizes 16,64,256 --sizes 64,256,1024 A B

Files are processed in the order given (sort them by version yourself).
Sizes are in KiB; the table is Markdown.
"""

from __future__ import annotations

import argparse
import mmap
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ckptfs import formats
from ckptfs.chunker import chunk_buffer, chunk_id

KIB = 1024
DEFAULT_SIZES = [
    (4, 16, 64),
    (8, 32, 128),
    (16, 64, 256),
    (32, 64, 256),
    (64, 64, 1024),
    (32, 128, 512),
    (64, 256, 1024),
]


def tensor_ranges(path: Path, data: mmap.mmap) -> list[tuple[int, int]]:
    """(start, end) of every non-empty tensor's bytes in the file."""
    bounds = formats.safetensors_boundaries(data[: min(len(data), 1 << 24)])
    if bounds is not None:
        return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    if data[:4] == b"PK\x03\x04":
        out = []
        for info in zipfile.ZipFile(path).infolist():
            if "/data/" not in info.filename or info.filename.endswith("serialization_id"):
                continue
            off = info.header_offset
            start = off + 30 + int.from_bytes(data[off + 26 : off + 28], "little") + int.from_bytes(
                data[off + 28 : off + 30], "little")
            if info.compress_size:
                out.append((start, start + info.compress_size))
        return out
    raise SystemExit(f"{path}: neither safetensors nor a zip (torch.save) file")


@dataclass
class Row:
    sizes: tuple[int, int, int]
    hints: bool
    new: list[int] = field(default_factory=list)  # per version after the first
    chunks: list[int] = field(default_factory=list)  # per version
    seconds: float = 0.0


def measure(paths: list[Path], settings: list[tuple[int, int, int]]) -> None:
    maps = []
    for p in paths:
        with open(p, "rb") as f:
            maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))

    # Tensor-level ideal.
    seen: set[bytes] = set()
    ideal, meta = [], []
    for i, (p, m) in enumerate(zip(paths, maps)):
        ranges = tensor_ranges(p, m)
        view = memoryview(m)
        fresh = 0
        for a, b in ranges:
            h = chunk_id(view[a:b])
            if h not in seen:
                seen.add(h)
                fresh += b - a
        view.release()
        if i:
            ideal.append(fresh)
        meta.append(len(m) - sum(b - a for a, b in ranges))

    rows = []
    for sizes in settings:
        for hints in (False, True):
            row = Row(sizes, hints)
            stored: set[bytes] = set()
            for i, m in enumerate(maps):
                view = memoryview(m)
                t0 = time.perf_counter()
                chunks = chunk_buffer(view, *(s * KIB for s in sizes), detect_format=hints)
                ids = [chunk_id(view[o : o + n]) for o, n in chunks]
                row.seconds += time.perf_counter() - t0
                fresh = 0
                for (o, n), cid in zip(chunks, ids):
                    if cid not in stored:
                        stored.add(cid)
                        fresh += n
                view.release()
                row.chunks.append(len(chunks))
                if i:
                    row.new.append(fresh)
            rows.append(row)
    for m in maps:
        m.close()
    report(paths, rows, ideal, meta, sum(p.stat().st_size for p in paths))


def report(paths: list[Path], rows: list[Row], ideal: list[int], meta: list[int],
           total: int) -> None:
    mib = 1 << 20
    ideal_sum = sum(ideal)
    print(f"{len(paths)} versions, {paths[0].stat().st_size / mib:.1f} MiB each; "
          f"tensor-level ideal for versions 2..{len(paths)}: {ideal_sum / mib:.2f} MiB "
          f"({', '.join(f'{x / mib:.2f}' for x in ideal)}); "
          f"meta per version {', '.join(f'{x / KIB:.1f} KiB' for x in meta)}")
    print("| min/avg/max KiB | hints | chunks/version | mean chunk KiB | new MiB | x ideal | "
          "GB/s (cut+hash) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        new = sum(r.new)
        chunks = sum(r.chunks) / len(r.chunks)
        mean = total / sum(r.chunks) / KIB
        ratio = new / ideal_sum if ideal_sum else float("nan")
        print(f"| {'/'.join(map(str, r.sizes))} | {'yes' if r.hints else 'no'} | {chunks:.0f} | "
              f"{mean:.1f} | {new / mib:.2f} | {ratio:.3f} | {total / r.seconds / 1e9:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--sizes", action="append", metavar="MIN,AVG,MAX",
                    help="a setting in KiB (repeatable; default: a sweep)")
    args = ap.parse_args()
    if len(args.files) < 2:
        ap.error("need at least two versions")
    settings = ([tuple(int(x) for x in s.split(",")) for s in args.sizes]
                if args.sizes else DEFAULT_SIZES)
    for s in settings:
        if len(s) != 3:
            ap.error(f"--sizes wants MIN,AVG,MAX, got {s}")
    measure(args.files, settings)  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
