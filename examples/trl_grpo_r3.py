"""GRPO with R3 in TRL on a tiny MoE against a real rr vLLM server, with weight sync every step; replay on vs off.

    .venv/bin/python examples/trl_grpo_r3.py [--steps 4] [--fp32] [--plot r3_trl.png]

Builds a random tiny Qwen3-MoE (.cache/), launches ``rr-server launch vllm`` with ``VLLM_SERVER_DEV_MODE=1``
(the weight-sync route), then trains twice from the same start with TRL's own ``GRPOTrainer`` loop through
``R3GRPOTrainer``: with replay, then without (``r3=False``). The first push of each run resets the engine to the
starting weights. Prints one line per optimizer step as it trains (reward, agreement, applied share, log-prob gap
and its floor), then a summary of both arms.

What it shows: the trainer runs in bf16 autocast by default (as TRL does) against the fp32 engine, so its own
router picks other experts than the engine's on a share of rows (``agreement`` < 1, measured in both arms). With
replay every row runs the engine's experts (``applied_share`` 1.0); without, those rows run other experts. The
log-prob gap (``|d|``) is drawn beside its floor, measured on every rollout before the trainer trains on it: the
trainer's log-probs of the sampled tokens with the engine's experts replayed (same weights, same batch, the
trainer's dtype) against the engine's. What is left there is arithmetic (bf16 against fp32), which no routing
removes; how far the gap is off its floor is what running other experts changes. On this random tiny model a
changed expert moves the log-probs little, so both arms' gaps sit on their floors; the summary prints both,
measured, and says which.

The plot is drawn by default: ``--plot PATH`` (default ``r3_trl.png`` in the current directory; needs
``pip install 'rr-replay[plot]'``, checked before training) draws, per step and per arm, the share of rows that ran
the engine's experts, the router agreement, and the log-prob gap with its floor; the numbers go to ``PATH`` with
``.json``. ``--plot ''`` draws and writes nothing. ``--url`` trains against a server already running
(``VLLM_SERVER_DEV_MODE=1``, serving ``--model-dir``) instead of launching one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
REPO = Path(__file__).resolve().parents[1]
ARMS = {True: "replay (R3)", False: "no replay"}
COLORS = {True: "tab:blue", False: "tab:orange"}
FLOOR = "gap_floor"  # the floor's key in each per-step row (not an r3/ metric: this example measures it)
KEEP = ("step", "loss", "reward", "r3/mean_abs_logp_diff", FLOOR, "r3/k3_kl", "r3/agreement", "r3/applied_share",
        "r3/applied_share_min_layer", "r3/weight_sync_seconds")  # fmt: skip
PLOT_SIZE = (12.0, 3.6)  # inches; at PLOT_DPI: 1200 x 360 pixels
PLOT_DPI = 100
NOISE = 0.01  # a mean gap within 1% of its mean floor counts as on it


def reward_len(completions: list[str], **_: Any) -> list[float]:
    """Toy reward: longer completions score higher."""
    return [len(c) / 10.0 for c in completions]


def gap_floor(trainer: Any, rollout: Any) -> float:
    """The log-prob gap's floor on one rollout (an ``rr_client.integrations.trl.Rollout``): the mean |trainer -
    engine| log-prob over its completion tokens with the engine's experts replayed, on the trainer's current
    weights, in its dtype (its autocast) and TRL's batch layout (prompts left-padded, completions right-padded).
    Routing is the engine's there, so what is left is arithmetic: the gap replay reaches; without replay the gap
    moves off it by what the trainer's own expert choices change."""
    import torch

    from rr_client.trainer import r3_metrics, replay_routing, to_tensors
    from rr_client.trainer.metrics import token_logprobs

    results = rollout.results
    rt = to_tensors(
        results,
        rollout.info,
        pad_side="split",
        prompt_length=max(len(r.prompt_ids or []) for r in results),
        response_length=max(len(r.output_ids) for r in results),
    )
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad(), trainer.accelerator.autocast(), replay_routing(model, rt):
        logits = model(rt.input_ids, attention_mask=rt.attention_mask).logits
    logps = token_logprobs(logits.float() / trainer.args.temperature, rt.input_ids)
    return r3_metrics(logps, rt, rt.response_mask.bool()).mean_abs_diff


