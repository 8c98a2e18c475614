#!/usr/bin/env python3
"""Format hints on or off: what a checkpoint series stores, against the tensor-level ideal.

Offline (no mount): every version's files are cut with ckptfs.chunker at the
default sizes, once with format hints (detect_format) and once with
content-defined cuts alone; a chunk counts once however often it occurs, and
all-zero chunks count nothing (ckptfs stores them as holes). The ideal is
tools/bench_dedup.py's: every distinct tensor's bytes once plus every
non-tensor byte. Printed for the whole series and for versions 2.. alone (the
increment: what later saves cost).

  python tools/make_framework_series.py /tmp/fw --timings /tmp/fw/t.json
  python tools/chunk_series.py /tmp/fw --timings /tmp/fw/t.json [--scenarios tf,deepspeed]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS.parent))
sys.path.insert(0, str(TOOLS))
from bench_dedup import ideal, version_files  # noqa: E402

from ckptfs.chunker import chunk_buffer, chunk_id  # noqa: E402

MB = 1_000_000


def stored(per_version: list[list[Path]], hints: bool) -> tuple[int, int]:
    """(unique chunk bytes of the whole series, of the first version)."""
    seen: set[bytes] = set()
    total = first = 0
    for i, files in enumerate(per_version):
        for path in files:
            data = path.read_bytes()
            view = memoryview(data)
            for off, n in chunk_buffer(view, detect_format=hints):
                chunk = view[off:off + n]
                if chunk[0] == 0 and not any(chunk):
                    continue
                cid = chunk_id(chunk)
                if cid not in seen:
                    seen.add(cid)
                    total += n
        if i == 0:
            first = total
    return total, first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="the OUT directory the generator wrote")
    ap.add_argument("--timings", type=Path, required=True,
                    help="the generator's --timings file (names the versions in order)")
    ap.add_argument("--scenarios", help="comma-separated (default: all in the timings)")
    args = ap.parse_args()
    scenarios = json.loads(args.timings.read_text())["scenarios"]
    names = args.scenarios.split(",") if args.scenarios else list(scenarios)
    print("| series | versions | logical MB | ideal MB (versions 2..) | CDC alone: series "
          "(2..) | with hints: series (2..) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        plain = args.root / name
        per_version = [version_files(plain, tag) for tag in scenarios[name]["versions"]]
        whole = ideal([p for files in per_version for p in files])
        increment = whole["stored"] - ideal(per_version[0])["stored"]
        cells = []
        for hints in (False, True):
            total, first = stored(per_version, hints)
            cells.append(f"{total / whole['stored']:.3f} ({(total - first) / increment:.3f})")
        print(f"| {name} | {len(per_version)} | {whole['logical'] / MB:,.1f} | "
              f"{whole['stored'] / MB:,.1f} ({increment / MB:,.1f}) | {cells[0]} | {cells[1]} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
