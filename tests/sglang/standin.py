"""Stand-in for SGLang's GPU scheduler: real io_struct batches whose routing comes from a CPU transformers forward.

The real scheduler cannot run without a GPU. This object takes its place on both ends of the
TokenizerManager: it is the ``send_to_scheduler`` socket (so it receives the real tokenized
requests, after SGLang's own wire encoding) and it emits ``BatchTokenIDOutput`` objects. Routing rows
are transformers' router top-k for the tokens the engine ran a forward on (prompt + completion - 1),
from :func:`rr_server.demo.tiny_moe.reference_routing` (stands in for the GPU capturer's ``get_topk``).
It also answers the control query ``/get_server_info`` makes (every scheduler's internal state), so
SGLang's own app can serve that route to the rr sidecar, and, given ``weights``
(:class:`tests.sglang.standin_weights.StandInWeights`), the weight routes' requests.

Which parts are SGLang's code and which are stood in for:

* SGLang's code: ``TokenizedGenerateReqInput`` as the real TokenizerManager sends it (pickle or 0.5.23's
  msgpack wire), the ``BatchTokenIDOutput`` class, and (with ``sglang_builds_output = True``, see
  :func:`sglang_stream_output`) the scheduler's own stream-output function that fills the batch,
  including the per-request routing list: ``SchedulerOutputProcessorMixin.stream_output_generation``
  (<= 0.5.12, lists routing only for requests that asked: the mixed-batch bug) or
  ``SchedulerOutputStreamer._stream_output_generation`` (0.5.13+, aligned with ``None``, PR #26423).
  Everything downstream (DetokenizerManager, TokenizerManager, ``/generate``) is SGLang's.
* Stood in for: the request objects that function reads (``_SchedReq``, not ``schedule_batch.Req``: a
  real ``Req`` needs the scheduler's memory pools), the scheduler ``self`` (``_SchedulerState``: one
  rank, no speculation, no PD, no stats; 0.5.23's ``get_serving``/``get_parallel`` runtime context),
  the socket it sends on (captured instead), the GPU forward and capturer (transformers top-k), and
  sampling (:func:`completion_for`). SGLang's function is used only for a step that finishes fresh
  requests in one go; streaming chunks and the default path (``sglang_builds_output = False``, used by
  the older tests) are built by :meth:`StandInScheduler.step`, which mirrors each version's list
  (asker-only <= 0.5.12, aligned 0.5.13+) and is checked against SGLang's function by
  ``tests/sglang/test_scheduler_output.py``.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rr_server.demo.tiny_moe import reference_routing
from tests.sglang.deepseek_v4 import capture_buffer_rows, is_deepseek_v4
from tests.sglang.deepseek_v32 import forward_rows, is_deepseek_v32

_SURR = 5  # INIT_INCREMENTAL_DETOKENIZATION_OFFSET in SGLang


@dataclass
class StandInReq:
    """One request as the stand-in scheduler sees it."""

    tok: Any
    prompt: list[int]
    completion: list[int]
    sent: int = 0  # completion tokens already sent
    sent_decode: int = 0  # decode ids already sent (incremental detokenization)
    done: bool = False
    rows: np.ndarray | None = field(default=None, repr=False)

    @property
    def rid(self) -> str:
        """The request id the TokenizerManager tracks."""
        return str(self.tok.rid)

    @property
    def asked(self) -> bool:
        """return_routed_experts as it reached the scheduler."""
        return bool(self.tok.return_routed_experts)

    @property
    def asked_indexer(self) -> bool:
        """return_indexer_topk as it reached the scheduler (0.5.23+)."""
        return bool(getattr(self.tok, "return_indexer_topk", False))

    @property
    def start(self) -> int:
        """routed_experts_start_len as it reached the scheduler (0 before 0.5.8)."""
        return int(getattr(self.tok, "routed_experts_start_len", 0) or 0)


def completion_for(prompt: list[int], n: int) -> list[int]:
    """Deterministic 'sampled' tokens (ids 10..299, never a special token)."""
    return [10 + (7 * (len(prompt) + j) + 3 * sum(prompt)) % 290 for j in range(n)]


_LOGPROBS: dict[tuple[str, tuple[int, ...]], list[float]] = {}


def completion_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    """Each completion token's log-prob under the checkpoint (temperature 1): the sampler's report the stand-in gives
    with ``sampling_logprobs``. From a transformers forward of every token but the last, the forward the capturers'
    rows come from too (one more key column can break a DSA indexer's ties among zero scores otherwise)."""
    ids = tuple(prompt + completion)
    key = (str(model_dir), ids)
    if key not in _LOGPROBS:
        from tests.support.tiny_checkpoints import load_eager

        with torch.no_grad():
            logits = load_eager(model_dir)(input_ids=torch.tensor([list(ids[:-1])])).logits[0].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        _LOGPROBS[key] = lp[len(prompt) - 1 :].tolist()
    return _LOGPROBS[key]


def _fields_of(cls: type) -> list[str]:
    """Constructor field names of an io_struct class (dataclass or msgspec.Struct)."""
    dc = getattr(cls, "__dataclass_fields__", None)
    return list(dc) if dc else list(getattr(cls, "__struct_fields__", ()))


class StandInScheduler:
    """Receives tokenized requests like a zmq socket; answers with real BatchTokenIDOutput batches."""

    def __init__(self, model_dir: Path, release: tuple[int, int, int], field_name: str) -> None:
        self.model_dir = model_dir
        self.release = release
        self.field = field_name
        self.reqs: dict[str, StandInReq] = {}
        self.arrivals: list[str] = []
        self.reply: Callable[[Any], None] | None = None  # hands a control reply to the TokenizerManager
        # True: a step that finishes fresh requests is built by SGLang's own scheduler code
        # (:func:`sglang_stream_output`), not by :meth:`step`'s rebuild
        self.sglang_builds_output = False
        self.zero_rows: Any = None  # index into the rows to zero (rows, or (rows, layers)), simulating a lost capture
        # per request, what the scheduler reports of it in the batch besides tokens and routing (cached_tokens,
        # cached_tokens_details, retraction_counts, weight_versions): as a real scheduler fills them
        self.reports: Callable[[StandInReq], dict[str, Any]] | None = None
        # answers the weight routes' requests (0.5.23: tests.sglang.standin_weights.StandInWeights), when set
        self.weights: Any = None
        # prefill/decode disaggregation (tests/sglang/test_pd.py), as SGLang 0.5.23's scheduler answers in each role:
        # "prefill" samples the first token and finishes (FINISH_LENGTH(length=0), disaggregation/prefill.py:1220)
        # with every prompt row (batch_result_processor.py:136-179); "decode" generates every token (the first is
        # the prefill server's) and its rows for the prompt, which it never ran, are its capture buffer's at those
        # KV slots (state_capturer/base.py:75, 173-188): zeros on a fresh server. None: no P/D.
        self.pd_role: str | None = None
        # True: a request asking return_logprob gets its completion tokens' log-probs from a transformers forward
        # (temperature 1, what the GPU's sampler would report); False: SGLang's empty lists, as before
        self.sampling_logprobs = False
        self.indexer_edit: Callable[[np.ndarray], None] | None = None  # a test's change to the indexer rows
        # a test's engine fault in a request's rows (tokens [0, P+R-1), before the start cut): what a GPU path gets
        # wrong (tests/sglang/test_source_audit.py)
        self.row_edit: Callable[[StandInReq, np.ndarray], None] | None = None
        self.indexer_row_edit: Callable[[StandInReq, np.ndarray], None] | None = None  # the same for indexer picks

    # ---- the zmq socket the TokenizerManager sends to
    def send_pyobj(self, obj: Any, flags: int = 0, protocol: int = pickle.HIGHEST_PROTOCOL) -> None:
        """What ``send_to_scheduler.send_pyobj`` receives; round-trips through pickle like zmq does."""
        self._receive(pickle.loads(pickle.dumps(obj, protocol=protocol)))

    def send(self, data: bytes, flags: int = 0, **_: Any) -> None:
        """0.5.23's msgpack wire: decode with SGLang's own decoder."""
        from sglang.srt.managers.io_struct import msgpack_decode

        self._receive(msgpack_decode(data))

    def _receive(self, obj: Any) -> None:
        """Queue every TokenizedGenerateReqInput in ``obj`` (single or batched); answer control queries."""
        from sglang.srt.managers.io_struct import GetInternalStateReq, TokenizedGenerateReqInput

        if isinstance(obj, GetInternalStateReq):
            self._answer_internal_state()
            return
        out = self.weights.answer(obj) if self.weights is not None else None
        if out is not None:  # a weight route's request: SGLang's scheduler-side code answered it
            assert self.reply is not None, "the harness did not connect the stand-in's replies"
            asyncio.get_running_loop().call_soon(self.reply, out)
            return
        from sglang.srt.managers import io_struct

        if isinstance(obj, getattr(io_struct, "UpdateWeightVersionReqInput", ())):  # 0.5.19+ asks the scheduler
            assert self.reply is not None, "the harness did not connect the stand-in's replies"
            asyncio.get_running_loop().call_soon(self.reply, io_struct.UpdateWeightVersionReqOutput())
            return
        for t in getattr(obj, "batch", None) or [obj]:
            if isinstance(t, TokenizedGenerateReqInput):
                unwrap = getattr(t, "unwrap_pickle_fields", None)
                if callable(unwrap):
                    unwrap()
                prompt = [int(x) for x in t.input_ids]
                n = int(getattr(t.sampling_params, "max_new_tokens", None) or 4)
                completion = completion_for(prompt, n)
                if self.pd_role == "prefill":
                    completion = completion[:1]  # the first token; the decode server generates from it
                self.reqs[str(t.rid)] = StandInReq(t, prompt, completion)
                self.arrivals.append(str(t.rid))

    def _answer_internal_state(self) -> None:
        """``/get_server_info`` asks every scheduler for its internal state; answer once the caller awaits it."""
        from sglang.srt.managers.io_struct import GetInternalStateReqOutput

        assert self.reply is not None, "the harness did not connect the stand-in's replies"
        out = GetInternalStateReqOutput(internal_state={"stand_in_scheduler": True, "max_req_input_len": 1024})
        asyncio.get_running_loop().call_soon(self.reply, out)

    # ---- the GPU forward it stands in for
    def routing_rows(self, req: StandInReq) -> torch.Tensor:
        """Rows the capturer returns at finish: tokens [0, P+R-1) (from start on, 0.5.12+), int32."""
        ids = req.prompt + req.completion
        if is_deepseek_v4(self.model_dir):  # HashTopK layers never write the buffer: their rows stay zero
            rows = capture_buffer_rows(self.model_dir, ids[:-1]).astype(np.int32)
        elif is_deepseek_v32(self.model_dir):
            rows = forward_rows(self.model_dir, ids[:-1])[0].astype(np.int32)
        else:
            rows = reference_routing(self.model_dir, ids[:-1]).astype(np.int32)
        if self.zero_rows is not None:  # a captured row lost (what the full check must refuse)
            rows[self.zero_rows] = 0
        if self.row_edit is not None:
            self.row_edit(req, rows)
        if self.pd_role == "decode":  # the prompt ran on the prefill server: this buffer never saw those tokens
            rows[: len(req.prompt)] = 0
        if self.release >= (0, 5, 12):
            rows = rows[req.start :]
        req.rows = rows
        return torch.from_numpy(np.ascontiguousarray(rows))

    def indexer_rows(self, req: StandInReq) -> torch.Tensor:
        """The indexer capturer's rows at finish (0.5.23 ``_maybe_collect_indexer_topk``): tokens [0, P+R-1), int32,
        from token 0 whatever ``routed_experts_start_len`` says; ``indexer_edit`` (a test's) changes them."""
        rows = forward_rows(self.model_dir, (req.prompt + req.completion)[:-1])[1]
        if self.indexer_edit is not None:
            self.indexer_edit(rows)
        if self.indexer_row_edit is not None:
            self.indexer_row_edit(req, rows)
        return torch.from_numpy(np.ascontiguousarray(rows))

    def step(self, rids: list[str], *, tokens: int | None = None) -> Any:
        """One scheduler output for ``rids``: ``tokens`` more completion tokens each (default: all, finishing)."""
        from sglang.srt.managers.io_struct import BatchTokenIDOutput

        if self.sglang_builds_output and tokens is None and not any(self.reqs[r].sent for r in rids):
            return sglang_stream_output(self, rids)
        per: dict[str, list[Any]] = {
            k: []
            for k in (
                "rids",
                "finished_reasons",
                "decoded_texts",
                "decode_ids",
                "read_offsets",
                "output_ids",
                "prompt_tokens",
                "completion_tokens",
            )
        }
        routing: list[Any] = []
        indexer: list[Any] = []
        lp_val: list[list[float]] = []
        lp_idx: list[list[int]] = []
        any_routing = False
        for rid in rids:
            r = self.reqs[rid]
            upto = len(r.completion) if tokens is None else min(len(r.completion), r.sent + tokens)
            delta = r.completion[r.sent : upto]
            if self.sampling_logprobs and getattr(r.tok, "return_logprob", False):
                lp_val.append(completion_logprobs(self.model_dir, r.prompt, r.completion)[r.sent : upto])
            else:
                lp_val.append([])
            lp_idx.append(list(delta) if lp_val[-1] else [])
            r.sent = upto
            r.done = upto == len(r.completion)
            surr = max(len(r.prompt) - _SURR, 0)
            decode_all = r.prompt[surr:] + r.completion[:upto]
            per["rids"].append(rid)
            finish = {"type": "length", "length": 0 if self.pd_role == "prefill" else len(r.completion)}
            per["finished_reasons"].append(finish if r.done else None)
            per["decoded_texts"].append("")
            per["decode_ids"].append(decode_all[r.sent_decode :])
            r.sent_decode = len(decode_all)
            per["read_offsets"].append(len(r.prompt) - surr)
            per["output_ids"].append(delta)
            per["prompt_tokens"].append(len(r.prompt))
            per["completion_tokens"].append(upto)
            indexer.append(self.indexer_rows(r) if r.done and r.asked_indexer else None)
            value = self.routing_rows(r) if r.done and r.asked else None
            if r.asked:
                any_routing = True
                routing.append(value)
            elif self.release >= (0, 5, 13):
                routing.append(None)  # fixed scheduler (PR #26423): aligned, None for non-askers
            # <= 0.5.12: non-askers get no entry at all (the mixed-batch bug)
        n = len(rids)
        values: dict[str, Any] = {
            **per,
            self.field: routing if any_routing else None,
            "indexer_topk": indexer if any(v is not None for v in indexer) else None,
            **({"output_token_logprobs_val": lp_val, "output_token_logprobs_idx": lp_idx} if any(lp_val) else {}),
            "skip_special_tokens": [True] * n,
            "spaces_between_special_tokens": [True] * n,
            "no_stop_trim": [False] * n,
            "reasoning_tokens": [0] * n,
            "cached_tokens": [0] * n,
            "retraction_counts": [0] * n,
            "http_worker_ipcs": [None] * n,
            "cached_tokens_details": None,
            "weight_versions": None,
            "spec_verify_ct": [0] * n,
            "spec_accepted_tokens": [0] * n,
            "spec_num_correct_drafts": [0] * n,
            "spec_acceptance_histogram": [[] for _ in range(n)],
            "spec_correct_drafts_histogram": [[] for _ in range(n)],
        }
        if self.reports is not None:
            for j, rid in enumerate(rids):
                for name, v in self.reports(self.reqs[rid]).items():
                    if values.get(name) is None:
                        values[name] = [None] * n
                    values[name][j] = v
        kwargs: dict[str, Any] = {}
        for name in _fields_of(BatchTokenIDOutput):
            if name in values:
                kwargs[name] = values[name]
            elif name.endswith(("_val", "_idx")) and "logprobs" in name:
                kwargs[name] = [[] for _ in range(n)]
            else:
                kwargs[name] = None
        return BatchTokenIDOutput(**kwargs)


def wire(obj: Any) -> Any:
    """Send ``obj`` across the process boundary the way this SGLang version does (pickle or msgpack)."""
    from sglang.srt.managers import io_struct

    if hasattr(io_struct, "msgpack_encode") and not getattr(io_struct, "_USE_PICKLE_IPC", True):
        return io_struct.msgpack_decode(io_struct.msgpack_encode(obj))
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


# ---- SGLang's own scheduler output function, driven with stand-in requests and scheduler state
class _Captured:
    """Stands in for the scheduler's ``send_to_detokenizer`` socket: keeps what SGLang would send."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_output(self, obj: Any, *_: Any, **__: Any) -> None:
        """``SenderWrapper.send_output`` (the call SGLang's stream-output code makes)."""
        self.sent.append(obj)

    send_pyobj = send_output


class _SchedulerState:
    """Minimal scheduler ``self`` for SGLang's stream-output code: one rank, no speculation, no PD, no stats."""

    def __init__(self) -> None:
        self.send_to_detokenizer = _Captured()
        self.is_generation = True
        self.stream_interval = 1
        self.attn_tp_rank = 0
        self.dp_rank = 0
        self.ps = _NS(dp_rank=0, attn_tp_rank=0)
        self.server_args = _NS(enable_request_time_stats_logging=False, stream_interval=1)
        self.spec_algorithm = _NS(is_none=lambda: True)
        self.disaggregation_mode = "null"
        self.rust_server = None
        self.model_config = _NS(is_multimodal_gen=False)
        self.has_additional_customized_info = False
        self.get_load = self.get_loads = self.load_inquirer_get_loads = lambda *a, **k: None
        self._get_cached_tokens_details = self.get_cached_tokens_details = lambda req: None
        self.enable_hicache_storage = lambda: False
        self.is_request_level_customized_info_key = lambda key: False
        self._maybe_log_time_stats = lambda *, req: None


class _NS:
    """Attribute bag."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class _TimeStats:
    """Picklable stand-in for a request's time stats (SGLang puts them into the batch)."""

    forward_entry_time = prefill_finished_time = 0.0
    enable_metrics = False

    def get_queueing_time(self) -> float:
        return 0.0

    get_prefill_launch_delay = get_prefill_launch_latency = get_prefill_finished_ts = get_queueing_time


class _SchedReq:
    """Stand-in for a finished ``schedule_batch.Req`` as SGLang's stream-output code reads it."""

    def __init__(self, r: StandInReq, rows: torch.Tensor | None) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        self.rid = r.rid
        self.http_worker_ipc = None
        self.finished_reason = FINISH_LENGTH(length=len(r.completion))
        self.finished_output = False
        self.finished_len = len(r.completion)
        self.stream = False
        self.decoded_text = ""
        self.origin_input_ids = list(r.prompt)
        self.output_ids = list(r.completion)
        self.output_ids_through_stop = list(r.completion)
        self._surr = max(len(r.prompt) - _SURR, 0)
        self.send_decode_id_offset = 0
        self.send_token_offset = 0
        self.send_output_token_logprobs_offset = 0
        self.sampling_params = _NS(
            skip_special_tokens=True, spaces_between_special_tokens=True, no_stop_trim=False, stream_interval=None
        )
        self.reasoning_tokens = 0
        self.cached_tokens = self.cached_tokens_device = self.cached_tokens_host = self.cached_tokens_storage = 0
        self.retraction_count = 0
        self.time_stats = _TimeStats()
        self.to_finish = None
        self.spec_accepted_tokens = 0
        self.weight_version_events: list[Any] = []
        self.return_logprob = self.return_hidden_states = self.return_indexer_topk = False
        self.return_sampling_mask = False
        self.return_routed_experts = r.asked  # the flag as it reached the scheduler
        self.routed_experts = rows  # what maybe_collect_routed_experts leaves (None when not asked)
        self.customized_info = None
        self.beam_group = None
        self.spec_verify_ct = self.spec_num_correct_drafts = 0
        self.spec_correct_drafts_histogram: list[int] = []
        # 0.5.14-0.5.22 read the prompt's multimodal token counts off the request (a text-only prompt here)
        self.mm_image_tokens = self.mm_audio_tokens = self.mm_video_tokens = 0
        self.multimodal_inputs = None

    def finished(self) -> bool:
        return True

    def init_incremental_detokenize(self) -> tuple[list[int], int]:
        ids = self.origin_input_ids[self._surr :] + self.output_ids
        return ids, len(self.origin_input_ids) - self._surr

    def get_mm_token_counts(self) -> tuple[int, int, int]:
        return 0, 0, 0

    def check_match_stop_str_prefix(self) -> bool:
        return False

    def log_time_stats(self) -> None:
        return None


def sglang_stream_output(sched: StandInScheduler, rids: list[str]) -> Any:
    """The finishing ``BatchTokenIDOutput`` for ``rids`` as SGLang's own scheduler code builds it.

    <= 0.5.12: ``SchedulerOutputProcessorMixin.stream_output_generation``; 0.5.13+:
    ``SchedulerOutputStreamer._stream_output_generation`` (on 0.5.23 its ``get_serving``/``get_parallel``
    runtime context is stood in for). Requests and scheduler state are stand-ins; the routing rows
    are the transformers reference (only for requests whose flag reached the scheduler).
    """
    try:
        from sglang.srt.managers.scheduler_components import output_streamer as mod

        fn = mod.SchedulerOutputStreamer._stream_output_generation
    except ImportError:
        from sglang.srt.managers import scheduler_output_processor_mixin as mod

        fn = mod.SchedulerOutputProcessorMixin.stream_output_generation
    reqs = []
    for rid in rids:
        r = sched.reqs[rid]
        rows = sched.routing_rows(r) if r.asked else None
        r.sent, r.done = len(r.completion), True
        reqs.append(_SchedReq(r, rows))
    state = _SchedulerState()
    saved = {n: getattr(mod, n) for n in ("get_serving", "get_parallel") if hasattr(mod, n)}
    if "get_serving" in saved:
        mod.get_serving = lambda: _NS(stream_interval=1, weight_version="default")
    if "get_parallel" in saved:
        mod.get_parallel = lambda: _NS(dp_rank=0, attn_tp_rank=0)
    try:
        fn(state, reqs, False)
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)
    (out,) = state.send_to_detokenizer.sent
    return out
