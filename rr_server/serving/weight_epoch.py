"""The weight version of one rr server, and whether its prefix cache may hold KV from older weights.

Engine-agnostic: :class:`WeightUpdateMiddleware` (pure ASGI) watches the engine's own weight routes (vLLM's dev-mode
``/collective_rpc`` with a weight-loading method, ``/start_weight_update`` .. ``/finish_weight_update``,
``/update_weights``, ``/update_weight_version``; SGLang's ``/update_weights_from_*``, ``/update_weight_version`` and
0.5.23's ``/begin_weight_update`` .. ``/end_weight_update`` session) and counts each one that completes (2xx) in
:class:`WeightEpoch`, and each SGLang answer that says the weights were loaded though the call failed (0.5.23's 400
"Weights were updated, but the cache was not flushed": an update, the cache left stale). rr's own weight sync goes
through these routes.
A request takes a :meth:`WeightEpoch.mark` at admission and :meth:`WeightEpoch.since` at finish: the versions at
both ends, and whether an update began or ended while it ran (``weight_update_during``).

**Cache epochs.** The same middleware watches the routes that drop the prefix cache (vLLM's ``/reset_prefix_cache``
answering ``{"success": true}``, a ``/pause`` that clears it, SGLang's ``/flush_cache``, SGLang's weight updates
with their default ``flush_cache``): after a weight change the cache is *stale* (its blocks may come from the older
weights) until one succeeds, or one succeeded earlier in the same pause (nothing computes while paused). A request
admitted while it is stale that hits the cache has cached tokens from older weights (``cached_under_older_weights``).

**One epoch per server.** vLLM's ``--api-server-count N`` runs N API processes on one socket; an update reaches one
of them. :meth:`WeightEpoch.share` maps the counters onto a file the server's processes share (the routing store's
sibling directory), so each sees every update, and the route's answer leaves only once the count is made.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs

from rr_server.serving.engines import LOADED_UNFLUSHED_ANSWERS
from rr_server.serving.http import (
    ASGIApp,
    BodyTooLarge,
    Message,
    Receive,
    Scope,
    Send,
    add_middleware,
    error_body,
    read_body,
    replay_receive,
    resume_receive,
    send_json,
)

__all__ = [
    "WeightEpoch",
    "WeightMark",
    "WeightUpdateMiddleware",
    "current_epoch",
    "update_kind",
    "cache_clear_kind",
    "UPDATE_PATHS",
    "SELF_FLUSHING_PATHS",
    "WINDOW_STARTS",
    "WINDOW_ENDS",
    "EPOCH_FILE",
    "WEIGHT_BODY_LIMIT",
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
# SGLang's updates that flush the radix cache after loading unless the body says ``"flush_cache": false`` (its
# scheduler asserts the flush succeeded).
SELF_FLUSHING_PATHS: frozenset[str] = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/update_weights_from_ipc",
    }
)
# Routes that open and close a weight-update window: vLLM's start..finish; SGLang 0.5.23's begin..end session
# (``http_server.py`` ``/begin_weight_update``, ``/end_weight_update``: P2P/RDMA loads and the tensor/distributed
# updates inside it; the end neither flushes the cache nor relabels the weights)
WINDOW_STARTS: frozenset[str] = frozenset({"/start_weight_update", "/begin_weight_update"})
WINDOW_ENDS: frozenset[str] = frozenset({"/finish_weight_update", "/end_weight_update"})
EPOCH_FILE = "weights.epoch"  #: the shared counters' file in the server's sibling directory
WEIGHT_BODY_LIMIT = 64 * 1024 * 1024  #: the most of a weight route's body the middleware reads (module docstring)
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
    if path in WINDOW_STARTS:
        return "start"
    if path in WINDOW_ENDS:
        return "finish"
    if path == "/collective_rpc":
        try:
            method = json.loads(body).get("method") if body else None
        except (ValueError, AttributeError):
            return None
        return "update" if _rpc_loads_weights(method) else None
    return None


def _false(v: Any) -> bool:
    return v is False or (isinstance(v, str) and v.lower() in ("false", "0"))


def cache_clear_kind(path: str) -> Literal["reset", "flush", "pause", "resume"] | None:
    """What a POST to ``path`` may do to the prefix cache: vLLM's reset (its body says whether it worked), SGLang's
    flush (2xx: it worked), a pause (clears unless ``clear_cache=false``; it also starts a pause), a resume."""
    if path == "/reset_prefix_cache":
        return "reset"
    if path == "/flush_cache":
        return "flush"
    if path == "/resume":
        return "resume"
    if path == "/pause":
        return "pause"
    return None


def _pause_clears(query: bytes) -> bool:
    """vLLM's ``/pause`` clears the caches unless ``clear_cache=false`` (its default is true)."""
    values = parse_qs(query.decode("latin-1")).get("clear_cache", [])
    return not values or not _false(values[-1])


