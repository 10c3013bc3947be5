"""The audit clock of verl's engines (FSDP and Megatron): one tick per training step, not per engine call."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rr_client.trainer.audit import AuditClock

__all__ = ["TrainingStepClock"]


class TrainingStepClock(AuditClock):
    """An :class:`rr_client.trainer.audit.AuditClock` advanced once per verl training step. verl calls its engine
    several times a step (the log-prob pass, then one update call per mini-batch: 5 with its default batch sizes);
    the session flushes each call without ticking (``ReplaySession.step(tick=False)``). A step runs from the first
    engine call after the previous step's update calls to the end of its own update calls, so every call of an
    audited step (its log-prob pass and all its update calls) is audited, the same for R2 and R3. The update calls
    end at the first of: verl's last update mini-batch (``update_lr_scheduler``, set by ``train_mini_batch``,
    verl 0.9.1 ``workers/engine_workers.py`` line 308), the engine leaving its outermost ``train_mode`` (which
    ``train_mini_batch`` holds around all its mini-batches and ``train_batch`` around one: update calls made
    without verl's marker still end their step), or a forward-only call after update calls."""

    def __init__(self, every: int) -> None:
        super().__init__(every)
        self.updating = False  #: the current step's update calls have begun
        self._depth = 0  #: nested ``train_mode`` blocks open

    def call_starts(self, forward_only: bool) -> None:
        """An engine call begins: a forward-only call after update calls opens the next step."""
        if forward_only:
            self.end_step()
        self.updating = self.updating or not forward_only

    def call_ends(self, forward_only: bool, last_update: bool) -> None:
        """An engine call ended (or raised): verl's last update mini-batch ends the step."""
        if not forward_only and last_update:
            self.end_step()

    def end_step(self) -> None:
        """The open step's update calls are over (a no-op when none ran): the step is finished."""
        if self.updating:
            self.updating = False
            self.tick()

    @contextmanager
    def train_mode(self) -> Iterator[None]:
        """Around the engine's ``train_mode`` block: leaving the outermost one ends the step's update calls."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.end_step()
