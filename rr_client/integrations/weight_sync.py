"""Push a trainer's weights to the rollout engine through disk, so the next rollout comes from them.

The path that works everywhere (CPU included): save the model as safetensors, then ask each engine to reload
from that folder. vLLM: ``POST /collective_rpc`` ``reload_weights(weights_path=...)`` (the API server must run
with ``VLLM_SERVER_DEV_MODE=1``), then ``POST /reset_prefix_cache`` (cached KV came from the old weights).
SGLang: ``POST /update_weights_from_disk`` then ``POST /flush_cache``. Which one is chosen by a
:class:`WeightEngine`'s ``kind``, or for a plain URL by the server's ``/rr/info`` ``engine`` (an rr-patched
engine); an engine without rr's plugin (e.g. behind rr's sidecar) must be named with a :class:`WeightEngine`.
Any failure is a :class:`rr_client.WeightSyncError`: a trainer must stop, not train on rollouts from stale
weights. GPU engines also have faster in-memory paths (vLLM's NCCL weight transfer, SGLang's
``update_weights_from_distributed``); rr does not drive them (see docs/trainer.md).

An HTTP 200 from the reload is not taken as proof: where the engine has its own weight checker (vLLM 0.32+'s dev-mode
``/weight_checker``, SGLang 0.5.12+'s ``/weights_checker``), each push ends by asking every engine for its per-tensor
checksums and comparing them across the replicas and with the previous push
(:mod:`rr_client.integrations._weight_check`); an engine without one is said once in the log and not checked.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import httpx

from rr_client.core import settings
from rr_client.core.engines import ENGINE_NAMES, ENGINES, EngineName
from rr_client.core.engines import engine as find_engine
from rr_client.core.errors import ConfigurationError, WeightSyncError
from rr_client.integrations import _weight_check as wcheck

__all__ = ["DiskWeightSync", "WeightEngine"]

logger = logging.getLogger("rr.weight_sync")

_KEY_ENV = "RR_API_KEY"
_DEV_MODE_ROUTES = frozenset(r for e in ENGINES.values() for r in e.dev_mode_routes)  # vLLM's, 404 without dev mode


def _check_url(url: object, where: str) -> str:
    """``url`` without its trailing slash; ConfigurationError unless it is an http(s) URL."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigurationError(f"{where}: {url!r} is not an http:// or https:// URL of an engine")
    return url.rstrip("/")


@dataclass(frozen=True)
class WeightEngine:
    """One engine to reload and which engine it is, so rr need not ask its ``/rr/info``.

    Needed for an engine that does not serve ``/rr/info``: vLLM or SGLang without rr's plugin, e.g. the
    engine behind rr's sidecar (``rr-server proxy``). ``url`` is the engine itself, never a router or the sidecar
    (they forward generation only). An unknown ``kind`` raises :class:`rr_client.core.errors.ConfigurationError`.
    """

    url: str
    kind: EngineName

    def __post_init__(self) -> None:
        _check_url(self.url, "WeightEngine")
        if self.kind not in ENGINES:
            raise ConfigurationError(
                f"WeightEngine({self.url!r}, {self.kind!r}): kind must be one of {', '.join(map(repr, ENGINE_NAMES))}"
            )


EngineSpec = str | WeightEngine
"""A plain URL (its kind comes from ``/rr/info``) or a :class:`WeightEngine`."""


