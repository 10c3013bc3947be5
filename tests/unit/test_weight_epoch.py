"""rr_server.serving.weight_epoch: which weight routes count as an update, and what a request spanning one sees.

The app is a small Starlette app with the engines' weight route names (vLLM's real routes are exercised on the
real server in tests/vllm/test_provenance.py); the middleware under test is rr's own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rr_server.serving.weight_epoch import EPOCH_FILE, WeightEpoch, WeightUpdateMiddleware, update_kind


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
    assert epoch.info() == {  # /pause cleared the cache (its default) and no resume since: nothing went stale
        "weight_version": 3,
        "weight_update_in_progress": False,
        "prefix_cache_stale": False,
        "cache_epoch": 2,  # the pause's clear and the SGLang update's own flush
    }
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


# --- cache epochs: whether the prefix cache may hold KV from older weights ----------------------------------------


def cache_app(epoch: WeightEpoch, reset_ok: list[bool]) -> Starlette:
    """The weight routes plus the cache routes as the engines answer them: vLLM 0.30's ``/reset_prefix_cache`` (200
    with ``success`` false while blocks are held), SGLang's ``/flush_cache`` (GET or POST), vLLM's ``/resume``."""
    app = app_with(epoch, [])

    async def reset(request: Request) -> JSONResponse:
        return JSONResponse({"success": reset_ok.pop(0)})

    async def ok(request: Request) -> JSONResponse:
        return JSONResponse({})

    app.router.routes.extend(
        [
            Route("/reset_prefix_cache", reset, methods=["POST"]),
            Route("/flush_cache", ok, methods=["GET", "POST"]),
            Route("/resume", ok, methods=["POST"]),
        ]
    )
    return app


RELOAD = ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/x"}})


def test_a_reload_leaves_the_cache_stale_until_a_reset_says_it_worked() -> None:
    epoch = WeightEpoch()
    app = cache_app(epoch, [False, True])
    assert not epoch.mark().cache_stale
    post_all(app, [RELOAD])
    assert epoch.mark().cache_stale and epoch.info()["prefix_cache_stale"] is True
    post_all(app, [("/reset_prefix_cache", {})])  # 200 {"success": false}: blocks still held
    assert epoch.cache_stale and epoch.cache_clears == 0
    post_all(app, [("/reset_prefix_cache", {})])
    assert not epoch.mark().cache_stale and epoch.cache_clears == 1


def test_a_pause_clears_for_the_updates_inside_it_unless_told_not_to() -> None:
    epoch = WeightEpoch()
    app = cache_app(epoch, [])
    post_all(app, [("/pause?mode=keep", {}), RELOAD, ("/resume", {})])
    assert not epoch.cache_stale  # cleared at the pause, nothing computed before the update
    post_all(app, [("/pause?mode=keep&clear_cache=false", {}), RELOAD, ("/resume", {})])
    assert epoch.cache_stale  # the frozen requests' old-weight KV stays in the cache
    post_all(app, [("/pause", {}), ("/resume", {}), RELOAD])
    assert epoch.cache_stale  # cleared, then generation ran again before the update


def test_sglang_updates_flush_unless_asked_not_to_and_a_get_flush_counts() -> None:
    epoch = WeightEpoch()
    app = cache_app(epoch, [])
    post_all(app, [("/update_weights_from_disk", {"model_path": "/x"})])
    assert not epoch.cache_stale and epoch.version == 1
    post_all(app, [("/update_weights_from_disk", {"model_path": "/x", "flush_cache": False})])
    assert epoch.cache_stale

    async def get_flush() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get("/flush_cache")).status_code

    assert asyncio.run(get_flush()) == 200 and not epoch.cache_stale


def test_the_count_is_made_before_the_answer_leaves() -> None:
    """A caller that reads the update's answer and sends its next request (to any API process) is admitted under
    the new version: the middleware counts before the last body chunk is sent."""
    epoch = WeightEpoch()
    seen: list[tuple[str, int]] = []

    async def engine(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    async def client_send(msg: Any) -> None:
        seen.append((msg["type"], epoch.version))

    async def go() -> None:
        body = b'{"method": "reload_weights"}'
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/collective_rpc", "query_string": b"", "headers": []}
        await WeightUpdateMiddleware(engine, epoch=epoch)(scope, receive, client_send)

    asyncio.run(go())
    assert seen == [("http.response.start", 0), ("http.response.body", 1)]


def test_api_processes_share_one_epoch(tmp_path: Path) -> None:
    """Two processes' epochs over one file (what --api-server-count's processes map): an update and a cache reset
    through either are seen by both, marks included; a fresh run zeroes a dead run's file."""
    a, b = WeightEpoch(), WeightEpoch()
    assert a.share(tmp_path, fresh=True) and b.share(tmp_path) and a.shared and b.shared
    mark_b = b.mark()
    post_all(cache_app(a, [True]), [RELOAD])
    assert b.version == 1 and b.since(mark_b) == (1, True) and b.mark().cache_stale
    post_all(cache_app(b, [True]), [("/reset_prefix_cache", {})])
    assert not a.cache_stale and a.info() == b.info()
    assert not b.share(tmp_path)  # once
    c = WeightEpoch()
    c.share(tmp_path, fresh=True)  # the first process of a new run: the dead run's counts are gone
    assert c.version == 0 and a.version == 0 and (tmp_path / EPOCH_FILE).stat().st_size == 64


