"""The real sidecar app under uvicorn in a thread (:class:`SidecarServer`), for tests over loopback HTTP.

The upstreams it fronts are FAKE engines (:mod:`tests.support.fake_upstreams`) in tests/http/ and real
vLLM CPU servers (:class:`tests.support.vllm_process.VLLMProcess`) in tests/vllm/.
"""

from __future__ import annotations

from rr_server.proxy import KEEP_ALIVE_S
from rr_server.proxy.app import ProxyConfig, create_app
from tests.support.threaded_server import ThreadedServer

__all__ = ["SidecarServer"]


class SidecarServer(ThreadedServer):
    """``create_app(cfg)`` served like ``rr-server proxy`` serves it (lifespan on, long keep-alive)."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        super().__init__(create_app(cfg), name="sidecar", lifespan="on", timeout_keep_alive=KEEP_ALIVE_S)
