"""vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``) behind the API key, and the launcher's refusal to open them
to the network without one (issue 29), without a server."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from rr_client.core.errors import ConfigurationError, RRError
from rr_patches.vllm import auth as vllm_auth
from rr_server.launch import vllm as launch_vllm
from rr_server.launch.vllm import OPEN_DEV_MODE_FLAG, check_dev_mode_exposure, is_loopback_host

DEV = {"VLLM_SERVER_DEV_MODE": "1"}


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", [None, "", "0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "example.com"])
def test_other_hosts_reach_the_network(host: str | None) -> None:
    """vLLM's default (``--host`` absent, or empty: vLLM parses it to None) binds every interface."""
    assert not is_loopback_host(host)


# (vLLM arguments, environment): dev mode reachable from the network without a key
REFUSED = [
    ([], DEV),
    (["--host", "0.0.0.0"], DEV),
    (["--host=::"], DEV),
    (["--host", ""], DEV),
    (["--host", "10.1.2.3", "--port", "8000"], DEV),
    (["--host", "127.0.0.1", "--host", "0.0.0.0"], DEV),  # argparse keeps the last
    (["--api-key", ""], {**DEV, "VLLM_API_KEY": "k"}),  # vLLM: a given --api-key wins over VLLM_API_KEY, "" is none
    (["--host", "0.0.0.0"], {"VLLM_SERVER_DEV_MODE": "true"}),  # vLLM cannot read it: counted as on
]
ALLOWED = [
    ([], {}),
    (["--host", "0.0.0.0"], {"VLLM_SERVER_DEV_MODE": "0"}),
    (["--host", "127.0.0.1"], DEV),
    (["--host=::1"], DEV),
    (["--host", "localhost"], DEV),
    (["--host", "0.0.0.0", "--api-key", "k"], DEV),
    (["--api_key=k"], DEV),
    (["--api-key", "a", "b", "--port", "1"], DEV),
    ([], {**DEV, "VLLM_API_KEY": "k"}),
    (["--uds", "/tmp/vllm.sock"], DEV),
    (["--headless"], DEV),
    ([OPEN_DEV_MODE_FLAG], DEV),
    (["--host", "0.0.0.0", OPEN_DEV_MODE_FLAG], DEV),
]


@pytest.mark.parametrize("args,env", REFUSED)
def test_open_dev_mode_is_refused(args: list[str], env: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError) as e:
        check_dev_mode_exposure(["--model", "m", *args], env)
    assert isinstance(e.value, RRError) and isinstance(e.value, ValueError)
    for name in ("VLLM_SERVER_DEV_MODE", "--host", "--api-key", OPEN_DEV_MODE_FLAG, "/collective_rpc"):
        assert name in str(e.value), name


@pytest.mark.parametrize("args,env", ALLOWED)
def test_dev_mode_with_a_key_or_on_loopback_is_allowed(args: list[str], env: dict[str, str]) -> None:
    check_dev_mode_exposure(["--model", "m", *args], env)


class _Launched(Exception):
    pass


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """``launch_vllm.main`` on vLLM 0.30, CPU, stopped at the launch; yields the commands it would run."""
    launched: list[list[str]] = []

    def popen(cmd: list[str], **_: Any) -> None:
        launched.append(cmd)
        raise _Launched

    monkeypatch.setattr(launch_vllm, "installed_version", lambda: "0.30.0")
    monkeypatch.setattr(launch_vllm, "is_cpu_platform", lambda: True)
    monkeypatch.setattr(launch_vllm.lifeline, "start", lambda: SimpleNamespace(guard=lambda pid: None))
    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    yield launched