def step_line(on: bool, step: int, steps: int, row: dict[str, Any]) -> str:
    """One training step as it is logged: reward, router agreement, the share of rows replay sent to the engine's
    experts (``off`` without replay), the log-prob gap and its floor."""
    applied = f"{_num(row.get('r3/applied_share')):7.1%}" if on else f"{'off':>7}"
    return (
        f"[{ARMS[on]:>11}] step {step:>3}/{steps}: reward {_num(row.get('reward')):6.3f}  "
        f"agreement {_num(row.get('r3/agreement')):6.1%}  applied {applied}  "
        f"gap {_num(row.get('r3/mean_abs_logp_diff')):.3g} (floor {_num(row.get(FLOOR)):.3g})"
    )


def train(url: str, model_dir: Path, *, r3: bool, steps: int, bf16: bool, out: Path) -> list[dict[str, Any]]:
    """Run ``steps`` GRPO steps, printing one line per step as TRL logs it (TRL's own dict printout is left out);
    return the per-step log rows, each with the floor of its step's rollout under :data:`FLOOR`."""
    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig

    transformers.utils.logging.disable_progress_bar()  # the weight push's shard bars, once per step

    from rr_client.integrations.trl import ROUTING_KEY, R3GRPOTrainer, RRRollout

    class FloorRollout(RRRollout):
        """RRRollout that measures :func:`gap_floor` on each training rollout, before the trainer trains on it."""

        def __init__(self, base_url: str) -> None:
            super().__init__(base_url)
            self.floors: dict[int, float] = {}  # the optimizer step the rollout trains (as TRL logs it) -> floor

        def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
            out = super().__call__(prompts, trainer)
            if trainer.model.training:
                self.floors[trainer.state.global_step + 1] = gap_floor(trainer, out[ROUTING_KEY])
            return out

    class StepLines(TrainerCallback):  # type: ignore[misc]
        """Prints each optimizer step's line (:func:`step_line`) as TRL logs it, with its rollout's floor."""

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
            if logs is not None and "loss" in logs:
                row = {**logs, FLOOR: rollout.floors.get(state.global_step)}
                print(step_line(r3, state.global_step, state.max_steps, row), flush=True)

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = ["the quick brown fox", "hello world and", "one two three four five six", "a b"]
    cfg = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        max_steps=steps,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=bf16,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    rollout = FloorRollout(url)
    trainer = R3GRPOTrainer(
        model=model,
        reward_funcs=reward_len,
        args=cfg,
        processing_class=tok,
        train_dataset=Dataset.from_dict({"prompt": prompts * 8}),
        rollout_func=rollout,
        r3=r3,
        audit_every=1,
    )  # audit every step: the agreement and applied share per step
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(StepLines())
    trainer.train()
    rows = [h for h in trainer.state.log_history if "loss" in h]
    return [{**h, FLOOR: rollout.floors.get(h["step"])} for h in rows]


def metrics(runs: dict[bool, list[dict[str, Any]]], *, bf16: bool) -> dict[str, Any]:
    """The per-step numbers the plot draws (and a little more), one list per arm, JSON-ready."""
    return {
        "trainer_dtype": "bf16 autocast" if bf16 else "fp32",
        "engine_dtype": "fp32",
        "arms": {
            ("replay" if on else "no_replay"): [{k.removeprefix("r3/"): h.get(k) for k in KEEP} for h in rows]
            for on, rows in runs.items()
        },
    }


