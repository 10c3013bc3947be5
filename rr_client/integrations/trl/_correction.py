"""TRL's importance-sampling rule as a function: :mod:`rr_client.trainer.correction` (no TRL needed there)."""

from __future__ import annotations

from rr_client.trainer.correction import MODES, importance_sampling_ratio

__all__ = ["MODES", "importance_sampling_ratio"]
