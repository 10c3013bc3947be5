"""The one version gate (:mod:`rr_client.core.versions`) and the one patch kit (:mod:`rr_client.core.patching`), and the
engine gates built on them (issue 29, item 3): every refusal is an :class:`UnsupportedVersionError`, so an
``RRError``, naming the package, what was found, what was tested and the override."""

from __future__ import annotations

import builtins
import functools
from typing import Any

import pytest

from rr_client.core import versions
from rr_client.core.errors import RRError, UnsupportedVersionError
from rr_client.core.patching import MARKER, Shape, check_shapes, is_wrapped, parameters, unwrap, wrap_once
from rr_client.core.versions import OVERRIDE, check_version


@pytest.mark.parametrize(
    "lo,hi,version,covered",
    [
        ("1.16", None, "1.16", True),
        ("1.16", None, "1.16.3", True),
        ("1.16", None, "1.16.0rc1", True),
        ("1.16", None, "1.17", False),
        ("1.16", None, "1.15.9", False),
        ("1.16", None, "1", False),
        ("0.22", "0.33", "0.30.0+cpu", True),
        ("0.22", "0.33", "0.22.0", True),
        ("0.22", "0.33", "0.33.9", True),
        ("0.22", "0.33", "0.34.0", False),
        ("0.22", "0.33", "0.21.9", False),
        ("0.22", "0.33", "1.0", False),
        ("0.5.7", "0.5.23", "0.5.10.post1", True),
        ("0.5.7", "0.5.23", "0.5.23", True),
        ("0.5.7", "0.5.23", "0.5.24", False),
        ("0.5.7", "0.5.23", "0.5.6", False),
        ("0.9.1", None, "0.9.1", True),
        ("0.9.1", None, "0.9.2", False),
    ],
)
def test_covers_at_the_precision_the_bounds_are_written_in(
    lo: str, hi: str | None, version: str, covered: bool
) -> None:
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
        check_version(
            "trl", versions.Tested("1.16"), "1.17.0", why="it reaches into private methods", allow_unsupported=False
        )
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


def _engine_gate(engine: str) -> tuple[Any, type[UnsupportedVersionError]]:
    """The engine's version gate and the error class it refuses with."""
    if engine == "vllm":
        from rr_server.serving.engines.vllm import UnsupportedVLLMVersion, check_vllm_version

        return check_vllm_version, UnsupportedVLLMVersion
    from rr_server.serving.engines.sglang import UnsupportedSGLangError, profile_for

    return profile_for, UnsupportedSGLangError


# engine -> (releases its gate refuses, the tested range the refusal names, what else its message names)
REFUSED = {
    "vllm": (["0.21.9", "0.34.0", "1.0.0", "garbage"], "0.22-0.33", [OVERRIDE, "--rr-allow-unsupported-version"]),
    "sglang": (["0.5.6", "0.5.24", "0.6.0", "garbage"], "0.5.7-0.5.23", []),
}


@pytest.mark.parametrize("engine, version", [(e, v) for e, (versions_, _, _) in REFUSED.items() for v in versions_])
def test_engine_gate_refuses_in_the_rr_error_tree(engine: str, version: str) -> None:
    gate, error = _engine_gate(engine)
    with pytest.raises(error) as exc:
        gate(version)
    e = exc.value
    _, tested, named = REFUSED[engine]
    assert isinstance(e, UnsupportedVersionError) and isinstance(e, RRError) and isinstance(e, RuntimeError)
    assert (e.package, e.version, e.tested) == (engine, version, tested)
    assert version in str(e) and all(n in str(e) for n in named), (str(e), named)


def test_vllm_gate_range_and_override() -> None:
    from rr_server.serving.engines.vllm import SUPPORTED, check_vllm_version, facts_for

    assert SUPPORTED == ((0, 22), (0, 33))
    for v in ("0.22.0", "0.30.0+cpu", "0.33.2"):
        assert check_vllm_version(v) == v and facts_for(v).supported
    assert check_vllm_version("0.34.0", allow_unsupported=True) == "0.34.0"
    assert not facts_for("0.34.0").supported and not facts_for("0.21.9").supported


def test_vllm_unparsable_facts_are_in_the_tree() -> None:
    from rr_server.serving.engines.vllm import facts_for

    with pytest.raises(UnsupportedVersionError, match="cannot parse vLLM version"):
        facts_for("garbage")


def test_sglang_gate_has_no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's patch never honoured the override (an untested SGLang goes through the sidecar): unchanged."""
    from rr_server.serving.engines.sglang import MAX_VERSION, MIN_VERSION, UnsupportedSGLangError, profile_for

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


