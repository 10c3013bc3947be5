"""What verl's rollout log-probs mean (before or after temperature), and the refusal where rr's gap would be wrong.

verl's actor computes ``log_softmax(logits / temperature)``. Its vLLM rollout serves the engine argument
``actor_rollout_ref.rollout.logprobs_mode`` (verl's default ``processed_logprobs``: after temperature;
``raw_logprobs`` is before it, the ``*_logits`` modes are no log-probs at all); its SGLang rollout returns them after
temperature unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set. rr's R3 gap compares the actor's log-probs with the
rollout's (``rollout_log_probs``, present with ``rollout.calculate_log_probs=True``), so where they would not mean
the same thing rr refuses (:func:`rr_client.core.logprobs.check_comparable_logprobs`) instead of reporting a wrong gap:
raw or unknown log-probs away from temperature 1, or with the rollout's ``top_k`` / ``top_p`` on (then they are the
unfiltered distribution's, not the one sampled from; vLLM's ``processed_logprobs`` are the filtered one's).
No torch, no verl import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from rr_client.core.engines import ENGINES, SGLANG
from rr_client.core.errors import LogprobsModeError
from rr_client.core.logprobs import PROCESSED, RAW, check_comparable_logprobs, mode_from_vllm

__all__ = [
    "RolloutLogprobs",
    "rollout_logprobs",
    "rollout_sampling",
    "check_rollout_logprobs",
    "SGLANG_ORIGINAL",
    "VERL_KEY",
    "ROLLOUT_LOGPROBS",
]

# the rollout's log-prob mode, as this process's replaying worker read it from its config (rr's engine reads it
# at batch time; one actor worker per verl process, as for the engine registry)
ROLLOUT_LOGPROBS: dict[str, Any] = {}

SGLANG_ORIGINAL = str(SGLANG.original_logprob_env)  # SGLang's switch to pre-temperature log-probs
VERL_KEY = "actor_rollout_ref.rollout.logprobs_mode"
_LOGITS = ("raw_logits", "processed_logits")  # vLLM modes that return logits in place of log-probs


# the sampling filters verl's rollout config holds and its agent loop sends to the engine (verl 0.9.1:
# ``AgentLoopWorker.generate_sequences`` passes top_k / top_p and a fixed repetition_penalty=1.0, so the config's
# repetition_penalty never reaches the engine); other names are read where a config has them
_SAMPLING_KEYS = ("top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty")


class RolloutLogprobs(NamedTuple):
    """The rollout's log-prob mode for rr ("processed", "raw" or None for unknown), the setting it came from, and
    the sampling filters the rollout samples with (what raw log-probs are checked against)."""

    mode: str | None
    source: str
    sampling: Mapping[str, Any] = MappingProxyType({})


def rollout_sampling(rollout: Any) -> Mapping[str, Any]:
    """The sampling filters of verl's rollout config that reach the engine (absent and None left out)."""
    got = {key: _get(rollout, key) for key in _SAMPLING_KEYS}
    return MappingProxyType({k: v for k, v in got.items() if v is not None})


def _get(cfg: Any, key: str) -> Any:
    """``cfg[key]`` of an omegaconf config, a mapping or a dataclass; None when absent."""
    if cfg is None:
        return None
    getter = getattr(cfg, "get", None)
    if callable(getter):
        try:
            return getter(key, None)
        except Exception:  # noqa: BLE001 - a dataclass config's get() may not take a default
            pass
    return getattr(cfg, key, None)


def _truthy(value: str | None) -> bool:
    """SGLang's ``get_bool_env_var`` reading ("true" or "1", any case)."""
    return str(value or "").strip().lower() in ("true", "1")


def rollout_logprobs(rollout: Any) -> RolloutLogprobs:
    """The mode of the log-probs verl's rollout (``actor_rollout_ref.rollout`` config) returns, and why rr thinks so
    (None for a vLLM ``*_logits`` mode: those are logits, not log-probs)."""
    name = str(_get(rollout, "name") or "")
    eng = ENGINES.get(name)
    sampling = rollout_sampling(rollout)
    if eng is not None and eng.logprobs_setting is not None:  # vLLM: an engine argument verl passes on
        vllm_mode = str(_get(rollout, eng.logprobs_setting) or eng.logprobs_default)  # the engine's own default
        what = " (logits, not log-probs)" if vllm_mode in _LOGITS else ""
        source = f"rollout.name={name}, {VERL_KEY}={vllm_mode}{what}"
        return RolloutLogprobs(mode_from_vllm(vllm_mode), source, sampling)
    if eng is not None and eng.original_logprob_env is not None:  # SGLang: after temperature unless its switch
        if _truthy(os.environ.get(eng.original_logprob_env)):
            return RolloutLogprobs(RAW, f"rollout.name={name} with {eng.original_logprob_env} set", sampling)
        return RolloutLogprobs(PROCESSED, f"rollout.name={name}", sampling)
    return RolloutLogprobs(None, f"rollout.name={name or '?'} (rr does not know its log-prob mode)", sampling)


def _fix(got: RolloutLogprobs) -> str:
    """What to change in verl's config for post-temperature log-probs."""
    if got.source.startswith("rollout.name=sglang"):
        return f"unset {SGLANG_ORIGINAL}"
    return f"set {VERL_KEY}=processed_logprobs (verl's default)"


def check_rollout_logprobs(rollout: Any, temperature: Any = None) -> RolloutLogprobs:
    """The rollout's log-prob mode; where it returns them (``rollout.calculate_log_probs``), refuse
    (:class:`LogprobsModeError`) what cannot be compared with verl's actor's at ``temperature`` (default:
    ``rollout.temperature``): raw or unknown log-probs away from temperature 1 or with ``rollout.top_k`` /
    ``top_p`` (or another filter) on, logits at any."""
    got = rollout_logprobs(rollout)
    if not _get(rollout, "calculate_log_probs"):
        return got  # no rollout log-probs: rr computes no gap (the engine checks again if a batch brings some)
    if str(_get(rollout, "logprobs_mode")) in _LOGITS:
        raise LogprobsModeError(
            f"verl's R3 log-prob gap: {got.source}: vLLM returns logits as rollout_log_probs, which no trainer "
            f"log-prob matches; {_fix(got)}"
        )
    t = _get(rollout, "temperature") if temperature is None else temperature
    check_comparable_logprobs(
        got.mode,
        None if t is None else float(t),
        consumer=f"verl's R3 log-prob gap ({got.source}; {_fix(got)})",
        sampling=got.sampling,
    )
    return got
