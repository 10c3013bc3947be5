"""What the doctor reads about a server's KV cache and weights besides ``/rr/info``: vLLM's Prometheus ``/metrics``
(the cache config, the engine's preemption counter), SGLang's server args (``/get_server_info``), the weight
version ``/rr/info`` counts, and a weight reload through the engine's own route (what rr's weight sync calls).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx

from rr_client import GenerateResult
from rr_client.core.engines import ENGINES, Engine
from rr_client.core.provenance import PROVENANCE_FIELD, Provenance

__all__ = [
    "EngineCache",
    "parse_metrics",
    "engine_cache",
    "preemption_count",
    "weight_version",
    "reload_weights",
    "provenance_of",
    "hold_generation",
    "release_generation",
    "requests_in_engine",
]

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class EngineCache:
    """The KV cache as the server describes it (None: it does not say)."""

    source: str  # where it came from: "/metrics cache_config_info", "/get_server_info", or "" (nothing)
    num_blocks: int | None = None  # KV blocks (pages) of the device cache
    block_size: int | None = None  # tokens per block
    prefix_caching: bool | None = None
    offload: str | None = None  # a KV offload / connector the server reports (vLLM kv_offloading_*), else None
    hierarchical: bool | None = None  # SGLang --enable-hierarchical-cache
    hierarchical_storage: str | None = None  # SGLang --hicache-storage-backend

    @property
    def capacity_tokens(self) -> int | None:
        return self.num_blocks * self.block_size if self.num_blocks and self.block_size else None


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition: ``(name, labels, value)`` per sample line (comments and bad lines skipped)."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def _int(v: Any) -> int | None:
    try:
        return int(v) if v not in (None, "", "None") else None
    except (TypeError, ValueError):
        return None


def _flag(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    return {"true": True, "false": False}.get(str(v).lower()) if v is not None else None


async def _get(http: httpx.AsyncClient, path: str) -> httpx.Response | None:
    try:
        resp = await http.get(path)
    except httpx.HTTPError:
        return None
    return resp if resp.status_code == 200 else None


async def engine_cache(http: httpx.AsyncClient, engine: str) -> EngineCache:
    """The server's KV cache facts: vLLM's ``vllm:cache_config_info`` labels, SGLang's server args."""
    eng = ENGINES.get(engine)
    if eng is None:
        return EngineCache("")
    if eng.cache_metric is not None:
        resp = await _get(http, "/metrics")
        if resp is not None:
            for name, labels, _ in parse_metrics(resp.text):
                if name == eng.cache_metric:
                    size = labels.get("kv_offloading_size")
                    backend = labels.get("kv_offloading_backend")
                    offload = (
                        f"{backend or 'native'} offloading, {size} GiB" if size not in (None, "", "None") else None
                    )
                    return EngineCache(
                        "/metrics cache_config_info",
                        _int(labels.get("num_gpu_blocks")),
                        _int(labels.get("block_size")),
                        _flag(labels.get("enable_prefix_caching")),
                        offload,
                    )
        return EngineCache("")
    for path in eng.server_args_routes:
        resp = await _get(http, path)
        if resp is None:
            continue
        try:
            args = resp.json()
        except ValueError:
            continue
        if isinstance(args, dict):
            page = _int(args.get("page_size")) or 1
            tokens = _int(args.get("max_total_num_tokens"))
            return EngineCache(
                path,
                tokens // page if tokens else None,
                page,
                None if args.get("disable_radix_cache") is None else not _flag(args.get("disable_radix_cache")),
                None,
                _flag(args.get("enable_hierarchical_cache")),
                args.get("hicache_storage_backend"),
            )
    return EngineCache("")


async def preemption_count(http: httpx.AsyncClient) -> float | None:
    """vLLM's cumulative ``vllm:num_preemptions`` over its engines (None: no ``/metrics`` or no such counter)."""
    resp = await _get(http, "/metrics")
    if resp is None:
        return None
    found = [v for name, _, v in parse_metrics(resp.text) if name == "vllm:num_preemptions_total"]
    return sum(found) if found else None


