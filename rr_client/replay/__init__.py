"""Routing replay (R3), recording (R2) and the replay audit for Hugging Face transformers 5.x MoE models.

``replay_routing`` / ``record_routing`` live in :mod:`rr_client.replay._core`, the routers' weight formulas
in :mod:`rr_client.replay.formulas`, the family coverage table in :mod:`rr_client.replay.coverage`
(``python -m rr_client.replay.coverage`` writes ``docs/replay-coverage.md``). ``ReplayError`` and
``UnsupportedModelError`` are defined in :mod:`rr_client.errors` and re-exported here.
"""

from rr_client.errors import ReplayError, UnsupportedModelError
from rr_client.replay._core import RoutingRecord, find_routers, record_routing, replay_routing, survey
from rr_client.replay.coverage import Family, coverage, family_status
from rr_client.replay.formulas import HASH_ROUTERS, SUPPORTED_ROUTERS

__all__ = [
    "ReplayError",
    "UnsupportedModelError",
    "RoutingRecord",
    "replay_routing",
    "record_routing",
    "find_routers",
    "survey",
    "SUPPORTED_ROUTERS",
    "HASH_ROUTERS",
    "Family",
    "coverage",
    "family_status",
]
