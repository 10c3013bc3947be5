"""The vLLM plugin's /rr/generate alias and its always-return switch, without a server."""

from __future__ import annotations

import pytest

from rr_patches.vllm import routes
from rr_patches.vllm.auth import RR_PREFIXES, _is_rr_path


def test_rr_generate_is_generate_and_behind_the_api_key_prefixes() -> None:
    table = {path: (handler, methods) for path, handler, methods in routes.RR_ROUTES}
    assert table["/rr/generate"] == table["/generate"] == (routes.generate, ("POST",))
    for path in table:  # every route rr adds is under a prefix vLLM's --api-key guards
        assert _is_rr_path(path) and path.startswith(RR_PREFIXES), path


@pytest.mark.parametrize(("value", "on"), [("", False), ("0", False), ("false", False), ("1", True), ("true", True)])
def test_always_return_switch(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv(routes.ALWAYS_ENV, value)
    assert routes.ALWAYS_ENV == "RR_VLLM_ALWAYS_RETURN_ROUTED_EXPERTS"
    assert routes.always_return_routing() is on


def test_add_rr_routes_refuses_to_shadow() -> None:
    from fastapi import FastAPI

    app = FastAPI()
    routes.add_rr_routes(app)
    assert {"/generate", "/rr/generate", "/rr/info"} <= {getattr(r, "path", None) for r in app.routes}
    with pytest.raises(RuntimeError, match="refusing to shadow"):
        routes.add_rr_routes(app)
