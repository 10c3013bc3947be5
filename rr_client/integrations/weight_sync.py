"""Push a trainer's weights to the rollout engine through disk, so the next rollout comes from them.

The path that works everywhere (CPU included): save the model as safetensors, then ask each engine to reload
from that folder. vLLM: ``POST /collective_rpc`` ``reload_weights(weights_path=...)`` (the API server must run
with ``VLLM_SERVER_DEV_MODE=1``), then ``POST /reset_prefix_cache`` (cached KV came from the old weights).
SGLang: ``POST /update_weights_from_disk`` then ``POST /flush_cache``. Which one is chosen by the server's
``/rr/info`` ``engine``. Any failure is a :class:`rr_client.WeightSyncError`: a trainer must stop, not train on
rollouts from stale weights. GPU engines also have faster in-memory paths (vLLM's NCCL weight transfer,
SGLang's ``update_weights_from_distributed``); rr does not drive them (see docs/trainer.md).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from rr_client import settings
from rr_client.errors import WeightSyncError

__all__ = ["DiskWeightSync", "ENGINE_ROUTES"]

# engine -> (reload route, how its JSON body names the folder, cache-reset route)
ENGINE_ROUTES: dict[str, tuple[str, str, str]] = {
    "vllm": ("/collective_rpc", "weights_path", "/reset_prefix_cache"),
    "sglang": ("/update_weights_from_disk", "model_path", "/flush_cache"),
}


class DiskWeightSync:
    """Save weights under ``directory`` and make every engine URL reload them; ``push`` returns the seconds taken.

    ``urls`` are the engines themselves (each replica), not a router or rr's sidecar in front of them: those
    forward generation only. ``engines`` may name each URL's engine up front; otherwise ``/rr/info`` says.
    Each push writes ``directory/step-<n>`` (complete before any engine reads it) and removes the previous one
    after every engine has reloaded.
    """

    def __init__(self, urls: str | Sequence[str], directory: str | Path, *, engines: Mapping[str, str] | None = None,
                 api_key: str | None = None, timeout: float = 600.0) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("DiskWeightSync needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in self.urls]
        self.directory = Path(directory)
        key = api_key if api_key is not None else settings.text("RR_API_KEY")
        self._http = httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                  headers={"authorization": f"Bearer {key}"} if key else None)
        self._engines: dict[str, str] = {u.rstrip("/"): e for u, e in (engines or {}).items()}
        self._current: Path | None = None

    def close(self) -> None:
        """Close the HTTP client."""
        self._http.close()

    def engine(self, url: str) -> str:
        """``vllm`` or ``sglang`` for ``url`` (from ``/rr/info``, asked once)."""
        if url not in self._engines:
            body = self._call("GET", url, "/rr/info", None, "asking which engine serves it")
            name = body.get("engine") if isinstance(body, dict) else None
            if name not in ENGINE_ROUTES:
                raise WeightSyncError(f"{url}/rr/info names engine {name!r}; rr can reload weights on "
                                      f"{sorted(ENGINE_ROUTES)} only")
            self._engines[url] = name
        return self._engines[url]

    def push(self, model: Any, step: int, *, state_dict: Mapping[str, Any] | None = None) -> float:
        """Save ``model`` (a transformers ``PreTrainedModel``; ``state_dict`` if the caller gathered a sharded one)
        and reload it on every engine. Raises :class:`WeightSyncError` naming the engine and what failed."""
        t0 = time.perf_counter()
        target = self.directory / f"step-{step}"
        partial = self.directory / f".step-{step}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            partial.parent.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(partial, state_dict=state_dict, safe_serialization=True)
            shutil.rmtree(target, ignore_errors=True)
            partial.rename(target)
        except (OSError, RuntimeError, ValueError) as e:
            raise WeightSyncError(f"saving the weights to {target} failed: {e}") from e
        for url in self.urls:
            self._reload(url, target.resolve())
        if self._current is not None and self._current != target:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = target
        return time.perf_counter() - t0

    def _reload(self, url: str, folder: Path) -> None:
        engine = self.engine(url)
        route, field, reset = ENGINE_ROUTES[engine]
        if engine == "vllm":
            body: dict[str, Any] = {"method": "reload_weights", "kwargs": {field: str(folder)}}
        else:
            body = {field: str(folder)}
        reply = self._call("POST", url, route, body, f"reloading weights from {folder}")
        if engine == "sglang" and isinstance(reply, dict) and reply.get("success") is False:
            raise WeightSyncError(f"{url}{route} refused the weights in {folder}: {reply.get('message')}")
        self._call("POST", url, reset, None, "dropping the KV cache computed with the old weights")

    def _call(self, method: str, url: str, route: str, body: Any, what: str) -> Any:
        try:
            resp = self._http.request(method, url + route, json=body)
        except httpx.HTTPError as e:
            raise WeightSyncError(f"{url}{route} ({what}): {type(e).__name__}: {e}") from e
        if resp.status_code == 404 and route in ("/collective_rpc", "/reset_prefix_cache"):
            raise WeightSyncError(f"{url}{route} is 404 ({what}): vLLM serves it only with VLLM_SERVER_DEV_MODE=1 "
                                  "in the server's environment, and only on the engine itself (not a router or "
                                  "rr's sidecar)")
        if resp.status_code >= 400:
            raise WeightSyncError(f"{url}{route} answered {resp.status_code} ({what}): {resp.text[:500]}")
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text
