"""verl's ``verl.plugins`` entry point (registered for every install of rr-replay; verl loads it on ``import verl``).

Cheap and harmless where rr's replay is not used: it imports rr's small core and the version gate (no torch, no
verl module), and :func:`rr_client.integrations.verl.install` only hooks the four verl modules rr patches, each
acting only with ``router_replay`` R2/R3 on fsdp2, and the legacy FSDP worker's module (verl 0.5-0.7), refused
there with replay asked. verl before 0.9 loads no entry point: ``VERL_USE_EXTERNAL_MODULES=`` this module. It never raises out of verl's import: verl would swallow the
error at debug level, so a failure is logged here as an error (router_replay on FSDP will then not run).
"""

from __future__ import annotations

import logging


def _load() -> None:
    """Install rr's verl patches; log, never raise."""
    try:
        from rr_client.integrations.verl import install

        install()
    except Exception:  # noqa: BLE001 - never out of verl's import
        logging.getLogger("rr_client.integrations.verl").error(
            "rr: installing the verl patches failed; verl runs unpatched (router_replay R2/R3 on FSDP will not replay)",
            exc_info=True,
        )


_load()
