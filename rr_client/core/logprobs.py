"""The sampled tokens' log-probs: what they mean (before or after temperature) and the one check before comparing them.

An engine reports each sampled token's log-prob either after temperature ("processed": SGLang's, and vLLM's with
``--logprobs-mode processed_logprobs``) or before it ("raw": vLLM's default ``raw_logprobs``). A trainer computes
``log_softmax(logits / temperature)``, so at a temperature other than 1 only processed log-probs mean the same on
both sides; gaps and importance ratios against raw ones are wrong. Core module: imports neither torch nor httpx.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rr_client.core.errors import LogprobsModeError, ProtocolError

__all__ = [
    "PROCESSED",
    "RAW",
    "MODES",
    "VLLM_FLAG",
    "check_comparable_logprobs",
    "mode_from_vllm",
    "parse_token_logprobs",
    "parse_openai_logprobs",
]

PROCESSED = "processed"  # after temperature (what a trainer computes from logits / temperature)
RAW = "raw"  # before temperature (vLLM's default raw_logprobs)
MODES = (PROCESSED, RAW)
VLLM_FLAG = "--logprobs-mode processed_logprobs"

# vLLM's --logprobs-mode values -> rr's modes; the *_logits modes return logits, never log-probs (no rr mode)
_VLLM_MODES = {"processed_logprobs": PROCESSED, "raw_logprobs": RAW}


def mode_from_vllm(logprobs_mode: Any) -> str | None:
    """rr's mode for vLLM's ``--logprobs-mode`` value, a string or an enum member (None when it returns logits or
    is unknown)."""
    if logprobs_mode is None:
        return None
    return _VLLM_MODES.get(str(getattr(logprobs_mode, "value", logprobs_mode)))


def check_comparable_logprobs(mode: str | None, temperature: float | None, *, consumer: str) -> None:
    """Refuse (LogprobsModeError) when the engine's log-probs cannot be compared with ``consumer``'s at this
    sampling temperature: pre-temperature (``raw``) or of unknown mode while ``temperature`` is not 1."""
    if mode is not None and mode not in MODES:
        raise LogprobsModeError(f"{consumer}: unknown engine log-prob mode {mode!r} (rr knows {list(MODES)})")
    if mode == PROCESSED or temperature is None or float(temperature) == 1.0:
        return
    what = (
        "before temperature (vLLM's default raw_logprobs)"
        if mode == RAW
        else "of unknown mode (the server's /rr/info states no logprobs_mode; rr's sidecar: --upstream-logprobs-mode)"
    )
    raise LogprobsModeError(
        f"{consumer}: the engine's log-probs are {what} but sampling ran at temperature {temperature}, so they do "
        f"not mean what the trainer's log_softmax(logits / {temperature}) means; serve vLLM with {VLLM_FLAG} "
        f"(rr-server launch vllm does unless told otherwise; SGLang's are after temperature) or sample at "
        f"temperature 1"
    )


def _value(v: Any, where: str, i: int) -> float:
    """One log-prob as a float (NaN for a missing one); anything but a number or None is a ProtocolError."""
    if v is None:
        return float("nan")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(f"{where}: log-prob {i} is {type(v).__name__} {v!r}, not a number or null")
    return float(v)


def parse_token_logprobs(rows: Any, output_ids: Sequence[int], *, where: str) -> np.ndarray:
    """SGLang-style ``output_token_logprobs`` (``[logprob, token_id, ...]`` per generated token) as float64, checked
    against ``output_ids``: one per token, the same token ids (ProtocolError otherwise)."""
    if not isinstance(rows, list):
        raise ProtocolError(f"{where}: output_token_logprobs must be a list, got {type(rows).__name__}")
    if len(rows) != len(output_ids):
        raise ProtocolError(f"{where}: {len(rows)} output_token_logprobs for {len(output_ids)} output_ids")
    out = np.empty(len(rows), dtype=np.float64)
    for i, (row, tid) in enumerate(zip(rows, output_ids)):
        if not isinstance(row, (list, tuple)) or len(row) < 2:
            raise ProtocolError(f"{where}: output_token_logprobs[{i}] must be [logprob, token_id, ...], got {row!r}")
        if isinstance(row[1], bool) or not isinstance(row[1], int) or row[1] != tid:
            raise ProtocolError(f"{where}: output_token_logprobs[{i}] names token {row[1]!r}, output_ids has {tid}")
        out[i] = _value(row[0], where, i)
    return out


def parse_openai_logprobs(block: Any, output_ids: Sequence[int], *, where: str) -> np.ndarray | None:
    """An OpenAI choice's ``logprobs`` (completions' ``token_logprobs`` or chat's ``content[].logprob``) as float64,
    one per token of ``output_ids`` (ProtocolError otherwise); None when the choice has none."""
    if block is None:
        return None
    if not isinstance(block, Mapping):
        raise ProtocolError(f"{where}: logprobs must be an object, got {type(block).__name__}")
    if "token_logprobs" in block:
        values = block["token_logprobs"]
    elif "content" in block:
        content = block["content"]
        if content is None:
            content = []
        if not isinstance(content, list) or not all(isinstance(c, Mapping) for c in content):
            raise ProtocolError(f"{where}: logprobs.content must be a list of objects")
        values = [c.get("logprob") for c in content]
    else:
        raise ProtocolError(f"{where}: logprobs has neither token_logprobs nor content")
    if not isinstance(values, list):
        raise ProtocolError(f"{where}: logprobs values must be a list, got {type(values).__name__}")
    if len(values) != len(output_ids):
        raise ProtocolError(f"{where}: {len(values)} log-probs for {len(output_ids)} token_ids")
    return np.array([_value(v, where, i) for i, v in enumerate(values)], dtype=np.float64)
