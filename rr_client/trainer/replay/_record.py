"""``record_routing`` (R2): the model's own top-k choice per MoE layer, kept on the device until asked for.

The hook keeps a reference to each router's index tensor (no op, no copy, no sync); the layout is assembled
on that device when the caller reads it, and moved (to the CPU by default) in one transfer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rr_client.core.errors import ReplayError
from rr_client.trainer.replay._routers import Router, find_routers, num_hidden_layers, router_hooks

__all__ = ["RoutingRecord", "record_routing"]


@dataclass
class RoutingRecord:
    """What ``record_routing`` saw: the model's own top-k ids of the last forward, in rr's layout."""

    num_hidden_layers: int
    moe_layers: list[int]
    topk: int
    shape: tuple[int, ...] | None = None
    _layers: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def tensor(self, device: torch.device | str | None = "cpu") -> torch.Tensor:
        """``[B, T, L, K]`` int64 (``[N, L, K]`` for 1-D ``input_ids``), absolute layers, dense layers zero.

        Assembled where the routers ran and moved to ``device`` in one transfer; ``device=None`` keeps it
        there (e.g. to replay it on the GPU: R2)."""
        if not self._layers:
            raise ReplayError("no forward pass ran inside record_routing")
        first = next(iter(self._layers.values()))
        dense = torch.zeros((first.shape[0], self.topk), dtype=torch.long, device=first.device)
        out = torch.stack(
            [
                self._layers[i].to(device=first.device, dtype=torch.long) if i in self._layers else dense
                for i in range(self.num_hidden_layers)
            ],
            dim=1,
        )
        if self.shape is not None and len(self.shape) >= 1:
            out = out.reshape(*self.shape, self.num_hidden_layers, self.topk)
        out = out.contiguous()
        return out if device is None else out.to(device)

    @property
    def routed_experts(self) -> torch.Tensor:
        """The record on the CPU (one transfer): ``tensor("cpu")``."""
        return self.tensor("cpu")


@contextmanager
def record_routing(model: nn.Module, *, allow_untested: bool = False) -> Iterator[RoutingRecord]:
    """Record the model's own top-k choice per MoE layer (R2); a recompute under gradient checkpointing
    re-records the same rows. ``rec.routed_experts`` (CPU) or ``rec.tensor(None)`` (the model's device) is
    filled after the forward inside the block; nothing is copied inside the forward. ``allow_untested``: a
    family whose router formula is in rr but untested (as for :func:`replay_routing`)."""
    routers = find_routers(model, allow_untested=allow_untested)
    rec = RoutingRecord(num_hidden_layers(model, routers), [r.layer for r in routers], routers[0].top_k)

    def on_model(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = kwargs.get("input_ids")
        if x is None and args:
            x = args[0]
        if x is None:
            e = kwargs.get("inputs_embeds")
            rec.shape = tuple(e.shape[:-1]) if e is not None else None
        else:
            rec.shape = tuple(x.shape)
        rec._layers.clear()

    def hook(r: Router, out: Any) -> Any:
        rec._layers[r.layer] = out[2]  # integer ids carry no autograd history: keep the tensor itself
        return None

    h = model.register_forward_pre_hook(on_model, with_kwargs=True)
    try:
        with router_hooks(routers, hook):
            yield rec
    finally:
        h.remove()
