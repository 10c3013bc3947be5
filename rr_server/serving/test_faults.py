"""Test-only fault injection: the silent engine faults the source audit must catch, made on purpose in a real server.

Off unless the server runs with ``RR_TEST_FAULTS=1`` (never set it in production); then a request whose ``rid``
starts with ``rr-fault-<name>-`` has its rows corrupted, just before rr checks and encodes them, the way an engine
bug would leave them (well formed, valid ids). Each fault imitates one bug found in an engine's GPU path:

- ``shift_decode``: every generated token's row is the previous token's (decode rows written one slot late);
- ``other_request``: the rows of the request this process served before (another request's KV slot);
- ``draft_node``: every generated token's row is the next token's (a tree-verification node other than the accepted
  one: SGLang #37949);
- ``stale_cache``: the cached prompt's rows (or, with no cache hit, the whole prompt's) routed as other weights would
  (expert ids moved by one: rows from an uncleared cache after a weight push).
"""

from __future__ import annotations

import numpy as np

from rr_client.core import settings

__all__ = ["FAULTS_ENV", "FAULT_PREFIX", "FAULTS", "fault_of", "inject"]

FAULTS_ENV = "RR_TEST_FAULTS"
FAULT_PREFIX = "rr-fault-"
FAULTS = ("shift_decode", "other_request", "draft_node", "stale_cache")

_last: list[np.ndarray] = []  # the rows of the request served before (other_request)


def fault_of(rid: str | None) -> str | None:
    """The fault ``rid`` asks for, when the server runs with ``RR_TEST_FAULTS=1`` (else None)."""
    if not rid or not rid.startswith(FAULT_PREFIX) or not settings.flag(FAULTS_ENV):
        return None
    name = rid[len(FAULT_PREFIX) :].split("-", 1)[0]
    return name if name in FAULTS else None


def inject(rows: np.ndarray | None, rid: str | None, *, prompt_tokens: int, cached_tokens: int, start: int) -> object:
    """``rows`` (``[rows, layers, k]`` of positions ``start ..``) with ``rid``'s fault made; unchanged otherwise."""
    if rows is None or not settings.flag(FAULTS_ENV):
        return rows
    fault = fault_of(rid)
    out = np.array(rows, copy=True)
    gen = max(0, prompt_tokens - start)  # index of the first generated token's row
    if fault == "shift_decode" and out.shape[0] > gen:
        out[gen + 1 :] = rows[gen:-1]
    elif fault == "draft_node" and out.shape[0] > gen + 1:
        out[gen:-1] = rows[gen + 1 :]
    elif fault == "other_request" and _last:
        prev = _last[0]
        reps = -(-out.shape[0] // max(1, prev.shape[0]))
        out = np.concatenate([prev] * reps)[: out.shape[0]] if prev.shape[1:] == out.shape[1:] else out
    elif fault == "stale_cache":
        end = max(0, (cached_tokens or prompt_tokens) - start)
        moe = np.asarray(rows).any(axis=(0, 2))  # dense layers stay all zero
        top = max(int(np.asarray(rows).max()) + 1, 2)
        out[:end, moe] = (rows[:end, moe].astype(np.int64) + 1) % top
    _last[:] = [np.array(rows, copy=True)]
    return out
