"""The real sidecar app under uvicorn in a thread (:class:`SidecarServer`), for tests over loopback HTTP.

The upstreams it fronts are FAKE engines (:mod:`tests.support.fake_upstreams`) in tests/http/ and real
vLLM CPU servers (:class:`tests.support.vllm_process.VLLMProcess`) in tests/vllm/.
"""

from __future__ import annotations

from typing import Any

from rr_server.proxy import KEEP_ALIVE_S
from rr_server.proxy.app import ProxyConfig, create_app
from rr_server.serving.store import install
from tests.support.threaded_server import ThreadedServer

__all__ = ["SidecarServer"]


class SidecarServer(ThreadedServer):
    """``create_app(cfg)`` served like ``rr-server proxy`` serves it (lifespan on, long keep-alive).

    ``rr-server proxy`` is one sidecar per process, and its routing store is the process's (named once, by the first
    server). Tests start many sidecars in one process: each gets a fresh store here, so its refs never name a server
    an earlier test started (and stopped); the process's store is put back at :meth:`stop`."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self._outer: tuple[Any, Any, bool] = (install._STORE, install._INDEXER, install._NAMED)
        install._STORE, install._INDEXER, install._NAMED = None, None, False
        try:
            super().__init__(create_app(cfg), name="sidecar", lifespan="on", timeout_keep_alive=KEEP_ALIVE_S)
        except BaseException:
            self._restore_store()
            raise

    def stop(self) -> None:
        super().stop()
        self._restore_store()

    def _restore_store(self) -> None:
        """Close this sidecar's store's sibling socket and put the process's store back."""
        mine = install._STORE
        if mine is not None and mine.siblings is not None:
            mine.siblings.close()
        install._STORE, install._INDEXER, install._NAMED = self._outer
