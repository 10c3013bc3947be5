"""rr's client layer: :class:`RoutedExpertsClient` (httpx) over one server or replicas, its checked results,
ref resolution, multi-turn trajectories and the OpenAI helpers. Stands on :mod:`rr_client.core` only.

Names load on first use, so ``import rr_client.client`` (and the root facade) stays httpx-free until a client
is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rr_client.client._client import Prompt, RoutedExpertsClient
    from rr_client.client._replicas import ReplicaStats
    from rr_client.client._results import GenerateBatch, GenerateResult, parse_sample
    from rr_client.client.trajectory import ChatTrajectory, Trajectory, TurnSpan

# name -> module that defines it
_LAZY = {
    "RoutedExpertsClient": "rr_client.client._client",
    "Prompt": "rr_client.client._client",
    "ReplicaStats": "rr_client.client._replicas",
    "GenerateBatch": "rr_client.client._results",
    "GenerateResult": "rr_client.client._results",
    "parse_sample": "rr_client.client._results",
    "Trajectory": "rr_client.client.trajectory",
    "ChatTrajectory": "rr_client.client.trajectory",
    "TurnSpan": "rr_client.client.trajectory",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    """Load a public name's module on first use (httpx stays unloaded until then)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rr_client.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
