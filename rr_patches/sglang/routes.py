"""``/rr/info`` on SGLang's own HTTP app: the facts a client validates every routing payload against."""

from __future__ import annotations

import sys
import weakref
from typing import Any

from rr_patches.sglang.state import state_of

__all__ = ["bind_tokenizer_manager", "rr_info_dict", "install_route"]

_TM: weakref.ReferenceType[Any] | None = None
_HTTP_MODULE = "sglang.srt.entrypoints.http_server"


def rr_info_dict(tm: Any) -> dict[str, Any]:
    """The ``/rr/info`` body (an RRInfo) for the model served by TokenizerManager ``tm``."""
    st = state_of(tm)
    if st.info is None:
        raise RuntimeError("the model config gives no routing dims")
    return st.info.model_dump()


async def _rr_info_endpoint() -> Any:
    """GET /rr/info."""
    from fastapi.responses import JSONResponse

    tm = _TM() if _TM is not None else None
    if tm is None:
        return JSONResponse({"error": {"message": "rr: no TokenizerManager in this process"}}, status_code=503)
    try:
        return JSONResponse(rr_info_dict(tm))
    except Exception as e:  # noqa: BLE001 - reported to the caller, not raised into uvicorn
        return JSONResponse({"error": {"message": f"rr: {e}"}}, status_code=500)


def install_route(app: Any) -> None:
    """Add ``GET /rr/info`` to a FastAPI app once."""
    if not any(getattr(r, "path", None) == "/rr/info" for r in app.router.routes):
        app.add_api_route("/rr/info", _rr_info_endpoint, methods=["GET"])


def bind_tokenizer_manager(tm: Any) -> None:
    """Remember ``tm`` for ``/rr/info`` and add the route to SGLang's app when it is loaded here."""
    global _TM
    _TM = weakref.ref(tm)
    mod = sys.modules.get(_HTTP_MODULE)
    if mod is not None and hasattr(mod, "app"):
        install_route(mod.app)
