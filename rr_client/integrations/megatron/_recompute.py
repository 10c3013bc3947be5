"""Which forward a recompute re-runs, decided on the device: each recompute replays its own micro-batch's rows in
whatever order the backwards run, on the layers Megatron really recomputes.

Megatron's ``REPLAY_BACKWARD`` pops a FIFO, so it is right only when the backwards run in forward order. A backward
of micro-batch 2 before 1, one backward of the summed losses, or a grad-on forward-only pass left in the queue
makes a recompute replay another micro-batch's rows, silently. Here every grad-on forward of a router that Megatron
checkpoints (:func:`recomputed`) keeps its targets in a slot beside a fingerprint of the router's input (two random
projections, one weighted by token position, and their scale: a recompute sees bit-identical input, another
micro-batch does not); a recompute picks the live slot (forwarded, not yet recomputed) whose fingerprint is nearest
its own (``argmin`` on the device) and replays its targets; the slot is then free for a later forward.

Nothing here reads the device, and nothing goes between host and device: slot indices are chosen on the device, the
host knows only how many forwards are outstanding (forwards minus recomputes), which is all that sizes the slots.
The verdicts are counted on the device per pick and read at ``step_done``: ``miss`` (the input matched no forward),
``reused`` (the pick was a forward already recomputed), ``ambiguous`` (another forward live at that pick had the same
input but other rows: the two recomputes could have swapped them). Two identical samples (a GRPO group's identical
completions) with other rows are ambiguous only when both were live together at a pick (F1 F2 B1 B2), not when each
backward ran before the next forward (F1 B1 F2 B2). Memory is bounded by the outstanding forwards; past
:data:`MAX_LIVE` of them it refuses (``step_done`` never called).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rr_client.core.errors import ReplayError
from rr_client.integrations.megatron._feeder import upload
from rr_client.trainer.replay.phase import DeviceTally

__all__ = ["RecomputePool", "fingerprint", "recomputed", "MATCH_TOLERANCE", "MAX_LIVE"]

#: a recompute's fingerprint must be within this share of its forward's scale (recompute is bit-identical on one
#: device; the slack covers non-deterministic kernels); other micro-batches differ by order 1
MATCH_TOLERANCE = 1e-4
#: outstanding (forwarded, not recomputed) forwards per token-count group that are refused: the step never ended
MAX_LIVE = 1024

_PROJECTIONS: dict[tuple[int, torch.device], torch.Tensor] = {}


def recomputed(router: Any) -> bool:
    """Whether Megatron-core (0.16.1) re-runs this :class:`~rr_client.integrations.megatron._routers.MegatronRouter`
    in the backward, so a pool must keep its forwards' rows. Selective recompute with ``"moe"`` checkpoints every
    MoE layer (``MoELayer.moe_layer_recompute``); ``"full"`` granularity checkpoints the decoder block's layers
    (``TransformerBlock._checkpointed_forward``): ``uniform`` all of them, ``block`` the first
    ``recompute_num_layers`` of each block (chunk), counted from 0 in ``block.layers`` (under fp8 / fp4 the window
    may shift past layers whose input needs no grad: every layer then); an MTP layer only under ``uniform``
    (``MultiTokenPredictionLayer._checkpointed_forward`` skips ``block``)."""
    cfg = router.module.config
    gran = getattr(cfg, "recompute_granularity", None)
    if gran == "selective":
        return "moe" in (getattr(cfg, "recompute_modules", None) or [])
    if gran != "full":
        return False
    method = getattr(cfg, "recompute_method", None)
    if method == "uniform":
        return True
    if method != "block":
        return True  # a method this release does not name: keep the rows (a pool costs memory, not correctness)
    if router.mtp:
        return False
    if getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None):
        return True
    index = block_index(router.name)
    return index is None or index < int(getattr(cfg, "recompute_num_layers", 0) or 0)


def block_index(name: str) -> int | None:
    """The 0-based index of a router's layer in its ``TransformerBlock.layers`` from its module path
    (``decoder.layers.2.mlp.router`` -> 2), or None when the path has no ``layers.<i>``."""
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


def _projection(hidden_size: int, device: torch.device) -> torch.Tensor:
    """``[hidden, 2]`` fixed random projections (seeded, so every rank and run agree), cached per device."""
    key = (hidden_size, device)
    if key not in _PROJECTIONS:
        gen = torch.Generator().manual_seed(0x5252)
        _PROJECTIONS[key] = upload(torch.randn(hidden_size, 2, generator=gen), device)  # once, non-blocking
    return _PROJECTIONS[key]


def fingerprint(hidden: torch.Tensor) -> torch.Tensor:
    """``[3]`` float64 on ``hidden``'s device: the token sum of a random projection, its position-weighted sum (a
    reordered batch differs) and their L2 scale (what the match is measured against: a sum's spread over tokens)."""
    x = hidden.detach().reshape(-1, hidden.shape[-1])
    p = (x.float() @ _projection(int(x.shape[-1]), x.device)).double()  # [T, 2]
    pos = torch.arange(1, p.shape[0] + 1, device=p.device, dtype=torch.float64) / max(int(p.shape[0]), 1)
    weights = torch.stack([torch.ones_like(pos), pos], dim=1)  # column 0 plain, column 1 by position
    return torch.cat([(p * weights).sum(0), p.square().sum().sqrt().reshape(1)])


def _distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The match distance of fingerprints ``a`` and ``b`` (``[..., 3]``, broadcast): the larger projection gap as a
    share of their joint scale (0 for a bit-identical input)."""
    gap = (a.narrow(-1, 0, 2) - b.narrow(-1, 0, 2)).abs().amax(-1)
    return gap / (a.narrow(-1, 2, 1) + b.narrow(-1, 2, 1) + 1e-30).squeeze(-1)


def _target_hash(targets: torch.Tensor) -> torch.Tensor:
    """0-d float64: a weighted sum of the targets (two forwards with equal input but other rows differ in it)."""
    w = torch.arange(1, targets.numel() + 1, device=targets.device, dtype=torch.float64).reshape(targets.shape)
    return (targets.double() * w.sqrt()).sum()


class _Slots:
    """Same-shape tensors in one doubling buffer: an append is amortized O(1) (its size known on the host), a write
    into a slot chosen on the device is one ``index_copy_``, a read one ``index_select`` (no host read); ``narrow``,
    never Python indexing, so fake CUDA tensors run it on a CPU build too."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.n = 0

    def append(self, t: torch.Tensor | bool) -> None:
        """Add ``t`` in a new slot (a Python bool fills a bool slot with no copy)."""
        if self.data is None:
            assert isinstance(t, torch.Tensor)
            self.data = t.new_empty((4, *t.shape))
        elif self.n == self.data.shape[0]:
            grown = self.data.new_empty((2 * self.n, *self.data.shape[1:]))
            self.data = grown.index_copy_(0, torch.arange(self.n, device=grown.device), self.data)
        at = torch.full((1,), self.n, dtype=torch.int64, device=self.data.device)  # a fill on the device, no copy
        if isinstance(t, torch.Tensor):
            self.data.index_copy_(0, at, t.unsqueeze(0).to(self.data.dtype))
        else:
            self.data.index_fill_(0, at, t)
        self.n += 1

    def put(self, at: torch.Tensor, t: torch.Tensor) -> None:
        """Overwrite the slot at the 1-element device index ``at`` with ``t``."""
        assert self.data is not None
        self.data.index_copy_(0, at, t.unsqueeze(0).to(self.data.dtype))

    def view(self) -> torch.Tensor:
        assert self.data is not None
        return self.data.narrow(0, 0, self.n)

    def pick(self, at: torch.Tensor) -> torch.Tensor:
        """A copy of the slot at the 1-element device index ``at``."""
        return self.view().index_select(0, at).squeeze(0)


@dataclass
class _Group:
    """The grad-on forwards of one token count, one per slot: fingerprints, target hashes, targets, ``have`` masks
    (when every forward has one), whether each slot's forward was recomputed (``taken``: a taken slot is free), and
    the device counts of the verdicts."""

    fps: _Slots = field(default_factory=_Slots)  #: [slots, 3]
    hashes: _Slots = field(default_factory=_Slots)  #: [slots]
    targets: _Slots = field(default_factory=_Slots)  #: [slots, T, K]
    haves: _Slots = field(default_factory=_Slots)  #: [slots, T] while every forward has one
    taken: _Slots = field(default_factory=_Slots)  #: [slots] bool
    all_have: bool = True
    forwards: int = 0
    recomputes: int = 0
    verdicts: torch.Tensor | None = None  #: [3] int64 on the device: miss, reused, ambiguous

    @property
    def outstanding(self) -> int:
        """Forwards not yet recomputed (host-known: every recompute takes one)."""
        return self.forwards - self.recomputes


class RecomputePool:
    """One router's grad-on forwards of the step, matched to its recomputes on the device (see the module)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.groups: dict[int, _Group] = {}

    def __len__(self) -> int:
        return sum(max(g.outstanding, 0) for g in self.groups.values())

    def add(self, targets: torch.Tensor, have: torch.Tensor | None, hidden: torch.Tensor) -> None:
        """Keep a grad-on forward's targets (``[T, K]``) and ``have`` beside its input's fingerprint, in a free slot
        (one a recompute took, found on the device) or a new one when every slot is outstanding."""
        g = self.groups.setdefault(int(targets.shape[0]), _Group())
        if g.outstanding >= MAX_LIVE:
            raise ReplayError(
                f"{self.name}: {g.outstanding} forwards with grad wait for a recompute: call "
                "step_done() after each step's last backward"
            )
        fp, h = fingerprint(hidden), _target_hash(targets)
        if have is None and g.all_have:
            g.all_have = False
            g.haves = _Slots()
        if have is not None:
            have = have.to(targets.device, non_blocking=True)
        if g.outstanding < g.fps.n:  # a recomputed forward's slot is free: the first one, chosen on the device
            at = g.taken.view().long().argmax().reshape(1)
            g.fps.put(at, fp)
            g.hashes.put(at, h)
            g.targets.put(at, targets)
            g.taken.view().index_fill_(0, at, False)
            if g.all_have:
                assert have is not None
                g.haves.put(at, have)
        else:
            g.fps.append(fp)
            g.hashes.append(h)
            g.targets.append(targets)
            g.taken.append(torch.zeros((), dtype=torch.bool, device=fp.device) if g.taken.data is None else False)
            if g.all_have:
                assert have is not None
                g.haves.append(have)
        g.forwards += 1

    def take(self, hidden: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The targets (and ``have``) of the live forward this recompute re-runs, chosen on the device; counts the
        pick's verdicts (miss, reused, ambiguous among the forwards live at this pick)."""
        g = self.groups.get(tokens)
        if g is None or g.outstanding <= 0:
            held = sorted(n for n, grp in self.groups.items() if grp.outstanding > 0)
            raise ReplayError(
                f"{self.name}: a recompute of {tokens} tokens, but no forward with grad of that size "
                f"waits for one (waiting: {held or 'none'}): its forward ran without grad, on no "
                "rows of rr's, or the step's rows were cleared (step_done) before its backward"
            )
        fp = fingerprint(hidden)
        taken, hashes = g.taken.view(), g.hashes.view()
        dist = _distance(g.fps.view(), fp)
        at = torch.argmin(dist + taken.double() * (10 * MATCH_TOLERANCE)).reshape(1)  # live first; never t[pick]
        live_twin = taken.logical_not() & (dist <= MATCH_TOLERANCE) & (hashes != hashes.index_select(0, at))
        found = torch.stack(
            [
                (dist.index_select(0, at) > MATCH_TOLERANCE).long().sum(),
                taken.index_select(0, at).long().sum(),
                live_twin.long().sum(),
            ]
        )
        g.verdicts = found if g.verdicts is None else g.verdicts + found
        taken.index_fill_(0, at, True)
        g.recomputes += 1
        return g.targets.pick(at), (g.haves.pick(at) if g.all_have else None)

    def verdicts(self, tally: DeviceTally, key: str) -> None:
        """Count, on the device, this step's mismatches under ``key``: ``miss`` (a recompute matched no forward),
        ``reused`` (a recompute took a forward already recomputed), ``ambiguous`` (forwards live at a recompute's
        pick with its input but other rows)."""
        for g in self.groups.values():
            if g.verdicts is not None:
                for name, count in zip(("miss", "reused", "ambiguous"), g.verdicts.unbind()):
                    tally.add(f"{key}/{name}", count)
