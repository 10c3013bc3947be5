"""The weight version of one rr server process: weight updates seen through the engine's weight routes.

Engine-agnostic: :class:`WeightUpdateMiddleware` (pure ASGI) watches the engine's own weight routes (vLLM's dev-mode
``/collective_rpc`` with a weight-loading method, ``/start_weight_update`` .. ``/finish_weight_update``,
``/update_weights``, ``/update_weight_version``; SGLang's ``/update_weights_from_*`` and ``/update_weight_version``)
and counts each one that completes (2xx) in :class:`WeightEpoch`. rr's own weight sync goes through these routes.
A request takes a :meth:`WeightEpoch.mark` at admission and :meth:`WeightEpoch.since` at finish: the versions at
both ends, and whether an update began or ended while it ran (``weight_update_during``).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

from rr_server.serving.http import ASGIApp, Message, Receive, Scope, Send, read_body, replay_receive

__all__ = [
    "WeightEpoch",
    "WeightMark",
    "WeightUpdateMiddleware",
    "current_epoch",
    "update_kind",
    "UPDATE_PATHS",
    "install_weight_epoch",
]

Kind = Literal["update", "start", "finish"]

# Paths whose success completes one weight update (the body does not matter).
UPDATE_PATHS: frozenset[str] = frozenset(
    {
        "/update_weights",
        "/update_weight_version",  # vLLM dev mode (update_weights: outside a start..finish window)
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",  # SGLang
        "/update_weights_from_ipc",
    }
)
_RPC_READS = ("get", "check", "init", "is_", "list", "report", "save")  # collective_rpc methods that change nothing


def _rpc_loads_weights(method: Any) -> bool:
    """A ``/collective_rpc`` method that loads weights (reload_weights, load_weights, update_weights_*, load_model)."""
    if not isinstance(method, str):
        return False
    m = method.lower()
    return ("weight" in m or m in ("load_model", "reload_model")) and not m.startswith(_RPC_READS)


def update_kind(path: str, body: bytes) -> Kind | None:
    """What a POST to ``path`` does to the weights: completes an update, opens or closes a window, or nothing."""
    if path in UPDATE_PATHS:
        return "update"
    if path == "/start_weight_update":
        return "start"
    if path == "/finish_weight_update":
        return "finish"
    if path == "/collective_rpc":
        try:
            method = json.loads(body).get("method") if body else None
        except (ValueError, AttributeError):
            return None
        return "update" if _rpc_loads_weights(method) else None
    return None


@dataclass(frozen=True, slots=True)
class WeightMark:
    """The epoch at a request's admission: completed updates, changes seen, and whether one was under way."""

    version: int
    changes: int
    active: bool


class WeightEpoch:
    """Weight updates of this process: ``version`` counts the completed ones; ``changes`` every update that ended
    (completed or failed on the server's side, which may have touched the weights); ``active`` those under way
    (a route in flight, or a start..finish window open). Thread-safe."""

    def __init__(self) -> None:
        self.version = 0
        self.changes = 0
        self._active = 0
        self._window = False
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """An update is under way."""
        return self._active > 0 or self._window

    def begin(self) -> None:
        """An update route started."""
        with self._lock:
            self._active += 1

    def end(self, status: int) -> None:
        """An update route answered ``status``: 2xx completes an update (a chunk inside a start..finish window
        only changes the weights: the window's finish completes it); 5xx may have touched the weights."""
        with self._lock:
            self._active = max(0, self._active - 1)
            if status < 400 or status >= 500:
                self.changes += 1
            if 200 <= status < 300 and not self._window:
                self.version += 1

    def open_window(self) -> None:
        """``/start_weight_update`` succeeded: an update is under way until ``/finish_weight_update``."""
        with self._lock:
            self._window = True
            self.changes += 1

    def close_window(self) -> None:
        """``/finish_weight_update`` succeeded: the update completed."""
        with self._lock:
            self._window = False
            self.changes += 1
            self.version += 1

    def mark(self) -> WeightMark:
        """The epoch now, taken when a request is admitted."""
        with self._lock:
            return WeightMark(self.version, self.changes, self.active)

    def since(self, mark: WeightMark) -> tuple[int, bool]:
        """(version now, whether an update began or ended since ``mark`` or was under way at either end)."""
        with self._lock:
            return self.version, mark.active or self.active or self.changes != mark.changes

    def info(self) -> dict[str, Any]:
        """``/rr/info`` fields: ``weight_version`` and ``weight_update_in_progress``."""
        return {"weight_version": self.version, "weight_update_in_progress": self.active}


_EPOCH = WeightEpoch()


def current_epoch() -> WeightEpoch:
    """This process's epoch (one per API server process)."""
    return _EPOCH


class WeightUpdateMiddleware:
    """Counts the weight updates that pass through the app's weight routes in :func:`current_epoch`; every
    request passes through unchanged."""

    def __init__(self, app: ASGIApp, epoch: WeightEpoch | None = None) -> None:
        self.app, self.epoch = app, epoch or _EPOCH

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope.get("type") != "http" or scope.get("method") != "POST" or not _maybe_update(path):
            await self.app(scope, receive, send)
            return
        body = b""
        if path == "/collective_rpc":  # the method decides; read the body and hand it on unchanged
            raw = await read_body(receive)
            if raw is None:
                return
            body, receive = raw, replay_receive(raw, receive)
        kind = update_kind(path, body)
        if kind is None:
            await self.app(scope, receive, send)
            return
        status = 500

        async def watch(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            await send(msg)

        if kind == "update":
            self.epoch.begin()
            try:
                await self.app(scope, receive, watch)
            finally:
                self.epoch.end(status)
            return
        await self.app(scope, receive, watch)
        if 200 <= status < 300:
            (self.epoch.open_window if kind == "start" else self.epoch.close_window)()


def _maybe_update(path: str) -> bool:
    return path in UPDATE_PATHS or path in ("/collective_rpc", "/start_weight_update", "/finish_weight_update")


def install_weight_epoch(app: Any) -> bool:
    """Add :class:`WeightUpdateMiddleware` to a Starlette/FastAPI app once; True if added now."""
    if getattr(app.state, "rr_weight_epoch", False):
        return False
    app.add_middleware(WeightUpdateMiddleware)
    app.state.rr_weight_epoch = True
    return True
