"""Ground truth for ``rr-server doctor --model-path``: the served checkpoint's own router top-k in transformers.

Imports torch and transformers, and only when asked. Works for any HF MoE model whose forward returns
``router_logits`` (one ``[tokens, experts]`` tensor per MoE layer), on CPU or GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["RouterReference", "LayerAgreement"]

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

    def router_probs(self, token_ids: Sequence[int], moe_layers: Sequence[int]) -> dict[int, np.ndarray]:
        """Softmax router probabilities ``[tokens, experts]`` per MoE layer for one token sequence."""
        torch = self.torch
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        with torch.no_grad():
            out = self.model(ids, output_router_logits=True)
        logits = getattr(out, "router_logits", None)
        if logits is None or len(logits) != len(moe_layers):
            got = None if logits is None else len(logits)
            raise RuntimeError(f"the model returned {got} router_logits tensors for MoE layers {list(moe_layers)}")
        return {layer: torch.softmax(lg.reshape(-1, lg.shape[-1])[: len(token_ids)].float(), -1).cpu().numpy()
                for layer, lg in zip(moe_layers, logits, strict=True)}

    def compare(self, routing: np.ndarray, token_ids: Sequence[int], start: int, moe_layers: Sequence[int],
                into: dict[int, LayerAgreement]) -> None:
        """Add one sample: ``routing`` rows are tokens ``start..`` of ``token_ids`` (the last token has no row)."""
        k = routing.shape[2]
        probs = self.router_probs(token_ids[: start + routing.shape[0]], moe_layers)
        for layer in moe_layers:
            p = probs[layer][start:]
            order = np.argsort(-p, axis=-1)
            ref = np.sort(order[:, :k], axis=-1)
            got = np.sort(routing[:, layer, :].astype(np.int64), axis=-1)
            same = np.all(ref == got, axis=-1)
            agg = into.setdefault(layer, LayerAgreement(layer))
            agg.equal += int(same.sum())
            agg.total += int(same.size)
            if k < p.shape[1]:
                kth = np.take_along_axis(p, order[:, k - 1 : k], -1)[:, 0]
                nxt = np.take_along_axis(p, order[:, k : k + 1], -1)[:, 0]
                agg.near_ties += int(((kth - nxt) < NEAR_TIE)[~same].sum())
            if agg.first_diff is None and not same.all():
                row = int(np.argmin(same))
                agg.first_diff = (start + row, got[row].tolist(), ref[row].tolist())
