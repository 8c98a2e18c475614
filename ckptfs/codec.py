"""Compression of chunks on their way to backing storage.

A chunk (16 KiB to 256 KiB of a checkpoint file, cut anywhere: see
docs/CHUNKING.md) is encoded on its own into ``(codec, param, payload)``;
the pack layer stores the three with the chunk and hands them back to
:func:`decode_chunk` together with the chunk's length.  Codec numbers and
payload layouts are part of the on-disk format (docs/COMPRESSION.md):

======  ==================  =====  ============================================
codec   name                param  payload
======  ==================  =====  ============================================
0       CODEC_RAW           0      the chunk's bytes as they are
1       CODEC_ZSTD          0      one zstd frame with content size and checksum
2       CODEC_PLANES        width  byte planes, each raw / zstd / rANS (below)
3       CODEC_FLOAT         width  rANS of each element's top 16 bits, lower
                                   byte planes raw or rANS, CRC-32C (below)
======  ==================  =====  ============================================

:func:`encode_chunk` picks per chunk: chunks that look like little-endian
floats (``detect_float_width``; the element phase is found too, since cuts
fall anywhere inside a tensor) get CODEC_FLOAT, or CODEC_PLANES where their
exponents repeat in runs and that is smaller; everything else zstd; what
does not shrink is stored raw.  All functions block on byte work and are
meant for worker threads: the native parts and zstd release the GIL.
Decoding never returns bytes of the wrong length: damage raises
:class:`ckptfs.errors.DamagedData` (compressed payloads carry zstd's checksum
or a CRC-32C of the chunk; a raw payload is checked for length only, and the
pack layer's BLAKE3 id check covers the rest).

Decoding is bounded before it starts, whatever the payload or its record
claim: a chunk is at most ``MAX_CHUNK_BYTES`` (the largest ckptfs stores), a zstd
frame must announce the chunk's length (or none) and a
window of at most ``ZSTD_MAX_WINDOW_BYTES`` before anything is decompressed,
and the planes/float sections' own lengths must fit the payload. So a
decode never allocates more than about two chunks, however the input lies.
"""

from __future__ import annotations

import struct
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zstandard

from ckptfs import native
from ckptfs.chunker import MAX_CHUNK_BYTES
from ckptfs.errors import DamagedData

if TYPE_CHECKING:
    if sys.version_info >= (3, 12):
        from collections.abc import Buffer
    else:
        from typing_extensions import Buffer

__all__ = [
    "CODEC_RAW",
    "CODEC_ZSTD",
    "CODEC_PLANES",
    "CODEC_FLOAT",
    "CODEC_NAMES",
    "Encoded",
    "encode_chunk",
    "encode_planes",
    "decode_chunk",
    "decode_chunk_into",
    "detect_float_width",
]

CODEC_RAW = 0  # stored as is
CODEC_ZSTD = 1  # zstd of the bytes
CODEC_PLANES = 2  # byte planes (width in param), each raw, zstd or rANS
CODEC_FLOAT = 3  # rANS of each element's sign/exponent/top mantissa bits (width in param)

CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd", CODEC_PLANES: "planes", CODEC_FLOAT: "float"}

# CODEC_PLANES plane methods.
PLANE_RAW = 0
PLANE_ZSTD = 1
PLANE_RANS = 2

# Symbol bits per element for CODEC_FLOAT: sign, 8 exponent bits and up to 3
# mantissa bits.  More pay off only in the first few steps of a training run
# (docs/COMPRESSION.md); every bit doubles the frequency table.
FLOAT_MAX_BITS = 12

# Chunks shorter than this are stored raw or zstd'ed: too few elements for a
# frequency table to pay.
_FLOAT_MIN_LEN = 512

# `runs` (native.float_layout): how many times more often neighbouring
# elements share their sign/exponent byte than chance.  Trained weights sit
# at about 1.0, optimizer state above.  From _PLANES_TRY on, CODEC_PLANES
# (zstd finds the repeats in the exponent plane) is tried too and the
# smaller kept; from _PLANES_ONLY on it nearly always wins and CODEC_FLOAT
# is skipped (docs/COMPRESSION.md has the measurements).
_PLANES_TRY = 1.2
_PLANES_ONLY = 2.0
# zstd level for those exponent planes: level 1 stored less than 3 there, faster.
_PLANES_LEVEL = 1

