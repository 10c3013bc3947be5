"""What every engine's release facts have in common: one facts type per release, one object per engine.

:class:`ReleaseFacts` is what one release of vLLM or SGLang does with routing (the plugin, the patch, the launchers,
the sidecar and the doctor read it; none of them compares version numbers itself). :class:`EngineReleases` is one
engine's releases: the tested range (the gate and the launchers' help), the draft-pollution fix and its upstream
issue, the facts of any release. Release strings are parsed by :func:`rr_client.core.versions.parse_release`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rr_client.core.engines import Engine
from rr_client.core.errors import UnsupportedVersionError
from rr_client.core.versions import Tested, parse_release

__all__ = ["ReleaseFacts", "EngineReleases", "ReplayFlags", "TreeVerify", "engine_release"]


def engine_release(version: str) -> tuple[int, int, int]:
    """``"0.30.0+cpu"`` -> ``(0, 30, 0)``, ``"0.5.10.post1"`` -> ``(0, 5, 10)``: at least ``major.minor``, padded to
    three parts so the facts compare plain 3-tuples; ValueError if it is not a release."""
    try:
        rel = parse_release(version)
    except ValueError:
        rel = ()
    if len(rel) < 2:
        raise ValueError(f"cannot parse engine version {version!r}")
    major, minor, patch = (*rel, 0)[:3]
    return major, minor, patch


@dataclass(frozen=True)
class ReleaseFacts:
    """Per-release facts rr relies on, for either engine (docs/engines.md); a fact the engine lacks stays False."""

    engine: str  # "vllm" or "sglang"
    version: str
    release: tuple[int, int, int]
    tested: Tested  # the engine's tested releases (:attr:`supported` asks it)
    draft_pollutes_routing: bool = False  # speculative draft MoE layers write the target's rows (vLLM < 0.30, #48622;
    #                                       SGLang < 0.5.23, #26980)
    # vLLM
    endpoint_plugins: bool = False  # loads ``vllm.endpoint_plugins`` in the API server (0.30+); older: wraps build_app
    aux_output_connector: bool = False  # capture through the AuxOutput connector (0.31+): needs prefix caching + MRV2
    cpu_capture: bool = False  # the CPU build can capture routing (0.30 only: monolithic MoE before, triton-cpu after)
    eplb_physical_ids: bool = False  # captures physical expert ids after the EPLB remap (0.14-0.15)
    all_zero_routing: bool = False  # returns all-zero routing (0.15; fixed by PR #33013 in 0.16)
    nested_json_lists: bool = False  # sends nested JSON lists, ~40 MB per 30k-token sample (0.21)
    cpu_compile_zeros: bool = False  # on CPU, torch.compile returns all-zero routing with the right shape (0.14+)
    cpu_reload_unpacked_experts: bool = False  # CPU: reload_weights skips the MoE experts' prepack (0.30, found by rr)
    fused_moe_zero_routing: bool = False  # FlashInfer monolithic MoE kernels return all-zero routing (< 0.30)
    kv_connector_refused: bool = False  # refuses any KV connector (offload too) with routed experts at startup (0.30)
    # KV tiers outside the device cache (vLLM #27170, #42695, #57810; LMCache #4993). ``/reset_prefix_cache`` resets
    # the connector only with ``reset_external=true`` (every release: entrypoints/serve/dev/cache/api_router.py:24
    # ``reset_external: bool = Query(default=False)``; v1/core/sched/scheduler.py:2725 ``if reset_connector:``), and
    # Scheduler.reset_connector_cache counts a connector without its own ``reset_cache`` as success (scheduler.py:2743
    # ``if self.connector.reset_cache() is False``; the base class returns None, kv_connector/v1/base.py:760;
    # MultiConnector: ``c.reset_cache() is not False`` per child, multi_connector.py:704; lines of 0.30). The
    # connectors whose own ``reset_cache`` clears their tier and says so; any other (LMCache, a module path) is
    # unverifiable: its tier stays stale after a reset
    resettable_connectors: tuple[str, ...] = ()
    # ``/pause`` with ``clear_cache`` resets the connector too (0.23+: v1/engine/core.py ``_reset_caches``
    # ``reset_connector=True``, 0.30 core.py:822); 0.22 resets the device cache only
    pause_resets_connector: bool = False
    # the P/D KV connectors refused with routed experts at startup (0.31+: "PD auxiliary output is not supported")
    pd_connectors_refused: tuple[str, ...] = ()
    # ``--logprobs-mode processed_logprobs`` exists (0.10.1+, vLLM PR #21398): sampled log-probs after temperature
    # (and after top-k/top-p/min-p); the default ``raw_logprobs`` is before temperature
    processed_logprobs: bool = False
    # SGLang
    field: str = "routed_experts"  # BatchTokenIDOutput/BatchStrOutput attribute carrying routing
    handle_is_async: bool = False  # TokenizerManager._handle_batch_output is ``async def`` (0.5.11+)
    has_plugins: bool = False  # sglang.srt.plugins + HookRegistry exist (0.5.11+)
    honours_start: bool = False  # the scheduler slices rows from routed_experts_start_len (0.5.12+)
    has_start_field: bool = False  # GenerateReqInput.routed_experts_start_len exists (0.5.8+)
    mixed_batch_bug: bool = False  # scheduler list misaligned when only some requests ask (<= 0.5.12)
    detok_encodes: bool = False  # plugins load in the detokenizer, which base64-encodes routing (0.5.22+)
    tensor_lost_as_json: bool = False  # --skip-tokenizer-init JSON-encodes the raw tensor as {} (0.5.7-0.5.9)
    drops_last_prompt_row: bool = False  # max_new_tokens=0 loses the last prompt row (#20964, every release)
    hash_layers_uncaptured: bool = False  # HashTopK (DeepSeek-V4) layers never write the buffer: zero rows (0.5.23+)
    # speculative tree verification (NGRAM; EAGLE-family at topk > 1) moves the capture rows with the accepted
    # tokens' KV (False on 0.5.23, SGLang #37949); None: not read for this release, so refused, never assumed
    tree_verify_moves_rows: bool | None = None
    # the indexer top-k is captured as token positions only with SGLang's fused top-k off (0.5.23: the fused path
    # captures KV slots / ragged offsets); None: not read for this release, so indexer capture is refused
    indexer_positions_unfused_only: bool | None = None
    # the indexer payload has one layer slot per decoder layer of a DSA model, GLM-5's "shared" layers holding the
    # previous layer's pick (0.5.23+: configs/model_config.py get_num_indexer_layers returns num_hidden_layers;
    # models/deepseek_common/attention_forward_methods/forward_mla.py:392 mirrors prev_topk_indices into the slot)
    indexer_slot_per_layer: bool = False
    # a ``--disaggregation-mode prefill`` server gathers the prompt's rows when its KV transfer ends (0.5.22+,
    # disaggregation/prefill.py process_disagg_prefill_inflight_queue); before, it answers none ([] or no key)
    pd_prefill_rows: bool = False
    # DeepSeek-V4.1's SWA bounded replay (rr_server.launch.bounded_replay): the release has the switch (vLLM 0.31+,
    # SGLang 0.5.21+), and it is on unless turned off (vLLM 0.31+, SGLang 0.5.23+)
    bounded_replay: bool = False
    bounded_replay_default_on: bool = False
    # what a weight update that loaded the weights but could not flush the cache answers (0.5.23+: 400,
    # ``success=False`` and this message; the release's weight_updater.py flush_cache_after_weight_update); None:
    # the release's scheduler asserts the flush instead (older SGLang) or the engine has no such answer (vLLM)
    unflushed_update_answer: str | None = None
    # SGLang 0.5.23+: ``/begin_weight_update`` .. ``/end_weight_update`` opens and closes a weight-update session
    # (http_server.py); the end neither flushes the cache nor relabels the weights
    weight_update_session: bool = False

    @property
    def supported(self) -> bool:
        """Inside the engine's tested releases (the version gate's own decision)."""
        return self.tested.covers(self.version)

    @property
    def capture_setting(self) -> str:
        """Where vLLM's ``--enable-return-routed-experts`` lands in its config."""
        return (
            "vllm_config.aux_output_config" if self.aux_output_connector else "model_config"
        ) + ".enable_return_routed_experts"

    @property
    def ignores_start(self) -> bool:
        """SGLang: ``routed_experts_start_len`` is accepted but ignored (0.5.8-0.5.11): rr slices the rows itself."""
        return self.has_start_field and not self.honours_start


