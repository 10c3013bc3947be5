"""rr's replay inside verl's FSDP actor engine (``FSDPEngineWithLMHead``, verl 0.9.1).

Mirrors verl's VeOmni replay: the engine carries ``routed_experts`` in the micro-batch like ``input_ids``;
``prepare_model_inputs`` arms the replay with the rows laid out the way the model sees the tokens (packed
``[1, N + pad]`` with remove-padding, right-padded ``[B, T]`` without), ``prepare_model_outputs`` hands back
what an R2 record pass saw. The replay block of a micro-batch stays open until the next micro-batch starts
(or the batch ends), so backward and its gradient-checkpointing recompute run replayed too. Each micro-batch's rows
enter through the session's one door (``ReplaySession.open_replay``: the stale-rows policy, the mask and the rows'
check, once); the audit runs per training step (:class:`TrainingStepClock`), not per engine call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from rr_client.core import settings
from rr_client.core.errors import ConfigurationError, MissingRoutingError, UnsupportedModelError
from rr_client.core.info import RRInfo
from rr_client.core.logprobs import PROCESSED, check_comparable_logprobs
from rr_client.core.source_audit import DEPTH_EDGES
from rr_client.trainer import keys as K
from rr_client.trainer.provenance import CACHED, COMPUTED, GENERATED, Segments
from rr_client.trainer.replay import find_routers
from rr_client.trainer.session import AUDIT_EVERY, ReplaySession

from . import _logprobs, _provenance
from ._clock import TrainingStepClock
from ._gate import REPLAY_MODES, check_verl_version
from ._rows import replay_rows, sample_of_rows, unpack_recorded

MODES = ("disabled", *REPLAY_MODES)


def _setting(engine_config: Any, name: str, default: Any) -> Any:
    """``<engine config>.router_replay.<name>`` (dataclass or plain mapping)."""
    rr = getattr(engine_config, "router_replay", None)
    return rr.get(name, default) if isinstance(rr, dict) else getattr(rr, name, default)


def replay_mode(engine_config: Any) -> str:
    """verl's own setting ``<engine config>.router_replay.mode`` (dataclass or plain mapping): disabled/R2/R3."""
    mode = str(_setting(engine_config, "mode", "disabled") or "disabled")
    if mode not in MODES:
        raise ConfigurationError(f"router_replay.mode={mode!r}; verl accepts {', '.join(MODES)}")
    return mode


def _valid(width: int, offsets: torch.Tensor) -> torch.Tensor:
    """``[B, width]``: True on the real tokens of verl's right-padded input (no remove-padding)."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.arange(width, device=offsets.device)[None, :] < lengths[:, None]


def check_gap_logprobs(temperature: Any) -> None:
    """Refuse (LogprobsModeError) a gap between the actor's and the rollout's log-probs that would not mean the
    same thing: the rollout's mode as the worker read it from its config (unknown without rr's worker), at this
    micro-batch's temperature (a scalar, or one per sample: the first that is not 1) and the rollout's sampling
    filters (top-k, top-p). No host read when the mode is post-temperature."""
    got = _logprobs.ROLLOUT_LOGPROBS.get("rollout")  # read through the module: the dict a reload rebinds
    mode = got.mode if got is not None else None
    if mode == PROCESSED:
        return
    if isinstance(temperature, torch.Tensor):
        off = temperature.detach().float().flatten().cpu()
        off = off[off != 1.0]
        temperature = float(off[0]) if off.numel() else 1.0
    source = got.source if got is not None else "the rollout's log-prob mode is unknown: rr's worker did not read it"
    check_comparable_logprobs(
        mode,
        None if temperature is None else float(temperature),
        consumer=f"verl's R3 log-prob gap ({source})",
        sampling=got.sampling if got is not None else None,
    )


def _prompt_lengths(micro_batch: Any) -> torch.Tensor | None:
    """Each sample's prompt length as verl's ``no_padding_2_padding`` reads it (``prompts`` nested, or the
    ``attention_mask`` over the prompt columns), on the batch's device; None when the batch carries neither."""
    keys = micro_batch.keys()
    if "prompts" not in keys:
        return None
    prompts = micro_batch["prompts"]
    if prompts.is_nested:
        return prompts.offsets().diff()
    if "attention_mask" not in keys:
        return None
    return micro_batch["attention_mask"][:, : prompts.shape[1]].sum(dim=1)


