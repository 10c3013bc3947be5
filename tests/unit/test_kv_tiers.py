"""KV offload tiers and rr's cache epoch on vLLM (issue 55, item 3; vLLM #27170, #42695, #57810; LMCache #4993).

On the installed vLLM 0.30's own code: its connector registry (which connectors have their own ``reset_cache``; the
release fact :attr:`ReleaseFacts.resettable_connectors`), its ``/reset_prefix_cache`` route (FastAPI parses
``reset_external``) and ``Scheduler.reset_prefix_cache`` / ``reset_connector_cache`` (run unbound on a scheduler
whose KV cache manager is a stand-in: the device cache part needs a running engine). rr's vLLM middleware watches
the route's real answers: with a connector, a reset clears the cache only with ``reset_external=true`` and a
connector whose reset is verifiable; otherwise the cache stays stale and a sample hitting it is flagged.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import re
from pathlib import Path
from types import MethodType, SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from rr_patches.vllm.kv_tiers import VLLMWeightUpdateMiddleware, configured_connectors, unverified_connectors
from rr_server.serving.engines.vllm import RESETTABLE_CONNECTORS, facts_for
from rr_server.serving.provenance_fields import cached_under_older
from rr_server.serving.weight_epoch import WeightEpoch


def _own_reset(module: str, cls_name: str) -> bool:
    """Whether vLLM's connector class defines its own ``reset_cache`` (imported when it can be; a connector whose
    module needs a package not installed here, LMCacheMPConnector's lmcache, is read from its source: no class of
    that module defines one)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except ImportError:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, module
        tree = ast.parse(Path(spec.origin).read_text())  # (LMCacheMPConnector: lmcache's class, or the in-tree one)
        return any(isinstance(f, ast.FunctionDef) and f.name == "reset_cache" for f in ast.walk(tree))
    return cls.reset_cache is not KVConnectorBase_V1.reset_cache


def test_the_resettable_connectors_fact_is_the_installed_vllms() -> None:
    """Every connector vLLM 0.30 registers: those with their own reset_cache are the fact's (MultiConnector's is
    only as good as its children's); every other inherits the base's None, which the scheduler counts as success."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector import factory

    regs = re.findall(r'register_connector\(\s*"(\w+)",\s*"([\w.]+)",\s*"(\w+)"', Path(factory.__file__).read_text())
    assert len(regs) >= 15 and "LMCacheConnectorV1" in {r[0] for r in regs}
    own = {name for name, module, cls in regs if _own_reset(module, cls)}
    facts = facts_for(vllm.__version__)
    assert own - {"MultiConnector"} == set(facts.resettable_connectors) == set(RESETTABLE_CONNECTORS)
    assert unverified_connectors(("LMCacheConnectorV1", "LMCacheMPConnector", "NixlConnector"), facts) == (
        "LMCacheConnectorV1",
        "LMCacheMPConnector",
        "NixlConnector",
    )
    assert unverified_connectors(("MultiConnector", "OffloadingConnector"), facts) == ()
    assert facts.pause_resets_connector and not facts_for("0.22.0").pause_resets_connector


def _connector(kind: str) -> Any:
    """A connector instance vLLM's scheduler resets: the real OffloadingConnector.reset_cache over a recording
    scheduler side, or the base class's reset_cache (what LMCacheConnectorV1 inherits)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    if kind == "OffloadingConnector":
        conn = object.__new__(OffloadingConnector)
        resets: list[int] = []
        conn.connector_scheduler = SimpleNamespace(resets=resets, reset_cache=lambda: resets.append(1))
        return conn
    return object.__new__(LMCacheConnectorV1)  # vLLM's own class, not initialised: its reset_cache is the base's


def _scheduler(connector: Any) -> Any:
    """vLLM's Scheduler's reset path, unbound, over a device cache stand-in that resets (no request holds blocks)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    s = SimpleNamespace(
        connector=connector,
        log_stats=False,
        running=[],
        kv_cache_manager=SimpleNamespace(reset_prefix_cache=lambda: True),
    )
    s.reset_connector_cache = MethodType(Scheduler.reset_connector_cache, s)
    s.reset_prefix_cache = MethodType(Scheduler.reset_prefix_cache, s)
    return s


def _app(connector: str | None, epoch: WeightEpoch) -> tuple[FastAPI, Any]:
    """vLLM 0.30's real ``/reset_prefix_cache`` route over the scheduler's real reset, behind rr's vLLM middleware;
    the engine's ``kv_transfer_config`` is vLLM's own config object."""
    from vllm.config import KVTransferConfig
    from vllm.entrypoints.serve.dev.cache.api_router import attach_router

    sched = _scheduler(_connector(connector) if connector else None)

    async def reset_prefix_cache(reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return sched.reset_prefix_cache(reset_running_requests, reset_connector)

    app = FastAPI()
    attach_router(app)
    cfg = KVTransferConfig(kv_connector=connector, kv_role="kv_both") if connector else None
    app.state.engine_client = SimpleNamespace(
        reset_prefix_cache=reset_prefix_cache, vllm_config=SimpleNamespace(kv_transfer_config=cfg)
    )
    app.add_middleware(VLLMWeightUpdateMiddleware, epoch=epoch)
    return app, sched


def _post(app: FastAPI, path: str) -> httpx.Response:
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path)

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("connector", "plain_clears", "external_clears"),
    [
        (None, True, True),  # no tier: the device cache is all there is
        ("OffloadingConnector", False, True),  # only reset_external reaches the tier, and it says so
        ("LMCacheConnectorV1", False, False),  # success either way, the tier never reset: stays stale
    ],
)
def test_a_reset_clears_the_cache_only_where_it_reached_the_tier(
    connector: str | None, plain_clears: bool, external_clears: bool
) -> None:
    for query, clears in (("", plain_clears), ("?reset_external=true", external_clears)):
        epoch = WeightEpoch()
        app, sched = _app(connector, epoch)
        epoch.end(200)  # a weight update: the cache may hold older KV
        assert epoch.cache_stale
        r = _post(app, "/reset_prefix_cache" + query)
        assert r.status_code == 200 and r.json() == {"success": True}  # vLLM says it worked every time
        assert epoch.cache_stale is not clears, (connector, query)
        mark = epoch.mark()
        assert cached_under_older(mark, 16) is not clears  # a sample that hits the cache is flagged while stale
        if connector == "OffloadingConnector":
            assert sched.connector.connector_scheduler.resets == ([1] if query else [])
    assert configured_connectors(app.state.engine_client) == ((connector,) if connector else ())


def test_a_clearing_pause_counts_only_where_it_resets_a_verifiable_tier() -> None:
    """vLLM 0.23+'s pause resets the connector too (its answer unread): an OffloadingConnector's tier is cleared, an
    LMCache tier is not (rr's hook decides; the route itself is not served here)."""
    for connector, clears in (("OffloadingConnector", True), ("LMCacheConnectorV1", False)):
        epoch = WeightEpoch()
        app, _ = _app(connector, epoch)
        mw = VLLMWeightUpdateMiddleware(app, epoch=epoch)
        scope = {"app": app, "query_string": b""}
        assert mw.pause_cleared(scope) is clears
        assert not mw.pause_cleared({"app": app, "query_string": b"clear_cache=false"})
