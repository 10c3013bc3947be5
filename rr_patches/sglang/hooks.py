"""AROUND hooks on SGLang's TokenizerManager: force routing on for every request, rewrite answers to rr's format.

Each hook has HookRegistry's AROUND signature ``hook(original, self, *args, **kwargs)`` so the same
function is registered as a plugin hook (0.5.11+) and installed by :mod:`rr_patches.sglang.apply` (older).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from rr_client.core import settings
from rr_client.core.codec import CheckedRouting, expected_rows, routing_error_fields, routing_meta_fields
from rr_client.core.errors import (
    MalformedPayloadError,
    MissingRoutingError,
    RoutedExpertsError,
    SeamMismatchError,
    ShapeMismatchError,
)
from rr_patches.sglang.convert import checked_value
from rr_patches.sglang.openai import Collector, collector, requested_format, requested_indexer_format
from rr_patches.sglang.provenance import batch_provenance, with_digest
from rr_patches.sglang.routes import bind_tokenizer_manager
from rr_patches.sglang.state import RRState, rr_enabled, state_of
from rr_server.serving.capture_paths import ROUTED_EXPERTS, capture_refusal
from rr_server.serving.indexer_fields import asked_indexer, indexer_error_fields, indexer_fields
from rr_server.serving.provenance_fields import bind_provenance
from rr_server.serving.routing_metrics import count_sample
from rr_server.serving.routing_metrics import declare as declare_counters
from rr_server.serving.store import current_store, refs_made_under
from rr_server.serving.store.install import store_blocks

__all__ = ["around_handle_batch_output", "around_send", "around_init", "ALWAYS_ENV", "always_return_routing"]

logger = logging.getLogger("rr.sglang")
# Give routing to every answer, asked or not: for callers behind sglang-router 0.3.2, which drops the flag.
ALWAYS_ENV = "RR_SGLANG_ALWAYS_RETURN_ROUTED_EXPERTS"
_MAX_REMEMBERED = 65536


def always_return_routing() -> bool:
    """``RR_SGLANG_ALWAYS_RETURN_ROUTED_EXPERTS`` is on (:func:`rr_client.core.settings.flag`'s rule, as for vLLM's)."""
    return settings.flag(ALWAYS_ENV)


def around_init(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """After TokenizerManager.__init__: read dims, warn about multi-tokenizer mode, expose ``/rr/info``."""
    result = original(self, *args, **kwargs)
    if rr_enabled(self):
        state_of(self)
        if int(getattr(self.server_args, "tokenizer_worker_num", 1) or 1) > 1:
            logger.error(
                "rr: --tokenizer-worker-num > 1 runs TokenizerWorkers in spawned uvicorn processes that "
                "the rr patch does not reach; their answers are NOT in rr format. Use 1 worker."
            )
        bind_tokenizer_manager(self)
        declare_counters()  # rr's counters on SGLang's /metrics (--enable-metrics: PROMETHEUS_MULTIPROC_DIR is set)
    return result


def _tokenized_generate_objs(args: tuple[Any, ...]) -> list[Any]:
    """Every TokenizedGenerateReqInput among a _send_* call's arguments (single, list, or batch wrapper)."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput

    found: list[Any] = []
    for a in args:
        items = a if isinstance(a, (list, tuple)) else getattr(a, "batch", [a])
        found.extend(x for x in items if isinstance(x, TokenizedGenerateReqInput))
    return found


