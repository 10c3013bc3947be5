"""rr_server.serving.weight_epoch: which weight routes count as an update, and what a request spanning one sees.

The app is a small Starlette app with the engines' weight route names (vLLM's real routes are exercised on the
real server in tests/vllm/test_provenance.py); the middleware under test is rr's own.
"""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rr_server.serving.weight_epoch import WeightEpoch, WeightUpdateMiddleware, update_kind


def app_with(epoch: WeightEpoch, seen: list[bool]) -> Starlette:
    """Weight routes answering as the engines do; ``/refused`` answers 401 like a keyed server without a key."""

    async def ok(request: Request) -> JSONResponse:
        await request.body()
        seen.append(epoch.active)  # the update is under way while the route runs
        return JSONResponse({"ok": True})

    async def refused(request: Request) -> JSONResponse:
        return JSONResponse({"error": "no key"}, status_code=401)

    paths = [
        "/collective_rpc",
        "/update_weights",
        "/start_weight_update",
        "/finish_weight_update",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/pause",
    ]
    app = Starlette(
        routes=[
            *(Route(p, ok, methods=["POST"]) for p in paths),
            Route("/update_weight_version_refused", refused, methods=["POST"]),
        ]
    )
    app.add_middleware(WeightUpdateMiddleware, epoch=epoch)
    return app


def post_all(app: Starlette, calls: list[tuple[str, dict[str, object]]]) -> list[int]:
    async def go() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [(await c.post(p, json=body)).status_code for p, body in calls]

    return asyncio.run(go())


def test_completed_updates_count_and_reads_do_not() -> None:
    epoch, seen = WeightEpoch(), []
    app = app_with(epoch, seen)
    mark = epoch.mark()
    post_all(app, [("/collective_rpc", {"method": "get_weight_info"}), ("/pause", {})])
    assert epoch.since(mark) == (0, False)  # neither loads weights
    post_all(app, [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/x"}})])
    assert epoch.since(mark) == (1, True) and seen[-1] is True
    post_all(app, [("/update_weights_from_disk", {"model_path": "/x"}), ("/update_weight_version", {})])
    assert epoch.info() == {"weight_version": 3, "weight_update_in_progress": False}
    after = epoch.mark()
    assert epoch.since(after) == (3, False)


def test_a_start_finish_window_is_one_update_and_spans_what_runs_inside() -> None:
    epoch, seen = WeightEpoch(), []
    app = app_with(epoch, seen)
    post_all(app, [("/start_weight_update", {})])
    inside = epoch.mark()
    assert inside.active and epoch.since(inside) == (0, True)  # admitted while an update is under way
    post_all(app, [("/update_weights", {"update_info": {}}), ("/update_weights", {"update_info": {}})])
    assert epoch.version == 0  # chunks of the window
    post_all(app, [("/finish_weight_update", {})])
    assert epoch.version == 1 and not epoch.active


def test_a_refused_update_changes_nothing() -> None:
    epoch = WeightEpoch()
    mark = epoch.mark()
    app = app_with(epoch, [])
    app.router.routes.append(
        Route("/update_weights_from_tensor", lambda r: JSONResponse({}, status_code=401), methods=["POST"])
    )
    assert post_all(app, [("/update_weights_from_tensor", {})]) == [401]
    assert epoch.since(mark) == (0, False)


def test_update_kind() -> None:
    assert update_kind("/collective_rpc", b'{"method": "load_weights"}') == "update"
    assert update_kind("/collective_rpc", b'{"method": "check_health"}') is None
    assert update_kind("/collective_rpc", b"not json") is None
    assert update_kind("/start_weight_update", b"") == "start"
    assert update_kind("/v1/completions", b"") is None