@dataclass(frozen=True, slots=True)
class WeightMark:
    """The epoch at a request's admission: completed updates, changes seen, whether one was under way, and whether
    the prefix cache may hold KV from older weights."""

    version: int
    changes: int
    active: bool
    cache_stale: bool = False


# the counters, one int64 each, in this order
_VERSION, _CHANGES, _ACTIVE, _WINDOW, _STALE, _CLEARS, _PAUSED, _CLEARED_IN_PAUSE = range(8)
_N = 8


class _Cells:
    """The epoch's counters: in this process's memory, or mapped from a file the server's processes share (then
    every change holds the file's lock as well as this process's)."""

    def __init__(self) -> None:
        self._view = memoryview(bytearray(8 * _N)).cast("q")
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._lock = threading.RLock()

    @contextmanager
    def locked(self) -> Iterator[memoryview]:
        with self._lock:
            if self._fd is None:
                yield self._view
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield self._view
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def shared(self) -> bool:
        return self._fd is not None

    def attach(self, path: Path, fresh: bool) -> None:
        """Map ``path`` (made if new, zeros; zeroed when ``fresh``: no live process of the server counts in it, it
        is a dead run's); this process's counts so far are merged in (an update it already saw)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if fresh:
                os.ftruncate(fd, 0)
            if os.fstat(fd).st_size < 8 * _N:
                os.ftruncate(fd, 8 * _N)
            mapped = mmap.mmap(fd, 8 * _N)
            view = memoryview(mapped).cast("q")
            with self._lock:
                for i in (_VERSION, _CHANGES, _STALE, _CLEARS):
                    view[i] = max(view[i], self._view[i])
                view[_ACTIVE] += self._view[_ACTIVE]
                self._view, self._fd, self._map = view, fd, mapped
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise


class WeightEpoch:
    """Weight updates of this server: ``version`` counts the completed ones; ``changes`` every update that ended
    (completed or failed on the server's side, which may have touched the weights); ``active`` those under way
    (a route in flight, or a start..finish window open); ``cache_stale`` whether the prefix cache may hold KV from
    older weights. Thread-safe; shared by the server's processes once :meth:`share` is called.

    ``sees_all_updates``: every weight update of the server passes through the routes counted here (the engine's own
    app, rr's patch or plugin). False for rr's sidecar unless its operator states that every update goes through it:
    an update pushed straight to the engine is invisible to it, so its answers say unknown
    (:mod:`rr_server.proxy.provenance`)."""

    def __init__(self, sees_all_updates: bool = True) -> None:
        self._cells = _Cells()
        self.sees_all_updates = sees_all_updates

    def share(self, directory: Path, fresh: bool = False) -> bool:
        """Count in ``directory``'s :data:`EPOCH_FILE`, with every process of the server that shares it (once;
        ``fresh``: this is the server's first live process, the file is a dead run's); False when that file cannot
        be made (this process then counts alone)."""
        if self._cells.shared:
            return False
        try:
            self._cells.attach(directory / EPOCH_FILE, fresh)
        except OSError:
            return False
        return True

    @property
    def shared(self) -> bool:
        """The counters are the server's, not only this process's."""
        return self._cells.shared

    def _get(self, i: int) -> int:
        with self._cells.locked() as c:
            return int(c[i])

    @property
    def version(self) -> int:
        return self._get(_VERSION)

    @property
    def changes(self) -> int:
        return self._get(_CHANGES)

    @property
    def active(self) -> bool:
        """An update is under way."""
        with self._cells.locked() as c:
            return c[_ACTIVE] > 0 or c[_WINDOW] > 0

    @property
    def cache_stale(self) -> bool:
        """The prefix cache may hold KV computed under older weights than the current ones."""
        return self._get(_STALE) > 0

    @property
    def cache_clears(self) -> int:
        """Prefix-cache clears seen succeed (the cache epoch)."""
        return self._get(_CLEARS)

    def begin(self) -> None:
        """An update route started."""
        with self._cells.locked() as c:
            c[_ACTIVE] += 1

    @staticmethod
    def _changed(c: memoryview, flushed: bool = False) -> None:
        """The weights changed: the cache is stale unless it was cleared earlier in this pause or flushed now."""
        c[_CHANGES] += 1
        c[_STALE] = 0 if flushed or (c[_PAUSED] and c[_CLEARED_IN_PAUSE]) else 1
        if flushed:
            c[_CLEARS] += 1

    def end(self, status: int, flushed: bool = False, loaded: bool = False) -> None:
        """An update route answered ``status``: 2xx completes an update (a chunk inside a start..finish window
        only changes the weights: the window's finish completes it); 5xx may have touched the weights. ``flushed``:
        a 2xx answer also flushed the prefix cache (SGLang's default). ``loaded``: a failed answer that says the
        weights were loaded (SGLang 0.5.23's 400 whose flush was refused): an update, the cache left stale."""
        ok = 200 <= status < 300 or loaded
        with self._cells.locked() as c:
            c[_ACTIVE] = max(0, c[_ACTIVE] - 1)
            if ok or status < 400 or status >= 500:
                self._changed(c, flushed and 200 <= status < 300)
            if ok and not c[_WINDOW]:
                c[_VERSION] += 1

    def open_window(self) -> None:
        """``/start_weight_update`` succeeded: an update is under way until ``/finish_weight_update``."""
        with self._cells.locked() as c:
            c[_WINDOW] = 1
            self._changed(c)

    def close_window(self) -> None:
        """``/finish_weight_update`` succeeded: the update completed."""
        with self._cells.locked() as c:
            c[_WINDOW] = 0
            self._changed(c)
            c[_VERSION] += 1

    def cache_cleared(self) -> None:
        """The prefix cache was dropped (a reset that said it worked, a flush, a clearing pause): no KV from older
        weights is left, unless an update is under way (it may still compute under the old ones)."""
        with self._cells.locked() as c:
            c[_CLEARS] += 1
            if not (c[_ACTIVE] or c[_WINDOW]):
                c[_STALE] = 0
            if c[_PAUSED]:
                c[_CLEARED_IN_PAUSE] = 1

    def paused(self, clears: bool) -> None:
        """Generation was paused (``clears``: the pause dropped the prefix cache too)."""
        with self._cells.locked() as c:
            c[_PAUSED], c[_CLEARED_IN_PAUSE] = 1, 0
        if clears:
            self.cache_cleared()

    def resumed(self) -> None:
        """Generation resumed: a later update makes the cache stale again unless it is cleared."""
        with self._cells.locked() as c:
            c[_PAUSED] = c[_CLEARED_IN_PAUSE] = 0

    def mark(self) -> WeightMark:
        """The epoch now, taken when a request is admitted."""
        with self._cells.locked() as c:
            return WeightMark(int(c[_VERSION]), int(c[_CHANGES]), bool(c[_ACTIVE] or c[_WINDOW]), bool(c[_STALE]))

    def since(self, mark: WeightMark) -> tuple[int, bool]:
        """(version now, whether an update began or ended since ``mark`` or was under way at either end)."""
        with self._cells.locked() as c:
            active = bool(c[_ACTIVE] or c[_WINDOW])
            return int(c[_VERSION]), mark.active or active or int(c[_CHANGES]) != mark.changes

    def info(self) -> dict[str, Any]:
        """``/rr/info`` fields: ``weight_version``, ``weight_update_in_progress``, ``prefix_cache_stale`` and
        ``cache_epoch`` (prefix-cache clears seen)."""
        with self._cells.locked() as c:
            return {
                "weight_version": int(c[_VERSION]),
                "weight_update_in_progress": bool(c[_ACTIVE] or c[_WINDOW]),
                "prefix_cache_stale": bool(c[_STALE]),
                "cache_epoch": int(c[_CLEARS]),
            }


_EPOCH = WeightEpoch()


def current_epoch() -> WeightEpoch:
    """This process's epoch (the server's once shared: :meth:`WeightEpoch.share`)."""
    return _EPOCH


class WeightUpdateMiddleware:
    """Counts the weight updates and prefix-cache clears that pass through the app's routes in :func:`current_epoch`
    before their answer leaves (a caller that reads the answer and sends its next request, to any process of the
    server, is admitted under the new count); every request passes through unchanged.

    A body it must read (``/collective_rpc``, SGLang's self-flushing updates) is read up to :attr:`max_body_bytes`:
    a longer ``/collective_rpc`` is answered 413 before more of it is buffered; a longer SGLang update (tensors
    inline) is handed on unread and counted as leaving the cache stale (its ``flush_cache`` unseen). It sits inside the server's key check
    (:func:`install_weight_epoch`), so a keyless request is refused before its body is read."""

    max_body_bytes: int | None = WEIGHT_BODY_LIMIT  #: the most a weight route's body may hold (None: no cap)

    def reset_cleared(self, scope: Scope, reply: bytes) -> bool:
        """A 2xx ``/reset_prefix_cache`` answer (``reply``) to the request ``scope`` cleared every cache that may
        hold older weights' KV (an engine with a KV tier outside the device cache overrides this)."""
        return _reset_worked(reply)

    def pause_cleared(self, scope: Scope) -> bool:
        """A 2xx ``/pause`` (``scope``) cleared every cache that may hold older weights' KV (its ``clear_cache``)."""
        return _pause_clears(scope.get("query_string", b""))

    def __init__(
        self, app: ASGIApp, epoch: WeightEpoch | None = None, loaded_unflushed: tuple[str, ...] | None = None
    ) -> None:
        self.app, self.epoch = app, epoch or _EPOCH
        # how a failed update's answer says the weights were loaded anyway (every known release's text by default)
        self.loaded_unflushed = LOADED_UNFLUSHED_ANSWERS if loaded_unflushed is None else loaded_unflushed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        method = scope.get("method")
        if (
            scope.get("type") != "http"
            or not _watched(path)
            or not (method == "POST" or (method == "GET" and path == "/flush_cache"))
        ):
            await self.app(scope, receive, send)
            return
        body, unread = b"", False
        if path == "/collective_rpc" or path in SELF_FLUSHING_PATHS:  # the body decides; handed on unchanged
            try:
                raw = await read_body(receive, self.max_body_bytes)
            except BodyTooLarge as e:
                if path == "/collective_rpc":  # a method name and its arguments: refused before more is buffered
                    await send_json(send, _too_large(path, self.max_body_bytes), 413)
                    return
                # an SGLang update carrying its tensors: handed on unread past the cap, counted as not flushing the
                # cache (its ``flush_cache`` unseen), so the cache stays stale rather than wrongly fresh
                raw, unread, receive = None, True, resume_receive(e.head, receive)
            else:
                if raw is None:
                    return
                body, receive = raw, replay_receive(raw, receive)
        kind, clear = update_kind(path, body), cache_clear_kind(path)
        if kind is None and clear is None:
            await self.app(scope, receive, send)
            return
        status, reply, settled = 500, bytearray(), False

        def settle() -> None:
            """Count what the route did, once: before its last body chunk leaves, or after it failed."""
            nonlocal settled
            if settled:
                return
            settled = True
            ok = 200 <= status < 300
            if kind == "update":
                loaded = 400 <= status < 500 and _says_loaded(bytes(reply), self.loaded_unflushed)
                flushed = path in SELF_FLUSHING_PATHS and not unread and not _no_flush(body)
                self.epoch.end(status, flushed=flushed, loaded=loaded)
            elif kind is not None and ok:
                (self.epoch.open_window if kind == "start" else self.epoch.close_window)()
            if not ok:
                return
            if (clear == "reset" and self.reset_cleared(scope, bytes(reply))) or clear == "flush":
                self.epoch.cache_cleared()
            elif clear == "pause":
                self.epoch.paused(clears=self.pause_cleared(scope))
            elif clear == "resume":
                self.epoch.resumed()

        async def watch(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            elif msg["type"] == "http.response.body":
                if (clear == "reset" or kind == "update") and len(reply) < 4096:
                    reply.extend(msg.get("body", b""))
                if not msg.get("more_body", False):
                    settle()
            await send(msg)

        if kind == "update":
            self.epoch.begin()
        try:
            await self.app(scope, receive, watch)
        finally:
            settle()


def _no_flush(body: bytes) -> bool:
    """SGLang's update body asks not to flush the cache (``"flush_cache": false``)."""
    try:
        d = json.loads(body) if body else {}
    except ValueError:
        return False
    return isinstance(d, dict) and _false(d.get("flush_cache"))


def _says_loaded(reply: bytes, answers: tuple[str, ...]) -> bool:
    """A failed update's answer says the weights were loaded: ``{"success": false, "message": <one of answers>...}``
    (SGLang 0.5.23's flush refused after the load: :attr:`ReleaseFacts.unflushed_update_answer`)."""
    try:
        d = json.loads(reply) if reply.strip() else {}
    except ValueError:
        return False
    msg = d.get("message") if isinstance(d, dict) and d.get("success") is False else None
    return isinstance(msg, str) and msg.startswith(answers)


def _reset_worked(reply: bytes) -> bool:
    """vLLM's ``/reset_prefix_cache`` answer says it worked: ``{"success": true}`` (0.30+: 200 with ``false`` while
    blocks are held), or an older vLLM's empty 200."""
    try:
        d = json.loads(reply) if reply.strip() else {}
    except ValueError:
        return False
    return not isinstance(d, dict) or d.get("success", True) is True


def _watched(path: str) -> bool:
    return (
        path in UPDATE_PATHS
        or path == "/collective_rpc"
        or path in WINDOW_STARTS
        or path in WINDOW_ENDS
        or cache_clear_kind(path) is not None
    )


def _too_large(path: str, limit: int | None) -> dict[str, Any]:
    """The 413 body for a weight route's oversized body."""
    return error_body(
        f"request body of {path} exceeds rr's limit of {limit} bytes for the weight routes whose body rr reads "
        "(rr_server.serving.weight_epoch.WEIGHT_BODY_LIMIT)",
        413,
        "RequestTooLarge",
    )


def install_weight_epoch(
    app: Any, middleware: type[WeightUpdateMiddleware] = WeightUpdateMiddleware, inside: tuple[type, ...] = ()
) -> bool:
    """Add ``middleware`` (:class:`WeightUpdateMiddleware` or an engine's own) to a Starlette/FastAPI app once; True
    if added now. ``inside``: key-check middleware classes already on the app (vLLM's ``AuthenticationMiddleware``
    when rr's routes are added after vLLM built its stack): it goes just inside the innermost of them, so a keyless
    request is refused before it reads a body. One added later wraps it anyway (Starlette: the last added is outer);
    an app whose stack is built already (vLLM 0.22 - 0.29's) is rebuilt (:func:`rr_server.serving.http.add_middleware`)."""
    if getattr(app.state, "rr_weight_epoch", False):
        return False
    add_middleware(app, middleware, inside=inside)
    app.state.rr_weight_epoch = True
    return True
