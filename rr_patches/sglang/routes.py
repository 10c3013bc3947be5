"""``/rr/info`` on SGLang's own HTTP app (the facts a client validates every routing payload against), plus rr's
middlewares for ``routed_experts_format`` on ``/generate`` and routing on the OpenAI endpoints (:mod:`.openai`)."""

from __future__ import annotations

import sys
import weakref
from typing import Any

from rr_patches.sglang.state import state_of
from rr_server.serving.http import error_body, json_response
from rr_server.serving.store import STORE_ROUTES, advertised_url, current_store, indexer_store, install_store

__all__ = ["bind_tokenizer_manager", "rr_info_dict", "install_route", "served_info"]

_TM: weakref.ReferenceType[Any] | None = None
_HTTP_MODULE = "sglang.srt.entrypoints.http_server"


def rr_info_dict(tm: Any) -> dict[str, Any]:
    """The ``/rr/info`` body (an RRInfo) for the model served by TokenizerManager ``tm``."""
    st = state_of(tm)
    if st.info is None:
        raise RuntimeError("the model config gives no routing dims")
    body = st.info.model_dump()
    body.update(st.epoch.info())  # weight_version: weight updates seen complete on SGLang's weight routes
    store = current_store()
    if store is not None:
        body["routing_store"] = store.stats()
    idx = indexer_store(make=False)
    if idx is not None:  # the indexer's own store, once an indexer ref was made
        body["indexer_store"] = idx.stats()
    return body


async def _rr_info_endpoint() -> Any:
    """GET /rr/info."""
    tm = _TM() if _TM is not None else None
    if tm is None:
        return json_response(error_body("rr: no TokenizerManager in this process", 503), 503)
    try:
        return json_response(rr_info_dict(tm))
    except Exception as e:  # noqa: BLE001 - reported to the caller, not raised into uvicorn
        return json_response(error_body(f"rr: {e}", 500), 500)


def install_route(app: Any) -> None:
    """Add ``GET /rr/info`` and the routing store's routes (refs) to a FastAPI app once."""
    have = {getattr(r, "path", None) for r in app.router.routes}
    if "/rr/info" not in have:
        app.add_api_route("/rr/info", _rr_info_endpoint, methods=["GET"])
    for path, handler, methods in STORE_ROUTES:
        if path not in have:
            app.add_api_route(path, handler, methods=list(methods))


def served_info(app: Any = None) -> Any:
    """The RRInfo of the bound TokenizerManager (the OpenAI middleware's ``info``); RuntimeError when unknown."""
    tm = _TM() if _TM is not None else None
    info = state_of(tm).info if tm is not None else None
    if info is None:
        raise RuntimeError("rr: no TokenizerManager with routing dims in this process")
    return info


def bind_tokenizer_manager(tm: Any) -> None:
    """Remember ``tm`` for ``/rr/info``; add the route and rr's middlewares to SGLang's app when it is loaded here.

    Raises ConfigurationError when the app already serves (middlewares can no longer be added): never serve
    without them.
    """
    global _TM
    _TM = weakref.ref(tm)
    args = getattr(tm, "server_args", None)  # the URL refs name: RR_ADVERTISE_URL, else SGLang's --host/--port
    install_store(advertised_url(getattr(args, "host", None) or "127.0.0.1", getattr(args, "port", None)))
    mod = sys.modules.get(_HTTP_MODULE)
    if mod is not None and hasattr(mod, "app"):
        from rr_patches.sglang.openai import install_http

        install_route(mod.app)
        install_http(mod.app, served_info, state_of(tm).epoch)
