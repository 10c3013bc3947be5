"""Which SGLang releases rr knows, and what each one does with routing: the one place for SGLang's version facts.

The patch, the launcher, the sidecar and the doctor read these facts (:data:`RELEASES`); none of them compares
versions itself.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping

from rr_client.core import versions
from rr_client.core.engines import SGLANG
from rr_client.core.errors import UnsupportedVersionError
from rr_client.core.logprobs import PROCESSED, RAW
from rr_client.core.versions import Tested, check_version
from rr_server.serving.engines.base import EngineReleases, ReleaseFacts, ReplayFlags, TreeVerify, engine_release

__all__ = [
    "MIN_VERSION",
    "MAX_VERSION",
    "TESTED",
    "DRAFT_FIX_RELEASE",
    "UNFLUSHED_UPDATE_ANSWER",
    "UnsupportedSGLangError",
    "RELEASES",
    "installed_version",
    "profile_for",
    "facts_for",
    "ORIGINAL_LOGPROB_ENV",
    "logprobs_mode",
    "indexer_slots",
    "FUSE_TOPK_ENV",
    "fuse_topk",
]

# The SGLang releases rr's patch was tested on, each bound compared at patch precision.
TESTED = Tested("0.5.7", "0.5.23")
MIN_VERSION = engine_release(TESTED.lo)
MAX_VERSION = engine_release(TESTED.hi or TESTED.lo)
# The first release with SGLang's draft opt-out (``disable_routed_experts_capture_for_draft``, sglang#26980).
DRAFT_FIX_RELEASE = "0.5.23"
# What 0.5.23's scheduler answers when an update loaded the weights but its cache flush was refused (requests still
# running or queued): ``success=False`` with this message, which http_server.py turns into HTTP 400
# (srt/managers/scheduler_components/weight_updater.py:129, flush_cache_after_weight_update; http_server.py:1317).
UNFLUSHED_UPDATE_ANSWER = "Weights were updated, but the cache was not flushed"


class UnsupportedSGLangError(UnsupportedVersionError):
    """The installed SGLang is outside the tested range, or its code no longer has the shape rr wraps."""


def installed_version() -> str:
    """Version of the installed ``sglang`` (distribution metadata, else an imported ``sglang.__version__``);
    PackageNotFoundError when there is none."""
    version = versions.installed_version(("sglang",), module="sglang")
    if version is None:
        raise importlib.metadata.PackageNotFoundError("sglang")
    return version


def facts_for(version: str) -> ReleaseFacts:
    """The facts of any parsable SGLang ``version`` (supported or not: the doctor reports bugs of both)."""
    rel = RELEASES.parse(version)
    return ReleaseFacts(
        engine=SGLANG.name,
        version=version,
        release=rel,
        tested=TESTED,
        field="output_routed_experts" if rel < (0, 5, 8) else "routed_experts",
        handle_is_async=rel >= (0, 5, 11),
        has_plugins=rel >= (0, 5, 11),
        honours_start=rel >= (0, 5, 12),
        has_start_field=rel >= (0, 5, 8),
        mixed_batch_bug=rel <= (0, 5, 12),
        detok_encodes=rel >= (0, 5, 22),
        tensor_lost_as_json=rel <= (0, 5, 9),
        drops_last_prompt_row=rel >= (0, 5, 7),
        draft_pollutes_routing=rel < (0, 5, 23),
        hash_layers_uncaptured=rel >= (0, 5, 23),
        # 0.5.23 (sgl-project/sglang#37949): capture rows live per KV slot (state_capturer/base.py:117
        # TopkCaptureOutput.finalize ``host_cache.buffer[out_cache_loc] = topk``; :173 get_topk reads them through
        # req_to_token); verification moves only the KV (speculative/spec_utils.py:859
        # move_accept_tokens_to_target_kvcache -> :908 ``get_kvcache().move_kv_cache``), on every NGRAM verify
        # (ngram_worker.py:510, whose GenerationBatchResult at :567 also drops routed_experts_output and
        # indexer_topk_output) and on EAGLE-family verifies at topk > 1 (eagle_worker_common.py:772 ->
        # _finalize_accept_tree_path :492). Other releases were not read: None, refused
        tree_verify_moves_rows=False if rel == (0, 5, 23) else None,
        # 0.5.23: environ.py:1978 ``SGLANG_DSA_FUSE_TOPK = EnvBool(True)``; layers/attention/dsa/dsa_topk_backend.py
        # :109 takes the unfused top-k (:272 _topk_unfused: token positions) only with it off, else :204
        # fast_topk_transform_fused (page_size=1 KV slots) / :218 the ragged transform (offsets into the fp8 cache);
        # dsa_indexer.py:2247 captures whichever came out (state_capturer/indexer_topk.py:65)
        indexer_positions_unfused_only=True if rel == (0, 5, 23) else None,
        indexer_slot_per_layer=rel >= (0, 5, 23),  # the first release that returns the indexer top-k at all
        pd_prefill_rows=rel >= (0, 5, 22),
        bounded_replay=rel >= (0, 5, 21),  # opt-in in 0.5.21-0.5.22; the decoder side on for DeepSeek-V4.1 after
        bounded_replay_default_on=rel >= (0, 5, 23),
        # 0.5.23 answers 400 with this message; 0.5.7-0.5.22 assert the flush in the scheduler instead
        unflushed_update_answer=UNFLUSHED_UPDATE_ANSWER if rel >= (0, 5, 23) else None,
        weight_update_session=rel >= (0, 5, 23),  # http_server.py:1458 /begin_weight_update, :1473 /end_weight_update
    )


def profile_for(version: str | None = None) -> ReleaseFacts:
    """The facts of ``version`` (default: installed); raises UnsupportedSGLangError outside :data:`TESTED`.

    The range decision is :func:`rr_client.core.versions.check_version`'s; SGLang's patch has no override (it never
    honoured ``RR_ALLOW_UNSUPPORTED_VERSION``): an untested SGLang is served through the rr sidecar instead.
    """
    version = installed_version() if version is None else version
    profile = facts_for(version)
    try:
        check_version("sglang", TESTED, version, allow_unsupported=False)
    except UnsupportedVersionError as e:
        raise UnsupportedSGLangError(
            f"rr's SGLang patch was tested with SGLang {TESTED}; found {version}. Refusing to patch code "
            "it was not tested against (pin a tested SGLang, or use the rr sidecar in front of it).",
            package=e.package,
            version=e.version,
            tested=e.tested,
        ) from None
    return profile


# SGLang's switch to pre-temperature sampled log-probs (its sampler, every release 0.5.7 - 0.5.23)
ORIGINAL_LOGPROB_ENV = str(SGLANG.original_logprob_env)


def logprobs_mode(env: Mapping[str, str] | None = None) -> str:
    """What SGLang's sampled log-probs mean (0.5.7 - 0.5.23): after temperature (``log`` of the temperature-scaled
    softmax, before top-k/top-p/min-p), or before it when ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is true (read as
    SGLang's ``get_bool_env_var`` reads it)."""
    value = (os.environ if env is None else env).get(ORIGINAL_LOGPROB_ENV, "false")
    return RAW if str(value).lower() in ("true", "1") else PROCESSED


# SGLang's switch of the DSA indexer's fused top-k + page-table transform (0.5.23: srt/environ.py:1978, on by default)
FUSE_TOPK_ENV = "SGLANG_DSA_FUSE_TOPK"


def fuse_topk(env: Mapping[str, str] | None = None) -> bool:
    """Whether SGLang's fused indexer top-k is on, read as its ``EnvBool`` reads ``SGLANG_DSA_FUSE_TOPK`` (0.5.23
    environ.py:143; unset: on); a value SGLang cannot parse is ValueError, as SGLang raises."""
    value = (os.environ if env is None else env).get(FUSE_TOPK_ENV)
    if value is None:
        return True
    if value.lower() in ("true", "1", "yes", "y"):
        return True
    if value.lower() in ("false", "0", "no", "n"):
        return False
    raise ValueError(f"{FUSE_TOPK_ENV}={value!r} is not a boolean SGLang reads (1/0, true/false, yes/no, y/n)")


def indexer_slots(version: str, num_hidden_layers: int) -> int:
    """Layer slots in each row of SGLang ``version``'s indexer payload for a DSA model of ``num_hidden_layers``
    decoder layers (:attr:`ReleaseFacts.indexer_slot_per_layer`: one per decoder layer); a release whose layout rr
    does not know (unparsable, or before 0.5.23) is refused, never assumed (:class:`UnsupportedSGLangError`)."""
    try:
        known = facts_for(version).indexer_slot_per_layer
    except ValueError:
        known = False
    if not known:
        raise UnsupportedSGLangError(
            f"SGLang {version}: rr does not know how this release lays out the indexer top-k's layers (known from "
            "0.5.23: one slot per decoder layer, configs/model_config.py get_num_indexer_layers); serve the model on "
            "SGLang 0.5.23+",
            package="sglang",
            version=version,
            tested=str(TESTED),
        )
    return num_hidden_layers


RELEASES = EngineReleases(
    wire=SGLANG,
    tested=TESTED,
    draft_fix_release=DRAFT_FIX_RELEASE,
    draft_issue="sgl-project/sglang#26980",
    error=UnsupportedSGLangError,
    facts_for=facts_for,
    installed_version=installed_version,
    loaded_unflushed_answers=(UNFLUSHED_UPDATE_ANSWER,),
    tree_verify=TreeVerify(  # speculative_hook.py / spec_info.py SpeculativeAlgorithm; arg_groups/fields/spec.py
        algorithm=("--speculative-algorithm", "speculative_algorithm"),
        topk=("--speculative-eagle-topk", "speculative_eagle_topk"),
        always_tree=frozenset({"NGRAM"}),
        issue="sgl-project/sglang#37949",
    ),
    bounded_replay_flags=ReplayFlags(
        on="--enable-decoder-swa-bounded-replay",
        off="--no-enable-decoder-swa-bounded-replay",
        opt_in=("--enable-encoder-swa-bounded-replay",),
        server_args=("enable_decoder_swa_bounded_replay", "enable_encoder_swa_bounded_replay"),
    ),
    # GenerateReqInput.logprob_start_len (managers/io_struct.py): 0 returns every prompt position's log-prob
    full_prefill_route="/generate",
    full_prefill_fields=(("return_logprob", True), ("logprob_start_len", 0)),
    model_info_routes=("/model_info", "/get_model_info"),  # entrypoints/http_server.py (0.5.23: both)
    supports_pd_pair=True,  # --disaggregation-mode prefill/decode, joined through bootstrap_host/bootstrap_room
    package="sglang",
    install_hint="pip install 'rr-replay[sglang]' (or scripts/setup_sglang.sh 0.5.23 for a .venvs/ env)",
    flag_sources=("srt/server_args.py", "srt/arg_groups/**/*.py"),  # ServerArgs.add_cli_args (0.5.23: arg_groups)
    default_port=30000,
    default_host="127.0.0.1",  # ServerArgs.host
)
