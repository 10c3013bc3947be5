"""rr on SGLang's own HTTP app beyond ``/rr/info``: ``routed_experts_format`` on ``/generate``, rr's routing on
``/v1/completions`` and ``/v1/chat/completions``.

* ``/generate``: :class:`GenerateFormatMiddleware` takes ``routed_experts_format`` out of the body (SGLang's
  parser never sees it), answers 400 for an unknown value, and hands the value to the TokenizerManager hooks
  through a context variable (the endpoint runs in the middleware's task, so ``_send_*`` sees it).
* OpenAI endpoints: :func:`rr_server.serving.openai_middleware.install_openai_routing` with ``engine="sglang"``. SGLang's
  serving code puts only the FIRST request's routing in the answer (``sglext.routed_experts``, response level);
  while a request that asked runs, a :class:`Collector` (context variable) receives every choice's checked
  routing (:class:`rr_client.CheckedRouting`, or why it was refused) and token ids from the hooks, and
  :func:`fill_answer` hands them to rr's finish, which encodes them without checking the same rows again.

Both are added to SGLang's FastAPI app when the TokenizerManager is built, i.e. before uvicorn starts it;
a TokenizerManager built after the app started (SGLang's granian / multi-tokenizer workers, which rr
refuses anyway) raises instead of serving without them.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rr_client.core.codec import CheckedRouting, check_format
from rr_client.core.errors import ConfigurationError
from rr_client.core.indexer import INDEXER_FORMAT_FIELD, check_indexer_format
from rr_client.core.provenance import PROVENANCE_FIELD
from rr_server.serving.http import (
    PostBodyMiddleware,
    Receive,
    Scope,
    Send,
    error_body,
    replay_receive,
    send_json,
    with_body,
)
from rr_server.serving.openai_middleware import install_openai_routing
from rr_server.serving.weight_epoch import WeightEpoch, WeightUpdateMiddleware

__all__ = [
    "Collector",
    "GenerateFormatMiddleware",
    "collector",
    "requested_format",
    "fill_answer",
    "collecting",
    "install_http",
]

_GENERATE_PATHS = ("/generate",)
_FORMAT_KEY = b"routed_experts_format"
_INDEXER_FORMAT_KEY = b"indexer_topk_format"
_FORMAT: contextvars.ContextVar[str | None] = contextvars.ContextVar("rr_routed_experts_format", default=None)
_INDEXER_FORMAT: contextvars.ContextVar[str | None] = contextvars.ContextVar("rr_indexer_topk_format", default=None)
_COLLECTOR: contextvars.ContextVar[Collector | None] = contextvars.ContextVar("rr_openai_collector", default=None)


@dataclass
class Collector:
    """What the hooks saw of one OpenAI request: its rids in send order, each one's prompt, checked routing (or
    the check's refusal), output ids."""

    start: int = 0  # the request's routed_experts_start (serving code before 0.5.12 drops it)
    rids: list[str] = field(default_factory=list)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    routing: dict[str, CheckedRouting | str] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    provenance: dict[str, dict[str, Any]] = field(default_factory=dict)  # rid -> its rr_provenance

    def sent(self, rid: str, input_ids: Any) -> None:
        """A request of this OpenAI call reached ``_send_*`` (called in the request's own task)."""
        self.rids.append(rid)
        try:
            self.prompts[rid] = [int(t) for t in input_ids]
        except (TypeError, ValueError):
            pass

    def finished(self, rid: str, out: Any, checked: CheckedRouting | None, refused: str | None) -> None:
        """The final answer of ``rid``: its checked routing, or why the check refused it (from the output handler)."""
        if checked is not None:
            self.routing[rid] = checked
        elif isinstance(refused, str):
            self.routing[rid] = refused
        ids = out.get("output_ids") if isinstance(out, dict) else None
        if isinstance(ids, list):
            self.outputs[rid] = [int(t) for t in ids]
        meta = out.get("meta_info") if isinstance(out, dict) else None
        prov = meta.get(PROVENANCE_FIELD) if isinstance(meta, dict) else None
        if isinstance(prov, dict):
            self.provenance[rid] = prov


def collector() -> Collector | None:
    """The collector of the OpenAI request running in this task, if rr asked for routing."""
    return _COLLECTOR.get()


def requested_format() -> str | None:
    """``routed_experts_format`` of the ``/generate`` request running in this task (None: server default)."""
    return _FORMAT.get()


