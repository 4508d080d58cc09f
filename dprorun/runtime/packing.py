"""A tiny file-bundle format for shipping a rank's trace files over the network: no pickle, names checked.

Layout: 8-byte big-endian header length, a JSON header {"files": [{"name", "size"}]}, then the file bytes,
all zlib-compressed.
"""
from __future__ import annotations

import json
import re
import struct
import zlib

ALLOWED_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
MAX_BUNDLE_BYTES = 4 << 30


class BundleError(ValueError):
    pass


def pack_files(files: dict[str, bytes]) -> bytes:
    for name in files:
        if not ALLOWED_NAME.match(name) or name in (".", ".."):
            raise BundleError(f"refusing to pack file name {name!r}")
    header = json.dumps({"files": [{"name": n, "size": len(b)} for n, b in files.items()]}).encode()
    body = struct.pack(">Q", len(header)) + header + b"".join(files.values())
    return zlib.compress(body, 3)


def unpack_files(blob: bytes) -> dict[str, bytes]:
    try:
        inflater = zlib.decompressobj()
        body = inflater.decompress(blob, MAX_BUNDLE_BYTES)
    except zlib.error as exc:
        raise BundleError(f"corrupted bundle: {exc}") from None
    if inflater.unconsumed_tail:
        raise BundleError(f"bundle larger than {MAX_BUNDLE_BYTES} bytes")
    if len(body) < 8:
        raise BundleError("bundle too short")
    (header_len,) = struct.unpack(">Q", body[:8])
    if header_len > len(body) - 8:
        raise BundleError("bundle header length out of range")
    try:
        header = json.loads(body[8:8 + header_len])
        entries = header["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"bad bundle header: {exc}") from None
    out: dict[str, bytes] = {}
    offset = 8 + header_len
    for entry in entries:
        name, size = entry.get("name"), entry.get("size")
        if not isinstance(name, str) or not ALLOWED_NAME.match(name) or name in (".", ".."):
            raise BundleError(f"bundle names a file {name!r} outside the rank folder")
        if not isinstance(size, int) or size < 0 or offset + size > len(body):
            raise BundleError(f"bundle entry {name!r} has a bad size")
        out[name] = body[offset:offset + size]
        offset += size
    if offset != len(body):
        raise BundleError("bundle has trailing bytes")
    return out
