"""Test-only stand-in for vLLM's Triton ``rejection_greedy_sample_kernel`` (GPU-only here): the same rule in torch."""

from __future__ import annotations

from typing import Any


def greedy_reject(output_token_ids: Any, cu_num_draft_tokens: Any, draft_token_ids: Any, target_argmax: Any,
                  bonus_token_ids: Any, is_greedy: Any, max_spec_len: int, uniform_probs: Any,
                  synthetic_conditional_rates: Any) -> None:
    """``rejection_greedy_sample_kernel``'s rule: keep the target's argmax up to and including the first
    draft it disagrees with; if every draft agrees, append the bonus token."""
    if synthetic_conditional_rates is not None:
        raise NotImplementedError("synthetic rejection mode is not stood in for")
    cu = cu_num_draft_tokens.tolist()
    for req, end in enumerate(cu):
        if is_greedy is not None and not bool(is_greedy[req]):
            continue
        start = cu[req - 1] if req else 0
        drafts = draft_token_ids[start:end].to(target_argmax.dtype)
        argmax = target_argmax[start:end]
        mismatch = (drafts != argmax).nonzero()
        n = int(mismatch[0]) + 1 if len(mismatch) else end - start
        output_token_ids[req, :n] = argmax[:n].to(output_token_ids.dtype)
        if not len(mismatch):
            output_token_ids[req, n] = bonus_token_ids[req].to(output_token_ids.dtype).reshape(())


def _no_warmup(**_: Any) -> None:
    """vLLM registers its Triton kernels for JIT warm-up; a torch function has nothing to warm."""


greedy_reject.register_warmup = _no_warmup  # type: ignore[attr-defined]
