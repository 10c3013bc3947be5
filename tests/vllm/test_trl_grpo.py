"""R3 in TRL: TRL 1.16's real GRPOTrainer trains the tiny MoE against a real rr vLLM CPU server with weight sync.

The server runs with ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc reload_weights``), on its own: its weights change.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from datasets import Dataset
from transformers import TrainerCallback

from rr_client.integrations.trl import R3GRPOTrainer, RRRollout, importance_sampling_ratio
from rr_client.trainer.replay import record_routing
from tests.support.grpo import cpu_grpo_config
from tests.support.png import png_size
from tests.support.scripts import load_script
from tests.support.vllm_process import VLLMProcess

pytestmark = pytest.mark.vllm_server
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
MOE_LAYERS = [0, 2]  # qwen3_dense: layer 1 is dense
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo_r3.py"
PLAIN_LOOP = EXAMPLE.with_name("plain_loop_r3.py")
PLAIN_LOOP_SEEDED = ["--steps", "3", "--lr", "5e-3", "--seed", "0"]  # as tests/vllm/test_plain_loop_example.py
PROMPTS = ["the quick brown fox", "hello world and", "one two three four five six", "a b"]


@pytest.fixture(scope="module")
def dev_server(tiny_models: dict[str, Path]) -> Iterator[VLLMProcess]:
    server = VLLMProcess(tiny_models["qwen3_dense"], name="trl-grpo", env={"VLLM_SERVER_DEV_MODE": "1"}).start()
    try:
        yield server
    finally:
        server.stop()


def length_reward(completions: list[str], **_: Any) -> list[float]:
    """Toy reward: longer completions score higher (varies across a group, so advantages are non-zero)."""
    return [len(c) / 10.0 for c in completions]


class LossBothWays(R3GRPOTrainer):
    """Test-only: also computes each batch's loss without replay (no grad), to compare with the replayed loss."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.loss_pairs: list[tuple[float, float]] = []
        self.is_inputs: list[dict[str, torch.Tensor]] = []

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        self.is_inputs.append(
            {
                k: inputs[k].detach().clone()
                for k in (
                    "importance_sampling_ratio",
                    "old_per_token_logps",
                    "sampling_per_token_logps",
                    "completion_mask",
                )
                if inputs.get(k) is not None
            }
        )
        loss = super()._compute_loss(model, inputs)
        self.r3 = False
        try:
            with torch.no_grad():
                plain = super()._compute_loss(model, inputs)
        finally:
            self.r3 = True
        self.loss_pairs.append((float(loss.detach()), float(plain)))
        return loss


def make_trainer(
    cls: type,
    server: VLLMProcess,
    model_dir: Path,
    out: Path,
    *,
    max_steps: int = 3,
    rollout_kw: dict[str, Any] | None = None,
    **kw: Any,
) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    cfg = cpu_grpo_config(
        str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=max_steps,
        learning_rate=2e-2,
    )
    return cls(
        model=model,
        reward_funcs=length_reward,
        args=cfg,
        processing_class=tok,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
        rollout_func=RRRollout(server.base_url, **(rollout_kw or {})),
        **kw,
    )