def _engine_list(engines: EngineSpec | Sequence[EngineSpec] | Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``(url, kind or None)`` per engine, in order, duplicates dropped; ConfigurationError on a bad entry."""
    if isinstance(engines, (str, WeightEngine)):
        items: list[Any] = [engines]
    elif isinstance(engines, Mapping):  # {url: kind}, the older way to name kinds
        items = [WeightEngine(u, k) for u, k in engines.items()]  # type: ignore[arg-type]
    elif isinstance(engines, Sequence):
        items = list(engines)
    else:
        raise ConfigurationError(
            f"DiskWeightSync: engines must be a URL, a WeightEngine or a sequence of them, got {type(engines).__name__}"
        )
    if not items:
        raise ConfigurationError("DiskWeightSync needs at least one engine (a URL or a WeightEngine)")
    out: dict[str, str | None] = {}
    for item in items:
        if isinstance(item, WeightEngine):
            url, kind = item.url.rstrip("/"), item.kind
        else:
            url, kind = _check_url(item, "DiskWeightSync"), None
        known = out.get(url)
        if known is not None and kind is not None and known != kind:
            raise ConfigurationError(f"DiskWeightSync: {url} is named both {known!r} and {kind!r}")
        out[url] = kind or known
    return list(out.items())


class DiskWeightSync:
    """Save weights under ``directory`` and make every engine reload them; ``push`` returns the seconds taken.

    ``engines``: each engine (each replica) as a URL, a :class:`WeightEngine`, or a sequence of either (a
    ``{url: kind}`` mapping is accepted too). A plain URL's kind comes from its ``/rr/info`` (an rr-patched
    engine); name the others with ``WeightEngine(url, "vllm" | "sglang")``. Routers and rr's sidecar forward
    generation only: pass the engines behind them. ``api_key`` is sent as ``Authorization: Bearer`` on every
    call (default: env ``RR_API_KEY``). Each push writes ``directory/step-<n>`` (complete before any engine
    reads it) and removes the previous one after every engine has reloaded.

    After each reload the engine's prefix cache is dropped (its KV came from the old weights; vLLM: with
    ``reset_external=true``, so a KV connector's offload tier is dropped too, unless the server's ``/rr/info`` says it
    runs no connector; vLLM 0.22 answers ``{"success": false}`` to that without a connector). An engine refuses
    while requests hold blocks (vLLM 0.30+: 200 ``{"success": false}``; SGLang: 400); the reset is retried for
    ``cache_reset_s`` seconds, then the push fails with :class:`WeightSyncError`: rollouts would hit old-weight KV.

    ``verify_weights`` (default on): after every engine reloaded, ask each one's own weight checker for its
    per-tensor checksums (vLLM 0.32+ ``/weight_checker``, dev mode; SGLang 0.5.12+ ``/weights_checker``) and fail the
    push with :class:`WeightSyncError` naming the engine, tensors and ranks when the replicas disagree, or when an
    engine's checksums since the last push contradict what the trainer changed (a tensor changed but kept, one kept
    but changed, nothing loaded; the first push against the checksums read just before it), or an answer is partial
    (keys lost since the last one, or missing beside a same-kind replica's). An engine without a checker (vLLM 0.31 and older, SGLang 0.5.11 and older) is
    said once in the log and skipped. ``verify_skip``: parts of tensor names left out of the check (tensors that
    legitimately differ per replica or move while serving: EPLB experts, uninitialized MoE padding). Hashing copies
    every weight to the host on the engine, and the saved checkpoint is hashed here, once per push.
    """

    def __init__(
        self,
        engines: EngineSpec | Sequence[EngineSpec] | Mapping[str, str],
        directory: str | Path,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        cache_reset_s: float = 30.0,
        verify_weights: bool = True,
        verify_skip: Sequence[str] = (),
    ) -> None:
        pairs = _engine_list(engines)
        self.cache_reset_s = cache_reset_s  # how long a refused prefix-cache reset is retried before the push fails
        self.verify_weights = verify_weights
        if isinstance(verify_skip, str) or not all(isinstance(p, str) and p for p in verify_skip):
            raise ConfigurationError(
                f"DiskWeightSync: verify_skip must be a sequence of name parts, got {verify_skip!r}"
            )
        self.verify_skip: tuple[str, ...] = tuple(verify_skip)
        self._unchecked: dict[str, str] = {}  # engine URL -> why it has no weight checker (said once)
        self._checksums: dict[str, wcheck.Checksums] = {}  # engine URL -> its checksums after the last push
        self._trainer: dict[str, wcheck.TensorDigest] | None = None  # the last pushed checkpoint's tensor digests
        self._trainer_unread: str | None = None  # why the pushed checkpoint could not be hashed (said once)
        self.urls: list[str] = [u for u, _ in pairs]
        self._engines: dict[str, str] = {u: k for u, k in pairs if k is not None}
        self.directory = Path(directory)
        if api_key is not None:
            key: str | None = api_key
            self._key_source: str | None = "the api_key argument"
        else:
            key = settings.text(_KEY_ENV)
            self._key_source = _KEY_ENV if key else None
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            headers={"authorization": f"Bearer {key}"} if key else None,
        )
        self._current: Path | None = None
        self._no_tier: dict[str, bool] = {}  # engine URL -> its /rr/info says it runs no KV connector

    def close(self) -> None:
        """Close the HTTP client."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def engines(self) -> list[WeightEngine]:
        """Every engine with its kind (asking ``/rr/info`` for the URLs not named yet)."""
        return [WeightEngine(u, self.engine(u)) for u in self.urls]  # type: ignore[arg-type]

    def engine(self, url: str) -> str:
        """``vllm`` or ``sglang`` for ``url``: as named, else from ``/rr/info`` (asked once)."""
        url = url.rstrip("/")
        if url not in self._engines:
            body = self._call("GET", url, "/rr/info", None, "asking which engine serves it")
            name = body.get("engine") if isinstance(body, dict) else None
            if isinstance(body, dict) and body.get("sidecar"):
                upstream = body.get("upstream") or "the engine's URL"
                raise WeightSyncError(
                    f"{url} is rr's sidecar in front of {upstream}: it forwards generation only, weights are "
                    f"reloaded on the engine itself; pass WeightEngine({upstream!r}, {name!r}) for each engine"
                )
            if name not in ENGINES:
                raise WeightSyncError(
                    f"{url}/rr/info names engine {name!r}; rr can reload weights on {sorted(ENGINES)} only"
                )
            self._engines[url] = name
            if "kv_connector" in body:  # an rr server says which KV connectors (tiers) it runs, None for none
                self._no_tier[url] = not body.get("kv_connector")
        return self._engines[url]

    def push(self, model: Any, step: int, *, state_dict: Mapping[str, Any] | None = None) -> float:
        """Save ``model`` (a transformers ``PreTrainedModel``; ``state_dict`` if the caller gathered a sharded one)
        and reload it on every engine. Raises :class:`WeightSyncError` naming the engine and what failed.

        Every engine's kind is settled first (``/rr/info``), so a wrong URL or key fails before the save.
        """
        t0 = time.perf_counter()
        for url in self.urls:
            self.engine(url)
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
        if self.verify_weights:
            self._baseline()
        for url in self.urls:
            self._reload(url, target.resolve())
        if self.verify_weights:
            self._verify(target.resolve())
        if self._current is not None and self._current != target:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = target
        return time.perf_counter() - t0

    def _reload(self, url: str, folder: Path) -> None:
        eng = find_engine(self.engine(url))
        route = eng.reload_route
        reply = self._call("POST", url, route, eng.reload_body(str(folder)), f"reloading weights from {folder}")
        if eng.reload_reply_says_success and isinstance(reply, dict) and reply.get("success") is False:
            raise WeightSyncError(f"{url}{route} refused the weights in {folder}: {reply.get('message')}")
        # vLLM resets a KV connector's tier (OffloadingConnector, LMCache) only when asked (vLLM #27170): asked
        # unless the server's /rr/info says it runs none; rr's server counts the reset as a clear only then
        tier = eng.kv_offload_connector and not self._no_tier.get(url, False)
        self._reset_cache(url, eng.cache_reset_route + ("?reset_external=true" if tier else ""))

    def _baseline(self) -> None:
        """Each engine's own checksums before its first reload: the first push is checked against them (a reload
        that loaded nothing keeps them all), not trusted for want of a previous push."""
        for url in self.urls:
            if url not in self._checksums:
                sums = self.engine_checksums(url)
                if sums is not None:
                    self._checksums[url] = wcheck.skip_filter(sums, self.verify_skip)

    def _verify(self, folder: Path) -> None:
        """Compare every engine's own weight checksums across the replicas and with the previous push (what each
        engine and the trainer changed since); WeightSyncError naming the engine, tensors and ranks on a mismatch.
        Engines without a checker are skipped (said once)."""
        now: dict[str, tuple[str, wcheck.Checksums]] = {}
        for url in self.urls:
            sums = self.engine_checksums(url)
            if sums is not None:
                now[url] = (self.engine(url), wcheck.skip_filter(sums, self.verify_skip))
        if not now:
            return
        trainer = self._trainer_digests(folder)
        for url, (_, sums) in now.items():
            wcheck.check_push_took(url, self._checksums.get(url), sums, self._trainer, trainer, folder)
        for note in wcheck.check_replicas_agree(now, folder):
            logger.info("rr: weight check: %s", note)
        # the next push is compared with the last one that passed (a failed push's engines hold what was not pushed)
        self._checksums.update({url: sums for url, (_, sums) in now.items()})
        self._trainer = trainer

    def engine_checksums(self, url: str) -> dict[str, str] | None:
        """``url``'s own per-tensor weight checksums (``"dp0:pp0:pcp0:tp0:<tensor>"`` -> digest), or None when the
        engine has no weight checker (said once in the log); WeightSyncError when the checker fails."""
        url = url.rstrip("/")
        if url in self._unchecked:
            return None
        kind = self.engine(url)
        route = find_engine(kind).weight_checker_route
        what = "reading the engine's own weight checksums"
        resp = self._request("POST", url, route, wcheck.CHECKSUM_BODY, what)
        try:
            body = resp.json() if resp.content else None
        except ValueError:
            body = resp.text
        why = wcheck.absent_checker(kind, resp.status_code, body)
        if why is not None:
            self._unchecked[url] = why
            logger.warning("rr: %s: %s; the weights it loads are not verified (its reload's 200 is trusted)", url, why)
            return None
        if resp.status_code >= 400:
            raise WeightSyncError(
                f"{url}{route} answered {resp.status_code} ({what}): {resp.text[:500]}; "
                "DiskWeightSync(..., verify_weights=False) pushes without the check",
                engine=url,
            )
        return wcheck.parse_checksums(kind, body, f"{url}{route}")

    def _trainer_digests(self, folder: Path) -> dict[str, wcheck.TensorDigest] | None:
        """The pushed checkpoint's tensor digests, or None (said once) when it cannot be read as safetensors."""
        try:
            return wcheck.trainer_digests(folder, self.verify_skip)
        except Exception as e:  # noqa: BLE001 - safetensors' own errors too; the replicas are still compared
            if self._trainer_unread is None:
                self._trainer_unread = f"{type(e).__name__}: {e}"
                logger.warning(
                    "rr: weight check: the checkpoint in %s cannot be hashed (%s); the engines' checksums are compared "
                    "across replicas only, not with what the trainer changed",
                    folder,
                    self._trainer_unread,
                )
            return None

    def _reset_cache(self, url: str, route: str) -> None:
        """Drop the prefix cache, retried while the engine refuses (requests hold blocks); WeightSyncError when it
        never worked."""
        what = "dropping the KV cache computed with the old weights"
        deadline, wait = time.monotonic() + self.cache_reset_s, 0.05
        while True:
            try:
                reply = self._call("POST", url, route, None, what)
            except WeightSyncError as e:
                if "answered 400" not in str(e) or time.monotonic() >= deadline:  # SGLang: 400 while requests run
                    raise
                refused = str(e)
            else:
                if not (isinstance(reply, dict) and reply.get("success") is False):
                    return
                refused = f"{url}{route} answered {reply}"
                if time.monotonic() >= deadline:
                    break
            time.sleep(wait)
            wait = min(1.0, wait * 2)
        raise WeightSyncError(
            f"{url}{route} ({what}) refused for {self.cache_reset_s:.0f} s ({refused}): requests still hold "
            "prefix-cache blocks from the old weights, and new rollouts would hit them; pause generation around "
            "the push (vLLM /pause with clear_cache, SGLang /pause_generation) or wait for in-flight requests"
        )

    def _request(self, method: str, url: str, route: str, body: Any, what: str) -> httpx.Response:
        """One call to the engine; WeightSyncError on a transport failure or a refused API key (never echoed)."""
        try:
            resp = self._http.request(method, url + route, json=body)
        except httpx.HTTPError as e:
            raise WeightSyncError(f"{url}{route} ({what}): {type(e).__name__}: {e}") from e
        code = resp.status_code
        if code in (401, 403):  # the body is left out: it could echo what was sent
            if self._key_source is None:
                why = (
                    f"no API key was sent (api_key=None and {_KEY_ENV} unset): pass DiskWeightSync(..., "
                    f"api_key=...) or set {_KEY_ENV}"
                )
            else:
                why = f"the API key from {self._key_source} was refused: it is not one of this server's keys"
            raise WeightSyncError(f"{url}{route} answered {code} ({what}): {why}")
        return resp

    def _call(self, method: str, url: str, route: str, body: Any, what: str) -> Any:
        resp = self._request(method, url, route, body, what)
        code = resp.status_code
        if code == 404 and route == "/rr/info":
            raise WeightSyncError(
                f"{url}/rr/info is 404 ({what}): {url} is not an rr server (an engine without rr's plugin, or a "
                f"router/sidecar), so its engine is unknown; pass WeightEngine({url!r}, 'vllm') or "
                f"WeightEngine({url!r}, 'sglang') for each engine"
            )
        if code == 404 and route in _DEV_MODE_ROUTES:
            raise WeightSyncError(
                f"{url}{route} is 404 ({what}): vLLM serves it only with VLLM_SERVER_DEV_MODE=1 "
                "in the server's environment, and only on the engine itself (not a router or "
                "rr's sidecar)"
            )
        if code >= 400:
            raise WeightSyncError(f"{url}{route} answered {code} ({what}): {resp.text[:500]}")
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text
