"""The megatron-core releases this integration was tested on, and the refusal of any other (one version gate).

The version is read from the distribution metadata, never by importing megatron (its import takes 10-60 s).
"""

from __future__ import annotations

from rr_client.core.errors import MissingDependencyError
from rr_client.core.versions import Tested, check_version, installed_version

__all__ = ["TESTED_MEGATRON", "WHY", "check_megatron_version"]

TESTED_MEGATRON = Tested("0.16")
WHY = (
    "rr feeds megatron.core.transformer.moe.router_replay.RouterReplay per TopKRouter and reads "
    "TopKRouter.layer_number and TransformerConfig's MoE settings, which change between releases"
)


def check_megatron_version(version: str | None = None) -> str:
    """The megatron-core version (default: the installed one), or :class:`rr_client.core.errors.UnsupportedVersionError`
    outside :data:`TESTED_MEGATRON` (one override: ``RR_ALLOW_UNSUPPORTED_VERSION=1``);
    :class:`rr_client.core.errors.MissingDependencyError` naming the extra when none is installed."""
    found = version if version is not None else installed_version(("megatron-core", "megatron_core"))
    if found is None:
        raise MissingDependencyError(
            "rr_client.integrations.megatron needs megatron-core: pip install 'rr-replay[megatron]'"
        )
    return check_version("megatron-core", TESTED_MEGATRON, found, why=WHY)