def test_grpo_r3_three_steps_with_weight_sync(
    dev_server: VLLMProcess, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    trainer = make_trainer(
        LossBothWays, dev_server, tiny_models["qwen3_dense"], tmp_path, verify_sync=1e-4, audit_every=1
    )
    gate0 = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n.endswith("mlp.gate.weight")}
    trainer.train()
    assert trainer.state.global_step == 3

    # a push before each of the 3 rollouts (steps 0, 1, 2); the engine then serves the trainer's weights ...
    log = trainer.sync_log
    assert [r["step"] for r in log] == [0, 1, 2]
    assert all(r["probe_gap"] < 1e-4 for r in log), [r["probe_gap"] for r in log]
    # ... which changed every step: the probe's log-probs (or its greedy tokens) differ from the previous push's
    for prev, cur in zip(log, log[1:]):
        same_tokens = prev["probe_tokens"] == cur["probe_tokens"]
        gap = np.abs(np.array(prev["probe_engine_logprobs"]) - np.array(cur["probe_engine_logprobs"])).max()
        assert not same_tokens or gap > 1e-4, f"step {cur['step']}: the engine serves the previous step's weights"

    steps = [h for h in trainer.state.log_history if "loss" in h and "r3/applied_share_min_layer" in h]
    assert len(steps) == 3
    for h in steps:
        assert h["r3/applied_share_min_layer"] == 1.0 and h["r3/applied_share"] == 1.0  # every MoE layer replayed
        assert h["r3/replayed_rows"] > 0 and h["r3/forwards"] >= 1
        assert h["r3/agreement"] == 1.0  # fp32, weights synced: the trainer's own choice equals the engine's
        assert h["r3/mean_abs_logp_diff"] < 1e-4 and h["r3/frac_abs_diff_gt_ln2"] == 0.0
        assert h["r3/weight_sync_probe_gap"] < 1e-4 and "r3/weight_sync_seconds" in h and "r3/k3_kl" in h
        # the audit and the gap by token segment, and the stale-rows policy's counts (issue 38)
        assert h["r3/computed_prompt/agreement"] == 1.0 and h["r3/generated/agreement"] == 1.0
        assert h["r3/generated/mean_abs_logp_diff"] < 1e-4 and "r3/cached_prompt/replayed_rows" in h
        assert h["r3/stale_masked"] == 0 and "r3/spans_update" in h and "r3/cached_tokens" in h
    # TRL's importance-sampling correction ran on the engine's log-probs, under TRL's default (sequence_mask, 3.0):
    # ratio = exp(sum over the completion of (trainer old log-prob - engine log-prob)), 0 above 3
    assert len(trainer.is_inputs) == 3
    for got in trainer.is_inputs:
        assert {"importance_sampling_ratio", "old_per_token_logps", "sampling_per_token_logps"} <= got.keys()
        diff = torch.nan_to_num(
            (got["old_per_token_logps"] - got["sampling_per_token_logps"]) * got["completion_mask"], nan=0.0
        ).sum(-1, keepdim=True)
        expect = torch.where(torch.exp(diff) > 3.0, torch.zeros_like(diff), torch.exp(diff))
        assert torch.allclose(got["importance_sampling_ratio"], expect)
        assert torch.allclose(got["importance_sampling_ratio"], torch.ones_like(expect), atol=1e-3)  # synced fp32
    assert all(abs(h["r3/is_ratio_mean"] - 1.0) < 1e-3 for h in steps)
    # the loss with replay equals the loss without it (each row sits under its own token) ...
    assert len(trainer.loss_pairs) == 3
    for with_r3, plain in trainer.loss_pairs:
        assert abs(with_r3 - plain) <= 1e-6 * max(1.0, abs(plain)), trainer.loss_pairs
    # ... and the routers were trained through the replayed choice
    for n, p in trainer.model.named_parameters():
        if n in gate0:
            assert not torch.equal(p.detach(), gate0[n]), f"{n} did not change"


