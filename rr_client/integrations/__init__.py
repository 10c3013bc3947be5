"""Trainer integrations: R3 inside an RL trainer's own loop, one module per trainer.

Each module imports its trainer only there (``rr_client.integrations.trl`` needs ``rr-replay[trl]``);
:mod:`rr_client.integrations.weight_sync` (pushing the trained weights to the engine) is shared.
"""
