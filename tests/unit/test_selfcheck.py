"""``python -m rr_patches.selfcheck``: what docker/install_rr.sh runs after installing rr into an engine's image."""

from __future__ import annotations

import pytest

from rr_patches import selfcheck


def test_vllm_in_this_env_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert selfcheck.main(["vllm"]) == 0
    assert capsys.readouterr().out.strip() == (
        "rr selfcheck: vLLM 0.30.0: rr's routes come from its vllm.endpoint_plugins entry point"
    )


def test_an_unknown_engine_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert selfcheck.main(["tgi"]) == 2
    assert capsys.readouterr().err.strip() == "usage: python -m rr_patches.selfcheck vllm|sglang"


def test_a_refusal_exits_1_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    """No SGLang in this env: the check's import fails, and says which module was missing."""
    assert selfcheck.main(["sglang"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("rr selfcheck: ") and "sglang" in err
