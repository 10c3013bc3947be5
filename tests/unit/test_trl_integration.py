"""rr_client.integrations.trl without a server: version gate and the refusals that keep replay from being skipped."""

from __future__ import annotations

import pytest

from rr_client.integrations import trl as rr_trl


def test_tested_trl_release_is_accepted_and_others_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RR_ALLOW_UNSUPPORTED_VERSION", raising=False)
    rr_trl.check_trl_version("1.16.0")
    rr_trl.check_trl_version("1.16.3")
    for other in ("1.17.0", "1.1.6", "0.16.0", "1.160.0"):
        with pytest.raises(ImportError, match=r"tested with TRL 1\.16"):
            rr_trl.check_trl_version(other)
    monkeypatch.setenv("RR_ALLOW_UNSUPPORTED_VERSION", "1")
    rr_trl.check_trl_version("1.17.0")


def test_installed_trl_is_the_tested_one() -> None:
    import trl

    rr_trl.check_trl_version(trl.__version__)


def test_rollout_refuses_plain_grpo_trainer() -> None:
    rollout = rr_trl.RRRollout("http://127.0.0.1:9")  # nothing is sent before the trainer check
    try:
        with pytest.raises(TypeError, match="only R3GRPOTrainer replays"):
            rollout(["a prompt"], object())
    finally:
        rollout.close()


def test_trainer_refuses_a_rollout_that_is_not_rr() -> None:
    with pytest.raises(TypeError, match=r"rollout_func=RRRollout"):
        rr_trl.R3GRPOTrainer(model="unused", reward_funcs=[], rollout_func=lambda prompts, trainer: {})


def test_sampling_params_follow_grpo_config() -> None:
    from trl import GRPOConfig

    cfg = GRPOConfig(output_dir="/tmp/rr-unused", temperature=0.7, top_p=0.9, top_k=0, max_completion_length=12,
                     repetition_penalty=1.1, generation_kwargs={"seed": 3}, report_to=[], use_cpu=True)
    sp = rr_trl.sampling_params_from(cfg, 4)
    assert sp == {"n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.1,
                  "max_new_tokens": 12, "seed": 3}