def test_grpo_r3_by_reference(dev_server: VLLMProcess, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """RRRollout(by_reference=True): the engine keeps the rows, each micro-batch's rows are read when it runs, the
    rows of replaced weights are retired after each push; replay and the gap are as inline."""
    import httpx

    def store() -> dict[str, Any]:
        return httpx.get(dev_server.base_url + "/rr/info", timeout=30).json()["routing_store"]

    before = store()
    trainer = make_trainer(
        R3GRPOTrainer,
        dev_server,
        tiny_models["qwen3_dense"],
        tmp_path,
        max_steps=2,
        audit_every=1,
        verify_sync=1e-4,
        rollout_kw={"by_reference": True},
    )
    trainer.train()
    after = store()
    steps = [h for h in trainer.state.log_history if "loss" in h and "r3/applied_share" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["r3/applied_share"] == 1.0 and h["r3/agreement"] == 1.0 and h["r3/mean_abs_logp_diff"] < 1e-4
    assert after["stored"] - before["stored"] >= 2 * 4  # every sample's rows stayed on the server
    assert after["read_bytes"] > before["read_bytes"]  # ... and were read by reference
    assert after["retired"] > before["retired"]  # the first rollout's rows were retired after the second push


def test_two_ranks_by_reference(dev_server: VLLMProcess, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """2 processes (torchrun, CPU, gloo), TRL 1.16 by reference with weight sync: every rank trains its 2 steps with
    its rows read when its micro-batches run (no RoutingExpiredError: the main process retires only between two
    barriers), and the replaced weights' rows are retired."""
    import httpx

    from rr_server.launch.process import free_port

    before = httpx.get(dev_server.base_url + "/rr/info", timeout=30).json()["routing_store"]
    script = Path(__file__).with_name("trl_two_ranks.py")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(script),
            dev_server.base_url,
            str(tiny_models["qwen3_dense"]),
            str(tmp_path),
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks), proc.stdout[-2000:]
    for r in ranks:
        assert (
            r["global_step"] == 2
            and r["pushes"] == 2
            and r["applied_share"]
            and all(a == 1.0 for a in r["applied_share"])
        ), r
    after = httpx.get(dev_server.base_url + "/rr/info", timeout=30).json()["routing_store"]
    assert after["read_bytes"] > before["read_bytes"] and after["retired"] > before["retired"]


def test_example_plots_both_arms(dev_server: VLLMProcess, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """examples/trl_grpo_r3.py for 2 steps against the dev-mode server: exit 0, one line per step as it trains, a
    whole 1200x360 PNG, and next to it the per-step numbers of both arms (bf16 trainer vs fp32 engine: a real, small
    gap on its floor with replay; replay only in its arm)."""
    png = tmp_path / "out" / "r3.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--steps",
            "2",
            "--url",
            dev_server.base_url,
            "--model-dir",
            str(tiny_models["qwen3_dense"]),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "replay reached the experts on every MoE layer in every step: yes" in proc.stdout
    # TRL's per-step dicts are not printed; the example's own line per step is, as it trains, before the summary
    assert "{'loss'" not in proc.stdout and "Writing model shards" not in proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    summary_at = next(i for i, line in enumerate(lines) if line.startswith("summary over 2 steps per arm"))
    steps = [(i, line) for i, line in enumerate(lines) if " step " in line and line.startswith("[")]
    assert [line.split(":")[0] for _, line in steps] == [
        "[replay (R3)] step   1/2",
        "[replay (R3)] step   2/2",
        "[  no replay] step   1/2",
        "[  no replay] step   2/2",
    ], proc.stdout[-3000:]
    assert all(i < summary_at for i, _ in steps)
    for _, line in steps:
        assert all(f" {word} " in line for word in ("reward", "agreement", "applied", "gap", "(floor"))
        assert ("applied  100.0%" if line.startswith("[replay") else "applied     off") in line
    followed = next(line for line in lines if line.startswith("rows that ran the engine's experts"))
    replay_share, other_share = (float(x.rstrip("%")) / 100 for x in followed.split()[-2:])
    assert replay_share == 1.0 and 0.5 < other_share <= 1.0
    assert "Replay ran the engine's experts on every row; without it" in proc.stdout
    assert any(line.startswith("  its floor (the engine's experts)") for line in lines)
    assert any(line.startswith("  gap above the floor") for line in lines)
    assert png_size(png) == (1200, 360) and png.stat().st_size > 30_000  # three panels drawn, not an empty canvas
    data = json.loads(png.with_suffix(".json").read_text())
    assert data["trainer_dtype"] == "bf16 autocast" and set(data["arms"]) == {"replay", "no_replay"}
    for arm, rows in data["arms"].items():
        assert [r["step"] for r in rows] == [1, 2], arm
        for r in rows:
            assert math.isfinite(r["loss"]) and r["weight_sync_seconds"] > 0
            # bf16 autocast vs the fp32 engine: never equal, never a different policy (|d| < ln 2 per token)
            assert 0.0 < r["mean_abs_logp_diff"] < math.log(2) and r["k3_kl"] >= 0.0, (arm, r)
            assert 0.0 < r["gap_floor"] < math.log(2), (arm, r)  # the gap with the engine's experts: bf16 rounding
            assert 0.5 < r["agreement"] <= 1.0, (arm, r)  # the trainer's own router, measured in both arms
            # replay reached every MoE layer in its arm; the other arm replayed nothing
            assert r["applied_share_min_layer"] == (1.0 if arm == "replay" else None), (arm, r)
            assert r["applied_share"] == (1.0 if arm == "replay" else None), (arm, r)
            if arm == "replay":  # the engine's experts in the loss forward too: the gap is its floor (same batch)
                assert r["mean_abs_logp_diff"] == pytest.approx(r["gap_floor"], rel=0.05), r


def test_plain_loop_example_pushes_weights_every_step(
    dev_server: VLLMProcess, tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/plain_loop_r3.py ``--weight-sync`` (a weight push before every rollout) against this module's
    dev-mode server (its weights change anyway; the pool's shared server runs it without the push in
    test_plain_loop_example.py). The engine samples from the weights being trained, so the trainer's own router
    agrees with the engine's on every row and the fp32 gap stays at rounding, step after step."""
    example = load_script(PLAIN_LOOP, "plain_loop_r3")
    model = str(tiny_models["qwen3_dense"])
    history = example.main(["--url", dev_server.base_url, "--model-path", model, *PLAIN_LOOP_SEEDED, "--weight-sync"])
    out = capsys.readouterr().out
    assert [h["step"] for h in history] == [0, 1, 2] and example.NO_SYNC_NOTE not in out
    assert all(h["reward_std"] > 0 and abs(h["loss"]) > 1e-6 for h in history), history  # it trains
    for h in history:
        assert h["r3/applied_share"] == 1.0 and h["r3/agreement"] == 1.0 and h["r3/mean_abs_logp_diff"] < 1e-4, h
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all("agreement 1.000" in line and "weights pushed in" in line for line in lines)


def test_trl_batch_rows_sit_under_their_tokens(
    dev_server: VLLMProcess, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """TRL's own batch (left-padded prompts of different lengths + right-padded completions) from a real rollout:
    the rows rr places under each token equal (a) an independent alignment and (b) transformers' own top-k for
    that token in an unpadded forward."""
    trainer = make_trainer(
        R3GRPOTrainer, dev_server, tiny_models["qwen3_dense"], tmp_path
    )  # syncs: the engine may hold trained weights
    inputs = [{"prompt": p} for p in PROMPTS for _ in range(4)]
    trainer.model.train()
    batch = trainer._generate_and_score_completions(inputs)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    c = batch["completion_ids"].size(1)
    rt, _segments = trainer._rows_for(ids, c)
    rollout = trainer._rr_batch
    assert rollout is not None and len({len(r.prompt_ids or []) for r in rollout.results}) > 1  # really padded
    model = trainer.model.eval()
    for b, r in enumerate(rollout.results):
        cols = [t for t in range(ids.size(1)) if mask[b, t]]  # independent: the real tokens' columns, in order
        tokens = list(r.prompt_ids or []) + list(r.output_ids)
        assert ids[b, cols].tolist() == tokens
        rows = np.asarray(r.routed_experts, dtype=np.int64)
        assert rows.shape[0] == len(tokens) - 1
        for j, col in enumerate(cols):
            if j < len(tokens) - 1:
                assert bool(rt.routed_experts_mask[b, col])
                assert np.array_equal(rt.routed_experts[b, col].numpy().astype(np.int64), rows[j])
            else:  # the last token routed nothing in the engine
                assert not bool(rt.routed_experts_mask[b, col])
        with torch.no_grad(), record_routing(model) as rec:
            model(torch.tensor([tokens]))
        own = rec.routed_experts[0, :-1].numpy()
        placed = rt.routed_experts[b, cols[:-1]].numpy().astype(np.int64)
        for layer in MOE_LAYERS:
            assert np.array_equal(np.sort(own[:, layer], -1), np.sort(placed[:, layer], -1)), (b, layer)
    pad_cols = ~mask.bool()
    assert not bool(rt.routed_experts_mask[pad_cols].any())


def test_sync_to_an_engine_without_dev_mode_stops_with_a_clear_error(
    qwen_server: VLLMProcess, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from rr_client import WeightSyncError
    from rr_client.integrations.weight_sync import DiskWeightSync

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["qwen3_dense"], dtype=torch.float32)
    sync = DiskWeightSync(qwen_server.base_url, tmp_path)
    try:
        with pytest.raises(WeightSyncError, match="VLLM_SERVER_DEV_MODE=1"):
            sync.push(model, 0)
    finally:
        sync.close()
    assert (tmp_path / "step-0" / "model.safetensors").exists()  # saved completely before any engine was asked


# ----------------------------------------------------------------------------- TRL's correction, in the loss
class ShiftedLogprobs(RRRollout):
    """TEST DEVICE: the engine's sampled log-probs moved by ``shift`` nats before TRL sees them, so the importance
    ratio TRL computes is a known ``exp(-shift)`` per token on identical weights (the engine itself is real)."""

    shift = 0.0

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        out = super().__call__(prompts, trainer)
        out["logprobs"] = [[x + self.shift for x in row] for row in out["logprobs"]]
        return out


class KeepsISInputs(R3GRPOTrainer):
    """Test-only: keeps each loss batch's ratio, old and engine log-probs and mask (after TRL computed them)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.is_inputs: list[dict[str, torch.Tensor]] = []

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        self.is_inputs.append(
            {
                k: inputs[k].detach().clone()
                for k in (
                    "importance_sampling_ratio",
                    "old_per_token_logps",
                    "sampling_per_token_logps",
                    "completion_mask",
                )
                if inputs.get(k) is not None
            }
        )
        return super()._compute_loss(model, inputs)


# (correction mode or None = off, engine shift in nats, clip_min, clip_max, expected gradient factor vs step 0)
IS_PLAN: list[tuple[str | None, float, float | None, float | None, float]] = [
    (None, 0.0, None, 3.0, 1.0),
    ("token_truncate", -2.0, None, 3.0, 3.0),  # ratio e^2 per token, clamped to clip_max
    ("token_truncate", 2.0, 0.5, 3.0, 0.5),  # ratio e^-2, clamped up to clip_min
    ("sequence_truncate", -2.0, None, 3.0, 3.0),  # e^(2 x tokens), clamped
    ("sequence_mask", -2.0, None, 3.0, 0.0),  # TRL's default MIS: every sequence above 3 is masked
    ("token_mask", -2.0, None, 3.0, 0.0),
    ("token_truncate", -0.5, None, 100.0, math.exp(0.5)),  # inside the bounds: the ratio itself, e^0.5
]


class ISPlan(TrainerCallback):
    """Before each step's rollout: that step's correction settings and engine shift (TRL reads them per use)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        mode, shift, lo, hi, _factor = IS_PLAN[state.global_step]
        t = self.trainer
        t.vllm_importance_sampling_correction = mode is not None
        t.vllm_importance_sampling_mode = mode or "token_truncate"
        t.vllm_importance_sampling_clip_min, t.vllm_importance_sampling_clip_max = lo, hi
        t.rr_rollout.shift = shift


def test_trl_correction_reaches_the_loss_at_temperature_07(
    qwen_server: VLLMProcess, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """TRL 1.16's GRPOTrainer.train on the real server (processed log-probs, rr's launcher), identical fp32 weights
    (lr 0, no sync), one seeded rollout repeated per step at temperature 0.7, with a separate reference model
    (beta > 0) replayed and audited, the MoE aux loss off (its gradient does not pass through the ratio). Step 0 (no correction): the trainer-engine gap is below 1e-5. Each later
    step forces a known ratio: the gradient is the step-0 gradient times the clipped ratio (truncate modes, both
    bounds), zero when MIS masks every sequence, and TRL's ratio per token is exp(old - engine), equal to rr's
    importance_sampling_ratio for plain loops."""
    model_dir = tiny_models["qwen3_dense"]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    cfg = cpu_grpo_config(
        str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=len(IS_PLAN),
        learning_rate=0.0,
        beta=0.04,
        temperature=0.7,
        generation_kwargs={"seed": 7},
        router_aux_loss_coef=0.0,
    )  # policy loss only
    rollout = ShiftedLogprobs(qwen_server.base_url)
    trainer = KeepsISInputs(
        model=model,
        reward_funcs=length_reward,
        args=cfg,
        processing_class=tok,
        train_dataset=Dataset.from_dict({"prompt": [PROMPTS[0]] * 8}),
        rollout_func=rollout,
        sync_weights=False,
        audit_every=1,
    )
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model  # TRL's own reference copy
    trainer.add_callback(ISPlan(trainer))
    trainer.train()

    steps = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert len(steps) == len(IS_PLAN) and len(trainer.is_inputs) == len(IS_PLAN)
    g0 = steps[0]["grad_norm"]
    assert g0 > 0 and steps[0]["r3/mean_abs_logp_diff"] < 1e-5, steps[0]  # T=0.7, processed log-probs
    assert all(h["r3/applied_share_min_layer"] == 1.0 for h in steps)  # audited: policy and reference replayed
    for (mode, shift, lo, hi, factor), h, got in zip(IS_PLAN, steps, trainer.is_inputs):
        # masked: zero but for the KL term's, ~1e-8 of g0 (reference and policy agree to rounding, not bitwise)
        assert h["grad_norm"] == pytest.approx(factor * g0, rel=1e-4, abs=1e-6 * g0), (mode, shift, h["grad_norm"])
        if mode is None:
            assert "importance_sampling_ratio" not in got
            continue
        ratio, old, eng = got["importance_sampling_ratio"], got["old_per_token_logps"], got["sampling_per_token_logps"]
        ours = importance_sampling_ratio(old, eng, got["completion_mask"], mode=mode, clip_min=lo, clip_max=hi)
        assert torch.equal(ratio, ours), mode  # rr's function for plain loops is TRL's rule
        if factor == 0.0:
            assert not ratio.any() and h["r3/is_ratio_max"] == 0.0
        if hi == 100.0:  # the unclipped token ratio: exp(trainer old log-prob - engine log-prob), ~e^0.5 here
            m = got["completion_mask"].bool()
            assert torch.allclose(ratio[m], torch.exp(old - eng)[m])
            assert torch.allclose(ratio[m], torch.full_like(ratio[m], math.exp(0.5)), rtol=1e-4)
