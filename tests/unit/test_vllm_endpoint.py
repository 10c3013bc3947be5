"""vLLM 0.30+: rr's routes come from the ``vllm.endpoint_plugins`` entry point, not the build_app wrap (issue 12).

Unit level, in .venv's vLLM 0.30 (no server): the entry point is installed and resolves to rr's factory,
the general plugin does not wrap ``build_app`` where the group exists, refuses loudly when ``VLLM_PLUGINS``
would keep the endpoint plugin from loading, and vLLM's own ``build_app`` attaches rr's routes through
``attach_endpoint_plugins``. The launcher's 0.31+ settings are checked here too.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

from rr_client.core.patching import is_wrapped

pytest.importorskip("vllm")


def test_entry_point_is_installed_and_resolves() -> None:
    from rr_patches.vllm.endpoint import RREndpointPlugin

    eps = [ep for ep in entry_points(group="vllm.endpoint_plugins") if ep.name == "rr"]
    assert [ep.value for ep in eps] == ["rr_patches.vllm.endpoint:make_plugin"]
    plugin = eps[0].load()()
    assert isinstance(plugin, RREndpointPlugin)
    from vllm.plugins.endpoint_plugins.interface import EndpointPlugin

    assert isinstance(plugin, EndpointPlugin)  # vLLM's runtime_checkable protocol
    assert plugin.name == "rr" and plugin.required_tasks == ("generate",)


def test_general_plugin_skips_the_wrap_where_the_group_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    from rr_patches.vllm import plugin

    monkeypatch.setenv("RR_ENABLE", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "rr")
    monkeypatch.setitem(plugin._state, "registered", False)
    from vllm.entrypoints.launchers.api_server import entry

    monkeypatch.setattr(entry, "build_app", entry.build_app)
    assert plugin.uses_endpoint_plugin()
    plugin.register()
    plugin.register()
    assert plugin._state["registered"]
    assert not is_wrapped(entry, "build_app"), "0.30+: no build_app wrap"


@pytest.mark.parametrize("value", [None, "", "other"])
def test_general_plugin_refuses_when_vllm_plugins_hides_the_endpoint(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    from rr_patches.vllm import plugin

    monkeypatch.setenv("RR_ENABLE", "1")
    if value is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", value)
    monkeypatch.setitem(plugin._state, "registered", False)
    with pytest.raises(plugin.UnsupportedVLLMVersion, match="VLLM_PLUGINS=rr"):
        plugin.register()


def _args(**kw: object) -> SimpleNamespace:
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # vLLM 0.33 moved it
        from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m"])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_vllm_build_app_attaches_rr_routes_via_the_endpoint_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RR_ENABLE", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "rr")
    from vllm.entrypoints.launchers.app import build_app

    app = build_app(_args(), ("generate",))
    paths = {getattr(r, "path", None) for r in app.routes}
    assert {"/generate", "/rr/info", "/v1/completions"} <= paths
    assert app.state.rr_routes_via == "vllm.endpoint_plugins"
    assert [p.name for p in app.state.endpoint_plugins] == ["rr"]


def test_endpoint_plugin_inert_without_rr_enable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RR_ENABLE", raising=False)
    monkeypatch.setenv("VLLM_PLUGINS", "rr")
    from vllm.entrypoints.launchers.app import build_app

    app = build_app(_args(), ("generate",))
    assert "/generate" not in {getattr(r, "path", None) for r in app.routes}


def test_launcher_sets_what_0_31_plus_capture_needs() -> None:
    from rr_server.launch.vllm import build_command

    env: dict[str, str] = {}
    cmd, notes = build_command(["--model", "m", "--no-enable-prefix-caching"], cpu=False, version="0.32.0", env=env)
    assert "--enable-prefix-caching" in cmd and "--no-enable-prefix-caching" not in cmd
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert len(notes) == 1 and "AuxOutput" in notes[0] and "VLLM_USE_V2_MODEL_RUNNER=1" in notes[0]
    env = {}
    cmd, notes = build_command(["--model", "m"], cpu=False, version="0.30.0", env=env)
    assert "--enable-prefix-caching" not in cmd and env == {} and notes == []


def test_routing_enabled_reads_where_each_version_keeps_it() -> None:
    from rr_patches.vllm.compat import routing_enabled

    v030 = SimpleNamespace(
        model_config=SimpleNamespace(enable_return_routed_experts=True), vllm_config=SimpleNamespace()
    )
    v032 = SimpleNamespace(
        model_config=SimpleNamespace(),
        vllm_config=SimpleNamespace(aux_output_config=SimpleNamespace(enable_return_routed_experts=True)),
    )
    off = SimpleNamespace(
        model_config=SimpleNamespace(),
        vllm_config=SimpleNamespace(aux_output_config=SimpleNamespace(enable_return_routed_experts=False)),
    )
    assert routing_enabled(v030) and routing_enabled(v032) and not routing_enabled(off)


def test_capture_setting_location_matches_the_installed_vllm() -> None:
    """On the installed vLLM's real config classes: 0.31+ keep the flag in AuxOutputConfig, 0.30 in ModelConfig."""
    import dataclasses

    import vllm
    from vllm.config import ModelConfig, VllmConfig

    from rr_patches.vllm.compat import routing_enabled
    from rr_server.serving.engines import engine_release

    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if engine_release(vllm.__version__)[:2] >= (0, 31):
        from vllm.config.aux_output import AuxOutputConfig

        assert "enable_return_routed_experts" not in model_fields
        assert "aux_output_config" in {f.name for f in dataclasses.fields(VllmConfig)}
        client = SimpleNamespace(
            model_config=SimpleNamespace(),
            vllm_config=SimpleNamespace(aux_output_config=AuxOutputConfig(enable_return_routed_experts=True)),
        )
        assert routing_enabled(client)
        assert not routing_enabled(
            SimpleNamespace(
                model_config=SimpleNamespace(), vllm_config=SimpleNamespace(aux_output_config=AuxOutputConfig())
            )
        )
    else:
        assert "enable_return_routed_experts" in model_fields
