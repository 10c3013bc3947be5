"""What the doctor's checks and probes share: their thresholds and the token-id prompts, prompt rows and agreement
they compare samples with (one module, so :mod:`rr_server.doctor.probes` need not import the checks)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rr_client import GenerateResult
from rr_client.core.agreement import routing_agreement

__all__ = ["ROW_AGREEMENT_MIN", "TRUTH_AGREEMENT_MIN", "PREFIX_CACHE_TOKENS"]

# Rows of one prompt recomputed in another request may differ only by numerics (batch shape, bf16 near-ties).
ROW_AGREEMENT_MIN = 0.99
# Below this share of (token, MoE layer) sets equal to the checkpoint's router, routing is not the model's.
TRUTH_AGREEMENT_MIN = 0.90
# The prefix-cache check's prompt: long enough to fill whole KV blocks (vLLM CPU caches in blocks of 128 tokens,
# GPU vLLM and SGLang in 16 or 1), so a repeat can be served from the cache.
PREFIX_CACHE_TOKENS = 300


def _prompts(count: int, vocab: int, seed: int = 0, length: int | None = None) -> list[list[int]]:
    """Distinct token-id prompts of 12-27 tokens (or ``length``), ids in [1, vocab)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, max(2, vocab), size=length or 12 + (5 * i) % 16).tolist() for i in range(count)]


def _prompt_rows(r: GenerateResult) -> np.ndarray:
    """The routing rows of the prompt's tokens (row p routes token p), from ``routed_experts_start`` on."""
    assert r.routed_experts is not None and r.prompt_ids is not None
    return r.routed_experts[: len(r.prompt_ids) - r.routed_experts_start]


def _agreement(a: np.ndarray, b: np.ndarray, moe_layers: Sequence[int]) -> float:
    """Share of (row, MoE layer) top-k sets equal in two arrays of the same rows."""
    if a.shape != b.shape:
        return 0.0
    if not len(moe_layers) or not a.shape[0]:
        return 1.0
    return routing_agreement(a, b, layers=moe_layers)
