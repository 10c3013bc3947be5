"""The verl releases this integration was tested on, and the refusal of any other."""

from __future__ import annotations

from rr_client import settings

TESTED_VERL = ("0.9.1",)


def check_verl_version(version: str | None = None) -> None:
    """Refuse a verl release this integration was not tested on (names the tested ones and the override)."""
    if version is None:
        import verl

        version = str(verl.__version__)
    if version in TESTED_VERL or settings.flag("RR_ALLOW_UNSUPPORTED_VERSION"):
        return
    raise ImportError(f"rr_client.integrations.verl was tested with verl {', '.join(TESTED_VERL)}; this is verl "
                      f"{version}. It subclasses FSDPEngineWithLMHead and wraps worker internals that change between "
                      "releases: pin verl==0.9.1, set router_replay.mode=disabled, or set "
                      "RR_ALLOW_UNSUPPORTED_VERSION=1 at your own risk")
