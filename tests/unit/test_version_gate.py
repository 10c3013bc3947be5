"""The one version gate (:mod:`rr_client.core.versions`) and the one patch kit (:mod:`rr_client.core.patching`), and the
engine gates built on them (issue 29, item 3): every refusal is an :class:`UnsupportedVersionError`, so an
``RRError``, naming the package, what was found, what was tested and the override."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from rr_client.core.errors import RRError, UnsupportedVersionError
from rr_client.core.patching import MARKER, is_wrapped, parameters, unwrap, wrap_once
from rr_client.core import versions
from rr_client.core.versions import OVERRIDE, check_version


@pytest.mark.parametrize("lo,hi,version,covered", [
    ("1.16", None, "1.16", True), ("1.16", None, "1.16.3", True), ("1.16", None, "1.16.0rc1", True),
    ("1.16", None, "1.17", False), ("1.16", None, "1.15.9", False), ("1.16", None, "1", False),
    ("0.22", "0.33", "0.30.0+cpu", True), ("0.22", "0.33", "0.22.0", True), ("0.22", "0.33", "0.33.9", True),
    ("0.22", "0.33", "0.34.0", False), ("0.22", "0.33", "0.21.9", False), ("0.22", "0.33", "1.0", False),
    ("0.5.7", "0.5.23", "0.5.10.post1", True), ("0.5.7", "0.5.23", "0.5.23", True),
    ("0.5.7", "0.5.23", "0.5.24", False), ("0.5.7", "0.5.23", "0.5.6", False),
    ("0.9.1", None, "0.9.1", True), ("0.9.1", None, "0.9.2", False),
])
def test_covers_at_the_precision_the_bounds_are_written_in(lo: str, hi: str | None, version: str,
                                                          covered: bool) -> None:
    assert versions.Tested(lo, hi).covers(version) is covered


@pytest.mark.parametrize("version", ["", "garbage", "latest", "x1.16"])
def test_unparsable_version_is_never_covered(version: str) -> None:
    assert not versions.Tested("1.16").covers(version)
    with pytest.raises(UnsupportedVersionError):
        check_version("trl", versions.Tested("1.16"), version, allow_unsupported=False)


def test_tested_spells_its_range() -> None:
    spelled = [str(versions.Tested(*bounds)) for bounds in (("1.16",), ("0.22", "0.33"), ("0.9.1", "0.9.1"))]
    assert spelled == ["1.16", "0.22-0.33", "0.9.1"]


def test_check_version_error_names_package_found_tested_and_override() -> None:
    with pytest.raises(UnsupportedVersionError) as exc:
        check_version("trl", versions.Tested("1.16"), "1.17.0", why="it reaches into private methods",
                      allow_unsupported=False)
    e = exc.value
    assert isinstance(e, RRError) and isinstance(e, RuntimeError)
    assert (e.package, e.version, e.tested) == ("trl", "1.17.0", "1.16")
    msg = str(e)
    assert "trl 1.16" in msg and "trl 1.17.0" in msg and OVERRIDE in msg and "private methods" in msg


def test_check_version_returns_a_covered_version() -> None:
    assert check_version("vllm", versions.Tested("0.22", "0.33"), "0.30.0+cpu", allow_unsupported=False) == "0.30.0+cpu"


def test_override_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OVERRIDE, raising=False)
    with pytest.raises(UnsupportedVersionError):
        check_version("trl", versions.Tested("1.16"), "1.17.0")
    monkeypatch.setenv(OVERRIDE, "1")
    assert check_version("trl", versions.Tested("1.16"), "1.17.0") == "1.17.0"
    with pytest.raises(UnsupportedVersionError):  # an explicit False beats the environment
        check_version("trl", versions.Tested("1.16"), "1.17.0", allow_unsupported=False)
    monkeypatch.setenv(OVERRIDE, "0")
    assert check_version("trl", versions.Tested("1.16"), "1.17.0", allow_unsupported=True) == "1.17.0"


def test_missing_package_is_refused_even_with_the_override() -> None:
    with pytest.raises(UnsupportedVersionError, match="no installed rr-no-such-package"):
        check_version("rr-no-such-package", versions.Tested("1.0"), allow_unsupported=True)


# ---- the engine gates -------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["0.21.9", "0.34.0", "1.0.0", "garbage"])
def test_vllm_gate_refuses_in_the_rr_error_tree(version: str) -> None:
    from rr_server.serving.vllm_facts import UnsupportedVLLMVersion, check_vllm_version

    with pytest.raises(UnsupportedVLLMVersion) as exc:
        check_vllm_version(version)
    e = exc.value
    assert isinstance(e, UnsupportedVersionError) and isinstance(e, RRError) and isinstance(e, RuntimeError)
    assert (e.package, e.version, e.tested) == ("vllm", version, "0.22-0.33")
    assert version in str(e) and OVERRIDE in str(e) and "--rr-allow-unsupported-version" in str(e)


def test_vllm_gate_range_and_override() -> None:
    from rr_server.serving.vllm_facts import SUPPORTED, check_vllm_version, facts_for

    assert SUPPORTED == ((0, 22), (0, 33))
    for v in ("0.22.0", "0.30.0+cpu", "0.33.2"):
        assert check_vllm_version(v) == v and facts_for(v).supported
    assert check_vllm_version("0.34.0", allow_unsupported=True) == "0.34.0"
    assert not facts_for("0.34.0").supported and not facts_for("0.21.9").supported


def test_vllm_unparsable_facts_are_in_the_tree() -> None:
    from rr_server.serving.vllm_facts import facts_for

    with pytest.raises(UnsupportedVersionError, match="cannot parse vLLM version"):
        facts_for("garbage")


@pytest.mark.parametrize("version", ["0.5.6", "0.5.24", "0.6.0", "garbage"])
def test_sglang_gate_refuses_in_the_rr_error_tree(version: str) -> None:
    from rr_server.serving.sglang_facts import UnsupportedSGLangError, profile_for

    with pytest.raises(UnsupportedSGLangError) as exc:
        profile_for(version)
    e = exc.value
    assert isinstance(e, UnsupportedVersionError) and isinstance(e, RRError) and isinstance(e, RuntimeError)
    assert (e.package, e.version, e.tested) == ("sglang", version, "0.5.7-0.5.23")
    assert version in str(e)


def test_sglang_gate_has_no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's patch never honoured the override (an untested SGLang goes through the sidecar): unchanged."""
    from rr_server.serving.sglang_facts import MAX_VERSION, MIN_VERSION, UnsupportedSGLangError, profile_for

    assert (MIN_VERSION, MAX_VERSION) == ((0, 5, 7), (0, 5, 23))
    monkeypatch.setenv(OVERRIDE, "1")
    with pytest.raises(UnsupportedSGLangError):
        profile_for("0.5.24")
    assert profile_for("0.5.10.post1").supported


