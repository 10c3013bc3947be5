"""Helpers shared by the test folders (imported as ``tests.support.<module>``).

- :mod:`~tests.support.threaded_server` — the one helper that runs an ASGI app under uvicorn in a
  thread on a free loopback port (the test-only servers, the fakes and the sidecar all use it).
- :mod:`~tests.support.vllm_process` — real vLLM CPU API servers as subprocesses, their command built
  by the launcher's own ``rr_server.launch.vllm.build_command``; ports, health and shutdown from
  ``rr_server.launch.process``.
- :mod:`~tests.support.protocol_server` — ``ProtocolTestServer``, a TEST-ONLY rr protocol server.
- :mod:`~tests.support.fake_upstreams` — FAKE SGLang / vLLM upstreams for the sidecar's fault corpus.
- :mod:`~tests.support.proxy_harness` — the real sidecar app in a thread (``SidecarServer``).
- :mod:`~tests.support.bad_requests` — the one corpus of malformed ``/generate`` requests.
- :mod:`~tests.support.routing_data` — synthetic routing arrays for unit tests.
"""
