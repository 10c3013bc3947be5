"""Engine version strings to comparable release tuples: the one parser for vLLM and SGLang versions."""

from __future__ import annotations

import re

__all__ = ["parse_release"]

_RELEASE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_release(version: str) -> tuple[int, int, int]:
    """``"0.30.0+cpu"`` -> ``(0, 30, 0)``, ``"0.5.10.post1"`` -> ``(0, 5, 10)``; ValueError if it is not a release."""
    m = _RELEASE.match(version.strip()) if isinstance(version, str) else None
    if m is None:
        raise ValueError(f"cannot parse engine version {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
