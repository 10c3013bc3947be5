"""Build ``/rr/info`` for an unpatched upstream from its model listing and the model's HF ``config.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rr_client.core.engines import engine as find_engine
from rr_client.core.hf_config import load_config
from rr_client.core.info import RRInfo
from rr_client.core.logprobs import PROCESSED
from rr_server.proxy.errors import ProxyError
from rr_server.proxy.upstream import Upstream
from rr_server.serving.capture_paths import POSITIONS_FIELD, REFUSED_FIELD, capture_info
from rr_server.serving.disaggregation import upstream_role_refusal

__all__ = ["fetch_info"]


def _load(path: str | None, hint: str) -> dict[str, Any]:
    """config.json from a local checkpoint dir; a clear 503 when it is not readable here."""
    if not path or not (Path(path) / "config.json").is_file() and not Path(path).is_file():
        raise ProxyError(
            503,
            "config_unavailable",
            f"cannot read the model's config.json at {path!r} ({hint}); pass --model-path DIR",
        )
    try:
        return load_config(path)
    except (OSError, ValueError) as e:
        raise ProxyError(503, "config_unavailable", f"cannot read {path}/config.json: {e}") from None


async def _vllm(up: Upstream, model_path: str | None, logprobs_mode: str | None) -> tuple[RRInfo, str]:
    """vLLM: model id and root path from ``/v1/models``, version from ``/version``; the log-prob mode only as told
    (vLLM's API does not say which ``--logprobs-mode`` it runs)."""
    models = await up.call("GET", "/v1/models", timeout=10.0)
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise ProxyError(502, "upstream_protocol", f"upstream /v1/models lists no model: {str(models)[:200]}")
    name, root = str(data[0]["id"]), data[0].get("root")
    version = (await up.call("GET", "/version", timeout=10.0)).get("version", "unknown")
    cfg = _load(model_path or root, "from /v1/models root")
    return RRInfo.from_hf_config(
        cfg,
        engine="vllm",
        engine_version=str(version),
        model=name,
        sidecar=True,
        upstream=up.url,
        logprobs_mode=logprobs_mode,
    ), name


async def _sglang(up: Upstream, model_path: str | None, logprobs_mode: str | None, role: str) -> tuple[RRInfo, str]:
    """SGLang: model path from ``/get_model_info``, version from ``/get_server_info``; log-probs after temperature
    (SGLang's default) unless told otherwise (``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` upstream: ``raw``). An upstream
    whose ``disaggregation_mode`` is not ``role`` is refused (502, ``upstream_role``)."""
    minfo = await up.call("GET", "/get_model_info", timeout=10.0)
    path = minfo.get("model_path") if isinstance(minfo, dict) else None
    try:
        sinfo = await up.call("GET", "/get_server_info", timeout=10.0)
        version = str(sinfo.get("version", "unknown")) if isinstance(sinfo, dict) else "unknown"
    except ProxyError:
        version, sinfo = "unknown", None
    said = next(
        (i["disaggregation_mode"] for i in (minfo, sinfo) if isinstance(i, dict) and "disaggregation_mode" in i), None
    )
    if why := upstream_role_refusal(said, role, up.url):
        raise ProxyError(502, "upstream_role", why)
    cfg = _load(model_path or path, "from /get_model_info model_path")
    name = str(path or model_path)
    # its refused capture paths, from its resolved server args; its SGLANG_DSA_FUSE_TOPK cannot be seen (None)
    paths = capture_info("sglang", version, sinfo if isinstance(sinfo, dict) else None, fused=None)
    return RRInfo.from_hf_config(
        cfg,
        engine="sglang",
        engine_version=version,
        model=name,
        sidecar=True,
        upstream=up.url,
        logprobs_mode=logprobs_mode or PROCESSED,
        capture_refused=paths[REFUSED_FIELD],
        indexer_positions=paths[POSITIONS_FIELD],
    ), name


async def fetch_info(
    up: Upstream, engine: str, model_path: str | None, logprobs_mode: str | None = None, role: str = "null"
) -> tuple[RRInfo, str]:
    """Ask the upstream what it serves; return the RRInfo (``logprobs_mode``: what the operator says the upstream's
    sampled log-probs are, ``--upstream-logprobs-mode``) and the upstream's model name. ``role``: the upstream's
    part, ``"null"`` (a plain sidecar's) or a P/D sidecar's ``"prefill"`` / ``"decode"`` server (SGLang's
    ``disaggregation_mode``)."""
    if find_engine(engine).native_generate:  # SGLang: its own /get_model_info and /get_server_info
        return await _sglang(up, model_path, logprobs_mode, role)
    return await _vllm(up, model_path, logprobs_mode)
