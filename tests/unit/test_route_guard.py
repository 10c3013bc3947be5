"""Every route of rr's vLLM server is named in docs/security.md with who may call it, and that is what it does
(issue 36, item 10).

vLLM's own ``build_app`` makes the real vLLM 0.30 app with every optional route group on (dev mode, runtime
LoRA, the profiler, fault tolerance; elastic EP is always there) and a key, with rr's endpoint plugin attached as
``VLLM_PLUGINS=rr`` does; rr's ``protect_rr_routes`` runs as at startup. The app's routes must be exactly the doc
table's, every "key" route must answer 401 without the key and with a wrong one, and no "anyone" route may.
No engine runs: a route the key lets through fails in its handler (no engine client), never with a 401.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rr_patches.vllm import auth as vllm_auth

REPO = Path(__file__).resolve().parents[2]
KEY = "route-key"
SECTION = "### Every route and who may call it"


def doc_routes() -> dict[str, str]:
    """``{path: "key" | "anyone"}`` from docs/security.md's route table."""
    text = (REPO / "docs/security.md").read_text()
    body = text.split(SECTION, 1)[1].split("\n#", 1)[0]
    out: dict[str, str] = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        who = "key" if cells[1].startswith("key") else "anyone" if cells[1] == "anyone" else cells[1]
        for path in re.findall(r"`(/[^`]*)`", cells[0]):
            assert path not in out, f"{path} listed twice"
            out[path] = who
    assert out, "no route table found"
    return out


@pytest.fixture(scope="module")
def vllm_app() -> Iterator[Any]:
    """vLLM 0.30's real app, every optional route group on, ``--api-key``, rr's routes, rr's guard applied."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with pytest.MonkeyPatch.context() as mp:
        for name, value in {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
            "RR_ENABLE": "1",
            "VLLM_PLUGINS": "rr",
        }.items():
            mp.setenv(name, value)
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(
            [
                "--model",
                "m",
                "--api-key",
                KEY,
                "--enable-fault-tolerance",
                "--profiler-config",
                json.dumps({"profiler": "torch", "torch_profiler_dir": "/tmp/rr-unused-profiles"}),
            ]
        )
        app = build_app(args, supported_tasks=("generate",))
        if not getattr(app.state, "rr_routes_installed", False):  # the plugin is not registered in this env
            from rr_patches.vllm.endpoint import RREndpointPlugin

            RREndpointPlugin().attach_router(app)
        how = vllm_auth.protect_rr_routes(app, args)
        assert "self-test passed" in how
        yield app


def _app_routes(app: Any) -> dict[str, str]:
    """``{path: method}`` of every route (a mount, e.g. /metrics' ASGI app: GET)."""
    out: dict[str, str] = {}
    for r in app.routes:
        methods = sorted(getattr(r, "methods", None) or ["GET"])
        out.setdefault(r.path, "POST" if "POST" in methods else methods[0])
    return out


def test_the_doc_lists_every_route_of_the_app(vllm_app: Any) -> None:
    doc, app = doc_routes(), _app_routes(vllm_app)
    assert set(doc.values()) == {"key", "anyone"}
    assert sorted(set(app) - set(doc)) == [], "routes the doc does not name"
    assert sorted(set(doc) - set(app)) == [], "routes the doc names that the app does not serve"
    for path in ("/scale_elastic_ep", "/start_profile", "/stop_profile", "/fault_tolerance/apply", "/adapters"):
        assert doc[path] == "key", path


def test_key_routes_need_the_key_and_open_ones_do_not(vllm_app: Any) -> None:
    from starlette.testclient import TestClient

    doc = doc_routes()
    client = TestClient(vllm_app, raise_server_exceptions=False)  # no lifespan: no engine is started
    wrong: dict[str, list[int]] = {}
    for path, method in _app_routes(vllm_app).items():
        url = re.sub(r"\{[^}]*\}", "x", path)
        got = [
            client.request(method, url, headers={"authorization": f"Bearer {k}"} if k else {}, json={}).status_code
            for k in (None, "not-the-key")
        ]
        if (doc[path] == "key") != (got == [401, 401]) or (doc[path] == "anyone" and 401 in got):
            wrong[f"{method} {path} ({doc[path]})"] = got
    assert wrong == {}


def test_engine_control_routes_a_later_vllm_adds_are_found_by_module() -> None:
    from fastapi import FastAPI

    app = FastAPI()

    async def new_route() -> dict[str, bool]:
        return {"ok": True}

    new_route.__module__ = "vllm.entrypoints.serve.elastic_ep.api_router"
    app.add_api_route("/scale_elastic_ep_v2", new_route, methods=["POST"])
    assert vllm_auth.engine_route_paths(app) == ("/scale_elastic_ep_v2",)
    assert set(vllm_auth.ENGINE_CONTROL_PATHS) <= set(vllm_auth.guarded_paths())