def requested_indexer_format() -> str | None:
    """``indexer_topk_format`` of the ``/generate`` request running in this task (None: server default)."""
    return _INDEXER_FORMAT.get()


@contextlib.contextmanager
def collecting(r: Any) -> Iterator[Callable[[Any], list[CheckedRouting | str | None] | None]]:
    """For the OpenAI middleware (``r``: the request's rr fields): collect while SGLang serves it, then ``fill``."""
    col = Collector(start=int(r.start))
    token = _COLLECTOR.set(col)
    try:
        yield lambda answer: fill_answer(answer, col)
    finally:
        _COLLECTOR.reset(token)


def fill_answer(answer: Any, col: Collector) -> list[CheckedRouting | str | None] | None:
    """Every choice's checked routing (or the check's refusal) from what the hooks saw, and its token ids.

    Returns one entry per choice for :func:`rr_server.serving.openai_routing.finish_answer` (``checked=``), which
    encodes them as they are: the rows were checked once, in the output handler. SGLang answers ``choices`` in
    the order its TokenizerManager sent the requests; with ``n > 1`` it first sends one prefix-caching request
    per prompt, so the choices are the last ``len(choices)`` rids sent. None when the counts do not add up
    (rr's finish then reports the routing as missing).
    """
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or len(col.rids) < len(choices):
        return None
    found: list[CheckedRouting | str | None] = []
    for choice, rid in zip(choices, col.rids[-len(choices) :]):
        found.append(col.routing.get(rid))
        if not isinstance(choice, dict):
            continue
        if rid in col.prompts and choice.get("prompt_token_ids") is None:
            choice["prompt_token_ids"] = col.prompts[rid]
        if rid in col.outputs and choice.get("token_ids") is None and choice.get("response_token_ids") is None:
            choice["token_ids"] = col.outputs[rid]
        if rid in col.provenance:
            choice[PROVENANCE_FIELD] = col.provenance[rid]
    return found


class GenerateFormatMiddleware(PostBodyMiddleware):
    """Pure ASGI: ``routed_experts_format`` on ``POST /generate`` is rr's; every other request passes untouched."""

    paths = _GENERATE_PATHS

    async def handle(self, scope: Scope, raw: bytes, receive: Receive, send: Send) -> None:
        """Take ``routed_experts_format`` and ``indexer_topk_format`` out of the body (400 for an unknown value) and run
        SGLang with them set."""
        body: Any = None
        if _FORMAT_KEY in raw or _INDEXER_FORMAT_KEY in raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None  # SGLang answers malformed JSON itself
        if not isinstance(body, dict) or not {"routed_experts_format", INDEXER_FORMAT_FIELD} & set(body):
            await self.app(scope, replay_receive(raw, receive), send)
            return
        fmt, ifmt = body.pop("routed_experts_format", None), body.pop(INDEXER_FORMAT_FIELD, None)
        try:
            fmt = None if fmt is None else check_format(fmt)
            ifmt = None if ifmt is None else check_indexer_format(ifmt)
        except ValueError as e:
            await send_json(send, error_body(str(e), 400), 400)
            return
        new = json.dumps(body).encode()
        token, itoken = _FORMAT.set(fmt), _INDEXER_FORMAT.set(ifmt)
        try:
            await self.app(with_body(scope, new), replay_receive(new, receive), send)
        finally:
            _FORMAT.reset(token)
            _INDEXER_FORMAT.reset(itoken)


def install_http(app: Any, info: Callable[[Any], Any], epoch: WeightEpoch | None = None) -> None:
    """Add rr's middlewares to SGLang's app once (``epoch``: where its weight routes are counted);
    ConfigurationError when the app is already serving (too late)."""
    if getattr(app.state, "rr_openai_routing", False):
        return
    if getattr(app, "middleware_stack", None) is not None:
        raise ConfigurationError(
            "rr: SGLang's HTTP app started before its TokenizerManager was built (multi-tokenizer/granian "
            "worker?); rr cannot add its /generate and OpenAI routing there. Run one tokenizer worker."
        )
    app.add_middleware(GenerateFormatMiddleware)
    if epoch is not None:
        app.add_middleware(WeightUpdateMiddleware, epoch=epoch)
    install_openai_routing(app, engine="sglang", info=info, native=collecting)
