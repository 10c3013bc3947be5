"""R3 / R2 for Megatron-core trainers: rr's rows into Megatron's own ``RouterReplay``, laid out for every parallelism.

The feeder (``pip install 'rr-replay[megatron]'``; megatron-core is imported only inside this package)::

    from rr_client.integrations.megatron import MegatronReplay
    replay = MegatronReplay(model_chunks)            # routers walked, settings that bypass replay refused
    replay.set_micro_batch(routing)                  # inside forward_step_func, before the model's forward
    ...                                              # forward / backward of the step's micro-batches
    replay.step_done()                               # clear every router's targets and action

In a training loop, :class:`MegatronSession` (``session = MegatronSession(model_chunks)``; ``session.open_replay(
routing, chunk=model)`` inside ``forward_step_func``, ``session.flush()`` after the step) is the same
:class:`rr_client.trainer.ReplaySession` as on the Hugging Face path, over a ``MegatronReplay``: the stale-rows
policy, the log-prob gap and the ``r3/`` keys included.

``routing`` is a :class:`rr_client.RoutingTensors` (padded ``[b, s]``), a :class:`rr_client.PackedRouting` (THD)
or a ``[b, s, layers, topk]`` tensor. Each ``TopKRouter`` takes its own layer's rows (by ``layer_number``), checked
(width = top-k, ids in range, no repeated id, a row for every real token but each sample's last, and, at the
forward, one row per token the router sees), pads given distinct valid experts, sliced as Megatron slices the batch
for context parallelism (zigzag ``[b, s]`` or per packed sample), sharded for sequence parallelism, sequence-first,
int64 on the router's device. :func:`router_targets` is the same layout as a function.
"""

from __future__ import annotations

from rr_client.integrations.megatron._feeder import (
    Feed,
    MtpPolicy,
    PadClock,
    Parallel,
    feed,
    parallel_from_state,
    router_targets,
)
from rr_client.integrations.megatron._gate import TESTED_MEGATRON, check_megatron_version
from rr_client.integrations.megatron._layout import cp_thd_index, cp_zigzag_index, sp_shard
from rr_client.integrations.megatron._lifecycle import own_choice
from rr_client.integrations.megatron._replay import MegatronReplay, Mode
from rr_client.integrations.megatron._routers import REFUSED, MegatronRouter, check_config, find_routers, graphs_router
from rr_client.integrations.megatron._session import MegatronSession

__all__ = [
    "MegatronReplay",
    "MegatronSession",
    "Mode",
    "MtpPolicy",
    "router_targets",
    "feed",
    "check_config",
    "graphs_router",
    "own_choice",
    "Feed",
    "Parallel",
    "PadClock",
    "MegatronRouter",
    "find_routers",
    "parallel_from_state",
    "REFUSED",
    "TESTED_MEGATRON",
    "check_megatron_version",
    "cp_zigzag_index",
    "cp_thd_index",
    "sp_shard",
]