def around_send(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """Before a request reaches the scheduler: remember what its caller asked, then ask for routing anyway.

    Every request then carries routing, so the scheduler's per-batch list lines up with the batch
    again (the <= 0.5.12 mixed-batch bug) and answers can still carry routing when a router dropped the flag.
    Runs in the HTTP request's task: ``/generate``'s ``routed_experts_format`` and an OpenAI request's
    collector (:mod:`rr_patches.sglang.openai`) are read from context variables here.
    """
    if rr_enabled(self):
        st = state_of(self)
        always = always_return_routing()
        col, fmt = collector(), requested_format()
        for t in _tokenized_generate_objs(args + tuple(kwargs.values())):
            rid = str(t.rid)
            state = self.rid_to_state.get(rid)
            caller = getattr(state, "obj", None) or t
            start = int(getattr(caller, "routed_experts_start_len", 0) or 0)
            asked = bool(t.return_routed_experts) or always
            if col is not None:  # an OpenAI request that asked (serving code before 0.5.9/0.5.12 drops flag/start)
                col.sent(rid, t.input_ids)
                st.collectors[rid] = col
                asked, start = True, start or col.start
            st.asked[rid] = (asked, start, fmt)
            if asked_indexer(caller):
                st.indexer_format[rid] = requested_indexer_format()
            st.admitted[rid] = (st.epoch.mark(), _ids(t.input_ids))
            t.return_routed_experts = True
        if len(st.asked) > _MAX_REMEMBERED:  # requests that vanished without a final answer
            for rid in [r for r in st.asked if r not in self.rid_to_state]:
                st.asked.pop(rid, None)
                st.collectors.pop(rid, None)
                st.admitted.pop(rid, None)
                st.indexer_format.pop(rid, None)
    return original(self, *args, **kwargs)


def _ids(ids: Any) -> list[int] | None:
    """Token ids as ints (None when SGLang has none here, e.g. an embedding input)."""
    try:
        return [int(t) for t in ids] if ids is not None else None
    except (TypeError, ValueError):
        return None


class _RRList(list):  # type: ignore[type-arg]
    """``ReqState.out_list`` stand-in: rewrites routing in each appended answer before anyone can read it."""

    def __init__(
        self,
        items: Any,
        fields: dict[str, Any] | None,
        collect: tuple[Collector, str] | None = None,
        checked: CheckedRouting | None = None,
        provenance: tuple[dict[str, Any], list[int] | None, Any] | None = None,
        indexer: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(items)
        self.indexer = indexer  # the final answer's indexer top-k fields (None: not asked)
        self.rr_fields = fields  # None: strip routing (the caller did not ask)
        self.collect = collect  # an OpenAI request's collector and this answer's rid
        self.checked = checked  # the request's routing as it passed the check (None: refused or missing)
        self.provenance = provenance  # the final answer's (rr_provenance, prompt ids, ReqState)

    def over(self, items: list[Any]) -> _RRList:
        """The same rr fields over ``items``: SGLang's consumer took the list (``state.out_list = []``,
        ``_wait_one_response``) while the batch's indexer checks ran, and the answers still to come must get them."""
        return _RRList(items, self.rr_fields, self.collect, self.checked, self.provenance, self.indexer)

    def append(self, out: Any) -> None:
        """Apply the rr fields (or strip routing) and the final answer's provenance to ``out["meta_info"]``, then
        append."""
        meta = out.get("meta_info") if isinstance(out, dict) else None
        if isinstance(meta, dict):
            meta.pop("routed_experts", None)
            meta.pop("indexer_topk", None)  # SGLang's own, never rr's: rr's comes from ``indexer``
            if self.rr_fields is not None:
                meta.update(self.rr_fields)
            if self.indexer is not None:
                meta.update(self.indexer)
            if self.provenance is not None:
                prov, prompt, state = self.provenance
                outs = getattr(state, "output_ids", None) or out.get("output_ids")
                bind_provenance(meta, with_digest(prov, prompt, outs))  # a by-reference answer's refs carry it too
        if self.collect is not None and self.rr_fields is not None:
            self.collect[0].finished(self.collect[1], out, self.checked, self.rr_fields.get("routed_experts_error"))
        super().append(out)


def _answer_fields(
    st: RRState, value: Any, *, rows: int, start: int, fmt: str | None
) -> tuple[dict[str, Any], CheckedRouting | None]:
    """rr fields for one answer that asked, and its checked routing; an error marker (logged) when refused."""
    try:
        if st.info is None:
            raise ShapeMismatchError("the model config gives no routing dims (num_hidden_layers/experts/top-k)")
        if (refused := capture_refusal(st.info, ROUTED_EXPERTS)) is not None:  # e.g. a speculative draft tree
            raise refused
        checked = checked_value(value, st.info, rows=rows, start=start, slice_start=not st.profile.honours_start)
        return routing_meta_fields(checked, fmt or _server_format(), store=current_store()), checked
    except RoutedExpertsError as e:
        logger.error("rr: refusing routing payload: %s", e)
        return routing_error_fields(e), None


def _decode_unran(tm: Any, prompt_tokens: int, start: int) -> SeamMismatchError | None:
    """On a P/D decode server (SGLang's ``--disaggregation-mode decode``), rows asked for prompt tokens: it received
    their KV from the prefill server and never ran them, so SGLang's rows there are its capture buffer's leftovers
    (zeros on a fresh server, another request's routing after that). Refused; None elsewhere."""
    mode = getattr(getattr(tm, "disaggregation_mode", None), "value", None)
    if mode != "decode" or start >= prompt_tokens:
        return None
    return SeamMismatchError(
        f"this SGLang server is a P/D decode server: it received the KV of the {prompt_tokens} prompt tokens from "
        f"the prefill server and never ran them, so its rows for tokens {start}..{prompt_tokens} are not their "
        f"routing; ask it from routed_experts_start_len={prompt_tokens} and take the prompt's rows from the "
        "prefill server (rr_client.PDClient does both and joins them at the seam)"
    )


def _server_format() -> str:
    """The server's default ``routed_experts_format`` (env RR_ROUTED_EXPERTS_FORMAT); a bad value is refused."""
    from rr_server.serving.generate_protocol import BadRequest, default_routed_experts_format

    try:
        return default_routed_experts_format()
    except BadRequest as e:
        raise MalformedPayloadError(str(e)) from None


#: one request of the batch: its ReqState, the answer list rr put there, and what is still to run on that list
#: before SGLang appends the answer (its indexer check, its routing fields when the store writes to an object store;
#: None: nothing)
AnswerJob = tuple[Any, "_RRList", Callable[["_RRList"], None] | None]


def run_answer_jobs(jobs: list[AnswerJob]) -> None:
    """Run each pending request's deferred work on its answer list (in a worker thread from 0.5.11 on:
    :func:`around_handle_batch_output`)."""
    for _, out_list, work in jobs:
        if work is not None:
            work(out_list)


def _then(*steps: Callable[[_RRList], None] | None) -> Callable[[_RRList], None] | None:
    """The given steps, in order, as one job (None when there are none)."""
    todo = [s for s in steps if s is not None]
    if not todo:
        return None

    def run(out_list: _RRList) -> None:
        for step in todo:
            step(out_list)

    return run


def prepare_batch(tm: Any, recv_obj: Any) -> list[AnswerJob]:
    """Convert each request's routing in ``recv_obj`` and hook its ReqState so the answer gets rr's fields.

    SGLang's own code then sees no routing at all (the field is set to None), so it can neither
    leak a raw tensor (the ``{}`` bug) nor hand one request another's rows. The indexer rows' checks (the heavy
    part: ``index_topk`` positions per layer per token) are returned, to run before SGLang's handler appends the
    answers (:func:`run_answer_jobs`).
    """
    st = state_of(tm)
    field = st.profile.field
    values = getattr(recv_obj, field, None)
    rids = list(getattr(recv_obj, "rids", None) or [])
    jobs: list[AnswerJob] = []
    if not rids:
        return jobs
    values = list(values) if values else []
    idx_values = list(getattr(recv_obj, "indexer_topk", None) or [])
    misaligned = bool(values) and len(values) != len(rids)
    if misaligned:  # a request reached the scheduler without the forced flag: never guess who owns which rows
        logger.error("rr: %d routing entries for %d requests; refusing all of them", len(values), len(rids))
    for i, rid in enumerate(rids):
        state = tm.rid_to_state.get(rid)
        finished = recv_obj.finished_reasons[i] is not None
        if finished:
            caller = getattr(state, "obj", None)  # the caller's own GenerateReqInput for this rid
            asked, start, fmt = st.asked.pop(rid, (bool(getattr(caller, "return_routed_experts", False)), 0, None))
            start = int(getattr(caller, "routed_experts_start_len", 0) or 0) or start
            col = st.collectors.pop(rid, None)
            mark, prompt = st.admitted.pop(rid, (None, None))
        if state is None:
            continue
        fields: dict[str, Any] | None = None
        checked: CheckedRouting | None = None
        idx: dict[str, Any] | None = None
        idx_check: Callable[[_RRList], None] | None = None
        routing_job: Callable[[_RRList], None] | None = None
        if finished and asked_indexer(caller):
            # a P/D decode server never ran the prompt: its indexer rows there are leftovers, as its routing rows are
            ifmt = st.indexer_format.pop(rid, None)
            first = max(start, (st.info.index_topk if st.info is not None else None) or 0)  # its first row
            unran_idx = _decode_unran(tm, int(recv_obj.prompt_tokens[i]), first)
            if unran_idx is not None:
                idx = indexer_error_fields(unran_idx)
            else:
                idx_check = _indexer_check(
                    st,
                    idx_values[i] if len(idx_values) == len(rids) else None,
                    prompt_tokens=int(recv_obj.prompt_tokens[i]),
                    completion_tokens=int(recv_obj.completion_tokens[i]),
                    start=start,
                    fmt=ifmt,
                    version=mark.version if mark is not None else None,
                )
        if finished and asked:  # routing comes with the final chunk only
            if misaligned:
                fields = routing_error_fields(ShapeMismatchError("routing list does not line up with the batch"))
            elif (unran := _decode_unran(tm, int(recv_obj.prompt_tokens[i]), start)) is not None:
                fields = routing_error_fields(unran)
            else:
                rows = expected_rows(int(recv_obj.prompt_tokens[i]), int(recv_obj.completion_tokens[i]), start)
                value = values[i] if values else None
                if value is None and rows == 0 and st.info is not None:  # nothing to route (SGLang sends no entry)
                    value = np.zeros((0, st.info.num_hidden_layers, st.info.topk), dtype=np.int32)
                if value is None:
                    fields = routing_error_fields(
                        MissingRoutingError("the engine returned no routing for this request")
                    )
                elif store_blocks():  # an object write per ref: made in the batch's worker thread
                    routing_job = _routing_job(st, value, rows, start, fmt, mark, count=col is None)
                else:
                    with refs_made_under(mark.version if mark is not None else None):  # a ref: the weights it ran on
                        fields, checked = _answer_fields(st, value, rows=rows, start=start, fmt=fmt)
            if col is None and routing_job is None:  # an OpenAI request's choices are counted when rr finishes it
                count_sample(fields)
        prov = (batch_provenance(recv_obj, i, st.epoch, mark), prompt, state) if finished else None
        state.out_list = _RRList(
            state.out_list, fields, (col, rid) if finished and col is not None else None, checked, prov, idx
        )
        jobs.append((state, state.out_list, _then(routing_job, idx_check)))
    if values:
        setattr(recv_obj, field, None)
    if idx_values:
        recv_obj.indexer_topk = None  # SGLang's own payload never reaches an answer
    return jobs


def _indexer_check(
    st: RRState,
    value: Any,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    start: int,
    fmt: str | None,
    version: int | None,
) -> Callable[[], dict[str, Any]]:
    """One request's indexer check, to run later (:func:`run_answer_jobs`); a ref made there carries ``version``,
    the weights its request was admitted under."""

    def check(out_list: _RRList) -> None:
        with refs_made_under(version):
            out_list.indexer = indexer_fields(
                st.info, value, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, start=start, fmt=fmt
            )

    return check


def _routing_job(
    st: RRState, value: Any, rows: int, start: int, fmt: str | None, mark: Any, *, count: bool
) -> Callable[[_RRList], None]:
    """One request's routing fields, made later on its answer list (:func:`run_answer_jobs`): checked, kept in the
    store (a ref made under the weights its request was admitted at), counted as :func:`prepare_batch` would."""

    def make(out_list: _RRList) -> None:
        with refs_made_under(mark.version if mark is not None else None):
            out_list.rr_fields, out_list.checked = _answer_fields(st, value, rows=rows, start=start, fmt=fmt)
        if count:
            count_sample(out_list.rr_fields)

    return make


def around_handle_batch_output(original: Any, self: Any, recv_obj: Any, *args: Any, **kwargs: Any) -> Any:
    """Rewrite routing for the batch, then run SGLang's own handler (a coroutine from 0.5.11 on).

    From 0.5.11 on, the batch's indexer checks (and its routing fields when the store writes each ref to an object
    store) run in a worker thread before SGLang's handler appends the answers:
    SGLang's event loop, which streams every request, is never held by them (the handle loop awaits this batch)."""
    from sglang.srt.managers.io_struct import BatchStrOutput, BatchTokenIDOutput

    if not (rr_enabled(self) and isinstance(recv_obj, (BatchStrOutput, BatchTokenIDOutput))):
        return original(self, recv_obj, *args, **kwargs)
    jobs = prepare_batch(self, recv_obj)
    if not any(check for _, _, check in jobs) or not state_of(self).profile.handle_is_async:  # checks run here
        run_answer_jobs(jobs)
        return original(self, recv_obj, *args, **kwargs)

    async def checked_off_the_loop() -> Any:
        await asyncio.to_thread(run_answer_jobs, jobs)
        for state, out_list, _ in jobs:  # SGLang's consumer may have taken the list meanwhile: rr's fields stay on
            if state.out_list is not out_list:
                state.out_list = out_list.over(state.out_list)
        return await original(self, recv_obj, *args, **kwargs)

    return checked_off_the_loop()