async def _info_int(http: httpx.AsyncClient, field: str) -> int | None:
    """The whole number ``field`` of the server's ``/rr/info`` (None: no answer, or not said)."""
    resp = await _get(http, "/rr/info")
    if resp is None:
        return None
    try:
        return _int(resp.json().get(field))
    except (ValueError, AttributeError):
        return None


async def weight_version(http: httpx.AsyncClient) -> int | None:
    """``/rr/info`` ``weight_version``: the weight updates the server has seen complete (None: not reported)."""
    return await _info_int(http, "weight_version")


async def _post(http: httpx.AsyncClient, eng: Engine, route: str, **kw: Any) -> httpx.Response | str:
    """POST to one of the engine's routes: its response, or why none came (the transport's error, or the 404 of a
    route vLLM serves only in dev mode)."""
    try:
        resp = await http.post(route, **kw)
    except httpx.HTTPError as e:
        return f"{route}: {type(e).__name__}: {e}"
    if resp.status_code == 404 and route in eng.dev_mode_routes:
        return f"{route} is 404: vLLM serves it only with VLLM_SERVER_DEV_MODE=1 in the server's environment"
    return resp


async def reload_weights(http: httpx.AsyncClient, engine: str, path: str) -> str | None:
    """Reload the weights in ``path`` through the engine's route (vLLM dev-mode ``/collective_rpc reload_weights``,
    SGLang ``/update_weights_from_disk``, as :class:`rr_client.integrations.weight_sync.DiskWeightSync` does);
    None when it worked, else why not."""
    eng = ENGINES.get(engine)
    if eng is None:
        return f"rr reloads weights on {sorted(ENGINES)} only, the server is {engine!r}"
    route = eng.reload_route
    resp = await _post(http, eng, route, json=eng.reload_body(path))
    if isinstance(resp, str):
        return resp
    if resp.status_code >= 400:
        return f"{route} answered {resp.status_code}: {resp.text[:300]}"
    try:
        reply = resp.json() if resp.content else None
    except ValueError:
        reply = None
    if isinstance(reply, dict) and reply.get("success") is False:
        return f"{route} refused the weights in {path}: {reply.get('message')}"
    return None


async def hold_generation(http: httpx.AsyncClient, engine: str) -> str | None:
    """Freeze generation with requests kept (vLLM dev-mode ``/pause?mode=keep``): None when held, else why not."""
    eng = ENGINES.get(engine)
    if eng is None or eng.hold_route is None:
        return f"{engine} has no pause that keeps requests"
    route, query = eng.hold_route
    resp = await _post(http, eng, route, params=dict(query))
    if isinstance(resp, str):
        return resp
    return None if resp.status_code < 300 else f"{route} answered {resp.status_code}: {resp.text[:200]}"


async def release_generation(http: httpx.AsyncClient, engine: str) -> str | None:
    """Let held generation go (vLLM ``/resume``): None when it went, else why not."""
    eng = ENGINES.get(engine)
    if eng is None or eng.release_route is None:
        return f"{engine} has no pause to release"
    try:
        resp = await http.post(eng.release_route)
    except httpx.HTTPError as e:
        return f"{eng.release_route}: {type(e).__name__}: {e}"
    return None if resp.status_code < 300 else f"{eng.release_route} answered {resp.status_code}: {resp.text[:200]}"


async def requests_in_engine(http: httpx.AsyncClient) -> int | None:
    """``/rr/info`` ``requests_in_engine``: requests the answering API process has in the engine (None: not said)."""
    return await _info_int(http, "requests_in_engine")


def provenance_of(r: GenerateResult) -> Provenance | None:
    """A sample's provenance: the client's parse, else its raw ``rr_provenance`` (None: the server sent none)."""
    p = getattr(r, "provenance", None)
    if isinstance(p, Provenance):
        return p
    raw = r.meta.get(PROVENANCE_FIELD)
    return None if raw is None else Provenance.from_dict(raw)  # malformed: MalformedPayloadError, the check fails
