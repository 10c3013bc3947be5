"""verl's ``verl.plugins`` entry point: importing this module installs rr's verl patches (verl loads it on import).

verl swallows a failing plugin at debug level, so a failure here is logged as an error before it is re-raised.
"""

from __future__ import annotations

import logging

try:
    from rr_client.integrations.verl import install

    install()
except Exception:  # pragma: no cover - logged for the user, then verl's loader sees it too
    logging.getLogger("rr_client.integrations.verl").exception("rr: installing the verl patches failed; "
                                                               "router_replay on FSDP will not run")
    raise