def test_launcher_refuses_open_dev_mode_before_starting(
    launcher: list[list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert launch_vllm.main(["--model", "m", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert not launcher and err.startswith("rr: VLLM_SERVER_DEV_MODE=1") and OPEN_DEV_MODE_FLAG in err


def test_launcher_override_starts_and_is_not_passed_to_vllm(launcher: list[list[str]]) -> None:
    with pytest.raises(_Launched):
        launch_vllm.main(["--model", "m", "--host", "0.0.0.0", OPEN_DEV_MODE_FLAG])
    assert launcher and OPEN_DEV_MODE_FLAG not in launcher[0] and "0.0.0.0" in launcher[0]


def test_launcher_starts_dev_mode_with_a_key(launcher: list[list[str]]) -> None:
    with pytest.raises(_Launched):
        launch_vllm.main(["--model", "m", "--host", "0.0.0.0", "--api-key", "k"])
    cmd = launcher[0]
    assert cmd[cmd.index("--api-key") : cmd.index("--api-key") + 2] == ["--api-key", "k"]


def test_launcher_help_is_not_refused(launcher: list[list[str]]) -> None:
    """``--help`` only prints vLLM's help (nothing listens), dev mode or not."""
    with pytest.raises(_Launched):
        launch_vllm.main(["--help"])
    assert "--help" in launcher[0]


# ------------------------------------------------------------------ the plugin: dev-mode paths behind the key


def test_static_list_covers_the_installed_vllms_dev_routes() -> None:
    """Every route ``register_vllm_dev_api_routers`` adds is found by module and is in DEV_MODE_PATHS."""
    from vllm.entrypoints.serve import register_vllm_dev_api_routers

    app = FastAPI()
    register_vllm_dev_api_routers(app)
    found = vllm_auth.dev_route_paths(app)
    assert {
        "/collective_rpc",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/server_info",
    } <= set(found)
    assert set(found) <= set(vllm_auth.DEV_MODE_PATHS)


def _app(tokens: list[str], *paths: str, module: str = "vllm.entrypoints.serve.dev.cache.api_router") -> FastAPI:
    """A FastAPI app with vLLM's AuthenticationMiddleware and POST routes ``paths`` defined in ``module``."""
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    app = FastAPI()
    for path in paths:

        async def ok() -> dict[str, bool]:
            return {"ok": True}

        ok.__module__ = module
        app.add_api_route(path, ok, methods=["POST"])
    app.add_middleware(AuthenticationMiddleware, tokens=tokens)
    return app


def _statuses(app: FastAPI, path: str) -> tuple[int, int, int]:
    with TestClient(app) as client:
        return tuple(
            client.post(path, headers={"authorization": f"Bearer {k}"} if k else {}).status_code
            for k in (None, "wrong", "k")
        )  # type: ignore[return-value]


def test_dev_routes_need_the_key_through_vllms_middleware() -> None:
    from vllm.entrypoints.serve.middleware import authenticate

    app = _app(["k"], "/collective_rpc", "/reset_prefix_cache")
    app.add_api_route("/health", lambda: {"ok": True}, methods=["POST"])  # defined here: not a dev route
    how = vllm_auth.protect_rr_routes(app, SimpleNamespace(api_key=["k"]))
    assert "dev-mode paths" in how and "self-test passed" in how
    assert set(vllm_auth.DEV_MODE_PATHS) <= set(authenticate.GUARDED_PREFIX)
    assert authenticate.GUARDED_PREFIX[:4] == ("/v1", "/v2", "/inference", "/cohere")
    assert len(authenticate.GUARDED_PREFIX) == len(set(authenticate.GUARDED_PREFIX))
    assert _statuses(app, "/collective_rpc") == (401, 401, 200)
    assert _statuses(app, "/reset_prefix_cache") == (401, 401, 200)
    assert _statuses(app, "/health")[0] == 200  # not a dev route: open, as in vLLM


def test_a_new_dev_route_is_found_by_its_module_and_guarded() -> None:
    app = _app(["k"], "/brand_new_dev_route", module="vllm.entrypoints.rl.online.api_router")
    assert vllm_auth.dev_route_paths(app) == ("/brand_new_dev_route",)
    vllm_auth.protect_rr_routes(app, SimpleNamespace(api_key=["k"]))
    assert _statuses(app, "/brand_new_dev_route") == (401, 401, 200)


def test_refuses_to_start_when_a_dev_route_would_stay_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM whose middleware guards rr's prefixes but not the dev-mode paths: the server must not start."""
    from vllm.entrypoints.serve.middleware import authenticate

    original = authenticate.AuthenticationMiddleware.__call__

    def not_dev(self: Any, scope: Any, receive: Any, send: Any) -> Any:
        if scope.get("path", "").startswith(vllm_auth.DEV_MODE_PATHS):
            return self.app(scope, receive, send)
        return original(self, scope, receive, send)

    monkeypatch.setattr(authenticate.AuthenticationMiddleware, "__call__", not_dev)
    with pytest.raises(vllm_auth.UnprotectedRoutesError, match="dev-mode") as e:
        vllm_auth.protect_rr_routes(_app(["k"]), SimpleNamespace(api_key=["k"]))
    assert "/collective_rpc" in str(e.value) and "/generate" not in str(e.value)


def test_without_vllms_prefix_tuple_rr_guards_the_dev_routes_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.entrypoints.serve.middleware import authenticate

    monkeypatch.delattr(authenticate, "GUARDED_PREFIX")
    app = FastAPI()
    for path in ("/collective_rpc", "/health"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["POST"])
    how = vllm_auth.protect_rr_routes(app, SimpleNamespace(api_key=["k"]))
    assert "ApiKeyMiddleware" in how
    assert _statuses(app, "/collective_rpc") == (401, 401, 200)
    assert _statuses(app, "/health")[0] == 200


def test_no_key_leaves_dev_routes_open_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with caplog.at_level("WARNING", logger="rr.vllm"):
        how = vllm_auth.protect_rr_routes(_app([]), SimpleNamespace(api_key=None))
    assert "open" in how and "VLLM_SERVER_DEV_MODE=1 without --api-key" in caplog.text
