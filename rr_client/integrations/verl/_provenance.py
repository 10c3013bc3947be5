"""Each sample's provenance from what verl 0.9.1's own rollout puts in its batch, and the stale-rows policy on it.

verl's agent loop copies its rollout server's per-sample ``extra_fields`` into the batch (``non_tensor_batch``,
then a ``NonTensorStack`` in the actor's TensorDict, cut with its micro-batches):

- ``num_cached_tokens``: vLLM's ``RequestOutput.num_cached_tokens`` (``vllm_async_server.generate``): the prompt
  tokens whose KV, and so whose rows, came from the prefix cache. A multi-turn trajectory keeps its first turn's.
- ``min_global_steps`` / ``max_global_steps``: the weight versions a trajectory ran under (verl's fully-async
  partial rollouts); different: its rows may be recomputed under other weights than its tokens were sampled with.
- ``rr_provenance``: rr's own wire object (:meth:`rr_client.core.provenance.Provenance.from_dict`), where a
  rollout path put it there; it wins over verl's fields.

verl reports no per-sample preemption count, so a sample spanning versions is treated as possibly recomputed
(rr's rule for an unknown count). A sample with none of these fields is counted ``r3/provenance_unknown``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from rr_client.core import settings
from rr_client.core.errors import StaleRoutingError
from rr_client.core.provenance import PROVENANCE_FIELD, Provenance, ProvenanceCheck, StalePolicy, check_stale_policy
from rr_client.trainer.provenance import check_provenances

CACHED_KEY = "num_cached_tokens"
FIRST_VERSION_KEY, LAST_VERSION_KEY = "min_global_steps", "max_global_steps"
POLICY_SETTING = "RR_STALE_ROWS"


def stale_policy() -> StalePolicy:
    """The stale-rows policy verl's workers apply: ``RR_STALE_ROWS`` (refuse, mask or off; default refuse).
    verl's ``RouterReplayConfig`` takes no extra field, so rr's knobs come from the environment."""
    return check_stale_policy(settings.text(POLICY_SETTING, default="refuse"))


def _values(micro_batch: Any, key: str, n: int) -> list[Any] | None:
    """The per-sample values of ``key`` (a NonTensorStack) in ``micro_batch``; None when absent."""
    if key not in micro_batch.keys():
        return None
    from verl.utils import tensordict_utils as tu

    got = tu.get(micro_batch, key)
    vals = got.tolist() if isinstance(got, torch.Tensor) else got
    if not isinstance(vals, list) or len(vals) != n:
        return None  # a batch-wide value (meta_info), not one per sample
    return vals


def _int(v: Any) -> int | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _one(i: int, own: Any, cached: Any, first: Any, last: Any) -> Provenance | None:
    if isinstance(own, dict):
        return Provenance.from_dict(own, where=f"verl batch sample {i}: {PROVENANCE_FIELD}")
    c, a, f = _int(cached), _int(first), _int(last)
    if c is None and a is None and f is None:
        return None
    return Provenance(
        cached_tokens=max(c or 0, 0),
        cache_tier="device" if c else None,
        preemptions=None,  # verl keeps no per-sample count
        weight_version_admitted=a,
        weight_version_finished=f if f is not None else a,
    )


def batch_provenances(micro_batch: Any, n: int) -> list[Provenance | None]:
    """One provenance (or None: unknown) per sample of verl's ``micro_batch`` of ``n`` samples."""
    cols = [_values(micro_batch, k, n) for k in (PROVENANCE_FIELD, CACHED_KEY, FIRST_VERSION_KEY, LAST_VERSION_KEY)]
    cols = [c if c is not None else [None] * n for c in cols]
    return [_one(i, *vals) for i, vals in enumerate(zip(*cols))]


def cached_counts(provs: Sequence[Provenance | None], device: torch.device) -> torch.Tensor:
    """``[n]`` cached prompt tokens per sample (0 where unknown), for the token segments."""
    return torch.tensor([p.cached_tokens if p is not None else 0 for p in provs], dtype=torch.long, device=device)


@contextmanager
def naming_knob() -> Iterator[None]:
    """A stale-rows refusal raised inside (the session's door, :func:`police`) names verl's knob: rr's policy comes
    from ``RR_STALE_ROWS`` in the workers' environment, not a ``stale_rows=`` argument."""
    try:
        yield
    except StaleRoutingError as e:
        raise StaleRoutingError(
            f"verl: {e} (verl's {FIRST_VERSION_KEY}/{LAST_VERSION_KEY} or the rows' {PROVENANCE_FIELD}); set "
            f"{POLICY_SETTING}=mask in the workers' environment to train such samples unreplayed, or off"
        ) from e


def police(provs: Sequence[Provenance | None], policy: StalePolicy) -> ProvenanceCheck:
    """The policy on one micro-batch's samples: :class:`StaleRoutingError` (refuse), naming verl's knob, or the
    check whose ``replay[i]`` is False for a sample to leave unreplayed (mask)."""
    with naming_knob():
        return check_provenances([[p] for p in provs], policy, turns=False)
