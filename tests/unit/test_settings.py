"""Every ``RR_*`` environment setting is read by rr_client.core.settings with one rule, and every reader in rr uses it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rr_client.core import settings

REPO = Path(__file__).resolve().parents[2]
FLAGS = sorted(n for n, s in settings.SETTINGS.items() if s.kind == "flag")


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("value", ["0", "false", "False", "FALSE", "no", "No", "off", "OFF", " 0 ", "", "  "])
def test_off_words_mean_off_for_every_flag(name: str, value: str) -> None:
    assert settings.flag(name, {name: value}) is False


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("value", ["1", "true", "True", "yes", "YES", "on", " On "])
def test_on_words_mean_on_for_every_flag(name: str, value: str) -> None:
    assert settings.flag(name, {name: value}) is True


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("value", ["2", "enabled", "t", "y", "-1"])
def test_other_values_are_refused_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(settings.SettingError, match=name):
        settings.flag(name, {name: value})


def test_unset_flag_is_its_default_and_unknown_names_are_refused() -> None:
    assert settings.flag("RR_ENABLE", {}) is False
    assert settings.flag("RR_ENABLE", {}, default=True) is True
    with pytest.raises(KeyError, match="RR_ENABLED is not an rr setting"):
        settings.flag("RR_ENABLED", {})


def test_text_and_integer_settings() -> None:
    assert settings.text("RR_API_KEY", {"RR_API_KEY": "  k  "}) == "k"
    assert settings.text("RR_API_KEY", {"RR_API_KEY": " "}) is None
    assert settings.integer("RR_ENCODE_THREAD_MIN_ELEMS", {}, default=7) == 7
    assert settings.integer("RR_ENCODE_THREAD_MIN_ELEMS", {"RR_ENCODE_THREAD_MIN_ELEMS": "12"}, default=7) == 12
    with pytest.raises(settings.SettingError, match="RR_ENCODE_THREAD_MIN_ELEMS"):
        settings.integer("RR_ENCODE_THREAD_MIN_ELEMS", {"RR_ENCODE_THREAD_MIN_ELEMS": "1e6"}, default=7)


def _shipped_sources() -> list[Path]:
    return [p for pkg in ("rr_client", "rr_server", "rr_patches") for p in sorted((REPO / pkg).rglob("*.py"))]


def test_every_rr_variable_in_the_code_is_a_registered_setting() -> None:
    """A new ``RR_*`` variable cannot appear without joining the one reader's table (and so this test's rule)."""
    used = {m for p in _shipped_sources() for m in re.findall(r"\bRR_[A-Z0-9_]+\b", p.read_text())}
    not_env = {"RR_OPENAI_FIELDS", "RR_PREFIXES", "RR_ROUTES"}  # constants named RR_*, not environment variables
    assert used - not_env - set(settings.SETTINGS) == set()


def test_no_module_reads_an_rr_variable_from_os_environ_itself() -> None:
    """One reader: ``os.environ.get("RR_...")`` / ``os.getenv("RR_...")`` appear nowhere but rr_client.core.settings."""
    pattern = re.compile(r"(os\.environ\.get|os\.getenv|os\.environ\[)\(?\s*[\"']RR_")
    offenders = [
        str(p.relative_to(REPO))
        for p in _shipped_sources()
        if p.name != "settings.py" and pattern.search(p.read_text())
    ]
    assert offenders == []


def test_sglang_always_flag_false_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug this reader fixed: ``RR_SGLANG_ALWAYS_RETURN_ROUTED_EXPERTS=False`` turned the flag ON (only "",
    "0" and "false" were off there), while the vLLM flag read "False" as off. Both now read it the same way,
    through the very call the patches make."""
    import rr_patches.sglang.hooks as sglang_hooks
    import rr_patches.vllm.routes as vllm_routes

    for value, want in (("False", False), ("NO", False), ("off", False), ("True", True), ("1", True)):
        monkeypatch.setenv(sglang_hooks.ALWAYS_ENV, value)
        monkeypatch.setenv(vllm_routes.ALWAYS_ENV, value)
        assert sglang_hooks.always_return_routing() is want
        assert vllm_routes.always_return_routing() is want
