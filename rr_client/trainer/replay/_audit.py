"""The replay audit: proof, per layer, that the replayed ids reached the experts, read once per block.

Counts that follow from the block's rows (replayed, left) are Python integers. Counts that need the
tensors (agreement of the model's own choice, ids seen at the experts' input) are 0-d device tensors kept in
a :class:`DeviceTally` and read with one ``tolist()`` per device when the block exits: no host sync inside
a forward or a backward. An experts module that receives the very tensor the replay hook returned is proven
without any op.
"""

from __future__ import annotations

from typing import Any

import torch

from rr_client.trainer import keys as K
from rr_client.trainer.audit import LayerCounts, layer_keys, segment_keys
from rr_client.trainer.replay._routers import LeftRouter, Router
from rr_client.trainer.replay._rows import BlockRows
from rr_client.trainer.replay.phase import DeviceTally

__all__ = ["DeviceTally", "Audit"]  # DeviceTally lives in rr_client.trainer.replay.phase


class Audit:
    """Counters of one ``replay_routing`` block; ``report()`` is the plain dict a trainer logs."""

    def __init__(
        self, routers: list[Router], left: list[LeftRouter], rows: BlockRows, tally: DeviceTally, segments: Any = None
    ) -> None:
        self.routers = routers
        self.segments = segments  #: rr_client.trainer.provenance.Segments of the block's rows, or None
        self._seg: dict[torch.device, torch.Tensor] = {}  # the rows' codes (-1 -> the discarded bin) per device
        self.left = left
        self.rows = rows
        self.tally = tally
        z = dict.fromkeys([r.layer for r in routers], 0)
        self.replayed, self.runs, self.checked = dict(z), dict(z), dict(z)  # runs: forwards, recomputes not
        self.applied_direct = dict(z)
        self.router_runs, self.expert_runs = dict(z), dict(z)
        self.expect: dict[int, torch.Tensor] = {}
        self.bad_experts: dict[int, str] = {}
        self.forwards = 0
        self.counts: dict[str, int] = {}
        self.n_tokens: int = rows.n_rows  #: real tokens among the rows (pads excluded; the tally's "tokens")

    def on_router(self, r: Router, own: torch.Tensor, new_ids: torch.Tensor, recompute: bool) -> None:
        """After the replay hook: remember what the experts must receive; count agreement (forwards only)."""
        self.router_runs[r.layer] += 1
        self.expect[r.layer] = new_ids
        if recompute:
            return
        lr = self.rows.layers[r.layer]
        self.replayed[r.layer] += lr.n_use
        self.runs[r.layer] += 1
        if lr.n_use:
            assert lr.ids_sorted is not None
            same = (own.sort(dim=-1).values == lr.ids_sorted).all(dim=-1, keepdim=True)
            hit = same if lr.use is None else same & lr.use
            self.tally.add(f"agree/{r.layer}", hit.sum())
            if self.segments is not None:
                self._by_segment(hit, lr.use, own.device)

    def _by_segment(self, hit: torch.Tensor, use: torch.Tensor | None, dev: torch.device) -> None:
        """Agreeing and replayed rows per segment code, as one device vector (no host read)."""
        s = len(self.segments.names)
        seg = self._seg.get(dev)
        if seg is None:
            codes = self.segments.rows.reshape(-1).long()
            seg = self._seg[dev] = torch.where(codes < 0, s, codes).to(dev, non_blocking=True)
        used = torch.ones_like(hit) if use is None else use
        vec = torch.zeros(2 * (s + 1), dtype=torch.long, device=dev)
        vec.index_add_(0, seg, hit.reshape(-1).long()).index_add_(0, seg + s + 1, used.reshape(-1).long())
        self.tally.add_vector("segments", vec)

    def on_experts(self, r: Router, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """At the experts' input: the ids there must be the replayed ones (the same tensor proves it for free)."""
        self.expert_runs[r.layer] += 1
        want = self.expect.pop(r.layer, None)
        if want is None:
            self.bad_experts[r.layer] = "the experts ran without their router running first"
            return
        lr = self.rows.layers[r.layer]
        self.checked[r.layer] += lr.n_use
        inputs = list(args) + list(kwargs.values())
        if any(a is want for a in inputs):
            self.applied_direct[r.layer] += lr.n_use
            return
        got = next(
            (
                a
                for a in inputs
                if isinstance(a, torch.Tensor) and not a.is_floating_point() and a.dim() == 2 and a.shape == want.shape
            ),
            None,
        )
        if got is None:
            self.bad_experts[r.layer] = "no [N, K] expert-id tensor among the experts module's inputs"
            return
        same = (got.sort(dim=-1).values == want.sort(dim=-1).values).all(dim=-1, keepdim=True)
        self.tally.add(f"applied/{r.layer}", (same if lr.use is None else same & lr.use).sum())

    def finish(self, counts: dict[str, int]) -> None:
        """Take the device counts read when the block exits."""
        self.counts = counts
        if "tokens" in counts:
            self.n_tokens = counts["tokens"]

    def left_rows(self, layer: int) -> int:
        """Rows of real tokens left to the model's own choice in ``layer`` (pads count neither way)."""
        return self.runs[layer] * self.n_tokens - self.replayed[layer]

    def _agree(self, layer: int) -> int:
        return self.counts.get(f"agree/{layer}", 0)

    def _applied(self, layer: int) -> int:
        return self.applied_direct[layer] + self.counts.get(f"applied/{layer}", 0)

    def report(self) -> dict[str, float]:
        """The block's ``r3/`` keys: the per-layer counts through :func:`rr_client.trainer.audit.layer_keys` (the
        one writer of ``applied_share``) and :func:`~rr_client.trainer.audit.segment_keys`, plus the block's own
        counters (forwards, routers left, orphan routers, unconsumed layers)."""
        counts = [
            LayerCounts(
                r.layer,
                replayed=self.replayed[r.layer],
                checked=self.checked[r.layer],
                applied=self._applied(r.layer),
                agreed=self._agree(r.layer),
                left=self.left_rows(r.layer),
            )
            for r in self.routers
        ]
        out = layer_keys(counts)
        out[K.FORWARDS] = float(self.forwards)
        out[K.LEFT_ROWS] = float(sum(c.left or 0 for c in counts))
        out[K.LEFT_LAYERS_HASH] = float(sum(x.why == "hash" for x in self.left))
        out[K.LEFT_ROUTERS_OUTSIDE_DECODER] = float(sum(x.why == "outside_decoder" for x in self.left))
        out[K.ORPHAN_ROUTERS] = float(sum(self.router_runs[r.layer] == 0 for r in self.routers))
        out[K.UNCONSUMED_LAYERS] = float(len(self.rows.unconsumed))
        for x in self.left:
            if x.why == "hash" and x.layer is not None:
                out[K.layer(x.layer, "left_rows_hash")] = float(self.n_tokens * self.forwards)
        if self.segments is not None:
            out.update(segment_keys(self.tally.vectors.get("segments"), self.segments.names))
        return out

    def problems(self) -> list[str]:
        msgs = []
        if self.forwards == 0:
            msgs.append("no forward pass ran inside replay_routing(audit=True)")
            return msgs
        orphans = [r for r in self.routers if self.router_runs[r.layer] == 0]
        if orphans:
            msgs.append(
                "orphan routers (in the model, never ran in the forward; a rebuilt or bypassed decoder "
                "layer?): " + ", ".join(f"layer {r.layer} {r.name}" for r in orphans)
            )
        if self.rows.unconsumed:
            msgs.append(
                f"replayed rows at layers {self.rows.unconsumed} were consumed by no router (the model has "
                "no replayable router there: layers shifted, or dense/MoE layer mapping wrong?)"
            )
        for r in self.routers:
            i = r.layer
            if i in self.bad_experts:
                msgs.append(f"layer {i}: {self.bad_experts[i]} ({r.name})")
            elif self.router_runs[i] and self.expert_runs[i] == 0 and self.replayed[i]:
                msgs.append(f"layer {i}: the experts module never ran after {r.name} (the block bypasses it)")
            elif self.checked[i] and self._applied(i) != self.checked[i]:
                msgs.append(
                    f"layer {i}: only {self._applied(i)}/{self.checked[i]} replayed rows reached the experts "
                    f"with the replayed ids (the MoE block {type(r.block).__name__} does not pass its "
                    "router's choice to its experts)"
                )
        return msgs