def _loss_ends(micro_batch: Any, prompt_lens: torch.Tensor | None) -> torch.Tensor | None:
    """``[B]``: the position of each sample's last loss token (its last ``response_mask`` token) in the sample's
    tokens, 0 where it has none; None when the batch carries no response mask or prompt lengths. On the device."""
    if prompt_lens is None or "response_mask" not in micro_batch.keys():
        return None
    rm = micro_batch["response_mask"]
    rm = (rm.to_padded_tensor(0) if rm.is_nested else rm).bool()
    if rm.shape[-1] == 0:
        return None
    col = torch.arange(rm.shape[-1], device=rm.device).expand_as(rm)
    last = torch.where(rm, col, torch.full_like(col, -1)).amax(dim=-1)
    return torch.where(last >= 0, prompt_lens.to(rm.device) + last, torch.zeros_like(last))


_NAMES = tuple((name, None) for name in K.SEGMENTS)


def _segments(
    offsets: torch.Tensor, prompt_lens: torch.Tensor, n_rows: int, width: int | None, cached: torch.Tensor
) -> Segments:
    """The micro-batch's rows cut into cached prompt (the first ``cached[i]`` tokens of sample ``i``: verl's
    ``num_cached_tokens``), computed prompt and generated, on the device. ``width``: the padded layout's. The gap's
    codes are set beside the log-probs (:meth:`prepare_model_outputs`)."""
    off = offsets.to(prompt_lens.device)
    lens = off[1:] - off[:-1]
    cached = cached.to(off.device)
    if width is None:  # packed rows, then pads
        idx = torch.arange(n_rows, device=off.device)
        sample = sample_of_rows(off, n_rows)
        pos = idx - off.index_select(0, sample)
        real = idx < off[-1]
        plen = prompt_lens.index_select(0, sample)
        hit = cached.index_select(0, sample)
    else:
        pos = torch.arange(width, device=off.device)[None, :].expand(lens.numel(), width)
        real = pos < lens[:, None]
        plen = prompt_lens[:, None]
        hit = cached[:, None]
    codes = torch.where(pos < hit, CACHED, torch.where(pos < plen, COMPUTED, GENERATED))
    rows = torch.where(real, codes, -1)
    return Segments(rows, rows.new_empty(0), _NAMES)