@dataclass(frozen=True)
class ReplayFlags:
    """One engine's DeepSeek-V4.1 SWA bounded-replay switch: the flag that turns it on, the one that turns it off,
    and where a running server reports it (which releases have it: :class:`ReleaseFacts`)."""

    on: str  # the (BooleanOptional) flag that turns the default-on side on
    off: str  # the flag that turns it off
    opt_in: tuple[str, ...] = ()  # other replay flags, off unless given (SGLang's encoder side)
    server_args: tuple[str, ...] = ()  # the server-args keys that report it (SGLang /get_server_info)
    metric_label: str | None = None  # the vllm:cache_config_info label that reports it (vLLM /metrics)
    # /rr/info ``platform`` values where the engine turns it off itself whatever it reports (vLLM: ROCm)
    off_on_platforms: tuple[str, ...] = ()


@dataclass(frozen=True)
class TreeVerify:
    """One engine's speculative tree verification (:attr:`ReleaseFacts.tree_verify_moves_rows`): the launch flags
    and server-args keys that choose it, and the upstream issue of the rows it leaves behind."""

    algorithm: tuple[str, str]  # the algorithm's launch flag and server-args key
    topk: tuple[str, str]  # the draft tree's top-k: launch flag and server-args key (> 1: a tree)
    always_tree: frozenset[str]  # algorithms whose every verification moves KV (upper case)
    issue: str


