"""TRL itself, imported once through rr's optional-dependency check, and the TRL releases this integration was
tested on (it overrides ``GRPOTrainer`` methods that move between releases)."""

from __future__ import annotations

from rr_client.core.optional import require
from rr_client.core.versions import Tested, check_version

__all__ = ["TESTED_TRL", "check_trl_version", "trl"]

trl = require("trl", for_what="rr_client.integrations.trl")
TESTED_TRL = Tested("1.16")


def check_trl_version(version: str | None = None) -> str:
    """The TRL version, or :class:`rr_client.UnsupportedVersionError` outside :data:`TESTED_TRL` (one override:
    ``RR_ALLOW_UNSUPPORTED_VERSION=1``)."""
    return check_version(
        "trl",
        TESTED_TRL,
        version if version is not None else str(trl.__version__),
        why="rr overrides GRPOTrainer internals that change between releases",
    )
