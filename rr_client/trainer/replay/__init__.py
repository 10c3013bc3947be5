"""Routing replay (R3), recording (R2) and the replay audit for Hugging Face transformers 5.x MoE models.

``replay_routing`` lives in :mod:`rr_client.trainer.replay._replay` (rows validated once per block by ``_rows``, the
audit in ``_audit``), ``record_routing`` in ``_record``, router discovery and hooks in ``_routers``, the
routers' weight formulas in :mod:`rr_client.trainer.replay.formulas`, the family coverage table in
:mod:`rr_client.trainer.replay.coverage` (``python -m rr_client.trainer.replay.coverage`` writes ``docs/replay-coverage.md``).
``ReplayError`` and ``UnsupportedModelError`` are defined in :mod:`rr_client.core.errors` and re-exported here.
"""

from rr_client.core.errors import ReplayError, UnsupportedModelError
from rr_client.trainer.replay._indexer import count_indexers, find_indexers, replay_indexer
from rr_client.trainer.replay._record import RoutingRecord, record_routing
from rr_client.trainer.replay._replay import CHECK_EVERY, replay_routing
from rr_client.trainer.replay._routers import LeftRouter, Router, find_routers, survey
from rr_client.trainer.replay.coverage import Family, coverage, family_status
from rr_client.trainer.replay.formulas import HASH_ROUTERS, SUPPORTED_ROUTERS

__all__ = [
    "ReplayError",
    "UnsupportedModelError",
    "RoutingRecord",
    "replay_routing",
    "record_routing",
    "replay_indexer",
    "find_indexers",
    "count_indexers",
    "CHECK_EVERY",
    "find_routers",
    "survey",
    "Router",
    "LeftRouter",
    "SUPPORTED_ROUTERS",
    "HASH_ROUTERS",
    "Family",
    "coverage",
    "family_status",
]
