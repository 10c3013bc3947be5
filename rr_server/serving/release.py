"""Engine version strings to comparable release tuples: vLLM's and SGLang's facts compare these.

The parsing itself is :func:`rr_client.core.versions.parse_release` (the one version gate's); here a release needs at
least ``major.minor`` and is padded to three parts, so the engines' facts compare plain 3-tuples.
"""

from __future__ import annotations

from rr_client.core.versions import parse_release as _parse

__all__ = ["parse_release"]


def parse_release(version: str) -> tuple[int, int, int]:
    """``"0.30.0+cpu"`` -> ``(0, 30, 0)``, ``"0.5.10.post1"`` -> ``(0, 5, 10)``; ValueError if it is not a release."""
    try:
        rel = _parse(version)
    except ValueError:
        rel = ()
    if len(rel) < 2:
        raise ValueError(f"cannot parse engine version {version!r}")
    major, minor, patch = (*rel, 0)[:3]
    return major, minor, patch
