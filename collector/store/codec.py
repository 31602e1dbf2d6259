"""A run document's bytes as the store keeps them (``body``): zstd, zlib in stores written before."""

from __future__ import annotations

import threading
import zlib

import zstandard

#: zstd level of a stored document: a run of the bench workload (40 spans, 18 KB of JSON) is ~2.14 KB
#: in ~23 us at level 1, ~2.12 KB in ~28 us at level 3 (1% smaller for a fifth more time, paid on every
#: published run); zlib level 6, which stores written before used: ~2.2 KB in ~150 us (bench/store_size.py).
_ZSTD_LEVEL = 1
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_compressor = threading.local()


def pack(doc: bytes) -> bytes:
    """A run document (JSON) as the store keeps it: a zstd frame (a compressor per thread: they
    keep state between calls and are not thread-safe)."""
    compressor: zstandard.ZstdCompressor | None = getattr(_compressor, "zstd", None)
    if compressor is None:
        compressor = _compressor.zstd = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    return compressor.compress(doc)


def unpack(body: bytes) -> bytes:
    """The JSON of a stored document (``body``): a zstd frame, or zlib (0x78 header) as written
    before zstd."""
    if body[:4] == _ZSTD_MAGIC:
        return zstandard.ZstdDecompressor().decompress(body)
    return zlib.decompress(body)
