"""The sampled log-probs: what they mean (before or after temperature and the sampling filters) and the one check
before comparing them.

An engine reports each sampled token's log-prob either after sampling's processing ("processed": vLLM's with
``--logprobs-mode processed_logprobs``, after penalties, temperature, top-k, top-p and min-p: the truncated
distribution the token was drawn from; SGLang's, after temperature) or before it ("raw": vLLM's default
``raw_logprobs``, SGLang's with ``SGLANG_RETURN_ORIGINAL_LOGPROB``).
A trainer computes ``log_softmax(logits / temperature)``, so at a temperature other than 1 only processed log-probs
mean the same on both sides; and with a filter or penalty on (top-k, top-p < 1, min-p, a repetition, presence or
frequency penalty) raw ones are the untruncated distribution's, not the one sampled from (about -0.1 nat/token at
top-p 0.9), so an importance ratio or gap against them is silently wrong. Core module: imports neither torch nor
httpx.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rr_client.core.engines import SGLANG
from rr_client.core.errors import ArgumentTypeError, ConfigurationError, LogprobsModeError, ProtocolError

__all__ = [
    "PROCESSED",
    "RAW",
    "MODES",
    "VLLM_FLAG",
    "SAMPLING_FILTERS",
    "check_comparable_logprobs",
    "engine_logprobs",
    "mode_from_vllm",
    "parse_token_logprobs",
    "parse_openai_logprobs",
]

PROCESSED = "processed"  # after temperature (vLLM's: and penalties, top-k/p, min-p: the distribution sampled from)
RAW = "raw"  # before temperature and every filter (vLLM's default raw_logprobs)
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


# sampling params (vLLM's names; SGLang's sampling_params and OpenAI bodies use the same) that change the
# distribution a token is drawn from beyond temperature, each with the test "on" and its neutral value
_FILTERS: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("top_k", lambda v: v > 0, "-1"),  # 0 and -1 (any value <= 0): off
    ("top_p", lambda v: v < 1.0, "1"),
    ("min_p", lambda v: v > 0.0, "0"),
    ("repetition_penalty", lambda v: v != 1.0, "1"),
    ("presence_penalty", lambda v: v != 0.0, "0"),
    ("frequency_penalty", lambda v: v != 0.0, "0"),
)
SAMPLING_FILTERS = tuple(name for name, _, _ in _FILTERS)


def _filters_on(sampling: Mapping[str, Any] | None) -> list[tuple[str, Any, str]]:
    """``(name, value, neutral value)`` of each filter or penalty ``sampling`` turns on (None and absent: off)."""
    on = []
    for name, active, neutral in _FILTERS:  # six names per check, once per batch: no per-token work
        value = (sampling or {}).get(name)
        if value is None:
            continue
        try:
            number = float("nan") if isinstance(value, bool) else float(value)
        except (TypeError, ValueError):
            number = float("nan")
        if number != number:  # a bool, text or NaN: nothing rr can judge the filter by
            raise ArgumentTypeError(f"sampling param {name}={value!r} is not a number")
        if active(number):
            on.append((name, value, neutral))
    return on


def _sglang_fix() -> str:
    """How SGLang serves processed log-probs, in the words rr uses elsewhere."""
    return f"SGLang: leave {SGLANG.original_logprob_env} unset, its log-probs are then after temperature"


def check_comparable_logprobs(
    mode: str | None,
    temperature: float | None,
    *,
    consumer: str,
    sampling: Mapping[str, Any] | None = None,
) -> None:
    """Refuse (LogprobsModeError) engine log-probs that ``consumer``'s correction or gap cannot be compared with:
    raw or of unknown mode while ``temperature`` (default: ``sampling``'s) is not 1, or while ``sampling`` (vLLM /
    SGLang / OpenAI names) has top-k, top-p, min-p or a penalty on, so they are not the distribution sampled from."""
    if mode is not None and mode not in MODES:
        raise LogprobsModeError(f"{consumer}: unknown engine log-prob mode {mode!r} (rr knows {list(MODES)})")
    if mode == PROCESSED:
        return
    if temperature is None and sampling is not None:
        temperature = sampling.get("temperature")
    off_temperature = temperature is not None and float(temperature) != 1.0
    filters = _filters_on(sampling)
    if not off_temperature and not filters:
        return
    what = (
        "before temperature and the sampling filters (vLLM's default raw_logprobs)"
        if mode == RAW
        else "of unknown mode (the server's /rr/info states no logprobs_mode; rr's sidecar: --upstream-logprobs-mode)"
    )
    ran, meaning, plain = [], [], []
    if off_temperature:
        ran.append(f"at temperature {temperature}")
        meaning.append(f"they do not mean what the trainer's log_softmax(logits / {temperature}) means")
        plain.append("at temperature 1")
    if filters:
        named = ", ".join(f"{name}={value!r}" for name, value, _ in filters)
        ran.append(f"with {named}")
        meaning.append(
            f"they {'are' if mode == RAW else 'may be'} the unfiltered distribution's, not the one the tokens were "
            "drawn from (an importance-sampling correction or log-prob gap against them is silently wrong: about "
            "-0.1 nat/token at top_p 0.9)"
        )
        plain.append("with " + ", ".join(f"{name}={neutral}" for name, _, neutral in filters))
    raise LogprobsModeError(
        f"{consumer}: the engine's log-probs are {what} but sampling ran {' and '.join(ran)}, so "
        f"{'; and '.join(meaning)}; serve processed log-probs (vLLM: {VLLM_FLAG}, the distribution sampled from, "
        f"which rr-server launch vllm adds unless told otherwise; {_sglang_fix()}) or sample {' and '.join(plain)}"
    )


def engine_logprobs(engine_logps: Any, logprobs_mode: str | None, *, consumer: str) -> tuple[Any, str | None]:
    """The engine's log-probs and their mode from a tensor (with ``logprobs_mode`` as given) or from a layout
    (:class:`rr_client.RoutingTensors` / :class:`rr_client.PackedRouting`: its ``logprobs`` and ``logprobs_mode``;
    ConfigurationError when it carries none or a given ``logprobs_mode`` contradicts it)."""
    if not (hasattr(engine_logps, "logprobs") and hasattr(engine_logps, "logprobs_mode")):
        return engine_logps, logprobs_mode
    if engine_logps.logprobs is None:
        raise ConfigurationError(
            f"{consumer}: the batch carries no engine log-probs (generate with return_logprob=True)"
        )
    if logprobs_mode is not None and logprobs_mode != engine_logps.logprobs_mode:
        raise ConfigurationError(
            f"{consumer}: logprobs_mode={logprobs_mode!r} but the batch's log-probs are {engine_logps.logprobs_mode!r}"
        )
    return engine_logps.logprobs, engine_logps.logprobs_mode


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
