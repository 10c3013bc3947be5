"""The processes of one rr server answer for each other's routing refs.

vLLM's ``--api-server-count N`` runs N API server processes that accept on one shared socket, each with its own
routing store: a read (or a retire) reaches whichever process the kernel picked, not the one that holds the rows.
So each store also listens on a Unix socket named after its instance, in a directory its siblings share (one per
server: the parent process and the URL refs name; mode 0700, this user's only). A read naming a sibling's
instance is answered by that sibling over its socket, a retire reaches every sibling, ``/rr/info``'s counters are
summed over them. A single-process server has no siblings and never uses the socket.

Messages: two little-endian u64 (JSON length, data length), the JSON, then (read answers) the rows' raw bytes.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import socketserver
import stat
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rr_client.core.errors import RoutingExpiredError
from rr_client.core.reference import FramePart

__all__ = ["Siblings", "group_dir", "merge_stats", "retire_everywhere", "PROCESS_GAUGES", "process_gauges"]

logger = logging.getLogger("rr.routing_store")

_INSTANCE = re.compile(r"[0-9a-f]{32}")  # a store instance id (uuid4 hex): the only names a socket gets
_HEAD = struct.Struct("<QQ")
_MAX_JSON = 64 << 20
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS
TIMEOUT_S = 30.0  #: one sibling call (a read of many rows); a sibling that does not answer is reported, not waited on
STATS_TIMEOUT_S = 1.0  #: ``/rr/info`` sums the counters on the event loop: never wait long for them


#: numbers each process reports beside its store's counters, summed over the server in ``/rr/info`` (vLLM's plugin
#: registers ``requests_in_engine``: what the doctor waits for when it holds a burst)
PROCESS_GAUGES: dict[str, Callable[[], int | None]] = {}


def process_gauges() -> dict[str, int]:
    """This process's :data:`PROCESS_GAUGES` now (one that cannot be read is left out)."""
    out = {}
    for name, read in list(PROCESS_GAUGES.items()):
        try:
            v = read()
        except Exception:  # noqa: BLE001 - a gauge never breaks the counters it rides with
            logger.debug("rr: process gauge %s could not be read", name, exc_info=True)
            continue
        if v is not None:
            out[name] = int(v)
    return out


class LocalStore(Protocol):
    """What a sibling answers with: its own store's rows, retire and counters."""

    instance: str

    def read(self, store: str, key: str, start: int | None = None, stop: int | None = None) -> FramePart: ...

    def extents(self, keys: list[tuple[str, str]]) -> list[tuple[int, int] | RoutingExpiredError]: ...

    def local_retire(self, through: int) -> dict[str, int]: ...

    def local_stats(self) -> dict[str, Any]: ...


def group_dir(url: str, base: str | None = None) -> Path:
    """The directory the processes of one server share: this user's, per parent process and advertised URL (under
    ``base``, else the temp dir, else ``/tmp`` where the temp dir's path is too long for a Unix socket)."""
    name = f"rr-routing-{os.getuid()}/{os.getppid()}-{hashlib.blake2b(url.encode(), digest_size=6).hexdigest()}"
    for root in [base] if base else [tempfile.gettempdir(), "/tmp"]:
        if len(f"{root}/{name}/{'0' * 32}.sock") <= _MAX_SOCKET_PATH:
            break
    return Path(root) / name


def _private_dir(path: Path) -> bool:
    """Make ``path`` (and its parent) mode 0700 if new; False if it is not a directory only this user can enter."""
    for d in (path.parent, path):
        d.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            return False
    return True


def _prune_dead_groups(root: Path) -> None:
    """Remove group directories whose server (the parent process they are named after) is gone."""
    for d in root.glob("*-*"):
        try:
            os.kill(int(d.name.split("-", 1)[0]), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, PermissionError):
            continue


def _send(sock: socket.socket, head: dict[str, Any], data: Sequence[memoryview | bytes] = ()) -> None:
    body = json.dumps(head, separators=(",", ":")).encode()
    sock.sendall(_HEAD.pack(len(body), sum(memoryview(d).nbytes for d in data)) + body)
    for d in data:
        sock.sendall(d)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"sibling closed the connection after {got} of {n} bytes")
        got += k
    return buf


