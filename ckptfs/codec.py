"""Compression of chunks on their way to backing storage: plain zstd for now.

`encode_chunk` stores a chunk zstd-compressed, or raw when that does not
shrink it; `decode_chunk` is its exact inverse and raises DamagedData on any
damaged input. Codec numbers are part of the pack format.
"""

from __future__ import annotations

from dataclasses import dataclass

import zstandard

from .errors import DamagedData

CODEC_RAW = 0
CODEC_ZSTD = 1


@dataclass(frozen=True)
class Encoded:
    codec: int
    param: int
    payload: bytes


def encode_chunk(data, *, width_hint=None, level: int = 3) -> Encoded:
    """May block."""
    raw = bytes(data)
    out = zstandard.ZstdCompressor(level=level).compress(raw)
    if len(out) >= len(raw):
        return Encoded(CODEC_RAW, 0, raw)
    return Encoded(CODEC_ZSTD, 0, out)


def decode_chunk(codec: int, param: int, payload, length: int) -> bytes:
    """May block."""
    if codec == CODEC_RAW:
        data = bytes(payload)
    elif codec == CODEC_ZSTD:
        try:
            data = zstandard.ZstdDecompressor().decompress(bytes(payload),
                                                           max_output_size=length)
        except zstandard.ZstdError as e:
            raise DamagedData(f"zstd: {e}") from e
    else:
        raise DamagedData(f"unknown codec {codec}")
    if len(data) != length:
        raise DamagedData(f"decoded {len(data)} bytes, expected {length}")
    return data
