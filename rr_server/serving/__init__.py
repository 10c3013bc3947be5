"""What every rr server speaks, shared by the engine adapters (``rr_patches``) and the sidecar (``rr_server.proxy``).

The ``/generate`` schema and replies, the OpenAI routing, ASGI helpers, fan-out, auth, ``RR_*`` settings and each
engine's version facts. Imports only :mod:`rr_client` and itself: never the adapters, the sidecar or the commands.
"""
