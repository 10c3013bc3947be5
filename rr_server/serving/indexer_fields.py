"""SGLang's sparse-attention indexer top-k (0.5.23+: ``--enable-return-indexer-topk``, per request
``return_indexer_topk``) in rr's form, for rr's SGLang patch and the sidecar alike: SGLang's int32 rows from token 0
become the choosing tokens' rows, checked by the one full check (:func:`rr_client.core.indexer.check_indexer`) and sent
as rr's ``.npy`` in the smallest dtype, or refused with the typed error (``indexer_topk: null`` and
``indexer_topk_error``); SGLang's own payload never leaves. vLLM captures none: :func:`vllm_indexer_refusal`."""

from __future__ import annotations

import logging
from typing import Any

from rr_client.core import settings
from rr_client.core.errors import (
    ConfigurationError,
    MissingRoutingError,
    RoutedExpertsError,
    ShapeMismatchError,
    UnsupportedVersionError,
)
from rr_client.core.indexer import (
    INDEXER_ERROR_FIELD,
    INDEXER_FIELD,
    INDEXER_FORMAT_FIELD,
    INDEXER_REF_FIELD,
    INDEXER_START_FIELD,
    check_indexer_format,
    decode_indexer,
    indexer_meta_fields,
)
from rr_client.core.info import RRInfo
from rr_server.serving.capture_paths import INDEXER_TOPK, capture_refusal
from rr_server.serving.engines.sglang import indexer_slots

__all__ = [
    "INDEXER_ERROR_FIELD",
    "INDEXER_REQUEST_FIELD",
    "INDEXER_FORMAT_ENV",
    "indexer_fields",
    "indexer_error_fields",
    "asked_indexer",
    "default_indexer_format",
    "vllm_indexer_refusal",
]

INDEXER_FORMAT_ENV = "RR_INDEXER_TOPK_FORMAT"  #: the server's default ``indexer_topk_format`` ("ref" unless set)

INDEXER_REQUEST_FIELD = "return_indexer_topk"  #: SGLang's per-request flag, rr's too

logger = logging.getLogger("rr.sglang")


def asked_indexer(caller: Any) -> bool:
    """Whether the caller's own request asked for the indexer top-k."""
    return bool(getattr(caller, "return_indexer_topk", False))


def default_indexer_format() -> str:
    """The server's default ``indexer_topk_format``: env ``RR_INDEXER_TOPK_FORMAT``, else "ref" (the rows are ~512x
    the expert routing); a bad value is refused (ConfigurationError)."""
    return check_indexer_format(settings.text(INDEXER_FORMAT_ENV, default="ref"))


def indexer_fields(
    info: RRInfo | None,
    value: Any,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    start: int,
    fmt: str | None = None,
) -> dict[str, Any]:
    """rr's ``meta_info`` entries for one finished request's indexer rows (``value``: SGLang's per-request entry), by
    reference in the server's indexer store (``fmt`` "ref", the default; :func:`rr_server.serving.store.indexer_store`)
    or inline ("npy"). SGLang's rows hold a slot per decoder layer (:func:`indexer_slots`); the check runs wherever
    this is called: the patch and the sidecar call it in a worker thread, off the event loop."""
    try:
        dims = info.indexer if info is not None else None
        if dims is None:
            raise ShapeMismatchError("the served model's config names no sparse-attention indexer (index_topk)")
        if (refused := capture_refusal(info, INDEXER_TOPK)) is not None:  # not positions (fused top-k, draft tree)
            raise refused
        if value is None:
            raise MissingRoutingError(
                "the engine returned no indexer top-k for this request (is SGLang started with "
                "--enable-return-indexer-topk, on a GPU backend that captures it?)"
            )
        if isinstance(value, (bytes, bytearray)):
            value = value.decode("ascii")
        checked = decode_indexer(  # SGLang's rows: a slot per decoder layer, rr keeps its indexer layers' (GLM-5)
            value,
            dims,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            start=start,
            engine_layers=indexer_slots(info.engine_version, info.num_hidden_layers),  # type: ignore[union-attr]
        )
        if (fmt or default_indexer_format()) == "npy":
            return indexer_meta_fields(checked)
        from rr_server.serving.store import indexer_store

        store = indexer_store()  # the indexer's own, capped apart: its rows never evict routing rows
        if store is None:
            raise ConfigurationError(f"{INDEXER_FORMAT_FIELD}='ref': this process holds no rr server's store")
        return {INDEXER_REF_FIELD: store.put(checked), INDEXER_START_FIELD: checked.start}
    except (RoutedExpertsError, ConfigurationError, UnsupportedVersionError) as e:
        return indexer_error_fields(e)


def indexer_error_fields(e: Exception) -> dict[str, Any]:
    """What a sample carries instead of indexer rows that were refused (logged); clients raise the error it names."""
    logger.error("rr: refusing indexer top-k: %s", e)
    return {INDEXER_FIELD: None, INDEXER_ERROR_FIELD: f"{type(e).__name__}: {e}"}


def vllm_indexer_refusal() -> str:
    """The 400 message for a request asking vLLM for the indexer top-k: no release captures it."""
    return (
        f"{INDEXER_REQUEST_FIELD}: vLLM captures no sparse-attention indexer top-k (an open request, vllm#49555); "
        "serve the model on SGLang 0.5.23+ with rr's patch (--enable-return-indexer-topk) for indexer replay"
    )