# A frame this encoder writes for a chunk of n bytes has a window of at most
# n rounded up to a power of two; zstd needs no more memory than that to decode.
ZSTD_MAX_WINDOW_BYTES = 2 * MAX_CHUNK_BYTES

_SECTION = struct.Struct("<BI")
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class Encoded:
    """One encoded chunk: store all three; ``param`` is 0..255."""

    codec: int
    param: int
    payload: bytes


# zstandard's (de)compressor objects are not thread-safe: one set per thread.
_local = threading.local()


def _compressor(level: int, checksum: bool = True) -> zstandard.ZstdCompressor:
    """This thread's compressor at level. checksum=False inside CODEC_PLANES,
    where the payload's CRC covers everything: no per-plane checksum."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get((level, checksum))
    if c is None:
        c = cache[level, checksum] = zstandard.ZstdCompressor(
            level=level, write_checksum=checksum, write_content_size=True
        )
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW_BYTES)
    return d


def _bytes_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    return view


def detect_float_width(data: Buffer) -> int | None:
    """2 (bf16/fp16), 4 (fp32) or None, guessed from the bytes alone.

    Looks at the byte entropy at each position modulo 4 (of up to 16 KiB
    sampled evenly): a float's sign/exponent byte is far more predictable
    than its low mantissa bytes, and bf16 shows it at every other byte, fp32
    at every fourth.  The element phase does not matter.
    """
    width, _, _ = native.float_layout(data, 0)
    return width or None


# ---- encoding ---------------------------------------------------------------------


def encode_chunk(data: Buffer, *, width_hint: int | None = None, level: int = 3) -> Encoded:
    """Encode one chunk, choosing the codec.

    ``width_hint`` (2..16, e.g. from a safetensors dtype) skips the float
    detection and uses that element width; the phase is still found from the
    bytes.  ``level`` is the zstd level of CODEC_ZSTD.  A chunk that does not shrink is
    stored CODEC_RAW.  (The exponent planes of CODEC_PLANES always use zstd
    level 1: higher levels stored more there.)
    """
    view = _bytes_view(data)
    n = len(view)
    if n == 0:
        return Encoded(CODEC_RAW, 0, b"")
    if width_hint is not None and not 2 <= width_hint <= 16:
        raise ValueError(f"width_hint must be 2..16, got {width_hint}")

    best: Encoded | None = None
    if n >= _FLOAT_MIN_LEN:
        width, phase, runs = native.float_layout(view, width_hint or 0)
        if width and runs >= _PLANES_TRY:
            alt = encode_planes(view, width, phase=phase, level=_PLANES_LEVEL)
            if alt.codec == CODEC_PLANES:
                best = alt
        if width and (best is None or runs < _PLANES_ONLY):
            payload = native.fc_encode(view, width, phase, FLOAT_MAX_BITS,
                                       n - 1 if best is None else len(best.payload) - 1)
            if payload is not None:
                best = Encoded(CODEC_FLOAT, width, payload)
    if best is None:
        # Not float-like (headers, pickles, zero runs, integers): zstd.
        z = _compressor(level).compress(view)
        if len(z) < n:
            best = Encoded(CODEC_ZSTD, 0, z)
    if best is None:
        return Encoded(CODEC_RAW, 0, bytes(view))
    return best


def encode_planes(data: Buffer, width: int, *, phase: int | None = None, level: int = 3) -> Encoded:
    """CODEC_PLANES encoding of ``data`` (or CODEC_RAW if it does not shrink).

    :func:`encode_chunk` tries it for float chunks whose exponents repeat
    in runs (optimizer state); callers that know their data is, say,
    integers of ``width`` bytes may use it directly.  ``phase`` defaults to
    the one :func:`native.float_layout` finds.
    """
    view = _bytes_view(data)
    n = len(view)
    if not 2 <= width <= 16:
        raise ValueError(f"width must be 2..16, got {width}")
    if phase is None:
        phase = native.float_layout(view, width)[1] if n >= 4 * width else 0
    if not 0 <= phase < width:
        raise ValueError(f"phase must be in [0, {width}), got {phase}")
    if n < phase + width:
        return Encoded(CODEC_RAW, 0, bytes(view))
    count = (n - phase) // width
    body = count * width
    split = native.split_planes(view[phase : phase + body], width)
    planes = memoryview(split)
    parts = [bytes([phase]), view[:phase], view[phase + body :]]
    cctx = _compressor(level, checksum=False)
    for j in range(width):
        plane = planes[j * count : (j + 1) * count]
        method, blob = PLANE_RAW, plane
        top = j == width - 1
        if top:  # the sign/exponent plane: zstd first (runs, repeats)
            z = cctx.compress(plane)
            if len(z) < len(blob):
                method, blob = PLANE_ZSTD, z
        # rANS must save 3% (or beat zstd); its estimate skips hopeless tries.
        cap = len(blob) - 1 if top else count - count // 32
        r = native.rans8_encode(plane, cap) if count >= 64 else None
        if r is not None:
            method, blob = PLANE_RANS, r
        # zstd for low planes that order-0 can shrink, or that are constant
        # (rANS leaves those); not for random-looking mantissas.
        if not top and (r is not None or count < 64 or split.count(
                split[j * count : j * count + 1], j * count, (j + 1) * count) == count):
            z = cctx.compress(plane)
            if len(z) < len(blob):
                method, blob = PLANE_ZSTD, z
        parts.append(_SECTION.pack(method, len(blob)))
        parts.append(blob)
    parts.append(_CRC.pack(native.crc32c(view)))
    payload = b"".join(parts)
    if len(payload) >= n:
        return Encoded(CODEC_RAW, 0, bytes(view))
    return Encoded(CODEC_PLANES, width, payload)


# ---- decoding ---------------------------------------------------------------------


def decode_chunk(codec: int, param: int, payload: Buffer, length: int) -> bytes:
    """The chunk's ``length`` bytes from an encoding: the exact inverse of
    :func:`encode_chunk` / :func:`encode_planes`.

    Raises DamagedData for an unknown codec or param, a length over
    MAX_CHUNK_BYTES, or any payload that is corrupt, short or long, before
    allocating the chunk.  Never returns data of another length.
    """
    src = _bytes_view(payload)
    _check_bounds(length)
    if codec == CODEC_RAW or codec == CODEC_ZSTD:
        return _decode_simple(codec, param, src, length)
    if codec == CODEC_FLOAT and 2 <= param <= 16 and length > 0:
        data = native.fc_decode(src, param, length)
        if data is None:
            raise DamagedData(f"damaged CODEC_FLOAT payload for a {length}-byte chunk")
        return data
    out = bytearray(length)
    decode_chunk_into(codec, param, payload, out)
    return bytes(out)


def decode_chunk_into(codec: int, param: int, payload: Buffer, out: Buffer) -> None:
    """Like :func:`decode_chunk`, decoding into the writable buffer ``out``,
    whose size is the chunk's length (no copy for CODEC_FLOAT).  On
    DamagedData ``out`` holds garbage."""
    dst = _bytes_view(out)
    if dst.readonly:
        raise ValueError("out must be writable")
    length = len(dst)
    src = _bytes_view(payload)
    _check_bounds(length)
    if codec == CODEC_FLOAT:
        if not 2 <= param <= 16:
            raise DamagedData(f"CODEC_FLOAT with width {param}")
        if length == 0 or not native.fc_decode_into(src, param, dst):
            raise DamagedData(f"damaged CODEC_FLOAT payload ({len(src)} bytes for {length})")
    elif codec == CODEC_PLANES:
        _decode_planes(param, src, dst)
    elif codec == CODEC_RAW or codec == CODEC_ZSTD:
        dst[:] = _decode_simple(codec, param, src, length)
    else:
        raise DamagedData(f"unknown codec {codec}")


def _check_bounds(length: int) -> None:
    if not 0 <= length <= MAX_CHUNK_BYTES:
        raise DamagedData(f"chunk length {length} is outside 0..{MAX_CHUNK_BYTES}")


def _check_frame(src, length: int, what: str) -> None:
    """A zstd frame's header must announce `length` bytes (or no size) and a
    window we allow, before anything is decompressed."""
    fp = zstandard.get_frame_parameters(src)
    if fp.content_size not in (length, zstandard.CONTENTSIZE_UNKNOWN):
        raise DamagedData(f"zstd {what} for {fp.content_size} bytes, expected {length}")
    if fp.window_size > ZSTD_MAX_WINDOW_BYTES:
        raise DamagedData(f"zstd {what} asks for a {fp.window_size}-byte window "
                          f"(at most {ZSTD_MAX_WINDOW_BYTES})")


def _decode_simple(codec: int, param: int, src: memoryview, length: int) -> bytes:
    if param != 0:
        raise DamagedData(f"codec {codec} with param {param}")
    if codec == CODEC_RAW:
        if len(src) != length:
            raise DamagedData(f"raw payload of {len(src)} bytes for a {length}-byte chunk")
        return bytes(src)
    try:
        # Frames from this encoder carry their content size and a checksum;
        # the first ckptfs versions wrote zstd's defaults (no checksum), and
        # those packs must stay readable: the length check still applies.
        _check_frame(src, length, "frame")
        data = _decompressor().decompress(src, max_output_size=length, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise DamagedData(f"damaged zstd payload: {exc}") from None
    if len(data) != length:
        raise DamagedData(f"zstd payload decoded to {len(data)} bytes, not {length}")
    return data


def _decode_planes(width: int, src: memoryview, dst: memoryview) -> None:
    n = len(dst)
    if not 2 <= width <= 16:
        raise DamagedData(f"CODEC_PLANES with width {width}")
    if len(src) < 1 + 4:
        raise DamagedData("CODEC_PLANES payload too short")
    phase = src[0]
    if phase >= width or n < phase + width:
        raise DamagedData(f"CODEC_PLANES phase {phase} for width {width}, length {n}")
    count = (n - phase) // width
    body = count * width
    tail = n - phase - body
    pos = 1
    if len(src) < pos + phase + tail + 4:
        raise DamagedData("CODEC_PLANES payload too short")
    dst[:phase] = src[pos : pos + phase]
    pos += phase
    dst[phase + body :] = src[pos : pos + tail]
    pos += tail
    planes = bytearray(body)
    dctx = _decompressor()
    for j in range(width):
        if len(src) < pos + _SECTION.size:
            raise DamagedData("CODEC_PLANES payload too short")
        method, size = _SECTION.unpack_from(src, pos)
        pos += _SECTION.size
        if len(src) < pos + size:
            raise DamagedData("CODEC_PLANES section runs past the payload")
        blob = src[pos : pos + size]
        pos += size
        target = memoryview(planes)[j * count : (j + 1) * count]
        if method == PLANE_RAW:
            if size != count:
                raise DamagedData("CODEC_PLANES raw plane of the wrong size")
            target[:] = blob
        elif method == PLANE_ZSTD:
            try:
                _check_frame(blob, count, "plane")
                if zstandard.get_frame_parameters(blob).content_size != count:
                    raise DamagedData("CODEC_PLANES zstd plane of the wrong size")
                plane = dctx.decompress(blob, max_output_size=count, allow_extra_data=False)
            except zstandard.ZstdError as exc:
                raise DamagedData(f"damaged zstd plane: {exc}") from None
            if len(plane) != count:
                raise DamagedData("CODEC_PLANES zstd plane of the wrong size")
            target[:] = plane
        elif method == PLANE_RANS:
            if not native.rans8_decode_into(blob, target):
                raise DamagedData("damaged rANS plane")
        else:
            raise DamagedData(f"unknown plane method {method}")
    if len(src) != pos + _CRC.size:
        raise DamagedData("CODEC_PLANES payload has trailing bytes")
    dst[phase : phase + body] = native.merge_planes(planes, width)
    if native.crc32c(dst) != _CRC.unpack_from(src, pos)[0]:
        raise DamagedData("CODEC_PLANES CRC mismatch")
