"""One object per engine rr serves: what a client and the wire need to know about vLLM or SGLang.

Its name (:data:`EngineName`, the one engine-name type), how its OpenAI endpoints carry routing (rr's fields in the
engine's own names, where its answers put routing and token ids), and its routes for reloading weights from disk
and dropping the KV cache. Callers ask the object (``engine(name).reload_route``), never compare names: a third engine
is one more :class:`Engine` here, its release facts in ``rr_server/serving/engines/`` and its adapter. The server
side's per-release facts live in :mod:`rr_server.serving.engines`. Torch- and httpx-free (core).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from rr_client.core.errors import ConfigurationError

__all__ = [
    "EngineName",
    "ENGINE_NAMES",
    "Engine",
    "VLLM",
    "SGLANG",
    "ENGINES",
    "engine",
    "offload_name",
    "ABSENT",
    "CHOICE_ROUTING_EXTS",
    "ANSWER_ROUTING_EXTS",
    "OUTPUT_ID_KEYS",
    "pop_ext_routing",
    "int_ids",
]

EngineName = Literal["vllm", "sglang"]
"""The engines rr serves, by the name ``/rr/info`` ``engine``, the launchers and the sidecar use."""
ENGINE_NAMES: tuple[EngineName, ...] = get_args(EngineName)

# what pop_ext_routing returns when there was no routing field (a payload may itself be None)
ABSENT = object()


def int_ids(value: Any) -> list[int] | None:
    """A token-id list from an answer, or None when absent or not a list of ints."""
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def pop_ext_routing(container: dict[str, Any], key: str) -> Any:
    """Remove and return ``container[key]["routed_experts"]`` (SGLang's ``sglext``/``sgl_ext``), dropping the
    extension object when nothing else is left in it, as SGLang leaves it out then; ``ABSENT`` if absent."""
    ext = container.get(key)
    if not isinstance(ext, dict) or "routed_experts" not in ext:
        return ABSENT
    payload = ext.pop("routed_experts")
    if not any(v is not None for v in ext.values()):
        del container[key]
    return payload


@dataclass(frozen=True, slots=True)
class Engine:
    """How one engine differs for rr on the wire: its OpenAI field names, where it puts routing, its weight routes."""

    name: EngineName
    label: str  # how messages spell it ("vLLM", "SGLang")
    native_format: str  # the ``routed_experts_format`` that is its own payload (vLLM: base64 .npy; SGLang: int32)
    # OpenAI endpoints
    start_keys: tuple[str, ...]  # request fields that set the first routed row (rr's name first)
    stream_refusal: str  # why a stream cannot carry routing without rr's engine-side collector
    choice_routing_ext: str | None  # per-choice extension object holding routing (SGLang: sgl_ext), else a field
    answer_routing_ext: str | None  # response-level extension holding the FIRST choice's routing (SGLang: sglext)
    output_id_keys: tuple[str, ...]  # where a choice carries its output token ids
    rows_from_payload: bool  # an answer without token ids may be counted by its payload (rr's patch counted them)
    start_field: str  # the engine's own name for the first routed row
    ask_fields: tuple[tuple[str, Any], ...]  # what the engine's body needs to return routing at all
    sidecar_slices_start: bool  # the sidecar asks for every row and drops ``start`` itself (SGLang < 0.5.12 drops it)
    sidecar_forces_routing: bool  # the sidecar asks for routing on every request (SGLang's mixed-batch bug)
    # weights from disk
    reload_route: str  # the route that reloads weights from a folder
    reload_field: str  # how its JSON body names the folder
    cache_reset_route: str  # the route that drops the KV cache computed with the old weights
    reload_rpc: str | None  # the body wraps the folder in a ``collective_rpc`` call of this method (vLLM)
    reload_reply_says_success: bool  # a 200 reply may still say ``{"success": false, "message": ...}`` (SGLang)
    dev_mode_routes: tuple[str, ...]  # routes served only with VLLM_SERVER_DEV_MODE=1 (vLLM's)
    # how its launch line names the model: the flags (its own spelling first), and whether a bare first argument is
    # the model (``vllm serve <model>``)
    model_flags: tuple[str, ...]
    positional_model: bool
    # the engine's own weight checker (per-tensor checksums, POST ``{"action": "checksum"}``): vLLM 0.32+ (dev mode),
    # SGLang 0.5.12+; 404 (or SGLang's "Unsupported action") on the releases without it
    weight_checker_route: str
    # its answer: per rank, ``{"ranks": [{"checksums", "parallelism_info"}]}`` (SGLang); else one map whose keys carry
    # the ranks (vLLM); and the releases that answer 404 for it, as messages name them (None: not named)
    weight_checker_per_rank: bool
    weight_checker_absent_in: str | None
    # freezing generation with requests kept (the doctor holds a burst until all of it is in the engine): the route
    # and its query, and the route that lets it go; None where the engine has no such pause
    hold_route: tuple[str, tuple[tuple[str, str], ...]] | None
    release_route: str | None
    weight_routes: tuple[str, ...]  # every route of a weight update (and what a weight sync calls around it)
    # the sidecar
    native_generate: bool  # serves rr's ``/generate`` wire itself (SGLang's own); else the sidecar translates it
    # log-probs
    logprobs_setting: str | None  # the engine argument that picks its log-prob mode (vLLM's ``logprobs_mode``)
    logprobs_default: str | None  # that argument's default
    original_logprob_env: str | None  # the variable that makes it return pre-temperature log-probs (SGLang's)
    # what it says about its KV cache, and its tier below the device cache
    cache_metric: str | None  # the Prometheus ``/metrics`` series whose labels are its cache config (vLLM's)
    # the request field that puts a request in its own prefix-cache namespace (the source audit's bypass): vLLM's
    # ``cache_salt``; SGLang's ``extra_key`` (its radix-tree key on every release rr supports; ``cache_salt`` 0.5.19+)
    cache_namespace_field: str
    server_args_routes: tuple[str, ...]  # routes answering its server arguments, cache settings included (SGLang's)
    kv_offload_connector: bool  # offloads KV through a KV connector (vLLM's KV offloading)
    hierarchical_cache: bool  # offloads KV through a hierarchical host/storage cache (SGLang's HiCache)
    offload_name: str  # the doctor's word for that tier
    # hash-routed MoE layers (DeepSeek-V4's token-id table) write routing rows: vLLM 0.33 captures every router's ids,
    # hash tables included; SGLang 0.5.23's ``HashTopK`` never writes the capture buffer (sglang#29040)
    captures_hash_layers: bool
    # the first release whose prefill/decode pair rr joins (``PDClient``, the sidecar's ``--prefill-upstream``): its
    # prefill server answers the prompt's rows from then on; None where the engine has no such pair for rr
    pd_pair_since: str | None = None

    def __str__(self) -> str:
        return self.name

    def engine_fields(self, start: int) -> dict[str, Any]:
        """rr's routing request, first routed row ``start``, in this engine's own names (added to the body it gets)."""
        return {**dict(self.ask_fields), self.start_field: start}

    def pop_choice_payload(self, choice: dict[str, Any]) -> Any:
        """Remove and return the engine's own routing field of one choice (None when absent)."""
        payload: Any = ABSENT
        if self.choice_routing_ext is not None:
            payload = pop_ext_routing(choice, self.choice_routing_ext)
        if payload is ABSENT or payload is None:
            payload = choice.pop("routed_experts", None)
        return payload

    def pop_answer_payload(self, answer: dict[str, Any]) -> Any:
        """Remove and return the response-level routing (the first choice's), None when the engine has none."""
        if self.answer_routing_ext is None:
            return None
        payload = pop_ext_routing(answer, self.answer_routing_ext)
        return None if payload is ABSENT else payload

    def output_ids(self, choice: Mapping[str, Any]) -> list[int] | None:
        """A choice's output token ids, from the first key that has them."""
        for key in self.output_id_keys:
            ids = int_ids(choice.get(key))
            if ids is not None:
                return ids
        return None

    def reload_body(self, folder: str) -> dict[str, Any]:
        """The JSON body of :attr:`reload_route` that loads the weights in ``folder``."""
        if self.reload_rpc is not None:
            return {"method": self.reload_rpc, "kwargs": {self.reload_field: folder}}
        return {self.reload_field: folder}


VLLM = Engine(
    name="vllm",
    label="vLLM",
    native_format="npy",
    start_keys=("routed_experts_start",),
    stream_refusal="vLLM's streaming chunks carry no routing; rr's vLLM plugin serves streams",
    choice_routing_ext=None,
    answer_routing_ext=None,
    output_id_keys=("token_ids",),
    rows_from_payload=False,
    start_field="routed_experts_prompt_start",
    ask_fields=(),
    sidecar_slices_start=False,
    sidecar_forces_routing=False,
    reload_route="/collective_rpc",
    reload_field="weights_path",
    cache_reset_route="/reset_prefix_cache",
    reload_rpc="reload_weights",
    reload_reply_says_success=False,
    dev_mode_routes=("/collective_rpc", "/reset_prefix_cache", "/pause", "/resume"),
    weight_checker_route="/weight_checker",
    weight_checker_per_rank=False,
    weight_checker_absent_in="vLLM 0.31 and older",
    model_flags=("--model",),
    positional_model=True,
    hold_route=("/pause", (("mode", "keep"),)),  # vLLM 0.30+: new adds wait in the scheduler until /resume
    release_route="/resume",
    weight_routes=(
        "/collective_rpc",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/weight_checker",  # what a weight sync reads after a push (dev mode, 0.32+)
    ),
    native_generate=False,
    logprobs_setting="logprobs_mode",
    logprobs_default="raw_logprobs",
    original_logprob_env=None,
    cache_metric="vllm:cache_config_info",
    cache_namespace_field="cache_salt",
    server_args_routes=(),
    kv_offload_connector=True,
    hierarchical_cache=False,
    offload_name="kv offload",
    captures_hash_layers=True,
)
SGLANG = Engine(
    name="sglang",
    label="SGLang",
    native_format="sglang",
    start_keys=("routed_experts_start", "routed_experts_start_len"),
    stream_refusal="SGLang's streams carry the first request's routing only; rr's SGLang patch serves streams",
    choice_routing_ext="sgl_ext",
    answer_routing_ext="sglext",
    output_id_keys=("token_ids", "response_token_ids"),
    rows_from_payload=True,  # 0.5.23 chat: response_token_ids
    start_field="routed_experts_start_len",
    ask_fields=(("return_routed_experts", True),),
    sidecar_slices_start=True,
    sidecar_forces_routing=True,
    reload_route="/update_weights_from_disk",
    reload_field="model_path",
    cache_reset_route="/flush_cache",
    reload_rpc=None,
    reload_reply_says_success=True,
    dev_mode_routes=(),
    weight_checker_route="/weights_checker",
    weight_checker_per_rank=True,
    weight_checker_absent_in=None,
    model_flags=("--model-path", "--model"),
    positional_model=False,
    hold_route=None,
    release_route=None,
    weight_routes=(
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/update_weights_from_ipc",
        "/update_weight_version",
        "/begin_weight_update",  # 0.5.23: a weight-update session (P2P/RDMA loads) .. its end
        "/end_weight_update",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/flush_cache",
        "/weights_checker",  # what a weight sync reads after a push (0.5.12+)
    ),
    native_generate=True,
    logprobs_setting=None,
    logprobs_default=None,
    original_logprob_env="SGLANG_RETURN_ORIGINAL_LOGPROB",
    cache_metric=None,
    cache_namespace_field="extra_key",
    server_args_routes=("/get_server_info", "/server_info"),
    kv_offload_connector=False,
    hierarchical_cache=True,
    offload_name="hierarchical cache",
    captures_hash_layers=False,
    pd_pair_since="0.5.22",  # disaggregation/prefill.py gathers the prompt's rows from 0.5.22 on
)

ENGINES: Mapping[str, Engine] = {e.name: e for e in (VLLM, SGLANG)}
# where any engine's answer may hold routing besides ``routed_experts``: per choice (SGLang's ``sgl_ext``) and for
# the whole answer (SGLang's ``sglext``, the first choice's)
CHOICE_ROUTING_EXTS: tuple[str, ...] = tuple(e.choice_routing_ext for e in ENGINES.values() if e.choice_routing_ext)
ANSWER_ROUTING_EXTS: tuple[str, ...] = tuple(e.answer_routing_ext for e in ENGINES.values() if e.answer_routing_ext)
# where any engine's OpenAI choice may carry its output token ids, in the order they are looked for
OUTPUT_ID_KEYS: tuple[str, ...] = tuple(dict.fromkeys(k for e in ENGINES.values() for k in e.output_id_keys))


def engine(name: str | Engine) -> Engine:
    """The engine called ``name`` (an :class:`Engine` is returned as it is); ConfigurationError naming the unknown
    engine and the known ones otherwise."""
    if isinstance(name, Engine):
        return name
    try:
        return ENGINES[name]
    except (KeyError, TypeError):
        raise ConfigurationError(f"unknown engine {name!r}: expected one of {sorted(ENGINES)}") from None


def offload_name(name: str) -> str:
    """The doctor's word for the KV tier below the device cache of the engine called ``name`` (``kv offload`` for an
    engine rr does not know)."""
    return ENGINES[name].offload_name if name in ENGINES else VLLM.offload_name
