"""R3 in TRL's GRPO: rollouts with routing from any rr server, replayed in every policy forward of the loss.

Two lines change in a TRL script::

    from rr_client.integrations.trl import R3GRPOTrainer, RRRollout
    trainer = R3GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                            rollout_func=RRRollout("http://127.0.0.1:8000"))

:class:`RRRollout` is TRL's ``rollout_func``: it tokenizes the prompts with TRL's own code, sends each
prompt's ``num_generations`` samples as one ``n`` request to rr's ``/generate`` (one URL or replicas), and
returns ``prompt_ids``, ``completion_ids``, ``logprobs`` plus the checked routing. TRL 1.16 hands extra keys
to the reward functions only, so :class:`R3GRPOTrainer` takes the routing out, carries each sample's index
through TRL's shuffle and split, and runs every log-prob forward (the loss, the old-policy and the reference
forwards) under :func:`rr_client.trainer.replay.replay_routing` with the rows placed under TRL's own left-padded prompt
+ right-padded completion batch; the tokens under the rows are compared with TRL's before any forward.
Before each rollout after an optimizer step it pushes the weights to the engine
(:class:`rr_client.integrations.weight_sync.DiskWeightSync`). It logs ``r3/...`` metrics in TRL's log.
``r3=False`` is plain GRPO on the same rollouts (the metrics still measure the gap), for comparison.

Imports TRL (``pip install 'rr-replay[trl]'``), checked against the releases it was tested on.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rr_client import settings
from rr_client.errors import ReplayError, WeightSyncError

try:
    import torch
    import trl
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("rr_client.integrations.trl needs TRL: pip install 'rr-replay[trl]'") from e

from rr_client._client import RoutedExpertsClient
from rr_client._results import GenerateResult
from rr_client.trainer.layouts import to_tensors
from rr_client.agreement import routing_agreement
from rr_client.info import RRInfo
from rr_client.integrations._loop import LoopThread
from rr_client.integrations.weight_sync import DiskWeightSync
from rr_client.trainer.metrics import r3_metrics, token_logprobs
from rr_client.trainer.replay import record_routing, replay_routing

__all__ = ["R3GRPOTrainer", "RRRollout", "TESTED_TRL", "ROUTING_KEY"]

TESTED_TRL = ("1.16",)
"""TRL releases (major.minor) this integration was run against; others are refused unless
``RR_ALLOW_UNSUPPORTED_VERSION=1`` (it reaches into ``GRPOTrainer``'s private methods, which move)."""

ROUTING_KEY = "rr_rollout"
"""The extra key :class:`RRRollout` returns its routing under (TRL would pass it to reward functions)."""

_SAMPLE_KEY = "rr_sample"  # per-sample index into the rollout, carried through TRL's shuffle/split


def check_trl_version(version: str | None = None) -> None:
    """Refuse a TRL release this integration was not tested on (names the tested ones and the override)."""
    v = version or trl.__version__
    if not any(v == t or v.startswith(t + ".") for t in TESTED_TRL):
        if settings.flag("RR_ALLOW_UNSUPPORTED_VERSION"):
            return
        raise ImportError(f"rr_client.integrations.trl was tested with TRL {', '.join(TESTED_TRL)}; this is TRL {v}. "
                          "It overrides GRPOTrainer internals that change between releases: pin trl==1.16.* or set "
                          "RR_ALLOW_UNSUPPORTED_VERSION=1 at your own risk")


@dataclass(frozen=True)
class Rollout:
    """One generation's samples (TRL's order) and the routing dimensions they were checked against."""

    results: list[GenerateResult]
    info: RRInfo


def sampling_params_from(args: Any, n: int) -> dict[str, Any]:
    """rr ``/generate`` sampling params from a ``GRPOConfig`` (its ``generation_kwargs`` win), ``n`` samples."""
    sp: dict[str, Any] = {
        "n": n,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k if args.top_k else -1,  # TRL: 0 = off; rr/SGLang: -1 = off
        "repetition_penalty": args.repetition_penalty,
    }
    if args.max_completion_length is not None:
        sp["max_new_tokens"] = args.max_completion_length
    if args.min_p is not None:
        sp["min_p"] = args.min_p
    extra = args.generation_kwargs or {}
    if isinstance(extra, str):
        raise ValueError("GRPOConfig.generation_kwargs must be a dict for RRRollout")
    sp.update(extra)
    return sp


class RRRollout:
    """TRL ``rollout_func`` over :class:`rr_client.RoutedExpertsClient`: samples, their log-probs and routing.

    ``base_url``: one rr server or a list of replicas (load-balanced by the client). ``engine_urls``: the
    engines to push weights to, when ``base_url`` is a router or rr's sidecar (default: ``base_url``).
    ``sampling_params`` override those taken from the ``GRPOConfig``; ``client_options`` go to the client
    (``timeout``, ``max_concurrency``, ``api_key``, ...). Use it with :class:`R3GRPOTrainer` only: TRL's own
    ``GRPOTrainer`` would hand the routing to the reward functions and train without replay.
    """

    def __init__(self, base_url: str | Sequence[str], *, engine_urls: str | Sequence[str] | None = None,
                 sampling_params: Mapping[str, Any] | None = None, **client_options: Any) -> None:
        check_trl_version()
        self.urls = [base_url] if isinstance(base_url, str) else list(base_url)
        eng = engine_urls if engine_urls is not None else self.urls
        self.engine_urls = [eng] if isinstance(eng, str) else list(eng)
        self.sampling_params = dict(sampling_params or {})
        self._loop = LoopThread()

        async def make() -> RoutedExpertsClient:
            return RoutedExpertsClient(self.urls if len(self.urls) > 1 else self.urls[0], **client_options)

        self.client = self._loop.run(make())

    def info(self) -> RRInfo:
        """The served model's ``/rr/info`` (cached by the client)."""
        return self._loop.run(self.client.info())

    def close(self) -> None:
        """Close the client and its loop thread."""
        self._loop.run(self.client.aclose())
        self._loop.close()

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        if not isinstance(trainer, R3GRPOTrainer):
            raise TypeError("RRRollout returns routing that only R3GRPOTrainer replays; with "
                            f"{type(trainer).__name__} TRL would pass it to the reward functions and train without "
                            "replay. Use rr_client.integrations.trl.R3GRPOTrainer (r3=False for plain GRPO)")
        prompt_ids, images, mm = trainer._tokenize_prompts(prompts)
        if images is not None or mm:
            raise ReplayError("RRRollout: multimodal prompts are not supported (rr's /generate takes token ids only)")
        n = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        prompt_ids = [list(map(int, p)) for p in prompt_ids]
        groups = len(prompt_ids) // n if n and len(prompt_ids) % n == 0 else 0
        if groups and all(prompt_ids[g * n + j] == prompt_ids[g * n] for g in range(groups) for j in range(n)):
            unique, per = [prompt_ids[g * n] for g in range(groups)], n  # TRL repeats each prompt n times in a row
        else:
            unique, per = prompt_ids, 1
        sp = {**sampling_params_from(trainer.args, per), **self.sampling_params, "n": per}
        batch = self._loop.run(self.client.generate(unique, sp, return_logprob=True))
        results = list(batch)
        if len(results) != len(prompt_ids):
            raise ReplayError(f"RRRollout: {len(results)} samples for {len(prompt_ids)} prompts")
        logprobs = [_sampled_logprobs(r) for r in results]
        return {
            "prompt_ids": [r.prompt_ids for r in results],
            "completion_ids": [list(r.output_ids) for r in results],
            "logprobs": logprobs,
            ROUTING_KEY: Rollout(results, batch.info),
        }


def _sampled_logprobs(r: GenerateResult) -> list[float]:
    """The sampled tokens' log-probs (``[logprob, token_id, _]`` per token), checked against the tokens."""
    rows = r.meta.get("output_token_logprobs")
    if not isinstance(rows, list) or len(rows) != len(r.output_ids):
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise ReplayError(f"sample {r.index}: {got} output_token_logprobs for {len(r.output_ids)} tokens")
    if [int(x[1]) for x in rows] != [int(t) for t in r.output_ids]:
        raise ReplayError(f"sample {r.index}: output_token_logprobs name other tokens than output_ids")
    return [float(x[0]) for x in rows]


class R3GRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` that replays the rollout's routing in the loss, old-policy and reference forwards.

    ``rollout_func`` must be an :class:`RRRollout`. ``r3=False``: plain GRPO on the same rollouts (metrics
    still logged). ``sync_weights``: push the weights to the engines before every rollout that follows an
    optimizer step (and before the first); ``sync_dir`` holds them (default: ``<output_dir>/rr-weights``; it
    must be readable by the engines). ``audit``: the replay audit (rows reaching the experts) on every forward,
    raising :class:`rr_client.ReplayError` when replay did not take effect. ``log_layers``: per-layer
    ``r3/layer<i>/...`` keys too. ``verify_sync``: after each push, the engine's log-probs of a probe
    completion must match the trainer's (replaying the engine's routing) within this tolerance, else
    :class:`rr_client.WeightSyncError` (1e-4 suits an fp32 engine; a bf16 engine needs ~0.1 and then only
    catches gross failures). ``sync_log`` keeps one record per push (step, seconds, probe log-probs, gap).

    Refused (clear error, never trained unreplayed): tools / environments (their tokens were not routed
    by the engine in this request), multimodal inputs, ``use_vllm=True`` (TRL's own vLLM generates then), a
    PEFT model with ``sync_weights`` (the engine needs merged weights).
    """

    def __init__(self, *args: Any, rollout_func: RRRollout, r3: bool = True, sync_weights: bool = True,
                 sync_dir: str | Path | None = None, verify_sync: float | None = None, audit: bool = True,
                 log_layers: bool = False, **kwargs: Any) -> None:
        check_trl_version()
        if not isinstance(rollout_func, RRRollout):
            raise TypeError(f"R3GRPOTrainer needs rollout_func=RRRollout(...), got {type(rollout_func).__name__}")
        super().__init__(*args, rollout_func=rollout_func, **kwargs)
        if self.tools or self.environment_factories is not None:
            raise ReplayError("R3GRPOTrainer: tools / environment_factory append tokens the engine did not route in "
                              "this request; multi-turn R3 needs rr's Trajectory (not wired into TRL 1.16's tool loop)")
        if self.use_vllm:
            raise ValueError("R3GRPOTrainer: use_vllm=True makes TRL's own vLLM generate; RRRollout is the generator")
        self.r3 = r3
        self.audit = audit
        self.log_layers = log_layers
        self.rr_rollout: RRRollout = rollout_func
        self._rr_batch: Rollout | None = None  # the latest generation's samples
        self._rr_current: list[int] | None = None  # which samples the next forward holds (None: all, in order)
        self._rr_open = ExitStack()  # grad-mode replays stay open until backward has run (checkpointing)
        self._rr_open_reports: list[dict[str, float]] = []
        self._rr_loss_logps: torch.Tensor | None = None
        self._rr_sync: DiskWeightSync | None = None
        self.verify_sync = verify_sync
        self.sync_log: list[dict[str, Any]] = []
        self._rr_synced_step: int | None = None
        if sync_weights:
            if hasattr(self.accelerator.unwrap_model(self.model), "peft_config"):
                raise ValueError("R3GRPOTrainer(sync_weights=True) with a PEFT model: the engine needs merged "
                                 "weights; merge the adapter or sync yourself and pass sync_weights=False")
            directory = Path(sync_dir) if sync_dir is not None else Path(self.args.output_dir or
                                                                          tempfile.mkdtemp()) / "rr-weights"
            self._rr_sync = DiskWeightSync(rollout_func.engine_urls, directory)

    # ------------------------------------------------------------------ weight sync

    def sync_weights(self) -> None:
        """Push the current weights to the engines unless this optimizer step's are there already."""
        if self._rr_sync is None or self._rr_synced_step == self.state.global_step:
            return
        state_dict = self.accelerator.get_state_dict(self.model)  # gathers sharded (FSDP/ZeRO-3) weights
        seconds = 0.0
        if self.accelerator.is_main_process:
            seconds = self._rr_sync.push(self.accelerator.unwrap_model(self.model), self.state.global_step,
                                         state_dict=state_dict)
        self.accelerator.wait_for_everyone()
        record: dict[str, Any] = {"step": self.state.global_step, "seconds": seconds}
        if self.verify_sync is not None:
            record.update(self._probe_engine())
            self._metrics["train"]["r3/weight_sync_probe_gap"].append(record["probe_gap"])
            if not record["probe_gap"] <= self.verify_sync:
                raise WeightSyncError(
                    f"after pushing step {self.state.global_step}'s weights the engine's log-probs differ from the "
                    f"trainer's by {record['probe_gap']:.3g} > verify_sync={self.verify_sync:g}: the engine does "
                    "not serve the trained weights (a reload that dropped weights? see the engine's log)")
        self.sync_log.append(record)
        self._rr_synced_step = self.state.global_step
        self._metrics["train"]["r3/weight_sync_seconds"].append(seconds)

    def _probe_engine(self) -> dict[str, Any]:
        """Greedy probe on the engine; the trainer's log-probs of the same tokens under the engine's routing."""
        prompt = [int(t) for t in self._tokenizer("Routing replay weight sync probe.")["input_ids"]]
        rollout = self.rr_rollout
        batch = rollout._loop.run(rollout.client.generate([prompt], {"n": 1, "max_new_tokens": 4,
                                                                     "temperature": 0.0}, return_logprob=True))
        r = batch[0]
        engine = torch.tensor(_sampled_logprobs(r), dtype=torch.float64)
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
        mine = token_logprobs(logits, seq[0].to(logits.device))[len(prompt):].cpu()
        return {"probe_tokens": list(r.output_ids), "probe_engine_logprobs": engine.tolist(),
                "probe_trainer_logprobs": mine.tolist(), "probe_gap": float((mine - engine).abs().max())}

    # ------------------------------------------------------------------ TRL hooks

    def _generate(self, prompts: list[Any]) -> Any:
        self.sync_weights()
        out = super()._generate(prompts)
        prompt_ids, completion_ids, tool_mask, extra = out[0], out[1], out[2], out[5]
        rollout = extra.pop(ROUTING_KEY, None)
        if not isinstance(rollout, Rollout):
            raise ReplayError(f"the rollout returned no {ROUTING_KEY!r}: R3GRPOTrainer needs RRRollout's output")
        if tool_mask is not None:
            raise ReplayError("R3GRPOTrainer: an env_mask marks tokens the engine did not route in this request")
        got = [(list(r.prompt_ids or []), list(r.output_ids)) for r in rollout.results]
        if got != [(list(p), list(c)) for p, c in zip(prompt_ids, completion_ids)]:
            raise ReplayError("the rollout's routing belongs to other samples than the prompt/completion ids TRL got")
        self._rr_batch = rollout
        return out

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self._rr_current = None
        output = super()._generate_and_score_completions(inputs)
        output[_SAMPLE_KEY] = torch.arange(output["prompt_ids"].shape[0], device=output["prompt_ids"].device)
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        if _SAMPLE_KEY not in inputs:
            raise ReplayError(f"the batch has no {_SAMPLE_KEY!r}: it did not come from R3GRPOTrainer's generation")
        self._rr_current = [int(i) for i in inputs[_SAMPLE_KEY].tolist()]
        self._rr_loss_logps = None
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._rr_current = None
        if self._rr_loss_logps is not None and inputs.get("sampling_per_token_logps") is not None:
            mode = "train" if self.model.training else "eval"
            mask = inputs["completion_mask"].bool() & ~torch.isnan(inputs["sampling_per_token_logps"])
            if bool(mask.any()):
                m = r3_metrics(self._rr_loss_logps.float(), inputs["sampling_per_token_logps"].float(), mask)
                self._metrics[mode]["r3/mean_abs_logp_diff"].append(m.mean_abs_diff)
                self._metrics[mode]["r3/k3_kl"].append(m.k3_kl)
                self._metrics[mode]["r3/frac_abs_diff_gt_ln2"].append(m.frac_gt_ln2)
        return loss

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        try:
            out = super().training_step(model, inputs, num_items_in_batch)
        except BaseException as e:
            self._rr_open.__exit__(type(e), e, e.__traceback__)
            self._rr_open = ExitStack()
            self._rr_open_reports = []
            raise
        stack, reports = self._rr_open, self._rr_open_reports
        self._rr_open, self._rr_open_reports = ExitStack(), []
        stack.close()  # after backward: the audit's checks run here and raise ReplayError if replay failed
        self._log_reports(reports, "train")
        return out

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **multimodal: Any) -> Any:
        if any(v is not None for v in multimodal.values()):
            names = sorted(k for k, v in multimodal.items() if v is not None)
            raise ReplayError(f"R3GRPOTrainer: multimodal inputs ({', '.join(names)}) are not supported")
        rows = self._rows_for(input_ids, logits_to_keep)
        inner = self.accelerator.unwrap_model(model)
        bs = batch_size or input_ids.size(0)
        grad = torch.is_grad_enabled()
        logps, ents, auxes = [], [], []
        reports: list[dict[str, float]] = []
        for s in range(0, input_ids.size(0), bs):
            e = min(s + bs, input_ids.size(0))
            ctx, on_exit = self._replay_context(inner, rows, s, e)
            if grad:  # kept open until backward has run (training_step closes it)
                value = self._rr_open.enter_context(ctx)
                self._rr_open.callback(on_exit, value)
                if self.r3 and value is not None:
                    self._rr_open_reports.append(value)  # the audit fills this dict when the block closes
                out = super()._get_per_token_logps_and_entropies(
                    model, input_ids[s:e], attention_mask[s:e], logits_to_keep, batch_size=e - s,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss)
            else:
                with ctx as value:
                    out = super()._get_per_token_logps_and_entropies(
                        model, input_ids[s:e], attention_mask[s:e], logits_to_keep, batch_size=e - s,
                        compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss)
                on_exit(value)
                if self.r3 and value is not None:
                    reports.append(value)
            logps.append(out[0])
            ents.append(out[1])
            auxes.append(out[2])
        if reports:
            self._log_reports(reports, "train" if self.model.training else "eval")
        lp = torch.cat(logps, dim=0)
        if grad or self._rr_current is not None:
            self._rr_loss_logps = lp.detach()
        ent = torch.cat(ents, dim=0) if compute_entropy else None
        aux = torch.stack(auxes).mean() if compute_aux_loss else None
        return lp, ent, aux

    # ------------------------------------------------------------------ rows under TRL's tokens

    def _rows_for(self, input_ids: torch.Tensor, logits_to_keep: int) -> Any:
        """The rollout's routing placed under ``input_ids`` (TRL: prompts left-padded, completions right-padded)."""
        if self._rr_batch is None:
            raise ReplayError("a log-prob forward ran before any rollout: no routing to replay")
        idx = self._rr_current if self._rr_current is not None else list(range(input_ids.size(0)))
        if len(idx) != input_ids.size(0):
            raise ReplayError(f"the batch has {input_ids.size(0)} samples but {len(idx)} routing indices")
        results = [self._rr_batch.results[i] for i in idx]
        width = input_ids.size(1)
        pad = self._tokenizer.pad_token_id
        rt = to_tensors(results, self._rr_batch.info, pad_side="split", prompt_length=width - logits_to_keep,
                        response_length=logits_to_keep, pad_token_id=pad if pad is not None else 0)
        real = rt.attention_mask.bool()
        if not torch.equal(rt.input_ids[real], input_ids.detach().cpu()[real]):
            bad = next(b for b in range(len(results)) if not torch.equal(rt.input_ids[b][real[b]],
                                                                          input_ids[b].detach().cpu()[real[b]]))
            raise ReplayError(f"row {bad} of the batch (rollout sample {idx[bad]}) holds other tokens than the "
                              "routing was recorded for: the rows would sit under the wrong tokens")
        return rt

    def _replay_context(self, model: Any, rt: Any, s: int, e: int) -> tuple[Any, Any]:
        """Replay (r3) or record (plain GRPO, for the agreement metric) for batch rows ``s:e``."""
        rows, mask = rt.routed_experts[s:e], rt.routed_experts_mask[s:e]
        if self.r3:
            return replay_routing(model, rows, mask, layers=rt.layers, audit=self.audit), lambda _r: None

        rec_ctx = record_routing(model)

        def after(rec: Any) -> None:
            own = rec.routed_experts
            mode = "train" if self.model.training else "eval"
            moe = list(self._rr_batch.info.moe_layers) if self._rr_batch is not None else None
            if bool(mask.any()):
                self._metrics[mode]["r3/agreement"].append(routing_agreement(own, rows, mask, layers=moe))
        return rec_ctx, after

    def _log_reports(self, reports: list[dict[str, float]], mode: str) -> None:
        """Audit dicts of one step's replayed forwards -> TRL's metrics (worst applied share, pooled agreement)."""
        reports = [r for r in reports if r]
        if not reports:
            return
        met = self._metrics[mode]
        replayed = sum(r["r3/replayed_rows"] for r in reports)
        met["r3/replayed_rows"].append(replayed)
        met["r3/left_rows"].append(sum(r["r3/left_rows"] for r in reports))
        met["r3/forwards"].append(sum(r["r3/forwards"] for r in reports))
        layer_keys = sorted({k for r in reports for k in r if k.startswith("r3/layer") and k.endswith("applied_share")})
        shares = [r[k] for r in reports for k in layer_keys if k in r and not math.isnan(r[k])]
        met["r3/applied_share_min_layer"].append(min(shares) if shares else float("nan"))
        applied = [r["r3/applied_share"] for r in reports if not math.isnan(r["r3/applied_share"])]
        met["r3/applied_share"].append(min(applied) if applied else float("nan"))
        agree = sum(r["r3/agreement"] * r["r3/replayed_rows"] for r in reports if r["r3/replayed_rows"])
        met["r3/agreement"].append(agree / replayed if replayed else float("nan"))
        if self.log_layers:
            for k in sorted({k for r in reports for k in r if k.startswith("r3/layer")}):
                vals = [r[k] for r in reports if k in r and not math.isnan(r[k])]
                if vals:
                    met[k].append(min(vals) if k.endswith("_share") or k.endswith("agreement") else sum(vals))
