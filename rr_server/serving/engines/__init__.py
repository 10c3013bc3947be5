"""Each engine's releases, one module per engine: tested range, per-release facts, fixes and their upstream issues.

``releases("vllm")`` is the engine's :class:`EngineReleases`, asked (``.facts_for(version)``, ``.tested``,
``.draft_fix_release``), never compared by name. A third engine is one more module here, one more
:class:`rr_client.core.engines.Engine` in the core, and its adapter.
"""

from __future__ import annotations

from collections.abc import Mapping

from rr_client.core.engines import Engine, engine
from rr_server.serving.engines import sglang, vllm
from rr_server.serving.engines.base import EngineReleases, ReleaseFacts, engine_release

__all__ = ["EngineReleases", "ReleaseFacts", "RELEASES", "releases", "engine_release", "LOADED_UNFLUSHED_ANSWERS"]

RELEASES: Mapping[str, EngineReleases] = {r.name: r for r in (vllm.RELEASES, sglang.RELEASES)}
#: every text by which a release of any engine says a failed weight update loaded the weights anyway
LOADED_UNFLUSHED_ANSWERS: tuple[str, ...] = tuple(a for r in RELEASES.values() for a in r.loaded_unflushed_answers)


def releases(name: str | Engine) -> EngineReleases:
    """The releases of the engine called ``name``; ConfigurationError naming the unknown engine and the known ones."""
    return RELEASES[engine(name).name]
