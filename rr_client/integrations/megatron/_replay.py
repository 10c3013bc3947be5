"""``MegatronReplay``: this rank's routers, checked once, fed per micro-batch through Megatron's own ``RouterReplay``.

Built on the model chunks of this rank: the routers are found by walking them (:mod:`._routers`), configurations that
bypass replay are refused, and every router gets a forward pre-hook that refuses a forward whose replay targets do
not have one row per token the router sees (Megatron would route the rest to no expert, silently). Targets are set
on each router's own ``RouterReplay`` instance, never through the positional global list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from rr_client.errors import ConfigurationError, ReplayError, ShapeMismatchError
from rr_client.integrations.megatron._feeder import Feed, MtpPolicy, Parallel, feed, parallel_from_state
from rr_client.integrations.megatron._gate import check_megatron_version
from rr_client.integrations.megatron._routers import MegatronRouter, check_config, check_registered, find_routers

__all__ = ["MegatronReplay", "Mode"]

Mode = Literal["R3", "R2"]


class MegatronReplay:
    """Replay (R3: the rollout's rows; R2: the rows the model recorded) on this rank's ``TopKRouter`` modules.

    ``model_chunks``: this rank's model (or its virtual-stage chunks); ``mtp``: MTP routers take rows
    (``"rows"``), are left to the model on purpose (``"skip"``), or take them when the rows hold their layer
    (``"auto"``); ``parallel``: this rank's layout (default: Megatron's ``parallel_state``).
    """

    def __init__(self, model_chunks: Any, *, mode: Mode = "R3", mtp: MtpPolicy = "auto",
                 parallel: Parallel | None = None) -> None:
        check_megatron_version()
        if mode not in ("R3", "R2"):
            raise ConfigurationError(f"mode must be 'R3' or 'R2', got {mode!r}")
        if mtp not in ("auto", "rows", "skip"):
            raise ConfigurationError(f"mtp must be 'auto', 'rows' or 'skip', got {mtp!r}")
        self.chunks = list(model_chunks) if isinstance(model_chunks, Sequence) else [model_chunks]
        self.mode, self.mtp = mode, mtp
        self.routers: list[MegatronRouter] = find_routers(self.chunks)
        if not self.routers:
            raise ReplayError("no TopKRouter in the given model chunks: nothing to replay on this rank "
                              "(pass the MoE model's chunks; a stage with dense layers only needs no MegatronReplay)")
        check_config(self.routers)
        check_registered(self.routers)
        self.parallel = parallel if parallel is not None else parallel_from_state(self.routers)
        self.left: list[MegatronRouter] = []  #: MTP routers the last feed left to the model
        self._hooks = [r.module.register_forward_pre_hook(self._check_tokens) for r in self.routers]

    # ------------------------------------------------------------------ targets
    def routers_of(self, chunk: int | None = None) -> list[MegatronRouter]:
        """The routers of model chunk ``chunk`` (a virtual stage), or all of them."""
        return [r for r in self.routers if chunk is None or r.chunk == chunk]

    def targets_for(self, routing: Any, *, chunk: int | None = None, **layout: Any) -> Feed:
        """This rank's targets for ``routing`` (the routers of ``chunk``, or all): see
        :func:`rr_client.integrations.megatron.router_targets` for ``routing`` and ``layout``'s keys."""
        return feed(self.routers_of(chunk), routing, parallel=layout.pop("parallel", self.parallel),
                    mtp=layout.pop("mtp", self.mtp), **layout)

    def set_targets(self, targets: dict[Any, torch.Tensor]) -> None:
        """Put ``targets`` (router module -> ``[tokens, topk]``) on each router's ``RouterReplay`` and replay them in
        the next forward (``REPLAY_FORWARD``); each set also queues them for a recompute (``REPLAY_BACKWARD``)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        check_registered(self.routers)
        known = {r.module for r in self.routers}
        for module, rows in targets.items():
            if module not in known:
                raise ReplayError(f"a target is keyed by a router this MegatronReplay does not hold "
                                  f"({type(module).__name__}): targets of another (rebuilt?) model")
            module.router_replay.set_target_indices(rows)
            module.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def set_micro_batch(self, routing: Any, *, chunk: int | None = None, **layout: Any) -> Feed:
        """Lay out ``routing`` for this rank and replay it in the next forward of the routers of ``chunk`` (or all);
        MTP routers the feed leaves get no action (they route themselves) and are listed in :attr:`left`."""
        got = self.targets_for(routing, chunk=chunk, **layout)
        for r in got.left:
            r.replay.clear_router_replay_action()
        self.left = got.left
        self.set_targets(got.targets)
        return got

    def step_done(self) -> None:
        """After the step's last backward: every router's targets, queue and action cleared."""
        for r in self.routers:
            r.replay.clear_indices()
            r.replay.clear_router_replay_action()

    def close(self) -> None:
        """Clear the routers' replay state and remove the token-count hooks."""
        self.step_done()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ the check Megatron lacks
    def _check_tokens(self, module: Any, args: tuple[Any, ...]) -> None:
        """Before a replayed router forward: refuse targets whose rows are not the tokens the router sees."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        rep = module.router_replay
        action = rep.router_replay_action
        if action == RouterReplayAction.REPLAY_FORWARD:
            rows = rep.target_topk_idx
        elif action == RouterReplayAction.REPLAY_BACKWARD:
            rows = rep.replay_backward_list[0] if rep.replay_backward_list else None
        else:
            return
        name = next((r.describe() for r in self.routers if r.module is module), type(module).__name__)
        if rows is None:
            raise ReplayError(f"{name}: {action.value} with no targets set (set_micro_batch before the forward)")
        hidden = args[0]
        tokens = hidden.numel() // hidden.shape[-1]
        if rows.dim() != 2 or int(rows.shape[0]) != tokens or int(rows.shape[1]) != int(module.topk):
            raise ShapeMismatchError(f"{name}: replay targets are {tuple(rows.shape)}, the router sees {tokens} "
                                     f"tokens with top-k {int(module.topk)}: Megatron would route the difference "
                                     "silently (check the context- / sequence-parallel layout and the micro-batch)")
