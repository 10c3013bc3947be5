"""vLLM endpoint plugin (``vllm.endpoint_plugins``, vLLM 0.30+): rr's ``/generate``, ``/rr/generate``, ``/rr/info``.

vLLM 0.30 added an official hook for extra HTTP routes: the ``vllm.endpoint_plugins`` entry-point group.
``build_app`` calls :meth:`RREndpointPlugin.attach_router` after every core router (and before vLLM adds
its middleware); ``init_app_state`` then awaits :meth:`RREndpointPlugin.init_state`. vLLM loads this group
only when ``VLLM_PLUGINS`` is set and names the plugin; rr's general plugin and this one are both called
``rr``, so ``VLLM_PLUGINS=rr`` allows both. Like the general plugin, it does nothing unless ``RR_ENABLE=1``.

On versions with this group the general plugin does not wrap ``build_app`` (see
:mod:`rr_patches.vllm.plugin`); the handlers are the same (:mod:`rr_patches.vllm.routes`), and the routes
stay behind vLLM's ``--api-key`` (:func:`rr_patches.vllm.auth.protect_rr_routes`, checked in ``init_state``,
once vLLM's middleware is on the app).
"""

from __future__ import annotations

import logging
from typing import Any

from rr_client.core import settings
from rr_client.core.errors import ConfigurationError

__all__ = ["RREndpointPlugin", "make_plugin", "ENDPOINT_GROUP"]

logger = logging.getLogger("rr.vllm")
ENDPOINT_GROUP = "vllm.endpoint_plugins"


class RREndpointPlugin:
    """vLLM ``EndpointPlugin``: attaches rr's routes to the OpenAI API server's app."""

    name = "rr"
    required_tasks: tuple[str, ...] | None = ("generate",)

    def __init__(self) -> None:
        self._app: Any = None

    @staticmethod
    def enabled() -> bool:
        """rr is switched on (``RR_ENABLE=1``, set by ``rr-server launch vllm``)."""
        return settings.flag("RR_ENABLE")

    def attach_router(self, app: Any) -> None:
        """Add ``/generate`` and ``/rr/info`` (once); refuse to shadow routes vLLM already serves."""
        if not self.enabled():
            logger.info("rr: endpoint plugin loaded but RR_ENABLE!=1: no routes added")
            return
        if getattr(app.state, "rr_routes_installed", False):
            return
        from rr_patches.vllm.auth import _extend_vllm_prefixes
        from rr_patches.vllm.plugin import check_vllm_version
        from rr_patches.vllm.routes import RR_ROUTES, add_rr_routes

        version = check_vllm_version(allow_unsupported=settings.flag("RR_ALLOW_UNSUPPORTED_VERSION"))
        _extend_vllm_prefixes()  # vLLM's AuthenticationMiddleware reads GUARDED_PREFIX per request
        add_rr_routes(app)  # the one route table (/generate, /rr/generate, /rr/info); refuses to shadow vLLM's
        app.state.rr_routes_installed = True
        app.state.rr_routes_via = ENDPOINT_GROUP
        self._app = app
        logger.info("rr: vLLM %s: added %s via %s", version, ", ".join(p for p, _, _ in RR_ROUTES), ENDPOINT_GROUP)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Put the routes behind vLLM's API keys (its middleware is on the app by now); refuse otherwise."""
        if self._app is None:
            return
        if engine_client is None:
            raise ConfigurationError("rr: the endpoint plugin needs an engine (not a render-only server)")
        from rr_patches.vllm.auth import protect_rr_routes
        from rr_patches.vllm.routes import name_store

        name_store(args)
        how = protect_rr_routes(self._app, args)
        state.rr_auth = how
        logger.info("rr: /generate and /rr/info auth: %s", how)


def make_plugin() -> RREndpointPlugin:
    """Zero-argument factory named by the ``vllm.endpoint_plugins`` entry point."""
    return RREndpointPlugin()