def figure(runs: dict[bool, list[dict[str, Any]]], *, title: str) -> Any:
    """Three panels, one line per arm and step: the share of rows that ran the engine's experts (replay: its
    ``r3/applied_share``; without replay only the rows its own router picked alike, its agreement), the router
    agreement (the trainer's own top-k against the engine's, what replay does not change), and the log-prob gap
    over its floor (a wide band; how far the mean gap is off it, per arm, in the legend). A matplotlib ``Figure``
    (matplotlib imported here, Agg)."""
    from rr_client.core.optional import require

    mpl = require("matplotlib", for_what="--plot")
    mpl.use("Agg")
    import matplotlib.pyplot as plt

    fig, (applied, agree, gap) = plt.subplots(1, 3, figsize=PLOT_SIZE, dpi=PLOT_DPI)
    for on, rows in runs.items():
        steps = [h["step"] for h in rows]
        style = {"color": COLORS[on], "marker": "o", "markersize": 4, "linestyle": "-" if on else "--"}
        ran = [_num(h.get("r3/applied_share" if on else "r3/agreement")) for h in rows]
        applied.plot(steps, ran, label=ARMS[on] + ("" if on else " (its own matching picks)"), **style)
        agree.plot(steps, [_num(h.get("r3/agreement")) for h in rows], label=ARMS[on], **style)
        floor = [_num(h.get(FLOOR)) for h in rows]  # under the gap: a wide band the gap line sits in or above
        gap.plot(steps, floor, label=f"{ARMS[on]}: floor", color=COLORS[on], linewidth=6, alpha=0.3)
        mean_floor = _mean(rows, FLOOR)
        off = (_mean(rows, "r3/mean_abs_logp_diff") - mean_floor) / mean_floor if mean_floor > 0 else float("nan")
        gap_label = f"{ARMS[on]}: gap, mean {off:+.2%} off its floor"
        gap.plot(steps, [_num(h.get("r3/mean_abs_logp_diff")) for h in rows], label=gap_label, **style)
    values = [_num(h.get(k)) for rows in runs.values() for h in rows for k in ("r3/mean_abs_logp_diff", FLOOR)]
    if all(v > 0 for v in values) and max(values) >= 10 * min(values):  # NaN fails too: linear, never log of 0
        gap.set_yscale("log")
    applied.set(xlabel="optimizer step", ylabel="share of rows", title="rows that ran the engine's experts")
    agree.set(xlabel="optimizer step", ylabel="share of rows", title="router agreement (own top-k vs engine's)")
    gap.set(xlabel="optimizer step", ylabel="mean |logp trainer - logp engine|", title="log-prob gap and its floor")
    for ax in (applied, agree, gap):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    return fig


def plot(runs: dict[bool, list[dict[str, Any]]], path: Path, *, title: str) -> Path:
    """:func:`figure` saved as a PNG at ``path`` (its folder made), PLOT_SIZE at PLOT_DPI."""
    fig = figure(runs, title=title)  # MissingDependencyError naming the [plot] extra without matplotlib
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return path


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    """The mean over steps of ``key`` (NaN where missing: a mean that says so, never a fake 0)."""
    return sum(_num(h.get(key)) for h in rows) / len(rows)


def summary(runs: dict[bool, list[dict[str, Any]]]) -> list[str]:
    """Both arms over their steps: the share of rows that ran the engine's experts, the router agreement, the
    log-prob gap, its floor and the gap above it, and what the numbers say (computed from them, never assumed)."""
    on, off = runs[True], runs[False]
    followed_on = min(_num(h.get("r3/applied_share_min_layer")) for h in on)
    followed_off = _mean(off, "r3/agreement")  # without replay: its router's own picks that match the engine's
    gap = {arm: _mean(rows, "r3/mean_abs_logp_diff") for arm, rows in runs.items()}
    floor = {arm: _mean(rows, FLOOR) for arm, rows in runs.items()}
    above = {arm: gap[arm] - floor[arm] for arm in runs}
    rows = [
        (f"summary over {len(on)} steps per arm", ARMS[True], ARMS[False]),
        ("rows that ran the engine's experts", f"{followed_on:.1%}", f"{followed_off:.1%}"),
        ("router agreement (own top-k vs engine's)", f"{_mean(on, 'r3/agreement'):.1%}", f"{followed_off:.1%}"),
        ("mean |logp trainer - logp engine| (nat)", f"{gap[True]:.3g}", f"{gap[False]:.3g}"),
        ("  its floor (the engine's experts)", f"{floor[True]:.3g}", f"{floor[False]:.3g}"),
        ("  gap above the floor", f"{above[True]:+.2g}", f"{above[False]:+.2g}"),
    ]
    lines = [f"{a:<42}{b:>14}{c:>14}" for a, b, c in rows]
    rel = {arm: above[arm] / floor[arm] if floor[arm] > 0 else float("nan") for arm in runs}
    on_floor = {arm: abs(rel[arm]) < NOISE for arm in runs}
    lines += [
        f"Replay ran the engine's experts on every row; without it {1.0 - followed_off:.1%} of rows ran others.",
        f"With replay the gap was {'on' if on_floor[True] else 'off'} its floor ({rel[True]:+.2%}); without, "
        f"{'on' if on_floor[False] else 'off'} it ({rel[False]:+.2%}). The floor is the gap with the engine's experts",
        "on the same weights and batch: arithmetic (the trainer's dtype against the fp32 engine) that no routing",
        "removes. "
        + (
            "Running other experts on those rows did not measurably move the log-probs on this random tiny model."
            if on_floor[False]
            else "How far the gap without replay is off its floor is what running other experts changed."
        ),
        "After step 1 the arms train on different rollouts and weights, so their gaps are not paired: compare each",
        "with its own floor (benchmarks/r3_effect.py measures R3's effect paired).",
    ]
    return lines


