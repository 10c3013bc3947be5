"""Ground truth for ``rr-server doctor --model-path``: the served checkpoint's own router top-k in transformers.

:func:`router_forward` and :func:`router_topk` are the one reference top-k: the doctor, the tiny MoE's
:func:`rr_server.tiny_moe.reference_routing` and the tests' stand-in engines all compute it here.

Imports torch and transformers, and only when asked. Works for any HF MoE model whose forward returns
``router_logits`` (one ``[tokens, experts]`` tensor per MoE layer), on CPU or GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rr_client.agreement import set_matches

__all__ = ["RouterReference", "LayerAgreement", "router_forward", "router_topk"]

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


def router_forward(model: Any, token_ids: Sequence[int], moe_layers: Sequence[int], *, device: str = "cpu"
                   ) -> tuple[Any, dict[int, Any]]:
    """One transformers forward of ``token_ids``: the model output and each MoE layer's router logits.

    The logits are float32 torch tensors ``[tokens, experts]``, one per entry of ``moe_layers`` (the layers the
    model's ``router_logits`` come from, in order).
    """
    import torch

    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    logits = getattr(out, "router_logits", None)
    if logits is None or len(logits) != len(moe_layers):
        got = None if logits is None else len(logits)
        raise RuntimeError(f"the model returned {got} router_logits tensors for MoE layers {list(moe_layers)}")
    return out, {layer: lg.reshape(-1, lg.shape[-1])[: len(token_ids)].float()
                 for layer, lg in zip(moe_layers, logits, strict=True)}


def router_topk(logits: dict[int, Any], num_layers: int, k: int) -> np.ndarray:
    """The reference routing: ``(tokens, num_layers, k)`` int64 ids of each MoE layer's k largest router logits.

    ``logits`` as :func:`router_forward` returns them; layers without a router (dense) stay 0, like the wire's.
    """
    import torch

    tokens = next(iter(logits.values())).shape[0] if logits else 0
    out = np.zeros((tokens, num_layers, k), dtype=np.int64)
    for layer, lg in logits.items():
        out[:, layer, :] = torch.topk(lg, k, dim=-1).indices.cpu().numpy()
    return out


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

    def compare(self, routing: np.ndarray, token_ids: Sequence[int], start: int, moe_layers: Sequence[int],
                into: dict[int, LayerAgreement]) -> None:
        """Add one sample: ``routing`` rows are tokens ``start..`` of ``token_ids`` (the last token has no row)."""
        k = routing.shape[2]
        _, logits = router_forward(self.model, token_ids[: start + routing.shape[0]], moe_layers, device=self.device)
        ref = router_topk(logits, routing.shape[1], k)[start:]
        for layer in moe_layers:
            same = set_matches(routing[:, layer, :], ref[:, layer, :])
            agg = into.setdefault(layer, LayerAgreement(layer))
            agg.equal += int(same.sum())
            agg.total += int(same.size)
            if same.all():
                continue
            if k < logits[layer].shape[1]:  # near-tie: the k-th and (k+1)-th router probabilities are close
                p = np.sort(self.torch.softmax(logits[layer][start:], -1).cpu().numpy(), axis=-1)[:, ::-1]
                agg.near_ties += int(((p[:, k - 1] - p[:, k]) < NEAR_TIE)[~same].sum())
            if agg.first_diff is None:
                row = int(np.argmin(same))
                agg.first_diff = (start + row, sorted(routing[row, layer].tolist()), sorted(ref[row, layer].tolist()))
