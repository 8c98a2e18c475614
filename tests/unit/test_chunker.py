"""Content-defined chunking: the native gear scan, the Chunker, chunk ids and the
safetensors / torch.save format hints."""

from __future__ import annotations

import io
import os
import random
import struct
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from gil import assert_releases_gil
from blake3 import blake3

from ckptfs import formats, native
from ckptfs.chunker import (
    DEFAULT_AVG_SIZE,
    DEFAULT_MAX_SIZE,
    DEFAULT_MIN_SIZE,
    BatchChunker,
    Chunker,
    chunk_buffer,
    chunk_id,
    name_whole_pieces,
)

MIB = 1 << 20
M64 = (1 << 64) - 1

# Small sizes make many chunks from little data, so every path of the scan runs.
SMALL = (64, 256, 1024)


@pytest.fixture
def rng() -> random.Random:
    return random.Random(0xC0C0)


def _gear_table() -> list[int]:
    state, out = 0x636B707466734344, []  # "ckptfsCD", as in native/ckptfs_native.c
    for _ in range(256):
        state = (state + 0x9E3779B97F4A7C15) & M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        out.append(z ^ (z >> 31))
    return out


GEAR = _gear_table()


def ref_cut_points(data: bytes, min_size: int, avg_size: int, max_size: int) -> list[int]:
    """The cut rule of native/ckptfs_native.h, written out plainly."""
    bits = avg_size.bit_length() - 1
    thr_small, thr_large = 1 << (64 - bits - 2), 1 << (64 - bits + 2)
    cuts, start, n = [], 0, len(data)
    while start < n:
        end = min(start + max_size, n)
        h = 0
        for j in range(max(0, min_size - 64), min_size - 1):  # fill the window
            if start + j >= n:
                break
            h = ((h << 1) + GEAR[data[start + j]]) & M64
        for length in range(min_size, max_size):
            if start + length > n:
                break
            h = ((h << 1) + GEAR[data[start + length - 1]]) & M64
            if h < (thr_small if length < avg_size else thr_large):
                end = start + length
                break
        cuts.append(end)
        start = end
    return cuts


def spans(cuts: list[int]) -> list[tuple[int, int]]:
    return [(a, b - a) for a, b in zip([0] + cuts, cuts)]


def feed_in_pieces(chunker: Chunker, data: bytes, sizes: Iterable[int]) -> list[tuple[int, int]]:
    out, pos, it = [], 0, iter(sizes)
    while pos < len(data):
        n = next(it)
        out += chunker.feed(data[pos : pos + n])
        pos += n
        # At most a possible zip data descriptor is held back from the scan.
        assert chunker.position - chunker.scanned <= 27
    return out + chunker.finish()


def random_pieces(rng: random.Random, choices: tuple[int, ...]) -> Iterable[int]:
    while True:
        yield rng.choice(choices)


# ---- the native gear scan --------------------------------------------------------


@pytest.mark.parametrize(
    "sizes",
    [(64, 128, 512), (64, 256, 1024), (100, 256, 300), (256, 256, 4096), (64, 1024, 1024),
     (1000, 1024, 1500), (64, 64, 64)],
)
def test_gear_matches_reference(rng: random.Random, sizes: tuple[int, int, int]) -> None:
    data = rng.randbytes(48 * 1024)
    assert native.gear_cut_points(data, *sizes) == ref_cut_points(data, *sizes)


def test_gear_reference_on_low_entropy_data(rng: random.Random) -> None:
    # Runs of one byte value and short repeats: the hash is periodic there.
    data = bytes(5000) + b"\xff" * 3000 + b"abc" * 2000 + rng.randbytes(9000) + bytes(3000)
    for sizes in [(64, 256, 1024), (128, 512, 2048)]:
        assert native.gear_cut_points(data, *sizes) == ref_cut_points(data, *sizes)


def test_gear_streaming_equals_one_shot(rng: random.Random) -> None:
    data = rng.randbytes(2 * MIB)
    for sizes in [SMALL, (4096, 16384, 65536)]:
        whole = native.gear_cut_points(data, *sizes)
        for trial in range(4):
            scanner = native.GearScanner(*sizes)
            cuts, pos = [], 0
            while pos < len(data):
                n = rng.choice([1, 7, 63, 64, 65, 1000, 4096, 100_000])
                cuts += [pos + c for c in scanner.scan(data[pos : pos + n])]
                pos += n
            if scanner.pending:
                cuts.append(len(data))
            assert cuts == whole, (sizes, trial)


def test_gear_many_cuts_in_one_call(rng: random.Random) -> None:
    # More cuts than the wrapper's per-call output array: it must loop.
    data = rng.randbytes(1 * MIB)
    cuts = native.gear_cut_points(data, 64, 128, 256)
    assert len(cuts) > 4 * 1024
    assert cuts == ref_cut_points(data, 64, 128, 256)


def test_gear_edge_inputs() -> None:
    assert native.gear_cut_points(b"", *SMALL) == []
    assert native.gear_cut_points(b"x", *SMALL) == [1]
    assert native.gear_cut_points(bytearray(5000), *SMALL) == ref_cut_points(bytes(5000), *SMALL)
    assert native.gear_cut_points(memoryview(bytes(3000))[7:], *SMALL) == ref_cut_points(
        bytes(2993), *SMALL)


