"""Ground truth for ``rr-server doctor --model-path``: the served checkpoint's own router choice in transformers.

The doctor compares against what the model's routers *select* (:func:`router_choice`, rr's ``record_routing``
hooks), not the top-k of ``router_logits``: DeepSeek-V3-style routers (GLM-4.5, Kimi-K2, DeepSeek-V3) select
by sigmoid score plus a correction bias within expert groups, which the logits' top-k does not reproduce.
The logits' top-k (:mod:`rr_client.trainer.router_reference`) stays the reference for plain softmax top-k
routers (the tiny MoE's :func:`rr_server.demo.tiny_moe.reference_routing`, the tests' stand-in engines) and the
fallback for a family rr cannot hook.

Imports torch and transformers, and only when asked; on CPU or GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rr_client.core.agreement import set_matches
from rr_client.trainer.router_reference import router_topk

__all__ = ["RouterReference", "LayerAgreement", "router_choice", "NEAR_TIE"]

NEAR_TIE = 1e-3


@dataclass
class LayerAgreement:
    """Per MoE layer: (token, layer) top-k sets equal to the reference, and near-ties among the differing ones."""

    layer: int
    equal: int = 0
    total: int = 0
    near_ties: int = 0  # rows whose k-th and (k+1)-th router probabilities are within NEAR_TIE
    first_diff: tuple[int, list[int], list[int]] | None = field(default=None)

    @property
    def share(self) -> float:
        return self.equal / self.total if self.total else 1.0


def router_choice(
    model: Any, token_ids: Sequence[int], moe_layers: Sequence[int], num_layers: int, k: int, *, device: str = "cpu"
) -> tuple[np.ndarray, dict[int, Any] | None]:
    """``(tokens, num_layers, k)`` int64: each MoE layer's selected experts in one forward, and the router logits.

    The selection is the model's own (rr's ``record_routing``); a layer the hooks do not see, or a model whose
    family rr cannot hook, falls back to the logits' top-k. The logits (``None`` when the model returns none for
    ``moe_layers``) only feed the near-tie diagnosis.
    """
    import torch

    from rr_client.core.errors import UnsupportedModelError
    from rr_client.trainer.replay import record_routing

    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    try:
        with torch.no_grad(), record_routing(model) as rec:
            out = model(ids, output_router_logits=True)
        chosen: np.ndarray | None = rec.routed_experts[0].numpy()
        seen = set(rec.moe_layers)
    except UnsupportedModelError:
        with torch.no_grad():
            out = model(ids, output_router_logits=True)
        chosen, seen = None, set()
    raw = getattr(out, "router_logits", None)
    logits = None
    if raw is not None and len(raw) == len(moe_layers):
        logits = {
            layer: lg.reshape(-1, lg.shape[-1])[: len(token_ids)].float()
            for layer, lg in zip(moe_layers, raw, strict=True)
        }
    missing = [layer for layer in moe_layers if layer not in seen]
    if missing and logits is None:
        got = None if raw is None else len(raw)
        raise RuntimeError(
            f"no router choice for MoE layers {missing}: rr's hooks did not see them and the model "
            f"returned {got} router_logits tensors for MoE layers {list(moe_layers)}"
        )
    ref = (
        router_topk(logits, num_layers, k)
        if logits is not None
        else np.zeros((len(token_ids), num_layers, k), np.int64)
    )
    if chosen is not None:
        for layer in seen:
            if layer < num_layers and chosen.shape[2] == k:
                ref[:, layer, :] = chosen[:, layer, :]
    return ref, logits


class RouterReference:
    """The checkpoint at ``path`` in transformers; :meth:`compare` scores returned routing against it."""

    def __init__(self, path: str, *, device: str = "cpu", dtype: str = "float32") -> None:
        import torch
        import transformers

        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        self.device = device
        self.model: Any = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        self.model.to(device).eval()

    def compare(
        self,
        routing: np.ndarray,
        token_ids: Sequence[int],
        start: int,
        moe_layers: Sequence[int],
        into: dict[int, LayerAgreement],
    ) -> None:
        """Add one sample: ``routing`` rows are tokens ``start..`` of ``token_ids`` (the last token has no row)."""
        k = routing.shape[2]
        ref, logits = router_choice(
            self.model, token_ids[: start + routing.shape[0]], moe_layers, routing.shape[1], k, device=self.device
        )
        ref = ref[start:]
        for layer in moe_layers:
            same = set_matches(routing[:, layer, :], ref[:, layer, :])
            agg = into.setdefault(layer, LayerAgreement(layer))
            agg.equal += int(same.sum())
            agg.total += int(same.size)
            if same.all():
                continue
            if (
                logits is not None and k < logits[layer].shape[1]
            ):  # near-tie: the k-th and (k+1)-th router probabilities are close
                p = np.sort(self.torch.softmax(logits[layer][start:], -1).cpu().numpy(), axis=-1)[:, ::-1]
                agg.near_ties += int(((p[:, k - 1] - p[:, k]) < NEAR_TIE)[~same].sum())
            if agg.first_diff is None:
                row = int(np.argmin(same))
                agg.first_diff = (start + row, sorted(routing[row, layer].tolist()), sorted(ref[row, layer].tolist()))
