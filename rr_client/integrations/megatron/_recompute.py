"""Which forward a recompute re-runs, decided on the device: each recompute replays its own micro-batch's rows in
whatever order the backwards run.

Megatron's ``REPLAY_BACKWARD`` pops a FIFO, so it is right only when the backwards run in forward order. A backward
of micro-batch 2 before 1, one backward of the summed losses, or a grad-on forward-only pass left in the queue
makes a recompute replay another micro-batch's rows, silently. Here every grad-on forward of a router keeps its
targets beside a fingerprint of the router's input (two random projections, one weighted by token position, and
their scale: a recompute sees bit-identical input, another micro-batch does not); a recompute picks the forward whose
fingerprint is nearest its own (``argmin`` on the device, unused forwards first) and replays its targets. Nothing
in the hooks reads the device: the verdicts (a recompute whose input matched no forward, one forward matched twice,
two forwards with the same input but other rows) are counted in a :class:`DeviceTally` and read at ``step_done``.

Memory is bounded: a token-count group whose recomputes caught up with its forwards drops its targets; a pool past
:data:`COMPACT_AT` live forwards (many micro-batches in flight) drops the consumed ones after one host read; past
:data:`MAX_LIVE` it refuses (``step_done`` never called).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rr_client.core.errors import ReplayError
from rr_client.trainer.replay.phase import DeviceTally

__all__ = ["RecomputePool", "fingerprint", "MATCH_TOLERANCE", "COMPACT_AT", "MAX_LIVE"]

#: a recompute's fingerprint must be within this share of its forward's scale (recompute is bit-identical on one
#: device; the slack covers non-deterministic kernels); other micro-batches differ by order 1
MATCH_TOLERANCE = 1e-4
#: live (not yet known consumed) forwards per token-count group before the consumed ones are dropped (one host read)
COMPACT_AT = 32
#: live forwards per group that are refused: the step never ended (``step_done`` not called)
MAX_LIVE = 1024

_PROJECTIONS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _projection(hidden_size: int, device: torch.device) -> torch.Tensor:
    """``[hidden, 2]`` fixed random projections (seeded, so every rank and run agree), cached per device."""
    key = (hidden_size, device)
    if key not in _PROJECTIONS:
        gen = torch.Generator().manual_seed(0x5252)
        _PROJECTIONS[key] = torch.randn(hidden_size, 2, generator=gen).to(device)
    return _PROJECTIONS[key]


def fingerprint(hidden: torch.Tensor) -> torch.Tensor:
    """``[3]`` float64 on ``hidden``'s device: the token sum of a random projection, its position-weighted sum (a
    reordered batch differs) and their L2 scale (what the match is measured against: a sum's spread over tokens)."""
    x = hidden.detach().reshape(-1, hidden.shape[-1])
    p = x.float() @ _projection(int(x.shape[-1]), x.device)  # [T, 2]
    pos = torch.arange(1, p.shape[0] + 1, device=p.device, dtype=torch.float64) / max(int(p.shape[0]), 1)
    a, b = p[:, 0].double(), p[:, 1].double()
    return torch.stack([a.sum(), (b * pos).sum(), (a.square().sum() + b.square().sum()).sqrt()])


def _distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The match distance of fingerprints ``a`` and ``b`` (``[..., 3]``, broadcast): the larger projection gap as a
    share of their joint scale (0 for a bit-identical input)."""
    return (a[..., :2] - b[..., :2]).abs().amax(-1) / (a[..., 2] + b[..., 2] + 1e-30)


def _target_hash(targets: torch.Tensor) -> torch.Tensor:
    """0-d float64: a weighted sum of the targets (two forwards with equal input but other rows differ in it)."""
    w = torch.arange(1, targets.numel() + 1, device=targets.device, dtype=torch.float64).reshape(targets.shape)
    return (targets.double() * w.sqrt()).sum()


class _Stack:
    """Same-shape tensors in one doubling buffer: an append is amortized O(1) and a pick one ``index_select``, so a
    recompute copies only its own forward's rows, not every live forward's (as re-stacking a list would)."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.n = 0

    def append(self, t: torch.Tensor) -> None:
        if self.data is None:
            self.data = t.new_empty((4, *t.shape))
        elif self.n == self.data.shape[0]:
            grown = self.data.new_empty((2 * self.n, *self.data.shape[1:]))
            grown[: self.n] = self.data
            self.data = grown
        self.data[self.n] = t
        self.n += 1

    def view(self) -> torch.Tensor:
        assert self.data is not None
        return self.data[: self.n]

    def pick(self, at: torch.Tensor) -> torch.Tensor:
        """The row at the 1-element device index ``at`` (no host read)."""
        return self.view().index_select(0, at.to(self.view().device)).squeeze(0)

    def keep(self, rows: list[int]) -> None:
        """Only ``rows`` (host indices), in order."""
        if self.data is not None:
            self.data = self.view()[torch.tensor(rows, dtype=torch.long, device=self.data.device)]
            self.n = len(rows)

    def clear(self) -> None:
        self.data, self.n = None, 0


@dataclass
class _Group:
    """The grad-on forwards of one token count: fingerprints and use counts of all of them (small), the targets and
    ``have`` masks of the live ones (``live``: their indices into the fingerprints)."""

    fps: _Stack = field(default_factory=_Stack)  #: [n, 3] every forward's fingerprint
    hashes: list[torch.Tensor] = field(default_factory=list)
    used: torch.Tensor | None = None  #: [n] int64 on the device: recomputes that took each forward
    live: list[int] = field(default_factory=list)
    live_at: _Stack = field(default_factory=_Stack)  #: the live indices, on the device
    targets: _Stack = field(default_factory=_Stack)  #: [live, T, K]
    haves: _Stack = field(default_factory=_Stack)  #: [live, T] when every live forward has one
    all_have: bool = True
    best: list[torch.Tensor] = field(default_factory=list)  #: each recompute's match distance (share of scale)
    recomputes: int = 0

    def drop_live(self) -> None:
        self.live = []
        self.live_at.clear()
        self.targets.clear()
        self.haves.clear()
        self.all_have = True


class RecomputePool:
    """One router's grad-on forwards of the step, matched to its recomputes on the device (see the module)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.groups: dict[int, _Group] = {}

    def __len__(self) -> int:
        return sum(len(g.live) for g in self.groups.values())

    def add(self, targets: torch.Tensor, have: torch.Tensor | None, hidden: torch.Tensor) -> None:
        """Keep a grad-on forward's targets (``[T, K]``) and ``have`` beside its input's fingerprint."""
        g = self.groups.setdefault(int(targets.shape[0]), _Group())
        if len(g.live) >= COMPACT_AT:
            self._compact(g)
        if len(g.live) >= MAX_LIVE:
            raise ReplayError(
                f"{self.name}: {len(g.live)} forwards with grad wait for a recompute: call "
                "step_done() after each step's last backward"
            )
        fp = fingerprint(hidden)
        g.fps.append(fp)
        g.hashes.append(_target_hash(targets))
        one = torch.zeros(1, dtype=torch.int64, device=fp.device)
        g.used = one if g.used is None else torch.cat([g.used, one])
        g.live.append(g.fps.n - 1)
        g.live_at.append(torch.tensor(g.fps.n - 1, dtype=torch.int64, device=fp.device))
        g.targets.append(targets)
        if have is None:
            g.all_have = False
            g.haves.clear()
        elif g.all_have:
            g.haves.append(have)

    def take(self, hidden: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The targets (and ``have``) of the forward this recompute re-runs, chosen on the device."""
        g = self.groups.get(tokens)
        if g is None or not g.live:
            held = sorted(n for n, grp in self.groups.items() if grp.live)
            raise ReplayError(
                f"{self.name}: a recompute of {tokens} tokens, but no forward with grad of that size "
                f"waits for one (waiting: {held or 'none'}): its forward ran without grad, on no "
                "rows of rr's, or the step's rows were cleared (step_done) before its backward"
            )
        fp = fingerprint(hidden)
        assert g.used is not None
        live = g.live_at.view()
        dist = _distance(g.fps.view().index_select(0, live), fp)
        pick = torch.argmin(dist + g.used.index_select(0, live).double() * (10 * MATCH_TOLERANCE))  # ties: unused first
        at = pick.reshape(1)  # index_select, never ``t[pick]``: a 0-d tensor index is read on the host
        g.used.index_add_(0, live.index_select(0, at), torch.ones(1, dtype=torch.int64, device=fp.device))
        g.best.append(dist.index_select(0, at).squeeze(0))
        g.recomputes += 1
        targets = g.targets.pick(at)
        have = g.haves.pick(at) if g.all_have else None
        if g.recomputes >= g.fps.n:  # every forward of the group had its recompute: no targets needed any more
            g.drop_live()
        return targets, have

    def _compact(self, g: _Group) -> None:
        """Drop the live forwards a recompute already took (one host read of the use counts)."""
        assert g.used is not None
        used = g.used.tolist()
        keep = [j for j, i in enumerate(g.live) if used[i] == 0]
        g.live = [g.live[j] for j in keep]
        g.live_at.keep(keep)
        g.targets.keep(keep)
        if g.all_have:
            g.haves.keep(keep)

    def verdicts(self, tally: DeviceTally, key: str) -> None:
        """Count, on the device, this step's mismatches under ``key``: ``miss`` (a recompute matched no forward),
        ``reused`` (a forward taken by two recomputes), ``ambiguous`` (two recomputed forwards with one input but
        other rows)."""
        for g in self.groups.values():
            if g.best:
                tally.add(f"{key}/miss", (torch.stack(g.best) > MATCH_TOLERANCE).sum())
            if g.used is None:
                continue
            tally.add(f"{key}/reused", (g.used > 1).sum())
            if g.recomputes and g.fps.n > 1:
                fps, hashes = g.fps.view(), torch.stack(g.hashes)
                d = _distance(fps[:, None], fps[None, :])
                taken = g.used > 0
                same = (d <= MATCH_TOLERANCE) & (hashes[:, None] != hashes[None, :]) & taken[:, None] & taken[None, :]
                tally.add(f"{key}/ambiguous", same.sum())
