"""rr's routing on vLLM's streaming ``/v1/completions`` and ``/v1/chat/completions`` (vLLM's chunks carry none).

vLLM puts ``routed_experts`` on the final ``CompletionOutput`` of a request but serializes it only into
non-streaming answers. While a streaming request that asked for routing runs, :func:`collecting` sets a
:class:`StreamCollector` (context variable); the engine client's ``generate``, wrapped once per engine client,
hands it every output of that request. The OpenAI middleware then sends one event right before
``data: [DONE]`` whose choices carry each choice's routing and token ids, put through rr's one full check
(:func:`rr_server.serving.openai_routing.finish_answer`). Non-streaming answers are left to vLLM, which already
carries routing there. Both kinds are collected for each choice's ``rr_provenance`` (cached tokens, preemptions,
weight versions at admission and finish, vLLM 0.32+'s own weight-version spans: :mod:`rr_patches.vllm.provenance`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rr_client.core.patching import wrap_once
from rr_client.core.provenance import PROVENANCE_FIELD
from rr_patches.vllm.provenance import admit, provenance_of
from rr_server.serving.weight_epoch import WeightMark, current_epoch

__all__ = ["StreamCollector", "collecting", "wrap_engine_generate", "fill_answer"]

_COLLECTOR: contextvars.ContextVar[StreamCollector | None] = contextvars.ContextVar(
    "rr_vllm_stream_collector", default=None
)


@dataclass
class _Choice:
    """What the engine produced for one (prompt, output index): its token ids so far and its final routing."""

    prompt_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    routing: Any = None
    finished: bool = False
    provenance: dict[str, Any] | None = None


@dataclass
class StreamCollector:
    """The outputs of one OpenAI request, per ``engine_client.generate`` call (vLLM makes one per prompt)."""

    prompts: list[dict[int, _Choice]] = field(default_factory=list)
    marks: list[WeightMark] = field(default_factory=list)
    connector: bool = False  #: vLLM runs a KV connector (cache_tier unknown)

    def new_prompt(self) -> int:
        """A ``generate`` call of this request started (admitted now); its slot is the prompt index vLLM uses."""
        self.prompts.append({})
        self.marks.append(admit())
        return len(self.prompts) - 1

    def add(self, slot: int, res: Any) -> None:
        """One ``RequestOutput`` (vLLM streams deltas): extend each output's token ids, keep its final routing."""
        choices = self.prompts[slot]
        prompt_ids = getattr(res, "prompt_token_ids", None)
        for out in getattr(res, "outputs", None) or ():
            ch = choices.setdefault(int(out.index), _Choice())
            if ch.prompt_ids is None and prompt_ids is not None:
                ch.prompt_ids = [int(t) for t in prompt_ids]
            ch.token_ids.extend(out.token_ids)
            if out.finish_reason is not None:
                ch.finished = True
                ch.routing = getattr(out, "routed_experts", None)
                mark = self.marks[slot]
                ch.provenance = provenance_of(
                    res,
                    ch.prompt_ids,
                    ch.token_ids,
                    mark,
                    connector=self.connector,
                    finish=current_epoch().since(mark),
                    spans=getattr(out, "weight_versions", None),  # vLLM 0.32+'s own weight-version spans
                ).to_dict()


async def _collected(gen: AsyncGenerator[Any, None], col: StreamCollector, slot: int) -> AsyncGenerator[Any, None]:
    """``gen``'s outputs, unchanged, each also given to ``col``; closing this closes (and so aborts) ``gen``."""
    try:
        async for res in gen:
            col.add(slot, res)
            yield res
    finally:
        await gen.aclose()


def _collecting_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """``engine_client.generate`` that hands its outputs to the calling context's collector, if any."""

    def generate(*args: Any, **kwargs: Any) -> Any:
        col = _COLLECTOR.get()
        gen = original(*args, **kwargs)
        if col is None:
            return gen
        return _collected(gen, col, col.new_prompt())

    return generate


def wrap_engine_generate(engine_client: Any) -> bool:
    """Let a streaming OpenAI request's collector see its outputs (once per engine client); True if wrapped now.

    Without a collector in the calling context (every other request), ``generate`` is vLLM's own, untouched.
    """
    if engine_client is None:
        return False
    return wrap_once(engine_client, "generate", _collecting_generate, what="vLLM's engine client")


def fill_answer(answer: Any, col: StreamCollector, stream: bool = True) -> None:
    """Give every choice of the routing event its routing and token ids (vLLM's own field names), and every
    choice (``stream=False``: of vLLM's own answer, which carries its routing) its ``rr_provenance``.

    vLLM numbers a choice ``prompt_index * n + output_index``; ``n`` is the number of outputs each prompt made.
    A choice with nothing collected is left bare (rr's finish then reports its routing as missing).
    """
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not col.prompts:
        return
    n = max((len(p) for p in col.prompts), default=0)
    if n == 0:
        return
    for choice in choices:
        index = choice.get("index") if isinstance(choice, dict) else None
        if not isinstance(index, int):
            continue
        slot, out_index = divmod(index, n)
        ch = col.prompts[slot].get(out_index) if slot < len(col.prompts) else None
        if ch is None or not ch.finished:
            continue
        if ch.provenance is not None:
            choice[PROVENANCE_FIELD] = ch.provenance
        if not stream:
            continue
        choice["prompt_token_ids"] = ch.prompt_ids
        choice["token_ids"] = ch.token_ids
        choice["routed_experts"] = ch.routing


@contextlib.contextmanager
def collecting(app: Any, r: Any) -> Iterator[Callable[[Any], None]]:
    """For the OpenAI middleware: collect a request's outputs while vLLM serves it, then ``fill`` (a stream's
    routing event; a non-streaming answer, which carries its routing already, gets only the provenance)."""
    from rr_patches.vllm.provenance import connector_configured

    engine = getattr(app.state, "engine_client", None)
    wrap_engine_generate(engine)
    col = StreamCollector(connector=connector_configured(engine))
    stream = bool(getattr(r, "stream", False))
    token = _COLLECTOR.set(col)
    try:
        yield lambda answer: fill_answer(answer, col, stream)
    finally:
        _COLLECTOR.reset(token)
