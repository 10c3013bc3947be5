"""Read a PNG's size without an image library, checking that the file is a PNG: signature, IHDR (CRC), IEND."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

__all__ = ["png_size"]

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """``(width, height)`` from the IHDR chunk; AssertionError when the file is not a whole PNG."""
    data = Path(path).read_bytes()
    assert data[:8] == SIGNATURE, f"{path}: not a PNG (starts {data[:8]!r})"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13, f"{path}: first chunk {kind!r} ({length} bytes), not IHDR"
    body = data[16:29]
    (crc,) = struct.unpack(">I", data[29:33])
    assert zlib.crc32(kind + body) == crc, f"{path}: IHDR CRC mismatch"
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82", f"{path}: no IEND chunk at the end (truncated?)"
    width, height = struct.unpack(">II", body[:8])
    return width, height
