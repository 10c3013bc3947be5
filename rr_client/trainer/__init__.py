"""rr's trainer layer: routing laid out for a trainer, replayed (R3) or recorded (R2) in a transformers model,
measured, and driven per micro-batch by one :class:`ReplaySession` behind every trainer integration.

Imports torch. Sits above the wire core and the client (it reads their checked samples) and below
:mod:`rr_client.integrations` (TRL, verl), which adapt a trainer's loop to the session.

- :mod:`rr_client.trainer.layouts`: :func:`to_tensors` / :func:`to_packed` (padded and packed batches).
- :mod:`rr_client.trainer.rows`: :class:`ReplayRows`, the one form of replay input and its one check.
- :mod:`rr_client.trainer.replay`: :func:`replay_routing`, :func:`record_routing`, the audit, the coverage table;
  :func:`replay_indexer` (sparse-attention indexer picks).
- :mod:`rr_client.trainer.metrics`: the log-prob gap and routing agreement.
- :mod:`rr_client.trainer.session`: :class:`ReplaySession`; :mod:`rr_client.trainer.keys`: its metric names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rr_client.core.optional import lazy_getattr

if TYPE_CHECKING:
    from rr_client.trainer import keys
    from rr_client.trainer.layouts import PackedRouting, RoutingTensors, tensor_dtype, to_packed, to_tensors
    from rr_client.trainer.metrics import r3_metrics
    from rr_client.trainer.replay import record_routing, replay_indexer, replay_routing
    from rr_client.trainer.rows import ReplayRows
    from rr_client.trainer.session import ReplaySession

__all__ = [
    "ReplaySession",
    "to_tensors",
    "to_packed",
    "RoutingTensors",
    "PackedRouting",
    "tensor_dtype",
    "ReplayRows",
    "replay_routing",
    "record_routing",
    "replay_indexer",
    "r3_metrics",
    "keys",
]

_LAZY = {
    "ReplaySession": "rr_client.trainer.session",
    "to_tensors": "rr_client.trainer.layouts",
    "to_packed": "rr_client.trainer.layouts",
    "RoutingTensors": "rr_client.trainer.layouts",
    "PackedRouting": "rr_client.trainer.layouts",
    "tensor_dtype": "rr_client.trainer.layouts",
    "ReplayRows": "rr_client.trainer.rows",
    "replay_routing": "rr_client.trainer.replay",
    "record_routing": "rr_client.trainer.replay",
    "replay_indexer": "rr_client.trainer.replay",
    "r3_metrics": "rr_client.trainer.metrics",
}

__getattr__ = lazy_getattr(__name__, {**_LAZY, "keys": "rr_client.trainer.keys"})
