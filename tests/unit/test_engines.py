"""One object per engine on each side of the wire: the core's :mod:`rr_client.core.engines` (names, OpenAI fields,
weight routes) and the server's :mod:`rr_server.serving.engines` (release facts), looked up by name, never compared."""

from __future__ import annotations

import pytest

from rr_client.core.engines import ENGINE_NAMES, ENGINES, SGLANG, VLLM, engine
from rr_client.core.errors import ConfigurationError, UnsupportedVersionError
from rr_server.serving.engines import RELEASES, ReleaseFacts, releases


def test_lookup_returns_the_one_object() -> None:
    assert engine("vllm") is VLLM and engine("sglang") is SGLANG and engine(SGLANG) is SGLANG
    assert ENGINE_NAMES == tuple(ENGINES) == ("vllm", "sglang")


@pytest.mark.parametrize("bad", ["tgi", "", None, "VLLM"])
def test_unknown_engine_is_a_typed_error_naming_the_known_ones(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"unknown engine .* expected one of \['sglang', 'vllm'\]"):
        engine(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="unknown engine"):
        releases(bad)  # type: ignore[arg-type]


def test_every_engine_has_its_release_facts() -> None:
    """A core engine without a server module (or the reverse) is a half-added engine."""
    assert set(RELEASES) == set(ENGINES)
    for name, rel in RELEASES.items():
        assert rel.wire is engine(name) and rel.name == name
        assert rel.help_range == f"{rel.tested.lo} - {rel.tested.hi or rel.tested.lo}"
        facts = rel.facts_for(rel.tested.lo)
        assert isinstance(facts, ReleaseFacts) and facts.engine == name and facts.supported


def test_reload_bodies() -> None:
    assert VLLM.reload_body("/w") == {"method": "reload_weights", "kwargs": {"weights_path": "/w"}}
    assert SGLANG.reload_body("/w") == {"model_path": "/w"}
    assert (VLLM.reload_route, VLLM.cache_reset_route) == ("/collective_rpc", "/reset_prefix_cache")
    assert (SGLANG.reload_route, SGLANG.cache_reset_route) == ("/update_weights_from_disk", "/flush_cache")


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_unparsable_release_is_the_engines_own_error(name: str) -> None:
    rel = releases(name)
    with pytest.raises(rel.error, match="cannot parse") as e:
        rel.facts_for("garbage")
    assert isinstance(e.value, UnsupportedVersionError)