def test_an_sglang_update_over_the_body_cap_is_handed_on_whole_and_leaves_the_cache_stale(
    monkeypatch: Any,
) -> None:
    """An SGLang update carrying its tensors inline (``/update_weights_from_tensor``) may exceed the middleware's
    body cap: it is handed on whole (never refused: the engine must get every byte), and, its ``flush_cache``
    unread, it counts as an update that left the cache stale, never as a flush. A ``/collective_rpc`` over the cap
    is a 413."""
    monkeypatch.setattr(WeightUpdateMiddleware, "max_body_bytes", 1000)
    epoch, got = WeightEpoch(), []

    async def update(request: Request) -> JSONResponse:
        got.append(await request.body())
        return JSONResponse({"success": True})

    app = Starlette(
        routes=[Route(p, update, methods=["POST"]) for p in ("/update_weights_from_tensor", "/collective_rpc")]
    )
    app.add_middleware(WeightUpdateMiddleware, epoch=epoch)
    body = {"serialized_named_tensors": ["x" * 5000], "flush_cache": True}
    assert post_all(app, [("/update_weights_from_tensor", body)]) == [200]
    assert len(got) == 1 and len(got[0]) > 5000 and got[0].endswith(b'"flush_cache":true}')  # every byte arrived
    assert epoch.version == 1 and epoch.cache_stale  # an update; its flush unseen, so not counted as a flush
    small = {"serialized_named_tensors": ["x"], "flush_cache": True}
    assert post_all(app, [("/update_weights_from_tensor", small)]) == [200] and not epoch.cache_stale
    assert post_all(app, [("/collective_rpc", {"method": "reload_weights", "args": ["x" * 5000]})]) == [413]
    assert len(got) == 2  # the oversized rpc never reached the route


def test_sglang_begin_end_session_is_a_window_and_the_end_leaves_the_cache_stale() -> None:
    """SGLang 0.5.23's ``/begin_weight_update`` .. ``/end_weight_update`` (P2P/RDMA loads): a window like vLLM's
    start..finish; a request admitted before the begin spans it, and the end flushes nothing."""
    assert update_kind("/begin_weight_update", b"") == "start" and update_kind("/end_weight_update", b"") == "finish"
    epoch = WeightEpoch()

    async def ok(request: Request) -> JSONResponse:
        return JSONResponse({"success": True})

    app = Starlette(routes=[Route(p, ok, methods=["POST"]) for p in ("/begin_weight_update", "/end_weight_update")])
    app.add_middleware(WeightUpdateMiddleware, epoch=epoch)
    assert post_all(app, [("/begin_weight_update", {})]) == [200] and epoch.active
    assert post_all(app, [("/end_weight_update", {})]) == [200]
    assert (epoch.version, epoch.active, epoch.cache_stale) == (1, False, True)


def test_the_sidecar_says_unknown_unless_every_update_goes_through_it() -> None:
    """rr's sidecar cannot see an update pushed straight to the engine: unless its operator states that every update
    goes through it, a sample's weight fields are null (unknown), never "no update, cache fresh"; with the statement
    its own count is the server's."""
    from rr_client.core.provenance import Provenance
    from rr_server.proxy.provenance import completion_provenance

    blind, told = WeightEpoch(sees_all_updates=False), WeightEpoch(sees_all_updates=True)
    for epoch in (blind, told):
        hit, miss = (Provenance.from_dict(completion_provenance(n, epoch, epoch.mark(), [1, 2], [3])) for n in (4, 0))
        if epoch is blind:
            assert (hit.weight_version_admitted, hit.weight_update_during, hit.cached_under_older_weights) == (
                None,
                None,
                None,
            )
            assert hit.weights_unknown and miss.cached_under_older_weights is False  # nothing cached to be stale
        else:
            assert (hit.weight_version_admitted, hit.weight_update_during, hit.cached_under_older_weights) == (
                0,
                False,
                False,
            )
            assert not hit.weights_unknown
