"""The verl releases this integration was tested on, and the refusal of any other (through :mod:`rr_client.core.versions`).

The version is read from the package metadata, never by importing verl's modules: :func:`install` runs inside
``import verl`` (verl's plugin loader) and must stay cheap there.
"""

from __future__ import annotations

from rr_client.core.versions import Tested, check_version, installed_version

__all__ = ["TESTED_VERL", "WHY", "REPLAY_MODES", "installed_verl_version", "check_verl_version"]

TESTED_VERL = Tested("0.9.1")
#: verl's ``router_replay.mode`` values that ask for replay (its FSDP and Megatron engines alike); "disabled" is off
REPLAY_MODES = ("R2", "R3")
WHY = (
    "rr subclasses verl's FSDPEngineWithLMHead and wraps ActorRolloutRefWorker.__init__, "
    "ToolAgentLoop._handle_generating_state and SGLangHttpServer.generate, which change between releases"
)


def installed_verl_version() -> str | None:
    """verl's version from its distribution metadata; else the ``__version__`` of a (partly) imported verl (a
    source checkout without metadata: verl sets it before it loads plugins); None when neither is there."""
    return installed_version(("verl",), module="verl")


def check_verl_version(version: str | None = None) -> str:
    """Return ``version`` (default: the installed verl's) when rr was tested on it, else raise
    :class:`rr_client.core.errors.UnsupportedVersionError` naming the tested release and ``RR_ALLOW_UNSUPPORTED_VERSION``."""
    found = version if version is not None else installed_verl_version()
    return check_version("verl", TESTED_VERL, found, why=WHY)
