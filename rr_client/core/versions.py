"""The one version gate: every engine and trainer rr patches or subclasses is checked here, the same way.

``check_version("trl", Tested("1.16"))`` returns the installed version or raises
:class:`rr_client.core.errors.UnsupportedVersionError` naming the package, what was found, what was tested and the one
override (``RR_ALLOW_UNSUPPORTED_VERSION=1``). Versions are compared as release tuples at the precision the
tested bounds are written in (``"1.16"`` covers every ``1.16.x``; ``"0.5.23"`` only that patch release).
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from rr_client.core import settings
from rr_client.core.errors import ConfigurationError, UnsupportedVersionError

__all__ = ["Tested", "check_version", "installed_version", "parse_release", "OVERRIDE"]

OVERRIDE = "RR_ALLOW_UNSUPPORTED_VERSION"
_RELEASE = re.compile(r"^v?(\d+(?:\.\d+)*)")


def parse_release(version: str) -> tuple[int, ...]:
    """``"0.30.0+cpu"`` -> ``(0, 30, 0)``, ``"0.5.10.post1"`` -> ``(0, 5, 10)``; ValueError if not a release."""
    m = _RELEASE.match(version.strip()) if isinstance(version, str) else None
    if m is None:
        raise ConfigurationError(f"cannot parse version {version!r}")
    return tuple(int(x) for x in m.group(1).split("."))


@dataclass(frozen=True)
class Tested:
    """Releases rr was tested on: ``lo`` to ``hi`` inclusive (``hi`` defaults to ``lo``), each compared at the
    precision it is written in."""

    lo: str
    hi: str | None = None

    def covers(self, version: str) -> bool:
        """Whether ``version`` lies in the tested range (an unparsable version never does)."""
        try:
            rel = parse_release(version)
        except ValueError:
            return False
        lo, hi = parse_release(self.lo), parse_release(self.hi or self.lo)
        return lo <= rel[: len(lo)] and rel[: len(hi)] <= hi

    def __str__(self) -> str:
        return self.lo if not self.hi or self.hi == self.lo else f"{self.lo}-{self.hi}"


def installed_version(distributions: Sequence[str], module: str | None = None) -> str | None:
    """The version of the first installed distribution of ``distributions`` (metadata only, nothing imported); else
    the ``__version__`` of ``module`` when it is already imported (a source checkout without metadata); else None."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    version = getattr(sys.modules.get(module), "__version__", None) if module else None
    return str(version) if version else None


def check_version(
    package: str,
    tested: Tested,
    version: str | None = None,
    *,
    why: str = "",
    allow_unsupported: bool | None = None,
    distributions: Sequence[str] | None = None,
) -> str:
    """Return ``version`` (default: the installed ``package``'s) when ``tested`` covers it, else raise
    :class:`UnsupportedVersionError`. ``why`` says what rr relies on that moves between releases;
    ``allow_unsupported`` (default: the ``RR_ALLOW_UNSUPPORTED_VERSION`` flag) lets it through."""
    found = version if version is not None else installed_version(distributions or (package,))
    if found is not None and tested.covers(found):
        return found
    allowed = settings.flag(OVERRIDE) if allow_unsupported is None else allow_unsupported
    if allowed and found is not None:
        return found
    what = f"{package} {found}" if found is not None else f"no installed {package}"
    raise UnsupportedVersionError(
        f"rr was tested with {package} {tested}; found {what}."
        + (f" {why}." if why else "")
        + f" Pin a tested {package}, or set {OVERRIDE}=1 to run at your own risk.",
        package=package,
        version=found or "",
        tested=str(tested),
    )
