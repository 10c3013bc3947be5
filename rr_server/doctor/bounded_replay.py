"""The doctor's ``bounded replay`` check (issue 44): DeepSeek-V4.1's SWA bounded replay, on by default in vLLM 0.31+
and SGLang 0.5.23+, serves prompts that are not a full prefill (:mod:`rr_server.launch.bounded_replay`).

What the server says: vLLM ``/metrics`` ``vllm:cache_config_info`` label ``swa_bounded_replay``; SGLang
``/get_server_info`` ``enable_decoder_swa_bounded_replay`` / ``enable_encoder_swa_bounded_replay`` (null: SGLang
resolved nothing, the model is not DeepSeek-V4.1). Whether the model is DeepSeek-V4.1: ``--model-path``'s
``config.json``, the served model's own when ``/rr/info`` ``model`` is a readable folder (or in the local Hugging Face
cache), SGLang's ``/model_info``. Where bounded replay may act, a probe compares the prompt rows of a 300-token prompt
served as usual (cold, then a prefix hit) with a full prefill of it: a request for prompt log-probs, which both
engines prefill whole and never read from the prefix cache (vLLM ``prompt_logprobs`` on ``/v1/completions``, SGLang
``/generate`` ``logprob_start_len`` 0).

Graded as the checks are: FAIL when it is on for DeepSeek-V4.1 (the log-probs are not a full prefill's whatever the
rows show) or when the rows differ from the full prefill; ok when it is off and the rows agree; not probed (n/a) when
the model has none, or the server does not say and the model is not known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from rr_client import GenerateResult, RoutedExpertsClient, RRError, RRInfo
from rr_client.client import parse_sample
from rr_client.core.engines import Engine
from rr_server.doctor.engine_state import _get, parse_metrics
from rr_server.doctor.probes import DoctorRun
from rr_server.doctor.samples import PREFIX_CACHE_TOKENS, ROW_AGREEMENT_MIN, _agreement, _prompt_rows, _prompts
from rr_server.launch.bounded_replay import (
    REPLAY_FLAGS,
    is_bounded_replay_model,
    model_config_of,
    off_advice,
    replay_in_argv,
)
from rr_server.serving.engines import releases
from rr_server.serving.engines.base import ReplayFlags
from rr_server.serving.openai_routing import OPENAI_PATHS

__all__ = ["ReplayState", "replay_state", "check_bounded_replay", "CHECK_NAME"]

CHECK_NAME = "bounded replay"
_SEED = 44  # the probe's prompt, distinct from every other check's


class ReplayRun(DoctorRun, Protocol):
    """A doctor run with its client (the full-prefill reference goes through ``/v1/completions`` on vLLM)."""

    client: RoutedExpertsClient
    params: dict[str, Any]  # the run's sampling params (greedy)


@dataclass(frozen=True)
class ReplayState:
    """Bounded replay on a server: on/off as the server says (None: not said) and whether its model has it."""

    on: bool | None
    source: str  # where ``on`` came from, or why it is not known
    model: bool | None = None  # the served model is DeepSeek-V4.1 (None: not known)
    model_source: str = ""  # where ``model`` came from


async def _said_by_metrics(
    http: httpx.AsyncClient, info: RRInfo, wire: Engine, flags: ReplayFlags, label: str
) -> tuple[bool | None, str]:
    """``label`` of the engine's cache-config metric (vLLM: ``swa_bounded_replay`` of ``vllm:cache_config_info``,
    where every CacheConfig field is a label)."""
    resp = await _get(http, "/metrics")
    for name, labels, _ in parse_metrics(resp.text) if resp is not None else []:
        if name != wire.cache_metric:
            continue
        value = labels.get(label)
        if value is None:
            return False, f"/metrics {name} has no {label} (a {wire.label} without SWA bounded replay)"
        on = value.lower() == "true"
        said = f"/metrics {name} {label}={value}"
        platform = (info.model_extra or {}).get("platform")
        if on and platform in flags.off_on_platforms:
            return False, f"{said}, but {wire.label} turns it off on {platform} itself"
        return on, said
    return None, f"the server does not say (no /metrics {wire.cache_metric})"


async def _said_by_server_args(http: httpx.AsyncClient, wire: Engine, flags: ReplayFlags) -> tuple[bool | None, str]:
    """The engine's server args, decoder and encoder sides (SGLang; null decoder: resolved for no model, not
    DeepSeek-V4.1)."""
    decoder, encoder = flags.server_args
    for path in wire.server_args_routes:
        resp = await _get(http, path)
        try:
            args = resp.json() if resp is not None else None
        except ValueError:
            args = None
        if not isinstance(args, dict):
            continue
        if decoder not in args and encoder not in args:
            return False, f"{path} has no {decoder} (a {wire.label} without SWA bounded replay)"
        dec, enc = args.get(decoder), args.get(encoder)
        on = [f"{k}={v}" for k, v in ((decoder, dec), (encoder, enc)) if v is True]
        if on:
            return True, f"{path} " + ", ".join(on)
        why = f" ({wire.label} resolves it for DeepSeek-V4.1 only)" if dec is None else ""
        return False, f"{path} {decoder}={dec}{why}, {encoder}={enc}"
    return None, f"the server does not say (no {wire.server_args_routes[0]})"


async def _model(http: httpx.AsyncClient, info: RRInfo, model_path: str | None) -> tuple[bool | None, str]:
    """Whether the served model is DeepSeek-V4.1, and from where (None: nothing to tell it from)."""
    for what, model in (("--model-path", model_path), ("/rr/info model", info.model)):
        cfg = model_config_of(model) if model else None
        if cfg is not None:
            return is_bounded_replay_model(cfg), f"{what} {model} config.json model_type {cfg.get('model_type')!r}"
    for path in releases(info.engine).model_info_routes:
        resp = await _get(http, path)
        try:
            body = resp.json() if resp is not None else None
        except ValueError:
            body = None
        if isinstance(body, dict) and (body.get("model_type") or body.get("architectures")):
            return is_bounded_replay_model(body), f"{path} model_type {body.get('model_type')!r}"
    return None, "the served model's config is not readable here (pass --model-path)"


async def replay_state(http: httpx.AsyncClient, info: RRInfo, model_path: str | None) -> ReplayState:
    """Bounded replay as the server reports it (a metric label or its server args, whichever the engine has); the
    model is looked up only where it can matter (not off)."""
    wire, flags = releases(info.engine).wire, REPLAY_FLAGS[info.engine]
    if flags.metric_label is not None:
        on, source = await _said_by_metrics(http, info, wire, flags, flags.metric_label)
    else:
        on, source = await _said_by_server_args(http, wire, flags)
    if on is None and replay_in_argv(info.engine, info.engine_version, []):
        source += f"; on by default in {info.engine} {info.engine_version}"
    if on is False:
        return ReplayState(on, source)
    model, model_source = await _model(http, info, model_path)
    return ReplayState(on, source, model, model_source)


async def _full_prefill(run: ReplayRun, http: httpx.AsyncClient, prompt: list[int]) -> GenerateResult:
    """``prompt`` prefilled whole (prompt log-probs asked: every prompt row computed, the prefix cache not read),
    through the route the engine takes them on (:attr:`EngineReleases.full_prefill_route`)."""
    params = {**run.params, "max_new_tokens": 1}
    rel = releases(run.info.engine)
    route, fields = rel.full_prefill_route, dict(rel.full_prefill_fields)
    if route in OPENAI_PATHS:
        batch = await run.client.complete(prompt, params, extra_body=fields)
        return batch.results[0]
    body = {"input_ids": [prompt], "sampling_params": params, **dict(rel.wire.ask_fields), **fields}
    try:
        resp = await http.post(route, json=body)
    except httpx.HTTPError as e:
        raise _NoReference(f"{route}: {type(e).__name__}: {e}") from None
    if resp.status_code >= 400:
        raise _NoReference(f"{route} answered {resp.status_code}: {resp.text[:200]}")
    reply = resp.json()
    item = reply[0] if isinstance(reply, list) and reply else reply
    return parse_sample(item, index=0, prompt_index=0, prompt_ids=prompt, info=run.info, want_routing=True)


class _NoReference(Exception):
    """The server would not prefill a prompt whole (why, in words)."""


async def _rows_vs_full(run: ReplayRun, http: httpx.AsyncClient) -> tuple[float, str] | str:
    """(worst agreement, what was compared) of a prompt served as usual (cold, then a prefix hit) with its full
    prefill; or why the rows were not compared."""
    prompt = _prompts(1, run.vocab, seed=_SEED, length=PREFIX_CACHE_TOKENS)[0]
    (cold,) = await run.gen([prompt], {"max_new_tokens": 1})
    try:
        full = await _full_prefill(run, http, prompt)
    except (_NoReference, RRError, ValueError) as e:
        return f"the server refused a full prefill (prompt log-probs): {type(e).__name__}: {e}"
    (hit,) = await run.gen([prompt], {"max_new_tokens": 1})
    ref = _prompt_rows(full)
    cold_share = _agreement(_prompt_rows(cold), ref, run.info.moe_layers)
    hit_share = _agreement(_prompt_rows(hit), ref, run.info.moe_layers)
    cached = hit.meta.get("cached_tokens")
    return min(cold_share, hit_share), (
        f"prompt rows of a {len(prompt)}-token prompt vs its full prefill (prompt log-probs): cold "
        f"{100 * cold_share:.2f}%, prefix hit ({cached} cached tokens) {100 * hit_share:.2f}% of (token, MoE layer) "
        "sets equal"
    )


async def check_bounded_replay(run: ReplayRun, http: httpx.AsyncClient, model_path: str | None) -> None:
    """The ``bounded replay`` check on ``run``'s report (see the module's doc for the grading)."""
    engine = run.info.engine
    if engine not in REPLAY_FLAGS:
        run.add(CHECK_NAME, True, f"not probed: rr knows bounded replay on {sorted(REPLAY_FLAGS)} only", False)
        return
    state = await replay_state(http, run.info, model_path)
    way_out = off_advice(engine)
    if state.on is False:
        run.add(CHECK_NAME, True, f"not probed: off ({state.source})", False)
        return
    if state.model is False:
        run.add(
            CHECK_NAME,
            True,
            f"not probed: the served model is not DeepSeek-V4.1 ({state.model_source}); bounded replay acts on "
            f"DeepSeek-V4.1 only ({state.source})",
            False,
        )
        return
    if state.on is None and state.model is None:
        run.add(
            CHECK_NAME,
            True,
            f"not probed: {state.source}, and {state.model_source}; if it serves DeepSeek-V4.1 with SWA bounded "
            f"replay, {way_out}",
            False,
        )
        return
    rows = await _rows_vs_full(run, http)
    compared = rows[1] if isinstance(rows, tuple) else f"rows not compared: {rows}"
    differ = isinstance(rows, tuple) and rows[0] < ROW_AGREEMENT_MIN
    if state.on and state.model:
        run.add(
            CHECK_NAME,
            False,
            f"DeepSeek-V4.1 with SWA bounded replay on ({state.source}; {state.model_source}): a prefix hit "
            "recomputes only the last window and the late layers prefill only each request's trailing window, so "
            "the log-probs differ from a trainer's full prefill and prompt rows those layers never ran are "
            f"unverified; {compared}. To train on its rollouts, {way_out}",
        )
    elif differ:
        run.add(
            CHECK_NAME,
            False,
            f"{compared} - prompt rows served as usual are not a full prefill's (bounded replay: {state.source}; "
            f"model: {state.model_source}). {way_out[0].upper() + way_out[1:]}",
        )
    elif isinstance(rows, tuple):
        unsure = (
            "; bounded replay is on: if the model is DeepSeek-V4.1"
            if state.on
            else "; the server does not say whether bounded replay is on: if it is"
        ) + f", the log-probs still differ from a full prefill ({way_out})"
        run.add(CHECK_NAME, True, f"{compared} (bounded replay: {state.source}; model: {state.model_source}){unsure}")
    else:
        run.add(
            CHECK_NAME,
            True,
            f"not probed: {compared} (bounded replay: {state.source}; model: {state.model_source}); if it is on "
            f"for DeepSeek-V4.1, {way_out}",
            False,
        )