# ---- the patch kit ----------------------------------------------------------------------------------------

class _Engine:
    """Stands in for third-party code rr wraps."""

    def step(self, batch: list[int], scale: int = 1) -> int:
        return sum(batch) * scale


def _doubling(original: Any) -> Any:
    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> int:
        return 2 * original(self, *args, **kwargs)

    return step


@pytest.fixture
def engine_cls() -> type[_Engine]:
    """A fresh subclass per test, so a wrap never leaks into another test."""
    return type("Engine", (_Engine,), {"step": _Engine.step})


def test_wrap_once_wraps_once_and_unwrap_restores(engine_cls: type[_Engine]) -> None:
    original = engine_cls.step
    assert not is_wrapped(engine_cls, "step")
    assert wrap_once(engine_cls, "step", _doubling, params=["self", "batch", "scale"], what="engine 1.0")
    assert is_wrapped(engine_cls, "step") and getattr(engine_cls.step, MARKER) is original
    assert engine_cls().step([1, 2]) == 6
    wrapped = engine_cls.step
    assert not wrap_once(engine_cls, "step", _doubling, params=["self", "batch", "scale"])  # already: no double
    assert engine_cls.step is wrapped and engine_cls().step([1, 2]) == 6
    assert parameters(engine_cls.step) == ["self", "batch", "scale"]  # functools.wraps layers are seen through
    assert unwrap(engine_cls, "step") and engine_cls.step is original and engine_cls().step([1, 2]) == 3
    assert not unwrap(engine_cls, "step")  # nothing left to restore


