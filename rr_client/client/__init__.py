"""rr's client layer: :class:`RoutedExpertsClient` (httpx) over one server or replicas, its checked results,
ref resolution, multi-turn trajectories and the OpenAI helpers. Stands on :mod:`rr_client.core` only.

Names load on first use, so ``import rr_client.client`` (and the root facade) stays httpx-free until a client
is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rr_client.core.optional import lazy_getattr

if TYPE_CHECKING:
    from rr_client.client._client import Prompt, RoutedExpertsClient
    from rr_client.client._pd import PDClient
    from rr_client.client._replicas import ReplicaStats
    from rr_client.client._results import GenerateBatch, GenerateResult, parse_sample
    from rr_client.client.source_audit import SourceAudit
    from rr_client.client.trajectory import ChatTrajectory, Trajectory, TurnSpan

# name -> module that defines it
_LAZY = {
    "RoutedExpertsClient": "rr_client.client._client",
    "Prompt": "rr_client.client._client",
    "ReplicaStats": "rr_client.client._replicas",
    "PDClient": "rr_client.client._pd",
    "GenerateBatch": "rr_client.client._results",
    "GenerateResult": "rr_client.client._results",
    "parse_sample": "rr_client.client._results",
    "Trajectory": "rr_client.client.trajectory",
    "ChatTrajectory": "rr_client.client.trajectory",
    "TurnSpan": "rr_client.client.trajectory",
    "SourceAudit": "rr_client.client.source_audit",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