class _Struct:
    """Stands in for a third-party dataclass rr reads fields of."""

    __dataclass_fields__ = {"rows": None, "out_list": None}

    async def handle(self, recv_obj: Any) -> None:
        return None


def test_check_shapes_passes_a_matching_shape(engine_cls: type[_Engine]) -> None:
    check_shapes(
        Shape(engine_cls, {"step": ["self", "batch", "scale"]}),
        Shape(engine_cls, {"step": [["self", "batch"], ["self", "batch", "scale"]]}),  # any of several
        Shape(engine_cls, {"step": ["self", ...]}),
        Shape(engine_cls, {"step": [..., "scale"]}),
        Shape(engine_cls, {"step": ["self", ..., "batch", ..., "scale", ...]}),
        Shape(engine_cls, {"step": None}),
        Shape(_Struct, fields=["rows", "out_list"], coroutines={"handle": True}),
        what="engine 1.0",
    )


@pytest.mark.parametrize(
    "shape,found",
    [
        (Shape(_Engine, {"gone": None}), "_Engine.gone is missing"),
        (
            Shape(_Engine, {"step": ["self", "batch"]}),
            "_Engine.step(self, batch, scale) does not have the shape rr relies on (self, batch)",
        ),
        (
            Shape(_Engine, {"step": [["self"], ["batch", ...]]}),
            "_Engine.step(self, batch, scale) does not have the shape rr relies on (self) or (batch, ...)",
        ),
        (Shape(_Engine, {"__doc__": None}), "_Engine.__doc__ is a str, not a function"),
        (Shape(_Struct, fields=["rows", "routed_experts"]), "_Struct has no field 'routed_experts'"),
        (Shape(_Engine, fields=["rows"]), "_Engine has no field 'rows'"),  # not a dataclass: declares no fields
        (Shape(_Struct, coroutines={"handle": False}), "_Struct.handle is async def (rr expects def)"),
        (Shape(_Engine, coroutines={"step": True}), "_Engine.step is not async def (rr expects async def)"),
        (Shape(_Engine, {"step": ["self", ...]}, coroutines={"step": True}), "_Engine.step is not async def"),
        (Shape(_Engine, coroutines={"gone": True}), "_Engine.gone is missing"),
        (Shape(builtins, {"min": ["iterable"]}), "builtins.min has no readable signature"),  # a builtin without one
    ],
)
def test_check_shapes_names_each_way_a_shape_differs(shape: Shape, found: str) -> None:
    """Every failure mode raises UnsupportedVersionError naming the object, what rr expects, what it found, and the
    package with its installed version."""
    with pytest.raises(UnsupportedVersionError) as exc:
        check_shapes(shape, what="engine 2.0 (rr was tested with engine 1.0)")
    msg = str(exc.value)
    assert found in msg, msg
    assert msg.endswith(" in engine 2.0 (rr was tested with engine 1.0): refusing to patch or subclass it"), msg


def test_check_shapes_reports_every_difference_at_once_in_the_callers_error() -> None:
    class EngineError(UnsupportedVersionError):
        pass

    with pytest.raises(EngineError) as exc:
        check_shapes(
            Shape(_Engine, {"gone": None, "step": ["self"]}),
            Shape(_Struct, fields=["nope"]),
            error=lambda msg: EngineError(msg, package="engine", version="2.0"),
        )
    assert str(exc.value) == (
        "_Engine.gone is missing; _Engine.step(self, batch, scale) does not have the shape rr "
        "relies on (self); _Struct has no field 'nope': refusing to patch or subclass it"
    )
    assert (exc.value.package, exc.value.version) == ("engine", "2.0")


def test_wrap_once_raises_the_callers_error(engine_cls: type[_Engine]) -> None:
    class EngineError(UnsupportedVersionError):
        pass

    with pytest.raises(
        EngineError,
        match=r"step\(self, batch, scale\) does not have the shape rr relies on "
        r"\(args, \.\.\.\)",
    ):
        wrap_once(engine_cls, "step", _doubling, params=["args", ...], error=EngineError)
    assert not is_wrapped(engine_cls, "step")


def test_vllm_build_app_wrap_uses_the_kit() -> None:
    """The vLLM plugin's build_app wrap is re-entrant through the one marker, and refuses a foreign shape."""
    from types import ModuleType

    from rr_patches.vllm import plugin
    from rr_server.serving.engines.vllm import UnsupportedVLLMVersion

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
    with pytest.raises(
        UnsupportedVLLMVersion, match=r"build_app\(app\) does not have the shape rr relies on \(args, \.\.\.\)"
    ):
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
    from rr_server.serving.engines.sglang import UnsupportedSGLangError
    from rr_server.serving.engines.vllm import UnsupportedVLLMVersion

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
