"""Helpers the replay tests share: fixed token ids, routing recorded or drawn at random, a model cache, and a spy
independent of rr's hooks that sees what each router chose and what its experts ran."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import numpy as np
import torch

from rr_client.client._results import GenerateResult
from rr_client.trainer.replay import find_routers, record_routing, replay_routing
from tests.support.routing_data import dims_info

from .tiny_models import EXPERTS, LAYERS, TOPK

Forward = Callable[[Any, torch.Tensor], torch.Tensor]


def token_ids(vocab: int, b: int, t: int, seed: int = 3) -> torch.Tensor:
    """A fixed ``[b, t]`` batch of token ids in ``[1, vocab)``."""
    return torch.randint(1, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def recorded(model: Any, x: torch.Tensor) -> torch.Tensor:
    """The routing ``record_routing`` reports for one plain forward of ``x`` (rr layout: absolute layers)."""
    with torch.no_grad(), record_routing(model) as rec:
        model(x)
    return rec.routed_experts


def engine_result(i: int, prompt: list[int], output: list[int], rows: np.ndarray, **fields: Any) -> GenerateResult:
    """Sample ``i`` as the client hands it over: ``prompt`` + ``output`` generated to length, ``rows`` its routing
    from token 0; ``fields`` (``meta``, ``provenance``, indexer picks) as given, ``meta`` empty by default."""
    meta = fields.pop("meta", {})
    # the required fields in their order: index, prompt_index, prompt_ids, output_ids, text, finish_reason,
    # routed_experts, routed_experts_start, meta
    return GenerateResult(i, i, prompt, output, None, "length", rows, 0, meta, **fields)


def random_routing(seed: int, b: int, t: int, dense: tuple[int, ...] = ()) -> torch.Tensor:
    """``[b, t, LAYERS, TOPK]`` distinct random ids for the tiny models (``tiny_models``), every layer drawn, the
    ``dense`` layers' rows then zeroed as rr's layout has them."""
    g = torch.Generator().manual_seed(seed)
    out = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(b * t * LAYERS)]).reshape(
        b, t, LAYERS, TOPK
    )
    if dense:
        out[:, :, list(dense)] = 0
    return out


LOGPROBS_INFO = dims_info(LAYERS, EXPERTS, TOPK, [0, 2])  # the tiny Qwen3-MoE's dims, as its server says them


class LogprobsSample:
    """One generated sample (2 prompt, 3 completion tokens) with the engine's log-probs of ``mode``: what
    ``to_tensors`` reads for the log-probs mode checks (session gap, importance ratio)."""

    index, prompt_ids, output_ids, routed_experts_start = 0, [1, 2], [3, 4, 5], 0
    routed_experts = np.zeros((4, LAYERS, TOPK), dtype=np.uint8)
    logprobs = np.array([-0.25, -1.0, -1.5])

    def __init__(self, mode: str | None) -> None:
        self.logprobs_mode = mode


class ModelCache:
    """Builds each tiny model once per test module and hands it back reset: eval mode, no gradients, no
    activation checkpointing (a test that changes these leaves the next one a clean model)."""

    def __init__(self, build: Callable[[str], Any]) -> None:
        self._build = build
        self._models: dict[str, Any] = {}

    def get(self, key: str) -> Any:
        """The model for ``key``, built on first use, reset."""
        if key not in self._models:
            self._models[key] = self._build(key)
        m = self._models[key]
        m.eval()
        m.zero_grad(set_to_none=True)
        m.gradient_checkpointing_disable()
        return m


def third_output(out: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The router's ids as transformers' tiny models return them: ``(logits, weights, ids)``."""
    return out[2]


class ExpertsSpy:
    """Independent of rr: what each MoE layer's router returned (its ids, read by ``pick``) and what its experts
    module received; a context manager that removes its hooks on exit."""

    def __init__(self, model: Any, pick: Callable[[tuple[torch.Tensor, ...]], torch.Tensor] = third_output) -> None:
        self.router: dict[int, torch.Tensor] = {}
        self.experts: dict[int, torch.Tensor] = {}
        self.handles: list[Any] = []
        for r in find_routers(model):
            self.handles.append(
                r.module.register_forward_hook(
                    lambda _m, _a, out, i=r.layer: self.router.__setitem__(i, pick(out).detach().clone())
                )
            )
            self.handles.append(
                r.block.experts.register_forward_pre_hook(
                    lambda _m, a, i=r.layer: self.experts.__setitem__(i, a[1].detach().clone())
                )
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks."""
        for h in self.handles:
            h.remove()

    def routing(self, b: int, t: int, layers: int, top_k: int) -> torch.Tensor:
        """``[b, t, layers, top_k]`` of the routers' ids seen: absolute layers, the layers without a router zero."""
        out = torch.zeros(b * t, layers, top_k, dtype=torch.long)
        for layer, got in self.router.items():
            out[:, layer] = got
        return out.reshape(b, t, layers, top_k)


def spied_forward(
    model: Any,
    x: torch.Tensor,
    forward: Forward,
    pick: Callable[[tuple[torch.Tensor, ...]], torch.Tensor] = third_output,
) -> tuple[torch.Tensor, ExpertsSpy]:
    """One plain forward of ``x`` without gradients under an :class:`ExpertsSpy`: its output and the spy."""
    with ExpertsSpy(model, pick) as spy, torch.no_grad():
        out = forward(model, x)
    return out, spy


def grads(model: Any, x: torch.Tensor, routing: torch.Tensor, forward: Forward) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of one token's log-probability summed, the forward replayed with ``routing``."""
    model.zero_grad(set_to_none=True)
    with replay_routing(model, routing):
        out = forward(model, x)
        torch.log_softmax(out, -1)[..., 5].sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
