"""TRL's ``GRPOConfig`` as rr's tests run it on the CPU: logging every step, no reports, no checkpoints, float32,
seed 0, no KL term; each test sets its own batch, lengths, steps and learning rate (and may override these)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CPU_DEFAULTS: dict[str, Any] = dict(
    logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0, beta=0.0
)


def cpu_grpo_config(output_dir: str | Path, **fields: Any) -> Any:
    """``GRPOConfig(output_dir, **CPU_DEFAULTS, **fields)`` (``fields`` win)."""
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(output_dir), **{**CPU_DEFAULTS, **fields})
