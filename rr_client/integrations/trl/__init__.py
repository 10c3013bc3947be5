"""R3 in TRL's GRPO: rollouts with routing from any rr server, replayed in every policy forward of the loss.

Two lines change in a TRL script::

    from rr_client.integrations.trl import R3GRPOTrainer, RRRollout
    trainer = R3GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                            rollout_func=RRRollout("http://127.0.0.1:8000"))

:class:`RRRollout` (``_rollout.py``) is TRL's ``rollout_func``: samples, the engine's sampling log-probs and the
checked routing. :class:`R3GRPOTrainer` (``_trainer.py``) is a thin adapter of TRL's trainer over
:class:`rr_client.trainer.ReplaySession`: the rows placed under TRL's batch, replay kept open until backward,
TRL's own importance-sampling correction with the engine's log-probs, applied in the loss by TRL's code (the same
rule as a function for plain loops: ``_correction.py``), weight sync.
Imports TRL (``pip install 'rr-replay[trl]'``), checked against the releases it was tested on.
"""

from __future__ import annotations

from rr_client.integrations.trl._correction import importance_sampling_ratio
from rr_client.integrations.trl._gate import TESTED_TRL, check_trl_version
from rr_client.integrations.trl._rollout import ROUTING_KEY, Rollout, RRRollout, sampled_logprobs, sampling_params_from
from rr_client.integrations.trl._trainer import GenerateOutput, R3GRPOTrainer

__all__ = [
    "R3GRPOTrainer",
    "RRRollout",
    "Rollout",
    "GenerateOutput",
    "TESTED_TRL",
    "ROUTING_KEY",
    "check_trl_version",
    "importance_sampling_ratio",
    "sampled_logprobs",
    "sampling_params_from",
]