def test_wrap_once_accepts_any_of_several_shapes(engine_cls: type[_Engine]) -> None:
    assert wrap_once(engine_cls, "step", _doubling, params=[["self", "batch"], ["self", "batch", "scale"]])


def test_wrap_once_refuses_a_wrong_shape_without_changing_the_owner(engine_cls: type[_Engine]) -> None:
    original = engine_cls.step
    with pytest.raises(UnsupportedVersionError, match=r"step\(self, batch, scale\).*engine 2\.0") as exc:
        wrap_once(engine_cls, "step", _doubling, params=["self", "batch"], what="engine 2.0")
    assert isinstance(exc.value, RRError)
    assert engine_cls.step is original and not is_wrapped(engine_cls, "step")


def test_wrap_once_refuses_a_missing_attribute_without_changing_the_owner(engine_cls: type[_Engine]) -> None:
    before = dict(vars(engine_cls))
    with pytest.raises(UnsupportedVersionError, match="gone is missing in engine 2.0"):
        wrap_once(engine_cls, "gone", _doubling, what="engine 2.0")
    assert dict(vars(engine_cls)) == before


def test_vllm_build_app_wrap_uses_the_kit() -> None:
    """The vLLM plugin's build_app wrap is re-entrant through the one marker, and refuses a foreign shape."""
    from types import ModuleType

    from rr_patches.vllm import plugin
    from rr_server.serving.vllm_facts import UnsupportedVLLMVersion

    mod = ModuleType("fake_vllm_entry")

    def build_app(args: Any, supported_tasks: Any = None) -> Any:
        return None

    mod.build_app = build_app  # type: ignore[attr-defined]
    assert plugin._patch(mod, "build_app") and plugin._patch(mod, "build_app")
    assert is_wrapped(mod, "build_app") and getattr(mod.build_app, MARKER) is build_app
    assert mod.build_app.__wrapped__ is build_app, "wrapped exactly once"
    assert not plugin._patch(mod, "missing")

    def odd(app: Any) -> Any:
        return app

    mod.build_app = odd  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedVLLMVersion, match="unexpected signature"):
        plugin._patch(mod, "build_app")
    assert mod.build_app is odd


def test_engine_generate_is_wrapped_once() -> None:
    """A streaming request's collector wraps an engine client's ``generate`` once, via the kit's marker."""
    from types import SimpleNamespace

    from rr_patches.vllm.openai_streams import wrap_engine_generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        return None

    client = SimpleNamespace(generate=generate)
    assert wrap_engine_generate(client) and not wrap_engine_generate(client)
    assert getattr(client.generate, MARKER) is generate
    assert not wrap_engine_generate(None)


def test_server_side_refusals_are_rr_errors() -> None:
    """Every refusal class of rr's engine side is in the RRError tree and still the RuntimeError it was."""
    from rr_client.core.errors import ConfigurationError
    from rr_patches.vllm.auth import UnprotectedRoutesError
    from rr_server.serving.sglang_facts import UnsupportedSGLangError
    from rr_server.serving.vllm_facts import UnsupportedVLLMVersion

    for cls in (UnsupportedVLLMVersion, UnsupportedSGLangError):
        assert issubclass(cls, UnsupportedVersionError) and issubclass(cls, RuntimeError)
    assert issubclass(UnprotectedRoutesError, ConfigurationError) and issubclass(UnprotectedRoutesError, RuntimeError)


def test_endpoint_plugin_without_an_engine_is_a_configuration_error() -> None:
    import asyncio

    from rr_client.core.errors import ConfigurationError
    from rr_patches.vllm.endpoint import RREndpointPlugin

    plugin = RREndpointPlugin()
    plugin._app = object()
    with pytest.raises(ConfigurationError, match="render-only"):
        asyncio.run(plugin.init_state(None, object(), object()))
