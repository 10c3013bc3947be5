"""verl's rollout log-probs and rr's R3 gap: read from verl's own rollout config (vLLM's ``logprobs_mode``, verl's
default ``processed_logprobs``; SGLang's after temperature unless ``SGLANG_RETURN_ORIGINAL_LOGPROB``), refused where
they would not mean what verl's actor computes (``log_softmax(logits / temperature)``), in the worker before it
builds anything and in rr's engine before a batch runs. The gap itself at temperature 0.7 against the real vLLM
server's log-probs is in test_vllm_rows.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rr_client.core.errors import LogprobsModeError
from rr_client.integrations.verl._logprobs import SGLANG_ORIGINAL, check_rollout_logprobs, rollout_logprobs
from tests.verl import harness as h


def rollout_cfg(
    model_dir: Path, *, name: str = "vllm", mode: str | None = None, temperature: float = 0.7, calculate: bool = True
) -> Any:
    """verl's generated ``actor_rollout_ref.rollout`` config with the given rollout, mode and temperature."""
    r = h.ppo_config(model_dir).actor_rollout_ref.rollout
    r.name, r.temperature, r.calculate_log_probs = name, temperature, calculate
    if mode is not None:
        r.logprobs_mode = mode
    return r


def test_the_rollouts_logprob_mode_comes_from_verls_config(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SGLANG_ORIGINAL, raising=False)
    default = rollout_cfg(model_dir)
    assert default.logprobs_mode == "processed_logprobs"  # verl's own default for its vLLM rollout
    assert check_rollout_logprobs(default).mode == "processed"  # after temperature: comparable at 0.7
    assert check_rollout_logprobs(rollout_cfg(model_dir, mode="raw_logprobs", temperature=1.0)).mode == "raw"
    with pytest.raises(LogprobsModeError) as e:
        check_rollout_logprobs(rollout_cfg(model_dir, mode="raw_logprobs"))
    for part in (
        "logprobs_mode=raw_logprobs",
        "temperature 0.7",
        "set actor_rollout_ref.rollout.logprobs_mode=processed_logprobs",
    ):
        assert part in str(e.value), (part, str(e.value))
    with pytest.raises(LogprobsModeError, match="logits, not log-probs"):
        check_rollout_logprobs(rollout_cfg(model_dir, mode="processed_logits", temperature=1.0))
    # no rollout log-probs (verl's default calculate_log_probs=False): no gap, nothing to refuse
    assert check_rollout_logprobs(rollout_cfg(model_dir, mode="raw_logprobs", calculate=False)).mode == "raw"
    assert check_rollout_logprobs(rollout_cfg(model_dir, name="sglang")).mode == "processed"
    monkeypatch.setenv(SGLANG_ORIGINAL, "true")
    assert rollout_logprobs(rollout_cfg(model_dir, name="sglang")).mode == "raw"
    with pytest.raises(LogprobsModeError, match=f"unset {SGLANG_ORIGINAL}"):
        check_rollout_logprobs(rollout_cfg(model_dir, name="sglang"))
    with pytest.raises(LogprobsModeError, match="of unknown mode"):  # a rollout rr cannot vouch for
        check_rollout_logprobs(rollout_cfg(model_dir, name="trtllm"))


def test_the_worker_refuses_pre_temperature_logprobs_before_it_builds(verl_process: None, model_dir: Path) -> None:
    """R3 on fsdp2, the rollout returning vLLM's raw log-probs at temperature 0.7: refused naming verl's setting;
    at temperature 1 it builds, and without replay rr leaves verl's worker alone."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    def worker(mode: str, temperature: float) -> Any:
        cfg = h.ppo_config(model_dir, mode=mode)
        r = cfg.actor_rollout_ref.rollout
        r.calculate_log_probs, r.logprobs_mode, r.temperature = True, "raw_logprobs", temperature
        return ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")

    with pytest.raises(LogprobsModeError, match=r"(?s)verl's R3 log-prob gap.*logprobs_mode=processed_logprobs"):
        worker("R3", 0.7)
    assert worker("R3", 1.0).enable_routing_replay is True
    assert worker("disabled", 0.7).enable_routing_replay is False


def test_raw_logprobs_with_the_rollouts_top_p_or_top_k_are_refused_at_temperature_1(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl's rollout at temperature 1 with ``top_p`` 0.9 (or ``top_k`` on): vLLM's raw log-probs are the
    untruncated distribution's, refused naming the flag and verl's setting; verl's default ``processed_logprobs``
    with the same filters, and raw ones with verl's default sampling (top_k -1, top_p 1), pass. rr's engine refuses
    the same before a batch, from what the worker read."""
    import torch

    from rr_client.integrations.verl import _engine, _logprobs

    monkeypatch.delenv(SGLANG_ORIGINAL, raising=False)
    for key, value in (("top_p", 0.9), ("top_k", 20)):
        raw = rollout_cfg(model_dir, mode="raw_logprobs", temperature=1.0)
        setattr(raw, key, value)
        with pytest.raises(LogprobsModeError) as e:
            check_rollout_logprobs(raw)
        for part in (f"{key}={value!r}", "logprobs_mode=raw_logprobs", "logprobs_mode=processed_logprobs"):
            assert part in str(e.value), (part, str(e.value))
        processed = rollout_cfg(model_dir, temperature=1.0)
        setattr(processed, key, value)
        assert check_rollout_logprobs(processed).mode == "processed"
    plain = rollout_cfg(model_dir, mode="raw_logprobs", temperature=1.0)
    assert (plain.top_k, plain.top_p) == (-1, 1)  # verl's defaults filter nothing
    said = check_rollout_logprobs(plain)
    assert said.mode == "raw" and dict(said.sampling) == {"top_k": -1, "top_p": 1}
    before = _logprobs.ROLLOUT_LOGPROBS.get("rollout")
    try:
        _logprobs.ROLLOUT_LOGPROBS["rollout"] = said
        _engine.check_gap_logprobs(torch.ones(2))  # temperature 1, no filter: raw ones compare
        _logprobs.ROLLOUT_LOGPROBS["rollout"] = said._replace(sampling={"top_k": -1, "top_p": 0.9})
        with pytest.raises(LogprobsModeError, match=r"(?s)verl's R3 log-prob gap.*top_p=0\.9"):
            _engine.check_gap_logprobs(torch.ones(2))
    finally:
        if before is None:
            _logprobs.ROLLOUT_LOGPROBS.pop("rollout", None)
        else:
            _logprobs.ROLLOUT_LOGPROBS["rollout"] = before
