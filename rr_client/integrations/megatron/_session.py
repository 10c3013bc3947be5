"""``MegatronSession``: :class:`rr_client.trainer.ReplaySession` over Megatron-core's own ``RouterReplay``.

The session keeps what every backend shares (the audit cadence, the stale-rows policy where rows enter, the log-prob
gap and its per-segment keys, the provenance counts, the merge of the step's keys); :class:`MegatronBackend` maps its
calls onto :class:`rr_client.integrations.megatron.MegatronReplay`'s public methods: a feed is ``set_micro_batch``,
R2's recording ``record`` and its replay ``set_micro_batch(key=, tokens=)``, the end of a step ``step_done``. The
``MegatronReplay`` always reports per layer, so the session's merge takes the worst layer from it exactly as it does
from the Hugging Face audit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rr_client.core.provenance import StalePolicy
from rr_client.integrations.megatron._feeder import Feed, MtpPolicy, Parallel
from rr_client.integrations.megatron._lifecycle import AUDIT_EVERY
from rr_client.integrations.megatron._replay import MegatronReplay, Mode
from rr_client.trainer.session import ReplaySession

__all__ = ["MegatronSession", "MegatronBackend"]


class MegatronBackend:
    """One :class:`MegatronReplay` on this rank's model chunks, driven by a :class:`ReplaySession`."""

    every_token = True  #: Megatron's RouterReplay replays whole tensors: a token without rows gets pad rows

    def __init__(
        self,
        model_chunks: Any,
        *,
        mode: Mode = "R3",
        mtp: MtpPolicy = "auto",
        parallel: Parallel | None = None,
        audit_every: int = AUDIT_EVERY,
        others: Sequence[Any] = (),
    ) -> None:
        self.replay = MegatronReplay(
            model_chunks,
            mode=mode,
            mtp=mtp,
            parallel=parallel,
            audit_every=audit_every,
            log_layers=True,
            others=others,
            stale_rows="off",  # the session applies its policy where the rows enter, once
        )

    def feed(
        self,
        routing: Any,
        *,
        chunk: Any,
        mask: Any,
        layers: Any,
        attention_mask: Any,
        layout: dict[str, Any],
        segments: Any = None,
    ) -> Feed:
        """R3: this micro-batch's rows (and their token ``segments``) into the routers of ``chunk``
        (``set_micro_batch``)."""
        given = {
            k: v for k, v in (("mask", mask), ("layers", layers), ("attention_mask", attention_mask)) if v is not None
        }
        return self.replay.set_micro_batch(routing, chunk=chunk, segments=segments, **given, **layout)

    def replay_record(self, *, key: Any, input_ids: Any, chunk: Any) -> Feed:
        """R2's update: the record of micro-batch ``key``, bound to ``input_ids``."""
        return self.replay.set_micro_batch(key=key, tokens=input_ids, chunk=chunk)

    def record(self, *, key: Any, input_ids: Any, chunk: Any) -> None:
        """R2's old-log-prob pass: record the routers' own choice under ``key``."""
        self.replay.record(key, tokens=input_ids, chunk=chunk)

    def step_done(self) -> dict[str, float]:
        """End the step with its checks (``step_done(check=True)``): the report, or a raised verdict."""
        return self.replay.step_done(check=True)

    def abandon(self) -> None:
        """End the step without its checks while another error is on its way."""
        try:
            self.replay.step_done(check=False)
        except Exception:  # keep the error that is already raised
            pass

    def close(self) -> None:
        """Clear the routers and remove the hooks."""
        self.replay.close()


class MegatronSession(ReplaySession):
    """A :class:`rr_client.trainer.ReplaySession` whose replay is Megatron-core's ``RouterReplay`` on this rank's
    ``model_chunks``: a :class:`MegatronReplay` (``mode``, ``mtp``, ``parallel``, ``others`` as there; kept in
    :attr:`megatron_replay`). :meth:`open_replay` inside ``forward_step_func`` (``chunk=`` the chunk the schedule
    passes) applies the stale-rows policy and feeds the micro-batch; R2: :meth:`open_record` ``(key=, input_ids=)``
    in the old-log-prob pass, :meth:`open_replay` ``(key=, input_ids=)`` in the update; :meth:`flush` after the
    step's last backward ends Megatron's step (its verdicts raise there) and merges its audit with the gaps and
    provenance counts exactly as for the Hugging Face hooks; :meth:`detach` at the end removes rr's hooks."""

    def __init__(
        self,
        model_chunks: Any,
        *,
        mode: Mode = "R3",
        mtp: MtpPolicy = "auto",
        parallel: Parallel | None = None,
        others: Sequence[Any] = (),
        audit_every: int = AUDIT_EVERY,
        layers: Sequence[int] | None = None,
        log_layers: bool = False,
        stale_rows: StalePolicy = "refuse",
    ) -> None:
        backend = MegatronBackend(
            model_chunks, mode=mode, mtp=mtp, parallel=parallel, audit_every=audit_every, others=others
        )
        super().__init__(
            backend.replay.chunks,
            audit_every=audit_every,
            layers=layers,  # type: ignore[arg-type]
            log_layers=log_layers,
            stale_rows=stale_rows,
            backend=backend,
        )
        self.megatron_replay: MegatronReplay = backend.replay  #: the MegatronReplay this session drives
        backend.replay.share_clock(self.clock)  # one audit clock: the session's, advanced by its flush
