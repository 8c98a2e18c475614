#!/usr/bin/env python3
"""Measure ckptfs chunk compression (ckptfs.codec) on real checkpoint files.

Every file is cut with the chunker ckptfs uses (ckptfs.chunker.chunk_buffer:
16/64/256 KiB content-defined chunks, forced cuts at tensor boundaries), each
chunk is compressed on its own with ckptfs.codec.encode_chunk, decoded again
and compared.  For comparison the whole file is compressed with plain
zstd -3 and with the zipnn package (if installed; byte mode with the file's
float dtype, one thread, which gave zipnn its best ratios here).

Files are grouped by dtype (fp32 / bf16 / fp16, the dtype with most bytes),
format (.pt / .safetensors) and kind (model / optimizer state); for each
group the table gives stored/logical bytes for the three, the ckptfs encode
and decode speed (GB/s of logical bytes, one thread, Python calls included,
best of --repeat passes),
and PASS when ckptfs stores less than zipnn.  Then one line per dtype over
all its files.

    python tools/make_ckpt_series.py --scenarios pretrain,pretrain-bf16 \\
        --files pt,safetensors,optim --versions 2 --steps 150 /var/tmp/ckc
    python tools/bench_compress.py /var/tmp/ckc/pretrain*/step_7550.*

--threads N also times decoding every chunk of a file on N threads (the
codec releases the GIL), and --json FILE writes all numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zstandard  # noqa: E402

from ckptfs import codec  # noqa: E402
from ckptfs.chunker import chunk_buffer  # noqa: E402

try:
    import zipnn  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - optional
    zipnn = None

DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
ZIPNN_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class Result:
    path: str
    dtype: str
    fmt: str
    kind: str
    logical: int = 0
    chunks: int = 0
    stored: int = 0
    zstd: int = 0
    zipnn: int | None = None
    enc_s: float = 0.0
    dec_s: float = 0.0
    par_dec_s: float | None = None
    zipnn_enc_s: float | None = None
    zipnn_dec_s: float | None = None
    codecs: Counter = field(default_factory=Counter)


def describe(path: Path) -> tuple[str, str, str]:
    """(dtype, format, kind) of a checkpoint file, from its contents."""
    fmt = "safetensors" if path.suffix == ".safetensors" else "pt"
    by_dtype: Counter = Counter()
    kind = "model"
    if fmt == "safetensors":
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            a, b = meta["data_offsets"]
            by_dtype[meta["dtype"].lower()] += b - a
        by_dtype = Counter({{"f32": "float32", "bf16": "bfloat16", "f16": "float16"}.get(k, k): v
                            for k, v in by_dtype.items()})
    else:
        import torch

        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if isinstance(obj, dict) and ("optimizer" in obj or "state" in obj):
            kind = "optimizer"

        def walk(o: object) -> None:
            if isinstance(o, torch.Tensor):
                by_dtype[str(o.dtype).removeprefix("torch.")] += o.numel() * o.element_size()
            elif isinstance(o, dict):
                for v in o.values():
                    walk(v)
            elif isinstance(o, (list, tuple)):
                for v in o:
                    walk(v)

        walk(obj)
    if "optim" in path.name:
        kind = "optimizer"
    dtype = by_dtype.most_common(1)[0][0] if by_dtype else "unknown"
    return DTYPE_NAMES.get(dtype, dtype), fmt, kind


def measure(path: Path, threads: int, use_zipnn: bool, repeat: int) -> Result:
    dtype, fmt, kind = describe(path)
    data = path.read_bytes()
    view = memoryview(data)
    res = Result(str(path), dtype, fmt, kind, logical=len(data))
    chunks = chunk_buffer(data)
    res.chunks = len(chunks)
    encoded = []
    for off, length in chunks:
        encoded.append((off, length, codec.encode_chunk(view[off : off + length])))
    for off, length, e in encoded:
        res.stored += len(e.payload)
        res.codecs[codec.CODEC_NAMES[e.codec]] += 1
        if codec.decode_chunk(e.codec, e.param, e.payload, length) != view[off : off + length]:
            raise SystemExit(f"{path}: chunk at {off} does not round-trip")
    # Timings: best of `repeat` passes (the machine may be shared); each
    # call is timed alone, so only codec work (and its Python calls) counts.
    enc_times, dec_times = [], []
    for _ in range(repeat):
        total = 0.0
        for off, length in chunks:
            piece = view[off : off + length]
            t = time.perf_counter()
            codec.encode_chunk(piece)
            total += time.perf_counter() - t
        enc_times.append(total)
        total = 0.0
        for off, length, e in encoded:
            t = time.perf_counter()
            codec.decode_chunk(e.codec, e.param, e.payload, length)
            total += time.perf_counter() - t
        dec_times.append(total)
    res.enc_s, res.dec_s = min(enc_times), min(dec_times)
    if threads > 1:
        # Each thread decodes its own share (one task per chunk would time
        # the executor's queue and GIL hand-offs instead of the codec).
        def decode_share(share: list) -> None:
            for _, length, e in share:
                codec.decode_chunk(e.codec, e.param, e.payload, length)

        shares = [encoded[k::threads] for k in range(threads)]
        best = float("inf")
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(repeat):
                t = time.perf_counter()
                list(pool.map(decode_share, shares))
                best = min(best, time.perf_counter() - t)
        res.par_dec_s = best
    res.zstd = len(zstandard.ZstdCompressor(level=3).compress(data))
    if use_zipnn and dtype in ZIPNN_DTYPES:
        z = zipnn.ZipNN(input_format="byte", bytearray_dtype=ZIPNN_DTYPES[dtype], threads=1)
        enc_t, dec_t = [], []
        for _ in range(repeat):
            src = bytearray(data)  # zipnn rewrites its input buffer in place
            t = time.perf_counter()
            comp = z.compress(src)
            enc_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            back = z.decompress(comp)
            dec_t.append(time.perf_counter() - t)
            if bytes(back) != data:
                raise SystemExit(f"{path}: zipnn does not round-trip")
        res.zipnn = len(comp)
        res.zipnn_enc_s, res.zipnn_dec_s = min(enc_t), min(dec_t)
    return res


def gbps(nbytes: int, seconds: float | None) -> str:
    return f"{nbytes / seconds / 1e9:.2f}" if seconds else "-"


def verdict(stored: int, zipnn_stored: int | None) -> str:
    if zipnn_stored is None:
        return "-"
    return "PASS" if stored < zipnn_stored else "MISS"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="checkpoint files (.pt, .safetensors)")
    ap.add_argument("--threads", type=int, default=1, help="also time decoding on N threads")
    ap.add_argument("--repeat", type=int, default=3, help="speeds: best of N passes (default 3)")
    ap.add_argument("--no-zipnn", action="store_true", help="skip zipnn even if installed")
    ap.add_argument("--json", type=Path, help="write the per-file numbers here")
    args = ap.parse_args()

    use_zipnn = zipnn is not None and not args.no_zipnn
    if zipnn is None:
        print("zipnn not installed")
    results = []
    for path in args.files:
        r = measure(path, args.threads, use_zipnn, max(1, args.repeat))
        results.append(r)
        zn = f"{r.zipnn / r.logical:.4f}" if r.zipnn is not None else "-"
        print(f"{path}: {r.dtype} {r.fmt} {r.kind}, {r.logical / 2**20:.1f} MiB, {r.chunks} chunks "
              f"{dict(r.codecs)}: ckptfs {r.stored / r.logical:.4f}, zstd-3 {r.zstd / r.logical:.4f}, "
              f"zipnn {zn}; encode {gbps(r.logical, r.enc_s)} GB/s, decode {gbps(r.logical, r.dec_s)} GB/s",
              flush=True)

    groups: dict[tuple[str, str, str], list[Result]] = defaultdict(list)
    by_dtype: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        groups[(r.dtype, r.fmt, r.kind)].append(r)
        by_dtype[r.dtype].append(r)

    def row(label: str, rs: list[Result]) -> str:
        logical = sum(r.logical for r in rs)
        stored = sum(r.stored for r in rs)
        zs = sum(r.zstd for r in rs)
        have_zn = all(r.zipnn is not None for r in rs)
        zn = sum(r.zipnn or 0 for r in rs) if have_zn else None
        enc = sum(r.enc_s for r in rs)
        dec = sum(r.dec_s for r in rs)
        par = sum(r.par_dec_s or 0 for r in rs) if args.threads > 1 else None
        zn_enc = sum(r.zipnn_enc_s or 0 for r in rs) if have_zn else None
        zn_dec = sum(r.zipnn_dec_s or 0 for r in rs) if have_zn else None
        cells = [label, f"{logical / 2**20:.0f}", f"{stored / logical:.4f}", f"{zs / logical:.4f}",
                 f"{zn / logical:.4f}" if zn is not None else "-", gbps(logical, enc), gbps(logical, dec)]
        if args.threads > 1:
            cells.append(gbps(logical, par))
        cells += [gbps(logical, zn_enc) if zn_enc else "-", gbps(logical, zn_dec) if zn_dec else "-",
                  verdict(stored, zn)]
        return "| " + " | ".join(cells) + " |"

    head = ["files (dtype, format, kind)", "MiB", "ckptfs", "zstd -3", "zipnn",
            "ckptfs enc GB/s", "ckptfs dec GB/s"]
    if args.threads > 1:
        head.append(f"dec GB/s, {args.threads} threads")
    head += ["zipnn enc GB/s", "zipnn dec GB/s", "< zipnn"]
    print()
    print("stored/logical (lower is better)")
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for key in sorted(groups):
        print(row(" ".join(key), groups[key]))
    for dtype in sorted(by_dtype):
        print(row(f"**all {dtype}**", by_dtype[dtype]))

    if args.json:
        args.json.write_text(json.dumps(
            [{**r.__dict__, "codecs": dict(r.codecs)} for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