def _recv(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    n, m = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    if n > _MAX_JSON:
        raise ConnectionError(f"sibling message of {n} JSON bytes")
    return json.loads(bytes(_recv_exact(sock, n))), _recv_exact(sock, m)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    answer: Callable[[dict[str, Any]], tuple[dict[str, Any], list[memoryview]]]


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            head, data = self.server.answer(_recv(self.request)[0])  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - reported to the asking sibling, never raised into the thread
            head, data = {"error": f"{type(e).__name__}: {e}"}, []
        try:
            _send(self.request, head, data)
        except OSError:  # the asking sibling gave up (timed out, or exited): nothing to answer
            pass


class Siblings:
    """This process's socket for its siblings, and calls to theirs (:func:`group_dir` names the directory)."""

    def __init__(self, store: LocalStore, directory: Path) -> None:
        self.store = store
        self.dir = directory
        self.path = directory / f"{store.instance}.sock"
        self._server = _Server(str(self.path), _Handler)
        self._server.answer = self._answer
        self._closed = False
        self.forwarded = 0  #: asks this process read from a sibling (``sibling_reads`` in the counters)
        threading.Thread(target=self._server.serve_forever, name="rr-store-siblings", daemon=True).start()
        atexit.register(self.close)

    @classmethod
    def join(cls, store: LocalStore, url: str, base: str | None = None) -> Siblings | None:
        """Listen for ``store``'s siblings; None (logged) where no private socket directory can be made."""
        if not _INSTANCE.fullmatch(store.instance):  # only rr's own ids name a socket
            return None
        d = group_dir(url, base)
        try:
            _prune_dead_groups(d.parent) if d.parent.is_dir() else None
            if not _private_dir(d):
                logger.warning(
                    "rr: %s is not a private directory of this user: the routing store does not "
                    "answer for sibling API server processes",
                    d,
                )
                return None
            if len(str(d / f"{store.instance}.sock")) > _MAX_SOCKET_PATH:
                logger.warning(
                    "rr: %s is too long a path for a Unix socket (TMPDIR): the routing store does not "
                    "answer for sibling API server processes",
                    d,
                )
                return None
            return cls(store, d)
        except OSError as e:
            logger.warning("rr: the routing store cannot listen for sibling API server processes in %s: %s", d, e)
            return None

    def close(self) -> None:
        """Stop listening and remove this process's socket (once; at exit too)."""
        if self._closed:
            return
        self._closed = True
        self.path.unlink(missing_ok=True)
        self._server.shutdown()
        self._server.server_close()
        if not any(self.dir.glob("*.sock")):  # the last process of the server out removes the directory
            for f in self.dir.iterdir():
                f.unlink(missing_ok=True)  # the shared weight epoch (rr_server.serving.weight_epoch)
            try:
                self.dir.rmdir()
            except OSError:
                pass

    def others_alive(self) -> bool:
        """Another process of this server listens here now (this one is not the first of a fresh run)."""
        for path in self.dir.glob("*.sock"):
            if path == self.path:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                try:
                    s.connect(str(path))
                    return True
                except OSError:
                    continue
        return False

    # ------------------------------------------------------------------ answering siblings

    def _answer(self, msg: dict[str, Any]) -> tuple[dict[str, Any], list[memoryview]]:
        op = msg.get("op")
        if op == "stats":
            return {"stats": {**self.store.local_stats(), **process_gauges()}}, []
        if op == "retire":
            return {"retired": self.store.local_retire(int(msg["through"]))}, []
        if op == "extents":  # what a read of these keys costs, asked before any row is sent
            got = self.store.extents([(self.store.instance, k) for k in msg["keys"]])
            return {
                "extents": [{"expired": str(e)} if isinstance(e, RoutingExpiredError) else list(e) for e in got]
            }, []
        if op != "read":
            raise ValueError(f"unknown op {op!r}")
        out: list[dict[str, Any]] = []
        data: list[memoryview] = []
        for key, a, b in msg["asks"]:
            try:
                p = self.store.read(self.store.instance, key, a, b)
            except RoutingExpiredError as e:
                out.append({"expired": str(e)})
                continue
            except ValueError as e:
                out.append({"bad": str(e)})
                continue
            rows = np.ascontiguousarray(p.rows)
            out.append(
                {
                    "key": p.key,
                    "start": p.start,
                    "stop": p.stop,
                    "shape": list(rows.shape),
                    "dtype": rows.dtype.name,
                    "digest": p.digest,
                }
            )
            data.append(rows.data)
        return {"parts": out}, data

    # ------------------------------------------------------------------ asking siblings

    def _call(self, path: Path, msg: dict[str, Any], timeout: float = TIMEOUT_S) -> tuple[dict[str, Any], bytearray]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(path))
            _send(s, msg)
            head, data = _recv(s)
        if "error" in head:
            raise ConnectionError(f"sibling {path.stem}: {head['error']}")
        return head, data

    def holder(self, instance: str) -> Path | None:
        """The socket of the sibling whose store is ``instance``, if one listens here."""
        if instance == self.store.instance or not _INSTANCE.fullmatch(instance):
            return None
        path = self.dir / f"{instance}.sock"
        return path if path.exists() else None

    def read(
        self, instance: str, asks: Sequence[tuple[str, int | None, int | None]]
    ) -> list[FramePart | RoutingExpiredError | ValueError]:
        """Rows of ``asks`` (key, start, stop) held by sibling ``instance``: a part, or why not, for each."""
        path = self.dir / f"{instance}.sock"
        self.forwarded += len(asks)
        try:
            head, data = self._call(path, {"op": "read", "asks": [list(a) for a in asks]})
            return self._parts(head, data)
        except (OSError, ValueError, KeyError, TypeError) as e:  # the sibling is gone (or broke): its rows with it
            return [self._gone(instance, path, e)] * len(asks)

    def extents(self, instance: str, keys: Sequence[str]) -> list[tuple[int, int] | RoutingExpiredError]:
        """(rows, bytes per row) of ``keys`` held by sibling ``instance``, or why not, for each; no row is sent."""
        path = self.dir / f"{instance}.sock"
        try:
            got = self._call(path, {"op": "extents", "keys": list(keys)})[0]["extents"]
            return [RoutingExpiredError(e["expired"]) if isinstance(e, dict) else (int(e[0]), int(e[1])) for e in got]
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:  # gone (or broke): its rows with it
            return [self._gone(instance, path, e)] * len(keys)

    @staticmethod
    def _gone(instance: str, path: Path, e: Exception) -> RoutingExpiredError:
        """Why a sibling's rows are gone: it does not answer (a dead one's socket is cleared)."""
        if isinstance(e, (ConnectionRefusedError, FileNotFoundError)):
            path.unlink(missing_ok=True)
        return RoutingExpiredError(
            f"routing store {instance}: the API server process that held it does not answer ({type(e).__name__}: {e})"
        )

    @staticmethod
    def _parts(head: dict[str, Any], data: bytearray) -> list[FramePart | RoutingExpiredError | ValueError]:
        """A sibling's read answer as parts (views into ``data``), expired keys and bad ranges."""
        out: list[FramePart | RoutingExpiredError | ValueError] = []
        view, offset = memoryview(data), 0
        for p in head["parts"]:
            if "expired" in p:
                out.append(RoutingExpiredError(p["expired"]))
            elif "bad" in p:
                out.append(ValueError(p["bad"]))
            else:
                dtype = np.dtype(p["dtype"])
                n = int(np.prod(p["shape"])) * dtype.itemsize
                rows = np.frombuffer(view[offset : offset + n], dtype=dtype).reshape(p["shape"])
                offset += n
                out.append(FramePart(p["key"], p["start"], p["stop"], rows, p["digest"]))
        return out

    def _others(self) -> list[Path]:
        return sorted(p for p in self.dir.glob("*.sock") if p != self.path and _INSTANCE.fullmatch(p.stem))

    def retire(self, through: int) -> list[dict[str, Any]]:
        """Retire ``through`` in every sibling; each one's answer (or why it gave none)."""
        out = []
        for path in self._others():
            try:
                out.append(self._call(path, {"op": "retire", "through": through})[0]["retired"])
            except (ConnectionRefusedError, FileNotFoundError):  # died: its rows went with it
                path.unlink(missing_ok=True)
            except OSError as e:
                logger.warning("rr: retire through %d did not reach sibling store %s: %s", through, path.stem, e)
                out.append({"instance": path.stem, "unreachable": f"{type(e).__name__}: {e}"})
        return out

    def stats(self) -> list[dict[str, Any]]:
        """Every sibling's own counters (a sibling that does not answer at once is left out)."""
        out = []
        for path in self._others():
            try:
                out.append(self._call(path, {"op": "stats"}, STATS_TIMEOUT_S)[0]["stats"])
            except OSError:
                continue
        return out


def merge_stats(local: dict[str, Any], others: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One server's store counters over its processes: counts and bytes summed, the newest weight version;
    ``processes`` and ``instances`` say over which."""
    if not others:
        return local
    out = dict(local)
    for k, v in local.items():
        if isinstance(v, int) and not isinstance(v, bool) and k != "weight_version":
            out[k] = v + sum(int(o.get(k, 0)) for o in others)
    out["weight_version"] = max([local["weight_version"], *(o.get("weight_version", 0) for o in others)])
    out["processes"] = 1 + len(others)
    out["instances"] = [local["instance"], *(o.get("instance") for o in others)]
    return out


def retire_everywhere(store: Any, through: int) -> dict[str, Any]:
    """Retire ``through`` in ``store`` and its siblings: freed counts summed, the weight version new refs get;
    ``unreachable`` lists siblings that did not answer."""
    out: dict[str, Any] = dict(store.local_retire(through))
    for r in store.siblings.retire(through) if store.siblings else []:
        if "unreachable" in r:
            out.setdefault("unreachable", []).append(r)
            continue
        out["retired"] += r["retired"]
        out["freed_bytes"] += r["freed_bytes"]
        out["weight_version"] = max(out["weight_version"], r["weight_version"])
    return out