def _num(v: Any) -> float:
    """A logged value as a float; missing is NaN (a gap in the line, never a fake 0)."""
    return float("nan") if v is None else float(v)


def launch(model_dir: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """``VLLM_SERVER_DEV_MODE=1 rr-server launch vllm`` serving ``model_dir`` on a free port; healthy."""
    from rr_server.launch.process import free_port, stop_process_group, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.gettempdir()) / f"rr-trl-example-{port}.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    cmd = [
        sys.executable, "-m", "rr_server", "launch", "vllm", "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--max-model-len", "512"
    ]  # fmt: skip
    print(f"launching: VLLM_SERVER_DEV_MODE=1 rr-server launch vllm --model {model_dir} --port {port} (log {log_path})")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(url, proc, log_path, 600)
    except BaseException:
        stop_process_group(proc)
        raise
    return url, proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per arm (replay on, then off)")
    ap.add_argument("--fp32", action="store_true", help="train in fp32 (replay on and off then agree: no gap to close)")
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=REPO / ".cache" / "example-trl-qwen3-moe",
        help="the tiny MoE (built there unless --url); with --url, the checkpoint that server serves",
    )
    ap.add_argument("--url", help="a running VLLM_SERVER_DEV_MODE=1 rr server of --model-dir (default: launch one)")
    ap.add_argument(
        "--plot",
        default="r3_trl.png",
        help="PNG of the experts-applied share, the agreement and the gap with its floor per step (default: "
        "r3_trl.png, drawn unless '' is given); the numbers go next to it as .json",
    )
    args = ap.parse_args(argv)

    from rr_server.launch.process import stop_process_group

    if args.plot:  # fail before training, not after, when matplotlib is missing
        from rr_client.core.optional import require

        require("matplotlib", for_what="--plot")
    if args.url:
        model_dir, url, proc = args.model_dir, args.url, None
    else:
        from rr_server.demo.tiny_moe import build_tiny_moe

        model_dir = build_tiny_moe(args.model_dir, num_layers=4, num_experts=16, topk=4)
        url, proc = launch(model_dir)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            runs = {
                on: train(url, model_dir, r3=on, steps=args.steps, bf16=not args.fp32, out=Path(tmp) / str(on))
                for on in (True, False)
            }
    finally:
        if proc is not None:
            stop_process_group(proc)
    print()
    print("\n".join(summary(runs)))
    if args.plot:
        png = Path(args.plot)
        data = metrics(runs, bf16=not args.fp32)
        png.parent.mkdir(parents=True, exist_ok=True)
        png.with_suffix(".json").write_text(json.dumps(data, indent=1, default=float))
        title = f"TRL GRPO, tiny MoE: {data['trainer_dtype']} trainer vs fp32 vLLM engine, weights synced every step"
        print(f"plot: {plot(runs, png, title=title)} (numbers: {png.with_suffix('.json')})")
    ok = all(h.get("r3/applied_share_min_layer") == 1.0 for h in runs[True])
    print("replay reached the experts on every MoE layer in every step:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