def _response_depths(plens: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """The context-depth bucket of each padded response column's token (its position: prompt length + column), for
    the gap by depth (``r3/depth/<bucket>/...``); None without prompt lengths."""
    if plens is None or len(shape) != 2:
        return None
    pos = plens.to(device).long()[:, None] + torch.arange(shape[1], device=device)[None, :]
    return torch.bucketize(pos, torch.tensor(DEPTH_EDGES, device=device), right=True)


if TYPE_CHECKING:  # for a type checker the mixin's super() is verl's engine; at run time the mixin stands alone
    _EngineBase = Any
else:
    _EngineBase = object


class RRFSDPEngineMixin(_EngineBase):
    """rr's R2/R3 replay for verl's FSDP actor engine: R3 replays the rollout's rows in every actor forward, R2
    records the log-prob recompute's own routing and replays it in the update epochs. Combined with verl's
    ``FSDPEngineWithLMHead`` at patch time (:func:`engine_class`); verl's mode setting switches it."""

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any) -> None:
        self.rr_mode = replay_mode(engine_config)
        sp = int(getattr(engine_config, "ulysses_sequence_parallel_size", 1) or 1)
        if self.rr_mode != "disabled":
            check_verl_version()
            if sp > 1:
                raise ConfigurationError(
                    f"router_replay.mode={self.rr_mode} with ulysses_sequence_parallel_size={sp}: rr does not "
                    "replay a sequence-parallel shard (its rows would land under other ranks' tokens); set it to "
                    "1 or router_replay.mode=disabled"
                )
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self.rr_info: RRInfo | None = None
        self.rr_session: ReplaySession | None = None
        self.rr_last_metrics: dict[str, float] = {}
        self._rr_action: str | None = None
        self._rr_record: Any = None
        self._rr_segments: Segments | None = None  # the open micro-batch's token segments
        self._rr_prompt_lens: torch.Tensor | None = None  # its samples' prompt lengths (the response's depth)

    def initialize(self) -> None:
        super().initialize()
        if self.rr_mode == "disabled":
            return
        cfg = self.model_config.hf_config
        import verl

        self.rr_info = RRInfo.from_hf_config(cfg.to_dict(), engine="verl", engine_version=verl.__version__)
        if not find_routers(self.module):
            raise UnsupportedModelError(
                f"router_replay.mode={self.rr_mode}: rr finds no replayable MoE router in {type(self.module).__name__}"
            )
        # verl's RouterReplayConfig takes no extra fields: rr's own knobs come from the environment (Ray's
        # runtime_env env_vars reach every worker)
        self.rr_session = ReplaySession(
            self.module,
            audit_every=settings.integer("RR_AUDIT_EVERY", default=AUDIT_EVERY),
            stale_rows=_provenance.stale_policy(),
            allow_untested=settings.flag("RR_ALLOW_UNTESTED_MODEL"),
            moe_layers=self.rr_info.moe_layers,
        )
        self.rr_session.clock = TrainingStepClock(self.rr_session.clock.every)  # one tick per training step

    # -- per batch
    def _rr_action_for(self, data: Any, forward_only: bool) -> str | None:
        if self.rr_mode == "disabled":
            return None
        from verl.utils import tensordict_utils as tu

        if tu.get_non_tensor_data(data, "enable_routing_replay", default=True) is False:
            return None  # verl's worker: the reference model's log-probs run unreplayed
        has = "routed_experts" in data.keys()
        if self.rr_mode == "R2" and forward_only and not has:
            return "record"
        if not has:
            raise MissingRoutingError(
                f"router_replay.mode={self.rr_mode}: the batch carries no routed_experts ("
                + (
                    "R3 needs actor_rollout_ref.rollout.enable_rollout_routing_replay=True"
                    if self.rr_mode == "R3"
                    else "R2 replays what compute_log_prob recorded; it was not in the update batch"
                )
                + ")"
            )
        return "replay"

    @contextlib.contextmanager
    def train_mode(self, **kwargs: Any) -> Iterator[Any]:
        """verl's ``train_mode`` block; leaving the outermost one ends the training step's update calls."""
        clock = self.rr_session.clock if self.rr_session is not None else None
        with contextlib.ExitStack() as stack:
            if isinstance(clock, TrainingStepClock):
                stack.enter_context(clock.train_mode())
            yield stack.enter_context(super().train_mode(**kwargs))

    def forward_backward_batch(self, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        clock = self.rr_session.clock if self.rr_session is not None else None
        if not isinstance(clock, TrainingStepClock):
            return self._rr_batch(data, loss_function, forward_only)
        from verl.utils import tensordict_utils as tu

        last = bool(tu.get_non_tensor_data(data, "update_lr_scheduler", default=False))
        clock.call_starts(forward_only)
        try:
            return self._rr_batch(data, loss_function, forward_only)
        finally:
            clock.call_ends(forward_only, last)

    def _rr_batch(self, data: Any, loss_function: Any, forward_only: bool) -> Any:
        """One engine call: verl's, replayed (or recorded) per micro-batch, flushed into its metrics."""
        self._rr_action = self._rr_action_for(data, forward_only)
        if self._rr_action is None:
            return super().forward_backward_batch(data, loss_function, forward_only)
        session = self.rr_session
        assert session is not None
        try:
            # closes the last micro-batch's block after its backward; the step's clock ticks (TrainingStepClock)
            with session.step(tick=not isinstance(session.clock, TrainingStepClock)) as met:
                out = super().forward_backward_batch(data, loss_function, forward_only)
        finally:
            self._rr_action = None
        self.rr_last_metrics = dict(met)
        if isinstance(out, dict) and isinstance(out.get("metrics"), dict):
            for k, v in met.items():
                out["metrics"][f"actor/{k}"] = [v]
        return out

    # -- per micro-batch
    def prepare_model_inputs(self, micro_batch: Any) -> Any:
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        if self._rr_action is None:
            return model_inputs, output_args
        from verl.utils import tensordict_utils as tu

        session = self.rr_session
        assert session is not None
        rmpad = tu.get_non_tensor_data(micro_batch, "use_remove_padding", default=True)
        offsets = micro_batch["input_ids"].offsets()
        pad = int(output_args.get("pad_size", 0)) if rmpad else 0
        if self._rr_action == "record":
            self._rr_record = session.open_record()  # closes the previous micro-batch's block first
        else:
            assert self.rr_info is not None
            if "rollout_log_probs" in micro_batch.keys():  # rr computes the gap: do both sides mean the same?
                check_gap_logprobs(micro_batch["temperature"])  # the temperature verl's forward divides by
            n = offsets.numel() - 1
            provs = _provenance.batch_provenances(micro_batch, n)
            plens = _prompt_lengths(micro_batch)
            width = None if rmpad else int(model_inputs["input_ids"].shape[-1])
            rows = replay_rows(
                micro_batch["routed_experts"],
                offsets,
                self.rr_info,
                pad=pad,
                width=width,
                loss_end=_loss_ends(micro_batch, plens),
                provenance=provs,
            )
            tokens = None  # which rows are real tokens: pads count neither replayed nor left
            if width is not None:
                tokens = _valid(width, offsets.to(rows.device))
            elif pad:
                n_tok = int(rows.rows.shape[1]) - pad
                tokens = torch.cat([rows.have.new_ones(n_tok), rows.have.new_zeros(pad)])
            self._rr_prompt_lens = plens
            self._rr_segments = (
                None
                if plens is None
                else _segments(
                    offsets, plens, int(rows.rows.shape[1]), width, _provenance.cached_counts(provs, plens.device)
                )
            )
            # the one door: the stale-rows policy on the rows' provenance, the mask, the rows' one check; the block
            # stays open until the next micro-batch, so its backward runs replayed
            with _provenance.naming_knob():
                session.open_replay(rows, tokens=tokens, segments=self._rr_segments)
        output_args["rr_pad"] = pad
        return model_inputs, output_args

    def prepare_model_outputs(self, output: Any, output_args: Any, micro_batch: Any, logits_processor_func: Any) -> Any:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        model_output = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        if self._rr_action == "record":
            rec = self._rr_record.routed_experts
            offsets = micro_batch["input_ids"].offsets()
            if tu.get_non_tensor_data(micro_batch, "use_remove_padding", default=True):
                flat = rec.reshape(-1, *rec.shape[-2:])
                model_output["routed_experts"] = unpack_recorded(flat, offsets.cpu(), output_args.get("rr_pad", 0))
            else:
                valid = _valid(rec.shape[1], offsets.cpu())
                model_output["routed_experts"] = unpack_recorded(rec[valid], offsets.cpu())
        elif self._rr_action == "replay" and "rollout_log_probs" in micro_batch.keys():
            lp = model_output.get("log_probs")
            if lp is not None:
                lp = no_padding_2_padding(lp.detach(), micro_batch)
                ref = micro_batch.select("rollout_log_probs", "response_mask").to_padded_tensor()
                assert self.rr_session is not None
                seg = self._rr_segments
                if seg is not None:  # every response token is generated (verl carries no turns)
                    seg = Segments(
                        seg.rows,
                        torch.full(tuple(lp.shape), GENERATED, dtype=torch.long, device=lp.device),
                        seg.names,
                        _response_depths(self._rr_prompt_lens, tuple(lp.shape), lp.device),
                    )
                # the samples the policy masked in this micro-batch's door leave the gap (the session's keep)
                self.rr_session.add_gap(
                    lp.float(), ref["rollout_log_probs"].float(), ref["response_mask"].bool(), segments=seg
                )
        return model_output


ENGINE_NAME = "RRFSDPEngineWithLMHead"


def engine_class(base: type) -> type:
    """verl's engine class ``base`` (``FSDPEngineWithLMHead``) with rr's replay: ``(RRFSDPEngineMixin, base)``, built
    when verl's engine module is imported (rr's patch checks ``base``'s shape first)."""
    return type(
        ENGINE_NAME,
        (RRFSDPEngineMixin, base),
        {"__module__": __name__, "__qualname__": ENGINE_NAME, "__doc__": RRFSDPEngineMixin.__doc__},
    )