@dataclass(frozen=True)
class EngineReleases:
    """One engine's releases as rr knows them: asked by the launchers, the speculative refusal and the doctor."""

    wire: Engine  # the engine's wire object (:mod:`rr_client.core.engines`)
    tested: Tested  # the releases rr was tested on
    draft_fix_release: str  # the first release whose speculative draft leaves the target's routing alone
    draft_issue: str  # the upstream issue of that bug
    error: type[UnsupportedVersionError]  # what an untested or unparsable release raises
    facts_for: Callable[[str], ReleaseFacts]  # the facts of any parsable release (supported or not)
    installed_version: Callable[[], str | None]  # the installed release, without importing the engine when it can
    bounded_replay_flags: ReplayFlags | None = field(default=None)  # DeepSeek-V4.1's SWA bounded-replay switch
    tree_verify: TreeVerify | None = None  # speculative tree verification that moves KV (SGLang's)
    # every text by which one of its releases says a failed weight update loaded the weights anyway
    # (:attr:`ReleaseFacts.unflushed_update_answer`): rr's weight epoch counts such an answer as an update
    loaded_unflushed_answers: tuple[str, ...] = ()
    # the route and body fields that prefill a prompt whole: prompt log-probs, computed at every prompt position and
    # never read from the prefix cache (the doctor's full-prefill reference; vLLM ``prompt_logprobs`` on
    # /v1/completions, SGLang ``/generate`` ``logprob_start_len`` 0)
    full_prefill_route: str = ""
    full_prefill_fields: tuple[tuple[str, Any], ...] = ()
    model_info_routes: tuple[str, ...] = ()  # routes answering the served model's ``model_type`` (SGLang's)
    # the sidecar joins a prefill server's and a decode server's halves of each sample (``--prefill-upstream``):
    # SGLang's P/D, whose decode server takes the prefill server's bootstrap address in the request
    supports_pd_pair: bool = False
    # its launch line, for the launchers' pre-flight (rr_server/launch/options.py): the package, how to install it,
    # the files (globs in the package) its server's argument parser is built from, whether that parser takes
    # ``--max_model_len`` for ``--max-model-len``, and its default listening port and host
    package: str = ""
    install_hint: str = ""
    flag_sources: tuple[str, ...] = ()
    underscore_flags: bool = False
    default_port: int = 0
    default_host: str = ""

    @property
    def name(self) -> str:
        """``vllm`` or ``sglang``: the wire object's name."""
        return self.wire.name

    @property
    def help_range(self) -> str:
        """The tested releases as the launchers' help states them (``0.22 - 0.33``)."""
        return f"{self.tested.lo} - {self.tested.hi or self.tested.lo}"

    def parse(self, version: str) -> tuple[int, int, int]:
        """The release tuple of ``version``; an unparsable string is this engine's unsupported-version error."""
        try:
            return engine_release(version)
        except ValueError:
            raise self.error(
                f"cannot parse {self.wire.label} version {version!r}",
                package=self.name,
                version=str(version),
                tested=str(self.tested),
            ) from None
