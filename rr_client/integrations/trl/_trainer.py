"""``R3GRPOTrainer``: TRL's ``GRPOTrainer`` as a thin adapter over :class:`rr_client.trainer.ReplaySession`.

What is TRL-specific lives here: refusing settings before ``GRPOTrainer.__init__`` runs, carrying each sample's
index through TRL's shuffle and split, placing the rows under TRL's left-padded prompt + right-padded completion
batch, TRL's importance-sampling correction with the engine's log-probs (run by TRL's own code, see
:meth:`R3GRPOTrainer._trl_correction`), weight sync. The replay lifecycle (open until backward, audit every N
steps, merged metrics) is the session's.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from rr_client.core.errors import ConfigurationError, ReplayError, WeightSyncError
from rr_client.core.logprobs import check_comparable_logprobs
from rr_client.core.patching import Params, Shape, check_shapes
from rr_client.core.provenance import StalePolicy
from rr_client.integrations.trl._correction import MODES
from rr_client.integrations.trl._gate import TESTED_TRL, check_trl_version, trl
from rr_client.integrations.trl._rollout import ROUTING_KEY, Rollout, RRRollout, sampled_logprobs, sampling_params_from
from rr_client.integrations.weight_sync import DiskWeightSync
from rr_client.trainer import keys as K
from rr_client.trainer.layouts import RoutingTensors, to_tensors
from rr_client.trainer.metrics import token_logprobs
from rr_client.trainer.provenance import Segments, build_segments
from rr_client.trainer.replay import replay_indexer, replay_routing
from rr_client.trainer.session import AUDIT_EVERY, ReplaySession

__all__ = ["R3GRPOTrainer", "GenerateOutput", "Generation", "OVERRIDDEN", "check_trl_shapes"]

GRPOTrainer = trl.GRPOTrainer
# the GRPOTrainer methods R3GRPOTrainer overrides, with the parameters rr calls them with (TRL 1.16; ``...``: any
# names): checked when R3GRPOTrainer is defined, so a TRL that moved one is refused, never run with rr's hook unused
OVERRIDDEN: dict[str, Params] = {
    "__init__": ["self", "model", "reward_funcs", "args", ..., "rollout_func", ...],
    "_generate": ["self", "prompts"],
    "_generate_and_score_completions": ["self", "inputs"],
    "_compute_loss": ["self", "model", "inputs"],
    "training_step": ["self", "model", "inputs", "num_items_in_batch"],
    "_get_per_token_logps_and_entropies": [
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
        ...,
    ],
}
_SAMPLE_KEY = "rr_sample"  # per-sample index into the rollout, carried through TRL's shuffle/split
_BATCH_KEY = "rr_generation"  # per-sample serial of the rollout it came from (train and eval rollouts interleave)


class Generation(NamedTuple):
    """One rollout rr holds for replay: its serial (carried with each sample), TRL's mode when it was generated
    (``train`` / ``eval``) and its samples (their rows carry their provenance to the session's stale-rows policy)."""

    serial: int
    mode: str
    rollout: Rollout


def _samples(rt: RoutingTensors, start: int, end: int) -> RoutingTensors:
    """Samples ``start:end`` of a token-major :class:`RoutingTensors` (a TRL chunk), with their provenance."""
    cut = {
        f.name: v[start:end]
        for f in fields(rt)
        if isinstance(v := getattr(rt, f.name), torch.Tensor) or (f.name == "provenance" and v is not None)
    }
    return replace(rt, **cut)


class GenerateOutput(NamedTuple):
    """``GRPOTrainer._generate``'s tuple in TRL 1.16, by name (a different length is refused, never guessed)."""

    prompt_ids: Any
    completion_ids: Any
    tool_mask: Any
    completions: Any
    logprobs: Any
    extra_fields: dict[str, Any]
    images: Any
    tool_images: Any


def _refuse_before_init(args: Any, model: Any, rollout_func: Any, sync_weights: bool, kwargs: dict[str, Any]) -> None:
    """Every refusal that does not need TRL's trainer, before ``GRPOTrainer.__init__`` reaches any server."""
    if not isinstance(rollout_func, RRRollout):
        raise ConfigurationError(f"R3GRPOTrainer needs rollout_func=RRRollout(...), got {type(rollout_func).__name__}")
    if args is not None and getattr(args, "use_vllm", False):
        raise ConfigurationError(
            "R3GRPOTrainer: use_vllm=True makes TRL's own vLLM generate (and TRL connects to "
            "it now); RRRollout is the generator: set use_vllm=False"
        )
    if kwargs.get("tools") or kwargs.get("environment_factory") is not None:
        raise ConfigurationError(
            "R3GRPOTrainer: tools / environment_factory append tokens the engine did not route "
            "in this request; multi-turn R3 needs rr's Trajectory (not wired into TRL 1.16's "
            "tool loop)"
        )
    peft = kwargs.get("peft_config") is not None or hasattr(model, "peft_config")
    if sync_weights and peft:
        raise ConfigurationError(
            "R3GRPOTrainer(sync_weights=True) with a PEFT model: the engine needs merged "
            "weights; merge the adapter or sync yourself and pass sync_weights=False"
        )
    if args is None:
        return
    if args.vllm_importance_sampling_correction:
        mode = args.vllm_importance_sampling_mode
        if mode not in MODES:
            raise ConfigurationError(f"vllm_importance_sampling_mode={mode!r}; TRL accepts {', '.join(MODES)}")
        if args.loss_type == "vespo" and not mode.startswith("token"):  # TRL's own rule on its vLLM path
            raise ConfigurationError(
                f"loss_type='vespo' with vllm_importance_sampling_mode={mode!r}: VESPO needs "
                "'token_truncate' or 'token_mask' (as on TRL's vLLM path)"
            )
    sampled = sampling_temperature(args, rollout_func)
    if sampled != args.temperature:
        raise ConfigurationError(
            f"RRRollout samples at temperature {sampled} but GRPOConfig.temperature is "
            f"{args.temperature}: the trainer's log-probs (logits / {args.temperature}) would "
            "not be those of the sampling policy; set the temperature in one place"
        )


def rollout_sampling(args: Any, rollout: RRRollout) -> dict[str, Any]:
    """The sampling params ``rollout`` samples with for ``args`` (its ``sampling_params`` and ``generation_kwargs``
    win): what the engine's log-probs are checked against (temperature, top-k, top-p, min-p, penalties)."""
    return {**sampling_params_from(args, 1), **rollout.sampling_params}


def sampling_temperature(args: Any, rollout: RRRollout) -> float:
    """The temperature ``rollout`` samples at for ``args`` (its ``sampling_params`` and ``generation_kwargs`` win)."""
    return float(rollout_sampling(args, rollout)["temperature"])


def check_trl_shapes(trainer: type = GRPOTrainer) -> None:
    """Raise :class:`rr_client.UnsupportedVersionError` unless ``trainer`` (TRL's ``GRPOTrainer``) has every method
    R3GRPOTrainer overrides (:data:`OVERRIDDEN`) with the parameters rr passes; names the installed TRL."""
    check_shapes(Shape(trainer, OVERRIDDEN), what=f"TRL {trl.__version__} (rr was tested with TRL {TESTED_TRL})")


check_trl_shapes()  # once, as R3GRPOTrainer is created below


class R3GRPOTrainer(GRPOTrainer):  # type: ignore[misc, valid-type]
    """``GRPOTrainer`` that replays the rollout's routing in the loss, old-policy and reference forwards.

    ``rollout_func`` must be an :class:`RRRollout`. ``r3=False``: plain GRPO on the same rollouts (the
    agreement and log-prob gap are still logged). ``audit_every``: the replay audit (ids proven to reach the
    experts, :class:`rr_client.ReplayError` if not) on the first step and every N-th after (0: never).
    ``allow_untested``: replay a family whose formula is in rr but untested. ``log_layers``: per-layer keys too.
    TRL's importance-sampling correction runs with the engine's log-probs under TRL's own settings
    (``GRPOConfig.vllm_importance_sampling_correction``, on by default, its ``_mode`` / ``_clip_min`` /
    ``_clip_max``), by TRL's own code, into the loss as on TRL's vLLM path. A separate reference model
    (``beta > 0``) replays the same rows. ``sync_weights``: push the weights to the rollout's engines (with its API key) before every
    rollout that follows an optimizer step; ``sync_dir`` holds them (default ``<output_dir>/rr-weights``).
    ``verify_sync``: after each push, the engine's log-probs of a probe completion must match the trainer's
    within this tolerance, else :class:`rr_client.WeightSyncError`. ``sync_log``: one record per push.
    ``stale_rows``: a sample whose rows may have been recomputed across a weight update (its provenance says it was
    preempted across one) is refused with :class:`rr_client.StaleRoutingError` at the session's door, before the
    first forward of its batch (``"refuse"``), or trained with its replay masked off and kept out of the log-prob
    gap (``"mask"``); both, and samples spanning an update without a recompute, are counted once per step in the
    log (``r3/stale_masked``, ``r3/spans_update``, ...). The audit and the
    log-prob gap are logged per token segment too (``r3/cached_prompt/agreement``, ...). With TRL's evaluation
    (``eval_strategy``) each eval batch replays its own eval rollout's rows (metrics under ``eval_r3/``), kept apart
    from the training rollout TRL trains on again (``num_iterations``, ``steps_per_generation``).

    Refused before TRL's own ``__init__`` (:class:`rr_client.ConfigurationError`): ``use_vllm=True``, tools /
    environments, a PEFT model with ``sync_weights``, a ``rollout_func`` that is not an :class:`RRRollout`, a
    rollout temperature other than ``GRPOConfig.temperature``; then, after one ``/rr/info`` call,
    :class:`rr_client.LogprobsModeError` when the server's log-probs are raw (or of unknown mode) and the
    temperature is not 1, or the rollout samples with top-k, top-p, min-p or a penalty on (``GRPOConfig.top_p``
    etc., ``generation_kwargs``, ``RRRollout(sampling_params=)``). Multimodal inputs are refused when they arrive.
    """

    replays_rr_rollouts = True  #: what RRRollout checks before generating for a trainer

    def __init__(
        self,
        *args: Any,
        rollout_func: RRRollout,
        r3: bool = True,
        sync_weights: bool = True,
        sync_dir: str | Path | None = None,
        verify_sync: float | None = None,
        audit_every: int = AUDIT_EVERY,
        allow_untested: bool = False,
        log_layers: bool = False,
        stale_rows: StalePolicy = "refuse",
        **kwargs: Any,
    ) -> None:
        check_trl_version()
        model = kwargs.get("model", args[0] if args else None)
        cfg = kwargs.get("args", args[2] if len(args) > 2 else None)
        _refuse_before_init(cfg, model, rollout_func, sync_weights, kwargs)
        # what the engine samples with (GRPOConfig's defaults filter nothing when TRL makes the config)
        self._rr_sampling = (
            rollout_sampling(cfg, rollout_func) if cfg is not None else dict(rollout_func.sampling_params)
        )
        self._check_logprobs(rollout_func.info())  # the one server call before TRL's own __init__
        super().__init__(*args, rollout_func=rollout_func, **kwargs)
        self.r3 = r3
        self.rr_rollout: RRRollout = rollout_func
        self.rr_session = ReplaySession(
            self.accelerator.unwrap_model(self.model),
            audit_every=audit_every,
            allow_untested=allow_untested,
            log_layers=log_layers,
            stale_rows=stale_rows,
        )
        # the latest rollout of each mode: an eval rollout never replaces the training batch TRL still trains on
        # (num_iterations > 1, steps_per_generation > 1), nor a training rollout the eval batch
        self._rr_held: dict[str, Generation] = {}
        self._rr_latest: Generation | None = None  # the rollout just generated (TRL's scoring forwards use it)
        self._rr_serial = 0
        self._rr_segments: Segments | None = None  # the last loss forward's token segments
        self._rr_current: list[int] | None = None  # which samples the next forward holds (None: all, in order)
        self._rr_current_gen: Generation | None = None  # ... and of which rollout (with _rr_current)
        self._rr_loss_logps: torch.Tensor | None = None
        self._rr_sync: DiskWeightSync | None = None
        self.verify_sync = verify_sync
        self.sync_log: list[dict[str, Any]] = []
        self._rr_synced_step: int | None = None
        if sync_weights:
            directory = (
                Path(sync_dir)
                if sync_dir is not None
                else Path(self.args.output_dir or tempfile.mkdtemp()) / "rr-weights"
            )
            self._rr_sync = DiskWeightSync(rollout_func.engines, directory, api_key=rollout_func.api_key)

    def _check_logprobs(self, info: Any) -> None:
        """:class:`rr_client.LogprobsModeError` unless the engine's log-probs mean what the trainer's do: processed,
        or raw / unknown only at temperature 1 with no top-k, top-p, min-p or penalty in the rollout's sampling."""
        check_comparable_logprobs(
            info.logprobs_mode,
            None,  # the rollout's temperature, read from its sampling params
            consumer="R3GRPOTrainer (TRL's importance-sampling correction and the r3/ gaps)",
            sampling=self._rr_sampling,
        )

    @contextmanager
    def _trl_correction(self, on: bool = True) -> Iterator[None]:
        """The one place TRL's importance-sampling correction is switched on: TRL 1.16 computes the ratio, logs it
        and multiplies it into the per-token loss only where ``self.use_vllm and
        self.vllm_importance_sampling_correction`` holds (``_generate_and_score_completions``, ``_compute_loss``),
        so ``use_vllm`` reads True inside this block when the correction is on, and False (``on=False``) around
        TRL's ``_generate``, whose ``use_vllm`` means its own vLLM client. tests/unit/test_trl_integration.py
        checks TRL's source still reads ``use_vllm`` only there."""
        before = self.use_vllm
        self.use_vllm = bool(on and self.vllm_importance_sampling_correction)
        try:
            yield
        finally:
            self.use_vllm = before

    def _log(self, metrics: dict[str, float], mode: str) -> None:
        """The session's metrics into TRL's per-step log."""
        for k, v in metrics.items():
            self._metrics[mode][k].append(v)

    def _flush_eval(self) -> None:
        """The eval forwards' metrics into TRL's eval log. Not a training step: the audit schedule (``audit_every``,
        counted in the session's steps) stays the training steps'; an eval is audited when the next step is."""
        steps = self.rr_session.steps
        try:
            self._log(self.rr_session.flush(), "eval")
        finally:
            self.rr_session.steps = steps

    @property
    def _rr_batch(self) -> Rollout | None:
        """The samples of the rollout just generated (train or eval)."""
        return self._rr_latest.rollout if self._rr_latest is not None else None

    def _generation(self, inputs: dict[str, Any]) -> Generation:
        """The rollout a batch's samples came from (by the serial carried with them), if rr still holds it."""
        tags = inputs.get(_BATCH_KEY)
        if tags is None:
            raise ReplayError(f"the batch has no {_BATCH_KEY!r}: it did not come from R3GRPOTrainer's generation")
        serials = sorted({int(t) for t in tags.tolist()})
        held = {g.serial: g for g in self._rr_held.values()}
        if len(serials) != 1 or serials[0] not in held:
            holds = ", ".join(f"{g.mode} rollout {g.serial}" for g in self._rr_held.values()) or "none"
            raise ReplayError(
                f"the batch holds samples of rollout(s) {serials}; rr holds the rows of {holds} only (the latest "
                "of each mode): a batch must come whole from the latest training or eval rollout, as TRL forms them"
            )
        return held[serials[0]]

    # ------------------------------------------------------------------ weight sync

    def sync_weights(self) -> None:
        """Push the current weights to the engines unless this optimizer step's are there already.

        By reference, the main process then retires the rows of the replaced weights, between two barriers: every
        rank has run its micro-batches before (it is here, about to generate), and none generates before the
        retire (the server's weight version moves at the retire, so rows made after it are never retired by it).
        Only before a training rollout: an eval rollout may come while training rows are still to be read."""
        if self._rr_sync is None or self._rr_synced_step == self.state.global_step:
            return
        state_dict = self.accelerator.get_state_dict(self.model)  # gathers sharded (FSDP/ZeRO-3) weights
        self.accelerator.wait_for_everyone()  # every rank is here: its micro-batches (and their rows) ran
        seconds = 0.0
        if self.accelerator.is_main_process:
            seconds = self._rr_sync.push(
                self.accelerator.unwrap_model(self.model), self.state.global_step, state_dict=state_dict
            )
            if self.model.training:
                self.rr_rollout.retire()  # by reference: the rows of the weights just replaced are no longer read
        self.accelerator.wait_for_everyone()
        record: dict[str, Any] = {"step": self.state.global_step, "seconds": seconds}
        if self.verify_sync is not None:
            record.update(self._probe_engine())
            self._log({K.WEIGHT_SYNC_PROBE_GAP: record["probe_gap"]}, "train")
            if not record["probe_gap"] <= self.verify_sync:
                raise WeightSyncError(
                    f"after pushing step {self.state.global_step}'s weights the engine's log-probs differ from the "
                    f"trainer's by {record['probe_gap']:.3g} > verify_sync={self.verify_sync:g}: the engine does "
                    "not serve the trained weights (a reload that dropped weights? see the engine's log)"
                )
        self.sync_log.append(record)
        self._rr_synced_step = self.state.global_step
        self._log({K.WEIGHT_SYNC_SECONDS: seconds}, "train")

    def _probe_engine(self) -> dict[str, Any]:
        """Greedy probe on the engine; the trainer's log-probs of the same tokens under the engine's routing."""
        prompt = [int(t) for t in self._tokenizer("Routing replay weight sync probe.")["input_ids"]]
        batch = self.rr_rollout.generate([prompt], {"n": 1, "max_new_tokens": 4, "temperature": 0.0})
        r = self.rr_rollout.resolve([batch[0]])[0]
        engine = torch.tensor(sampled_logprobs(r), dtype=torch.float64)
        model = self.accelerator.unwrap_model(self.model)
        seq = torch.tensor([list(r.prompt_ids or []) + list(r.output_ids)], device=self.accelerator.device)
        rt = to_tensors([r], batch.info, pad_side="right")
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), replay_routing(model, rt):
                logits = model(seq).logits[0].double()
        finally:
            model.train(was_training)
        mine = token_logprobs(logits, seq[0].to(logits.device))[len(prompt) :].cpu()
        return {
            "probe_tokens": list(r.output_ids),
            "probe_engine_logprobs": engine.tolist(),
            "probe_trainer_logprobs": mine.tolist(),
            "probe_gap": float((mine - engine).abs().max()),
        }

    # ------------------------------------------------------------------ TRL hooks

    def _generate(self, prompts: list[Any]) -> Any:
        self.sync_weights()
        with self._trl_correction(False):
            raw = super()._generate(prompts)
        if not isinstance(raw, tuple) or len(raw) != len(GenerateOutput._fields):
            raise ReplayError(
                f"GRPOTrainer._generate returned {type(raw).__name__} of "
                f"{len(raw) if isinstance(raw, tuple) else '?'} items; TRL 1.16 returns "
                f"{len(GenerateOutput._fields)}: this TRL is not the one rr was tested with"
            )
        out = GenerateOutput(*raw)
        rollout = out.extra_fields.pop(ROUTING_KEY, None)
        if not isinstance(rollout, Rollout):
            raise ReplayError(f"the rollout returned no {ROUTING_KEY!r}: R3GRPOTrainer needs RRRollout's output")
        if out.tool_mask is not None:
            raise ReplayError("R3GRPOTrainer: an env_mask marks tokens the engine did not route in this request")
        got = [(list(r.prompt_ids or []), list(r.output_ids)) for r in rollout.results]
        if got != [(list(p), list(c)) for p, c in zip(out.prompt_ids, out.completion_ids)]:
            raise ReplayError("the rollout's routing belongs to other samples than the prompt/completion ids TRL got")
        self._check_logprobs(rollout.info)
        mode = "train" if self.model.training else "eval"
        self._rr_serial += 1
        self._rr_latest = self._rr_held[mode] = Generation(self._rr_serial, mode, rollout)
        self.rr_session.moe_layers = list(rollout.info.moe_layers)  # agreement over MoE layers only (r3=False)
        return raw

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self._rr_current, self._rr_current_gen, self._rr_latest = None, None, None
        with self._trl_correction():
            output = super()._generate_and_score_completions(inputs)
        generation = self._rr_latest
        if generation is None:
            raise ReplayError("TRL scored completions without calling _generate: no rollout rr could replay")
        ratio = output.get("importance_sampling_ratio")
        if ratio is not None:  # TRL's ratio, on the engine's log-probs: also under rr's keys
            flat = ratio.flatten() if ratio.shape[-1] == 1 else ratio[output["completion_mask"].bool()]
            if flat.numel():
                self._log(
                    {
                        K.IS_RATIO_MIN: float(flat.min()),
                        K.IS_RATIO_MEAN: float(flat.mean()),
                        K.IS_RATIO_MAX: float(flat.max()),
                    },
                    "train" if self.model.training else "eval",
                )
        output[_SAMPLE_KEY] = torch.arange(output["prompt_ids"].shape[0], device=output["prompt_ids"].device)
        output[_BATCH_KEY] = torch.full_like(output[_SAMPLE_KEY], generation.serial)
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        if _SAMPLE_KEY not in inputs:
            raise ReplayError(f"the batch has no {_SAMPLE_KEY!r}: it did not come from R3GRPOTrainer's generation")
        self._rr_current_gen = self._generation(inputs)
        self._rr_current = [int(i) for i in inputs[_SAMPLE_KEY].tolist()]
        self._rr_loss_logps = None
        try:
            with self._trl_correction():
                loss = super()._compute_loss(model, inputs)
        finally:
            self._rr_current, self._rr_current_gen = None, None
        engine = inputs.get("sampling_per_token_logps")
        if self._rr_loss_logps is not None and engine is not None:
            mask = inputs["completion_mask"].bool() & ~torch.isnan(engine)
            seg = self._rr_segments
            if seg is not None:  # the completion columns' codes, beside TRL's per-token log-probs
                seg = seg.columns(engine.shape[1], engine.device)
            # the samples the session's policy masked in this loss forward are out of the gap (its add_gap)
            self.rr_session.add_gap(self._rr_loss_logps.float(), engine.float(), mask, segments=seg)
        if not self.model.training:  # an eval batch: its replay and gap into the eval log, not the next step's
            self._flush_eval()
        return loss

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        try:
            out = super().training_step(model, inputs, num_items_in_batch)
        except BaseException:
            self.rr_session.abandon()
            raise
        # after backward: audit verdicts raise here. One flush per optimizer step (TRL's gradient-accumulation
        # boundary), so the step's metrics merge its micro-batches by the session's rules (token-weighted gaps,
        # worst share), as verl's do per mini-batch, not as a mean of per-micro-batch values.
        if self.accelerator.sync_gradients:
            self._log(self.rr_session.flush(), "train")
        else:
            self.rr_session.close()
        return out

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> Any:
        if any(v is not None for v in multimodal.values()):
            names = sorted(k for k, v in multimodal.items() if v is not None)
            raise ReplayError(f"R3GRPOTrainer: multimodal inputs ({', '.join(names)}) are not supported")
        rt, seg = self._rows_for(input_ids, logits_to_keep)
        session = self.rr_session
        own = self.accelerator.unwrap_model(model)
        if own is not session.model:  # TRL's separate reference model (beta > 0): the same rows, replayed in it
            return self._reference_forward(
                model, own, rt, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss
            )
        if torch.is_grad_enabled():  # the loss forward: one block, open until backward has run (checkpointing)
            self._rr_segments = seg
            if self.r3:
                session.open_replay(rt, segments=seg)  # the stale-rows policy on the rows' provenance
            else:
                session.open_record(rt.routed_experts, rt.routed_experts_mask)
            out = super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=input_ids.size(0),
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
            )
            self._rr_loss_logps = out[0].detach()
            return out

        def chunk_rows(s: int, e: int) -> AbstractContextManager[Any]:
            part = _samples(rt, s, e)  # the rows, their picks and provenance: the session's door takes them
            return (
                session.forward(part, segments=seg.narrow(s, e))
                if self.r3
                else session.recording(part.routed_experts, part.routed_experts_mask)
            )

        out = self._chunked(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, chunk_rows
        )
        if self._rr_current is not None:
            self._rr_loss_logps = out[0].detach()
            self._rr_segments = seg
        elif not self.model.training:  # TRL's eval scoring forward (an eval loss forward flushes in _compute_loss)
            self._flush_eval()
        return out

    def _chunked(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        compute_entropy: bool,
        compute_aux_loss: bool,
        chunk_rows: Callable[[int, int], AbstractContextManager[Any]],
    ) -> Any:
        """TRL's forward in its chunks of ``batch_size`` samples, samples ``[s, e)`` under ``chunk_rows(s, e)`` (their
        rows replayed or recorded): the log-probs joined, the entropies and the mean aux loss where asked."""
        n = input_ids.size(0)
        bs = batch_size or n
        logps, ents, auxes = [], [], []
        for s in range(0, n, bs):
            e = min(s + bs, n)
            with chunk_rows(s, e):
                out = super()._get_per_token_logps_and_entropies(
                    model,
                    input_ids[s:e],
                    attention_mask[s:e],
                    logits_to_keep,
                    batch_size=e - s,
                    compute_entropy=compute_entropy,
                    compute_aux_loss=compute_aux_loss,
                )
            logps.append(out[0])
            ents.append(out[1])
            auxes.append(out[2])
        return (
            torch.cat(logps, dim=0),
            torch.cat(ents, dim=0) if compute_entropy else None,
            torch.stack(auxes).mean() if compute_aux_loss else None,
        )

    def _reference_forward(
        self,
        model: Any,
        own: Any,
        rt: RoutingTensors,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        compute_entropy: bool,
        compute_aux_loss: bool,
    ) -> Any:
        """TRL's reference forward on a model other than the policy: replayed with the rollout's rows (audited in
        audited steps; ``r3=False``: its own routing, as plain GRPO), never with the policy's hooks."""
        if torch.is_grad_enabled():
            raise ReplayError(
                f"a forward with gradients on {type(own).__name__}, which is not the policy R3GRPOTrainer replays"
            )
        if not self.r3:
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
            )
        session = self.rr_session

        @contextmanager
        def chunk_rows(s: int, e: int) -> Iterator[None]:  # TRL's chunks, each under its own rows (and picks)
            part, _, _ = session.police(_samples(rt, s, e))  # the session's policy; masked samples route natively
            audited = session.clock.audited
            with ExitStack() as stack:
                stack.enter_context(
                    replay_routing(
                        own,
                        part,
                        check_every=session.check_every,
                        audit=audited,
                        allow_untested=session.allow_untested,
                    )
                )
                if part.indexer_topk is not None:
                    stack.enter_context(
                        replay_indexer(own, part.indexer_topk, layers=part.indexer_layers, audit=audited)
                    )
                yield

        return self._chunked(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, chunk_rows
        )

    # ------------------------------------------------------------------ rows under TRL's tokens

    def _rows_for(self, input_ids: torch.Tensor, logits_to_keep: int) -> tuple[RoutingTensors, Segments]:
        """The routing of the batch's own rollout placed under ``input_ids`` (TRL: prompts left-padded, completions
        right-padded), with its samples' provenance (the session's stale-rows policy reads it), and the batch's
        token segments.
        A loss forward's samples are those ``_compute_loss`` named (of the rollout they came from, train or eval);
        TRL's scoring forwards hold the rollout just generated, all of it, in order."""
        gen = self._rr_current_gen if self._rr_current is not None else self._rr_latest
        if gen is None:
            raise ReplayError("a log-prob forward ran before any rollout: no routing to replay")
        idx = self._rr_current if self._rr_current is not None else list(range(input_ids.size(0)))
        if len(idx) != input_ids.size(0):
            raise ReplayError(f"the batch has {input_ids.size(0)} samples but {len(idx)} routing indices")
        batch = gen.rollout
        if any(not 0 <= i < len(batch.results) for i in idx):
            raise ReplayError(
                f"sample indices {idx} of a batch of the {gen.mode} rollout {gen.serial}, which has "
                f"{len(batch.results)} samples: the batch's rows are not that rollout's"
            )
        results = [batch.results[i] for i in idx]
        unread = [r.routed_experts is None or (r.indexer_ref is not None and r.indexer_topk is None) for r in results]
        if any(unread):  # by reference: this micro-batch's rows (and indexer picks), read now
            results = self.rr_rollout.resolve(results)
            for i, r in zip(idx, results):
                batch.results[i] = r
        width = input_ids.size(1)
        pad = self._tokenizer.pad_token_id
        rt = to_tensors(
            results,
            batch.info,
            pad_side="split",
            prompt_length=width - logits_to_keep,
            response_length=logits_to_keep,
            pad_token_id=pad if pad is not None else 0,
        )
        real = rt.attention_mask.bool()
        ids = input_ids.detach().cpu()
        if not torch.equal(rt.input_ids[real], ids[real]):
            bad = next(b for b in range(len(results)) if not torch.equal(rt.input_ids[b][real[b]], ids[b][real[b]]))
            raise ReplayError(
                f"row {bad} of the batch (rollout sample {idx[bad]}) holds other tokens than the "
                "routing was recorded for: the rows would sit under the wrong tokens"
            )
        return rt, build_segments(results, rt)