@pytest.mark.parametrize(
    "sizes", [(32, 256, 1024), (512, 256, 1024), (64, 1024, 512), (64, 300, 1024), (0, 0, 0)]
)
def test_gear_rejects_bad_sizes(sizes: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        native.GearScanner(*sizes)


def test_gear_c_rejects_bad_sizes() -> None:
    from ckptfs._native import ffi, lib

    state = ffi.new("ckptfs_gear_state *")
    cuts = ffi.new("size_t[]", 4)
    assert lib.ckptfs_gear_cuts(state, b"abc", 3, 32, 256, 1024, cuts, 4) == ffi.cast("size_t", -1)


@pytest.fixture
def gear_lanes():
    """Switch the scan between its 16-lane AVX-512 form and the scalar loop;
    skips where the CPU has no AVX-512F and BW."""
    from ckptfs._native import lib

    was = lib.ckptfs_gear_vector(1)
    if not lib.ckptfs_gear_vector(-1):
        lib.ckptfs_gear_vector(was)
        pytest.skip("no AVX-512F and BW: the scan has one form here")
    yield lib.ckptfs_gear_vector
    lib.ckptfs_gear_vector(was)


# Spans long enough for the lanes in both halves of the rule (avg_size >= 2^15).
LANE_SIZES = [(2048, 32768, 131072), (DEFAULT_MIN_SIZE, DEFAULT_AVG_SIZE, DEFAULT_MAX_SIZE),
              (65536, 1 << 20, 4 << 20), (64, 32768, 1 << 20)]


def test_gear_lanes_match_reference(rng: random.Random, gear_lanes) -> None:
    data = rng.randbytes(MIB)
    cuts = native.gear_cut_points(data, *LANE_SIZES[0])
    assert len(cuts) > 10
    assert cuts == ref_cut_points(data, *LANE_SIZES[0])


def test_gear_lanes_match_scalar(rng: random.Random, gear_lanes) -> None:
    # Random bytes, and runs where the hash is periodic and hits come in
    # bursts (many lanes at once, or none for a whole span).
    rand = rng.randbytes(8 * MIB)
    low = (bytes(50_000) + b"\xff" * 30_000 + b"abc" * 20_000 + rng.randbytes(90_000)
           + bytes(30_000)) * 8
    for data in (rand, low, rand[:70_000] + low):
        for sizes in LANE_SIZES + [SMALL, (8192, 8192, 24576)]:
            gear_lanes(0)
            scalar = native.gear_cut_points(data, *sizes)
            gear_lanes(1)
            assert native.gear_cut_points(data, *sizes) == scalar, sizes
            # and streamed in writes' pieces, through the chunk feed
            for size in (4096, MIB, 3 * MIB + 5):
                scanner = native.GearScanner(*sizes)
                got = []
                for pos in range(0, len(data), size):
                    got += [pos + c for c in scanner.scan(data[pos:pos + size])]
                if scanner.pending:
                    got.append(len(data))
                assert got == scalar, (sizes, size)


def test_the_faster_gear_scan_is_picked(rng: random.Random) -> None:
    # The lanes' gathers are fast on Intel's AVX-512 cores and slow on AMD's
    # Zen 4 (0.74 against 0.24 ms/MiB for the scalar loop): the CPU flags alone
    # picked the lanes there, at a third of the loop's speed.
    import time

    from ckptfs._native import lib

    picked = lib.ckptfs_gear_vector(1)
    if not lib.ckptfs_gear_vector(-1):
        lib.ckptfs_gear_vector(picked)
        pytest.skip("no AVX-512F and BW: the scan has one form here")
    data = rng.randbytes(8 * MIB)
    cpu = {0: 1e9, 1: 1e9}
    try:
        for _ in range(4):
            for form in (0, 1):
                lib.ckptfs_gear_vector(form)
                t0 = time.thread_time()
                native.gear_cut_points(data, *LANE_SIZES[1])
                cpu[form] = min(cpu[form], time.thread_time() - t0)
    finally:
        lib.ckptfs_gear_vector(picked)
    assert cpu[picked] <= 1.25 * cpu[1 - picked], (picked, cpu)


def test_gear_chunk_sizes(rng: random.Random) -> None:
    data = rng.randbytes(16 * MIB)
    mn, avg, mx = DEFAULT_MIN_SIZE, DEFAULT_AVG_SIZE, DEFAULT_MAX_SIZE
    sizes = [n for _, n in spans(native.gear_cut_points(data, mn, avg, mx))]
    assert all(mn <= n <= mx for n in sizes[:-1])
    mean = sum(sizes) / len(sizes)
    assert 0.8 * avg < mean < 1.6 * avg


def test_find4(rng: random.Random) -> None:
    needle = b"PK\x07\x08"
    for _ in range(300):
        n = rng.randrange(0, 80)
        data = bytearray(rng.choice(b"PK\x07\x08x") for _ in range(n))
        start = rng.randrange(0, 10)
        end = rng.choice([None, rng.randrange(0, 90)])
        assert native.find4(data, needle, start, end) == bytes(data).find(needle, start, end), (
            data, start, end)
    big = bytearray(rng.randbytes(MIB).replace(b"P", b"Q"))
    assert native.find4(big, needle) == -1
    for pos in (0, 1, 15, 16, 17, MIB // 2, MIB - 5, MIB - 4):
        probe = bytearray(big)
        probe[pos : pos + 4] = needle
        assert native.find4(probe, needle) == pos
    with pytest.raises(ValueError):
        native.find4(b"abc", b"abc")


def test_gear_releases_the_gil() -> None:
    def make_call(scale: int) -> Callable[[], object]:
        data = os.urandom(64 * MIB * scale)
        # tiny min: hashes every byte
        return lambda: native.gear_cut_points(data, 64, 128, 1 << 30)

    assert_releases_gil(make_call)


# ---- chunk ids ---------------------------------------------------------------------


def test_chunk_id() -> None:
    assert chunk_id(b"") == bytes.fromhex(
        "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262")
    data = os.urandom(100_000)
    assert chunk_id(data) == blake3(data).digest()
    assert chunk_id(memoryview(data)) == chunk_id(bytearray(data))
    assert len(chunk_id(data)) == 32


# ---- the Chunker -------------------------------------------------------------------


def test_chunker_deterministic_and_split_independent(rng: random.Random) -> None:
    data = rng.randbytes(1 * MIB)
    whole = chunk_buffer(data, *SMALL)
    assert whole == chunk_buffer(data, *SMALL)
    assert whole == spans(native.gear_cut_points(data, *SMALL))
    for choices in [(1, 2, 3), (10, 100, 1000), (4096, 65536, 1 << 20)]:
        piece_rng = random.Random(choices[0])
        got = feed_in_pieces(Chunker(*SMALL), data, random_pieces(piece_rng, choices))
        assert got == whole


def test_chunk_sizes_within_bounds(rng: random.Random) -> None:
    data = rng.randbytes(4 * MIB)
    mn, avg, mx = 4096, 16384, 65536
    chunks = chunk_buffer(data, mn, avg, mx)
    assert sum(n for _, n in chunks) == len(data)
    assert all(mn <= n <= mx for _, n in chunks[:-1])
    assert 0 < chunks[-1][1] <= mx


def test_chunks_tile_the_stream(rng: random.Random) -> None:
    data = rng.randbytes(300_000)
    pos = 0
    for off, n in chunk_buffer(data, *SMALL, boundaries=[5, 1000, 1001, 250_000]):
        assert off == pos and n > 0
        pos += n
    assert pos == len(data)


def _ids(data: bytes, chunks: list[tuple[int, int]]) -> list[bytes]:
    return [chunk_id(data[o : o + n]) for o, n in chunks]


@pytest.mark.parametrize("edit", ["insert_front", "delete_front", "insert_middle"])
def test_shifted_bytes_only_change_nearby_chunks(rng: random.Random, edit: str) -> None:
    sizes = (4096, 16384, 65536)
    old = rng.randbytes(8 * MIB)
    if edit == "insert_front":
        new = rng.randbytes(100) + old
    elif edit == "delete_front":
        new = old[777:]
    else:
        new = old[: 4 * MIB] + rng.randbytes(3) + old[4 * MIB :]
    old_ids = set(_ids(old, chunk_buffer(old, *sizes)))
    new_chunks = chunk_buffer(new, *sizes)
    new_ids = _ids(new, new_chunks)
    fresh = [c for c, i in zip(new_chunks, new_ids) if i not in old_ids]
    assert len(new_chunks) > 300
    # The edited chunk and the few after it until the cuts fall back in step
    # (usually one or two; min_size skipping can delay it a little).
    assert len(fresh) <= 8, fresh
    assert fresh[-1][0] < 12 * sizes[1] + (4 * MIB if edit == "insert_middle" else 0)


def test_forced_boundaries_restart_cdc(rng: random.Random) -> None:
    data = rng.randbytes(1 * MIB)
    bounds = sorted(rng.sample(range(1, len(data)), 40)) + [len(data) + 50]
    chunks = chunk_buffer(data, *SMALL, boundaries=bounds)
    edges = {o for o, _ in chunks} | {len(data)}
    assert all(b in edges for b in bounds if b <= len(data))
    # Between two forced boundaries the chunks are exactly those of that
    # segment chunked on its own.
    marks = [0] + [b for b in bounds if b < len(data)] + [len(data)]
    expect = []
    for a, b in zip(marks, marks[1:]):
        expect += [(a + o, n) for o, n in spans(native.gear_cut_points(data[a:b], *SMALL))]
    assert chunks == expect
    # The same when the boundaries arrive while streaming, just in time.
    chunker = Chunker(*SMALL, detect_format=False)
    got, pos = [], 0
    pending = list(bounds)
    while pos < len(data):
        n = rng.randrange(1, 40_000)
        chunker.add_boundaries([b for b in pending if b < pos + n])
        pending = [b for b in pending if b >= pos + n]
        got += chunker.feed(data[pos : pos + n])
        pos += n
    assert got + chunker.finish() == expect


def test_boundary_behind_the_scan_is_refused(rng: random.Random) -> None:
    chunker = Chunker(*SMALL, detect_format=False)
    chunker.feed(rng.randbytes(5000))
    with pytest.raises(ValueError):
        chunker.add_boundaries([4000])
    chunker.add_boundaries([5000, 6000])  # at or after the scan: fine
    out = chunker.feed(rng.randbytes(2000)) + chunker.finish()
    assert (5000 in {o for o, _ in out}) and (6000 in {o for o, _ in out})
    with pytest.raises(ValueError):
        chunker.feed(b"more")


def test_unknown_format_gets_no_hints(rng: random.Random) -> None:
    data = rng.randbytes(200_000)
    chunker = Chunker(*SMALL)
    assert chunker.feed(data) + chunker.finish() == spans(native.gear_cut_points(data, *SMALL))
    assert chunker.format == "unknown"


# ---- format hints: real safetensors and torch.save files ---------------------------


def _state_dict():  # a tiny model's worth of tensors, several dtypes and a view
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    sd = {
        "embed.weight": torch.randn(300, 64, generator=gen),
        "block.0.ln.weight": torch.ones(64),
        "block.0.ln.bias": torch.zeros(64),
        "block.0.attn.weight": torch.randn(192, 64, generator=gen),
        "block.0.lora_A": torch.randn(4, 64, generator=gen).to(torch.bfloat16),
        "block.0.lora_B": torch.zeros(192, 4, dtype=torch.bfloat16),
        "block.0.count": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0),
        "head.weight": torch.randn(300, 64, generator=gen).half(),
    }
    return torch, sd


def _tensor_bytes(tensor) -> bytes:
    torch = pytest.importorskip("torch")
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_safetensors_boundaries_real_file(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    torch, sd = _state_dict()
    path = tmp_path / "model.safetensors"
    st.save_file(sd, str(path), metadata={"step": "100"})
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    bounds = formats.safetensors_boundaries(raw[: 8 + n])
    assert bounds is not None and bounds[0] == 8 + n and bounds[-1] == len(raw)
    assert bounds == formats.safetensors_boundaries(raw)  # trailing bytes ignored
    assert formats.safetensors_boundaries(raw[: 8 + n - 1]) is None  # header incomplete
    assert formats.safetensors_boundaries(raw[:5]) is None
    # Every non-empty tensor's bytes lie exactly between two boundaries.
    starts = set(bounds)
    with st.safe_open(str(path), framework="pt") as f:  # type: ignore[attr-defined]
        for name in f.keys():
            blob = _tensor_bytes(f.get_tensor(name))
            if not blob:
                continue
            at = raw.find(blob, 8 + n)
            assert at in starts and at + len(blob) in starts, name
    # Chunking honours them, whatever the feed sizes.
    whole = chunk_buffer(raw, *SMALL)
    edges = {o for o, _ in whole} | {len(raw)}
    assert set(bounds) <= edges
    got = feed_in_pieces(Chunker(*SMALL), raw, random_pieces(random.Random(1), (1, 5, 77, 4096)))
    assert got == whole


def _zip_members(raw: bytes) -> list[tuple[str, int, int]]:
    out = []
    for info in zipfile.ZipFile(io.BytesIO(raw)).infolist():
        name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
        start = info.header_offset + 30 + name_len + extra_len
        out.append((info.filename, start, start + info.compress_size))
    return out


def test_torch_zip_boundaries_real_file(tmp_path: Path) -> None:
    torch, sd = _state_dict()
    sd["embed_rows"] = sd["embed.weight"][10:20]  # a view: shares a storage
    path = tmp_path / "step_1000.pt"
    torch.save(sd, path)
    raw = path.read_bytes()
    members = _zip_members(raw)
    # What torch 2.13 writes: stored members, 64-byte aligned data, sizes in
    # data descriptors after the data (flag bit 3), names under the file's stem.
    for info in zipfile.ZipFile(path).infolist():
        assert info.compress_type == zipfile.ZIP_STORED
        assert info.filename.startswith("step_1000/")
        assert info.flag_bits & 0x08 or info.file_size == 0
    assert all(start % 64 == 0 for _, start, _ in members)
    expect = [x for _, start, end in members for x in (start, end)]
    assert formats.torch_zip_boundaries(raw) == expect
    # Storage bytes sit exactly in their members' data.
    by_name = {name: (start, end) for name, start, end in members}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in sd.values()}
    for storage in storages.values():
        blob = torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()
        if blob:
            at = raw.find(blob)
            assert (at, at + len(blob)) in by_name.values()
    # Prefixes: only what the bytes so far tell, and nothing for a non-zip.
    part = formats.torch_zip_boundaries(raw[: len(raw) // 2])
    assert part and len(part) < len(expect) and part == expect[: len(part)]
    assert part[-1] <= len(raw) // 2
    assert formats.torch_zip_boundaries(b"\x00" * 100) is None


def test_zip_parser_incremental(tmp_path: Path) -> None:
    torch, sd = _state_dict()
    path = tmp_path / "v.pt"
    torch.save(sd, path)
    raw = path.read_bytes()
    expect = formats.torch_zip_boundaries(raw)
    for trial in range(12):
        rnd = random.Random(trial)
        parser, got, pos = formats.ZipBoundaries(), [], 0
        while pos < len(raw):
            n = 1 if trial == 0 else rnd.choice([1, 2, 3, 4, 20, 30, 64, 1000, 9999])
            stable = parser.stable
            new = parser.feed(raw[pos : pos + n])
            assert all(b >= stable for b in new)  # never behind what was settled
            assert parser.seen - parser.stable <= 27
            got += new
            pos += n
        assert got == expect and not parser.done   # it looks for a zip after this one


def test_zips_back_to_back_are_all_parsed(tmp_path: Path) -> None:
    """A .distcp file: torch.save archives one after another."""
    torch, sd = _state_dict()
    blobs = []
    for i in range(3):
        path = tmp_path / f"part{i}.pt"
        torch.save({k: v + i for k, v in sd.items()}, path)
        blobs.append(path.read_bytes())
    raw = b"".join(blobs)
    want: list[int] = []
    at = 0
    for blob in blobs:
        if at:
            want.append(at)                   # where the next zip starts
        want += [at + b for b in formats.torch_zip_boundaries(blob)]
        at += len(blob)
    for n in (1, 7, 4096, len(raw)):
        parser, got = formats.ZipBoundaries(), []
        for pos in range(0, len(raw), n):
            got += parser.feed(raw[pos:pos + n])
        assert got == want


def test_zip_parser_not_fooled_by_descriptor_lookalikes(tmp_path: Path) -> None:
    # Member data holding descriptor signatures: stray ones, ones followed by
    # a zip signature, and a whole torch.save archive saved as a byte tensor.
    # Only a descriptor whose size field equals its distance from the data
    # start (and is followed by a signature) ends a member.
    torch = pytest.importorskip("torch")
    fake = b"PK\x07\x08" + struct.pack("<III", 0, 1000, 1000) + b"PK\x03\x04" * 4
    inner = io.BytesIO()
    torch.save({"a": torch.arange(100), "b": torch.ones(3)}, inner)
    blobs = [fake * 50 + b"PK\x07" + bytes(61), inner.getvalue(), b"PK\x07\x08" * 100]
    tensors = {f"x{i}": torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()
               for i, b in enumerate(blobs)}
    path = tmp_path / "tricky.pt"
    torch.save({**tensors, "y": torch.arange(10)}, path)
    raw = path.read_bytes()
    expect = [x for _, start, end in _zip_members(raw) for x in (start, end)]
    assert formats.torch_zip_boundaries(raw) == expect


def test_zip_with_sizes_in_local_headers() -> None:
    # Python's zipfile on a seekable file writes sizes up front (no descriptor).
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("a.bin", os.urandom(3000))
        z.writestr("b/c.bin", b"")
        z.writestr("d.bin", os.urandom(70000))
    raw = buf.getvalue()
    expect = [x for _, start, end in _zip_members(raw) for x in (start, end)]
    assert formats.torch_zip_boundaries(raw) == expect


def test_chunker_on_torch_save_stream(tmp_path: Path) -> None:
    torch, sd = _state_dict()
    path = tmp_path / "ckpt.pt"
    torch.save(sd, path)
    raw = path.read_bytes()
    bounds = formats.torch_zip_boundaries(raw)
    assert bounds
    whole = chunk_buffer(raw, *SMALL)
    chunker = Chunker(*SMALL)
    got = feed_in_pieces(chunker, raw, random_pieces(random.Random(2), (1, 2, 3, 31, 500, 8192)))
    assert chunker.format == "zip"
    assert got == whole
    edges = {o for o, _ in whole} | {len(raw)}
    assert set(bounds) <= edges
    # Chunk sizes: within [min, max] unless ended by a boundary or the stream.
    forced = set(bounds) | {len(raw)}
    for off, n in whole:
        assert n <= SMALL[2]
        assert n >= SMALL[0] or off + n in forced


def test_unchanged_tensors_dedup_across_versions(tmp_path: Path) -> None:
    # Version 2 changes one small tensor between big unchanged ones and is saved
    # under another file name (so every zip member header differs): with hints
    # only that tensor's chunk and the small header chunks are new.
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(3)
    sd = {f"w{i}": torch.randn(256, 256, generator=gen) for i in range(4)}
    sd["w1_lora"] = torch.zeros(8, 256)
    torch.save(sd, tmp_path / "step_1.pt")
    sd["w1_lora"] = torch.randn(8, 256, generator=gen)
    torch.save(sd, tmp_path / "step_2.pt")
    v1, v2 = (tmp_path / "step_1.pt").read_bytes(), (tmp_path / "step_2.pt").read_bytes()
    sizes = (4096, 16384, 65536)

    def new_bytes(detect: bool) -> int:
        old = set(_ids(v1, chunk_buffer(v1, *sizes, detect_format=detect)))
        chunks = chunk_buffer(v2, *sizes, detect_format=detect)
        return sum(n for (o, n), i in zip(chunks, _ids(v2, chunks)) if i not in old)

    changed = 8 * 256 * 4
    with_hints = new_bytes(True)
    assert changed <= with_hints < changed + 4096  # + pickle, headers, zip directory
    assert new_bytes(False) > with_hints


def test_format_detection() -> None:
    header = b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    st = struct.pack("<Q", len(header)) + header + bytes(8)
    hints = formats.FormatHints()
    assert [b for c in st for b in hints.feed(bytes([c]))] == [8 + len(header), 16 + len(header)]
    assert hints.format == "safetensors"
    for head, fmt in [(b"PK\x03\x04", "zip"), (b"\x00" * 9, "unknown"),
                      (b"GGUF\x03\x00\x00\x00\x00", "unknown")]:
        hints = formats.FormatHints()
        hints.feed(head)
        assert hints.format == fmt
    hints = formats.FormatHints(max_header=1000)  # a header too big to collect
    assert hints.feed(struct.pack("<Q", 5000) + b"{" + bytes(100)) == []
    assert hints.format == "unknown" and hints.stable == hints.seen
    # Malformed JSON or offsets: no hints, and chunking goes on unhinted.
    for bad in [b'{"t":{"data_offsets":[8,0]}}', b'{"t":', b'[1, 2]']:
        blob = struct.pack("<Q", len(bad)) + bad + bytes(100)
        assert formats.safetensors_boundaries(blob) is None
        chunker = Chunker(*SMALL)
        chunker.feed(blob)
        assert chunker.format == "unknown" and chunker.boundaries == []


def test_npz_zip64_sizes(tmp_path: Path) -> None:
    # numpy.savez writes sizes 0xFFFFFFFF in the local header and the real
    # ones in a zip64 extra field.
    np = pytest.importorskip("numpy")
    path = tmp_path / "arrays.npz"
    np.savez(path, a=np.arange(1000, dtype=np.float32), b=np.ones((3, 7)))
    raw = bytearray(path.read_bytes())
    # zipfile before Python 3.11.4 (Debian 12's 3.11.2) also writes the real sizes
    # into the 32-bit fields; later ones write 0xFFFFFFFF there, as zip64 wants.
    # Make every local header the latter, so the zip64 path runs on any Python.
    for info in zipfile.ZipFile(io.BytesIO(bytes(raw))).infolist():
        struct.pack_into("<II", raw, info.header_offset + 18, 0xFFFFFFFF, 0xFFFFFFFF)
    raw = bytes(raw)
    assert struct.unpack_from("<I", raw, 18)[0] == 0xFFFFFFFF
    expect = [x for _, start, end in _zip_members(raw) for x in (start, end)]
    assert formats.torch_zip_boundaries(raw) == expect


_TF_SAVE = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, tensorflow as tf
rng = np.random.default_rng(0)
v = {"w": tf.Variable(rng.standard_normal((300, 70)).astype("float32")),
     "b": tf.Variable(np.arange(70, dtype="int64")),
     "h": tf.Variable(rng.standard_normal((5, 3)).astype("float16")),
     "s": tf.Variable(3.5)}
prefix = tf.train.Checkpoint(**v).write(sys.argv[1])
for key, _ in tf.train.list_variables(prefix):
    if key != "_CHECKPOINTABLE_OBJECT_GRAPH":
        np.save(os.path.join(sys.argv[2], key.replace("/", "_") + ".npy"),
                tf.train.load_variable(prefix, key))
"""


def test_tf_bundle_index_real_checkpoint(tmp_path: Path) -> None:
    """tf_bundle_index finds every tensor TensorFlow wrote, at its bytes."""
    import importlib.util
    import subprocess
    import sys

    import numpy as np

    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow-cpu is not installed "
                    "(tools/setup-debian.sh --with-tests installs it)")
    values = tmp_path / "values"
    values.mkdir()
    subprocess.run([sys.executable, "-c", _TF_SAVE, str(tmp_path / "ck"), str(values)],
                   check=True, timeout=300, capture_output=True)
    entries = formats.tf_bundle_index((tmp_path / "ck.index").read_bytes())
    data = (tmp_path / "ck.data-00000-of-00001").read_bytes()
    by_key = {e.key: e for e in entries}
    assert "_CHECKPOINTABLE_OBJECT_GRAPH" in by_key
    checked = 0
    for npy in values.iterdir():
        want = np.load(npy)
        key = next(k for k in by_key if k.replace("/", "_") + ".npy" == npy.name)
        e = by_key[key]
        assert e.shard == 0 and e.size == want.nbytes, (key, e)
        assert data[e.offset:e.offset + e.size] == want.tobytes(), key
        checked += 1
    assert checked == 4     # w, b, h, s (write() keeps no save counter)
    # Entries tile the data file in offset order.
    assert [e.offset for e in entries] == sorted(e.offset for e in entries)
    assert entries[-1].offset + entries[-1].size == len(data)
    with pytest.raises(ValueError):
        formats.tf_bundle_index(data)
    with pytest.raises(ValueError):
        formats.tf_bundle_index((tmp_path / "ck.index").read_bytes()[:-1])


def _zstd_frames(rng: random.Random) -> tuple[bytes, list[int]]:
    """Frames of every kind back to back (checksums, raw/RLE/compressed blocks,
    multi-block frames, a skippable frame) and where each one ends."""
    import zstandard

    parts = []
    for level, checksum, data in [
            (3, False, rng.randbytes(300_000)),                 # raw blocks, 3 of them
            (3, True, bytes(200_000)),                           # RLE / tiny compressed
            (1, True, (b"tensor" * 5000) + rng.randbytes(1000)),
            (19, False, b"x"),
            (3, False, rng.randbytes(5))]:
        parts.append(zstandard.ZstdCompressor(level=level, write_checksum=checksum,
                                              write_content_size=level != 1).compress(data))
    parts.insert(2, struct.pack("<II", 0x184D2A53, 7) + b"skipped")
    ends, pos = [], 0
    for p in parts:
        pos += len(p)
        ends.append(pos)
    return b"".join(parts), ends


def test_zstd_frames_boundaries(rng: random.Random) -> None:
    stream, ends = _zstd_frames(rng)
    assert formats.ZstdFrames().feed(stream) == ends
    for _ in range(5):      # any split gives the same boundaries
        parser, got, pos = formats.ZstdFrames(), [], 0
        for n in random_pieces(rng, (1, 2, 3, 5, 17, 4096, 100_000)):
            got += parser.feed(stream[pos:pos + n])
            pos += n
            if pos >= len(stream):
                break
        assert got == ends
    # Other bytes between frames (a zarr3 shard index, B-tree nodes): a cut where
    # the next frame starts, learned from its magic; nothing inside them.
    index = b"\x00" * 16 + b"\xff" * 16 + b"crc!"
    node = b"\x0c\xdb\x20\xde" + rng.randbytes(5000).replace(b"\x28\xb5", b"")
    joined = stream + index + stream + node
    want = ends + [len(stream) + len(index)] + [len(stream) + len(index) + e for e in ends]
    assert formats.ZstdFrames().feed(joined) == want
    for _ in range(5):
        parser, got, pos = formats.ZstdFrames(), [], 0
        for n in random_pieces(rng, (1, 2, 3, 4, 5, 33, 4096)):
            before = parser.stable
            new = parser.feed(joined[pos:pos + n])
            assert all(b >= before for b in new), (before, new)    # nothing behind the scan
            got += new
            pos += n
            assert parser.seen - 4 <= parser.stable <= parser.seen
            if pos >= len(joined):
                break
        assert got == want
    hints = formats.FormatHints()
    assert hints.feed(stream[:3]) == [] and hints.format is None
    assert hints.feed(stream[3:]) == ends and hints.format == "zstd"


def test_zstd_frames_in_the_chunker_dedup_moved_values(rng: random.Random) -> None:
    """A value that moves within the data file (another value before it grew)
    is stored once with hints; CDC alone re-stores the chunks at its edges."""
    import zstandard

    comp = zstandard.ZstdCompressor(level=3)
    values = [comp.compress(rng.randbytes(n)) for n in (150_000, 90_000, 70_000, 300_000)]
    v1 = b"".join(values)
    values[0] = comp.compress(rng.randbytes(171_111))
    v2 = b"".join(values)

    def new_bytes(hints: bool) -> int:
        ids = {chunk_id(v1[o:o + n]) for o, n in chunk_buffer(v1, detect_format=hints)}
        return sum(n for o, n in chunk_buffer(v2, detect_format=hints)
                   if chunk_id(v2[o:o + n]) not in ids)

    assert new_bytes(True) == len(values[0])
    assert new_bytes(False) > len(values[0]) + 16 * 1024


# ---- BatchChunker: cut and named in one native call per buffer ------------------


def _reference_named(data: bytes, chunks: list[tuple[int, int]], crc_block: int) -> list:
    """What the write path stored before the batch call: the Chunker's cuts,
    each named from its own bytes (BLAKE3, per-block CRC-32C, zero test)."""
    out = []
    for off, n in chunks:
        piece = data[off:off + n]
        zero = not any(piece)
        out.append((off, n, b"" if zero else chunk_id(piece),
                    native.crc32c_blocks(piece, crc_block), zero))
    return out


def _batch_named(chunker: BatchChunker, data: bytes, sizes: Iterable[int]) -> list:
    out, pos, it = [], 0, iter(sizes)
    while pos <= len(data):
        n = next(it)
        named = chunker.feed_named(data[pos:pos + n]) if pos < len(data) else \
            chunker.finish_named()
        out += list(zip(named.offsets, named.lengths, named.ids, named.crcs, named.zero))
        if pos == len(data):
            break
        pos = min(pos + n, len(data))
    return out


def _with_zero_runs(rng: random.Random, n: int) -> bytes:
    data = bytearray(rng.randbytes(n))
    for _ in range(3):
        at = rng.randrange(n)
        run = rng.randrange(1, 4 * DEFAULT_MAX_SIZE)
        data[at:at + run] = bytes(len(data[at:at + run]))
    return bytes(data)


# BLAKE3 in the native call (a build with the BLAKE3 library), or in Python.
HASH_IN_C = [pytest.param(True, marks=pytest.mark.skipif(
    not native.chunk_feed_hashes(), reason="built without the BLAKE3 C library")), False]


@pytest.mark.parametrize("hash_in_c", HASH_IN_C)
@pytest.mark.parametrize("sizes,crc_block", [
    ((DEFAULT_MIN_SIZE, DEFAULT_AVG_SIZE, DEFAULT_MAX_SIZE), 64 * 1024),
    (SMALL, 64),
    ((64, 64, 64), 7),
])
def test_batch_chunker_matches_reference(rng: random.Random, sizes, crc_block,
                                         hash_in_c) -> None:
    """Same chunks, ids, CRCs and zero flags as the Chunker plus naming each
    chunk from its bytes, however the stream is split (writes that straddle
    chunk ends, 1-byte and unaligned pieces, forced cuts, zero runs)."""
    scale = sizes[2] // 64
    for trial in range(12):
        data = _with_zero_runs(rng, rng.randrange(1, 200 * scale) if trial % 4 else 4 * MIB)
        bounds = sorted(rng.sample(range(len(data) + 1), min(6, len(data)))) if trial % 2 else []
        whole = chunk_buffer(data, *sizes, boundaries=bounds, detect_format=False)
        pieces = (1, 3, 4095, sizes[0] - 1, sizes[2] + 1, 1 << 20, rng.randrange(1, 1 << 20))
        got = _batch_named(BatchChunker(*sizes, boundaries=bounds, detect_format=False,
                                        crc_block=crc_block, hash_in_c=hash_in_c),
                           data, random_pieces(rng, pieces))
        assert got == _reference_named(data, whole, crc_block)


@pytest.mark.parametrize("hash_in_c", HASH_IN_C)
def test_batch_chunker_on_torch_save_stream(tmp_path: Path, hash_in_c: bool) -> None:
    """Format hints (held bytes, forced cuts learned from the stream) give the
    same named chunks as the Chunker."""
    torch, sd = _state_dict()
    path = tmp_path / "ckpt.pt"
    torch.save(sd, path)
    raw = path.read_bytes()
    whole = chunk_buffer(raw, *SMALL)
    for seed in range(3):
        chunker = BatchChunker(*SMALL, crc_block=256, hash_in_c=hash_in_c)
        got = _batch_named(chunker, raw,
                           random_pieces(random.Random(seed), (1, 2, 3, 31, 500, 8192)))
        assert chunker.format == "zip"
        assert got == _reference_named(raw, whole, 256)


@pytest.mark.parametrize("hash_in_c", HASH_IN_C)
def test_whole_pieces_named_as_a_batch_chunker_names_them(rng: random.Random,
                                                          hash_in_c: bool) -> None:
    """Pieces shorter than the smallest chunk, named in one native call: the
    ids, CRCs and zero flags a BatchChunker fed each piece alone gives (the
    commit-time cut of small rewrites, staging.py)."""
    lens = [4096, 1, 63, 4097, DEFAULT_MIN_SIZE - 1, 4096, 100, 4096]
    pieces = [rng.randbytes(n) for n in lens]
    pieces[1] = bytes(1)
    pieces[5] = bytes(4096)                 # zeros: a hole, no id
    pieces[6] = bytes(99) + b"\x01"          # not zeros: the last byte counts
    gap = b"\xff" * 5
    data, offs = b"", []
    for piece in pieces:
        offs.append(len(data) + len(gap))
        data += gap + piece
    for crc_block in (64 * 1024, 16 * 1024):
        named = name_whole_pieces(data, offs, lens, crc_block=crc_block, hash_in_c=hash_in_c)
        assert named.offsets == offs and named.lengths == lens
        for k, piece in enumerate(pieces):
            chunker = BatchChunker(detect_format=False, crc_block=crc_block, hash_in_c=hash_in_c)
            assert not chunker.feed_named(piece).offsets
            want = chunker.finish_named()
            assert want.lengths == [len(piece)]
            assert (named.ids[k], named.crcs[k], named.zero[k]) == \
                (want.ids[0], want.crcs[0], want.zero[0]), k
    assert named.zero == [False, True, False, False, False, True, False, False]


def test_whole_pieces_refuses_what_a_cut_may_fall_inside() -> None:
    data = bytes(2 * DEFAULT_MIN_SIZE)
    with pytest.raises(ValueError):
        name_whole_pieces(data, [0], [DEFAULT_MIN_SIZE])
    with pytest.raises(ValueError):
        native.name_pieces(data, [len(data) - 10], [11], 64 * 1024)   # past the end
    with pytest.raises(ValueError):
        native.name_pieces(data, [0], [0], 64 * 1024)                 # empty


def test_chunk_feeder_rejects_bad_forced_cuts() -> None:
    feeder = native.ChunkFeeder(64, 256, 1024, 64)
    with pytest.raises(ValueError):
        feeder.feed(bytes(100), [50, 10])
    with pytest.raises(ValueError):
        feeder.feed(bytes(100), [101])
    with pytest.raises(ValueError):
        native.ChunkFeeder(64, 256, 2048, 64)      # 32 CRC blocks: more than a chunk holds


def test_chunk_feed_hashes_in_c_where_the_build_can() -> None:
    """tools/setup-debian.sh installs the BLAKE3 C library: there, a build
    without it is a mistake (the write path pays a GIL round trip per chunk)."""
    # What ckptfs/_native_build.py looks for (importing it would build).
    found = any(Path("/usr/share/cargo/registry").glob("blake3-*/c/blake3_dispatch.c"))
    if found and os.uname().machine == "x86_64" and "CKPTFS_BLAKE3_C" not in os.environ:
        assert native.chunk_feed_hashes()


def test_chunk_feed_releases_the_gil() -> None:
    def make_call(scale: int) -> Callable[[], object]:
        feeder = native.ChunkFeeder(DEFAULT_MIN_SIZE, DEFAULT_AVG_SIZE, DEFAULT_MAX_SIZE,
                                    64 * 1024)
        data = os.urandom(64 * MIB * scale)
        return lambda: feeder.feed(data, [])

    assert_releases_gil(make_call)


def test_gear_lanes_match_scalar_at_every_size_and_alignment(gear_lanes) -> None:
    """Random buffers of many lengths (around the lanes' thresholds: 16 lanes
    of 256 to 1024 bytes, groups of eight) starting at every alignment of a
    larger buffer, under random cut rules: the vector scan cuts exactly where
    the scalar loop does. Whole buffers and streamed in uneven pieces."""
    r = random.Random(0x5EA4)
    pool = bytearray(r.randbytes(3 * MIB + 64))
    # Stretches where the hash hits in bursts (a period divides the window).
    pool[MIB:MIB + 40_000] = b"\x00\x01" * 20_000
    pool[2 * MIB:2 * MIB + 30_000] = bytes(30_000)
    view = memoryview(bytes(pool))
    lengths = [0, 1, 63, 64, 65, 4095, 4096, 4097, 4103, 4104, 16383, 16384, 16385,
               16 * 1024 + 8 * 17, 65535, 65536, 65537, 300_001, MIB - 3, 3 * MIB]
    lengths += [r.randrange(1, 3 * MIB) for _ in range(12)]
    rules = LANE_SIZES + [SMALL, (8192, 8192, 24576), (256, 4096, 65536), (64, 64, 64)]
    for n in lengths:
        for align in (0, 1, 3, 7, 8, 13, 63):
            if align + n > len(view):
                continue
            data = view[align:align + n]
            sizes = r.choice(rules)
            gear_lanes(0)
            scalar = native.gear_cut_points(data, *sizes)
            gear_lanes(1)
            assert native.gear_cut_points(data, *sizes) == scalar, (n, align, sizes)
            if n <= 70_000 and sizes[1] <= 32768:
                assert scalar == ref_cut_points(bytes(data), *sizes), (n, align, sizes)
            scanner = native.GearScanner(*sizes)
            got, pos = [], 0
            while pos < n:
                step = r.choice((1, 7, 4096, 4097, 65536, 200_000))
                got += [pos + c for c in scanner.scan(data[pos:pos + step])]
                pos += step
            if scanner.pending:
                got.append(n)
            assert got == scalar, (n, align, sizes, "streamed")
