"""GRPO with R3 in TRL on a tiny MoE against a real rr vLLM server, with weight sync every step; replay on vs off.

    .venv/bin/python examples/trl_grpo_r3.py [--steps 4] [--fp32] [--plot r3_trl.png]

Builds a random tiny Qwen3-MoE (.cache/), launches ``rr-server launch vllm`` with ``VLLM_SERVER_DEV_MODE=1``
(the weight-sync route), then trains twice from the same start with TRL's own ``GRPOTrainer`` loop through
``R3GRPOTrainer``: with replay, then without (``r3=False``). The first push of each run resets the engine to the
starting weights. Prints one row per optimizer step, then a summary of both arms.

What it shows: the trainer runs in bf16 autocast by default (as TRL does) against the fp32 engine, so its own
router picks other experts than the engine's on a share of rows (``agreement`` < 1, measured in both arms). With
replay every row runs the engine's experts (``applied_share`` 1.0); without, those rows run other experts. On this
random tiny model a changed expert moves the log-probs little, so the log-prob gap (``|d|``) is mostly bf16
arithmetic in both arms and replay lowers it only a little; the summary prints both, measured, and says which.

``--plot PATH`` (default ``r3_trl.png``; needs ``pip install 'rr-replay[plot]'``) draws, per step and per arm, the
trainer-engine log-prob gap and the router agreement; the numbers go to ``PATH`` with ``.json``. ``--plot ''``
draws nothing. ``--url`` trains against a server already running (``VLLM_SERVER_DEV_MODE=1``, serving
``--model-dir``) instead of launching one.
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
COLUMNS = ("r3/mean_abs_logp_diff", "r3/k3_kl", "r3/agreement", "r3/applied_share_min_layer", "r3/weight_sync_seconds")
ARMS = {True: "replay (R3)", False: "no replay"}
PLOT_SIZE = (8.0, 3.4)  # inches; at PLOT_DPI: 800 x 340 pixels
PLOT_DPI = 100


def reward_len(completions: list[str], **_: Any) -> list[float]:
    """Toy reward: longer completions score higher."""
    return [len(c) / 10.0 for c in completions]


def train(url: str, model_dir: Path, *, r3: bool, steps: int, bf16: bool, out: Path) -> list[dict[str, Any]]:
    """Run ``steps`` GRPO steps; return the per-step log rows (TRL's own per-step printout is left out: the
    example prints its table and summary at the end)."""
    import torch
    import transformers
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig

    transformers.utils.logging.disable_progress_bar()  # the weight push's shard bars, once per step

    from rr_client.integrations.trl import R3GRPOTrainer, RRRollout

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
    trainer = R3GRPOTrainer(
        model=model,
        reward_funcs=reward_len,
        args=cfg,
        processing_class=tok,
        train_dataset=Dataset.from_dict({"prompt": prompts * 8}),
        rollout_func=RRRollout(url),
        r3=r3,
        audit_every=1,
    )  # audit every step: the agreement and applied share per step
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def metrics(runs: dict[bool, list[dict[str, Any]]], *, bf16: bool) -> dict[str, Any]:
    """The per-step numbers the plot draws (and a little more), one list per arm, JSON-ready."""
    keep = ("step", "loss", "reward", *COLUMNS)
    return {
        "trainer_dtype": "bf16 autocast" if bf16 else "fp32",
        "engine_dtype": "fp32",
        "arms": {
            ("replay" if on else "no_replay"): [{k.removeprefix("r3/"): h.get(k) for k in keep} for h in rows]
            for on, rows in runs.items()
        },
    }


def plot(runs: dict[bool, list[dict[str, Any]]], path: Path, *, title: str) -> Path:
    """Two panels, one line per arm: mean |logp_trainer - logp_engine| per step (log scale), router agreement."""
    from rr_client.core.optional import require

    mpl = require("matplotlib", for_what="--plot")
    mpl.use("Agg")
    import matplotlib.pyplot as plt

    fig, (gap, agree) = plt.subplots(1, 2, figsize=PLOT_SIZE, dpi=PLOT_DPI)
    for on, rows in runs.items():
        steps = [h["step"] for h in rows]
        style = {"label": ARMS[on], "marker": "o", "markersize": 4, "linestyle": "-" if on else "--"}
        gap.plot(steps, [_num(h.get("r3/mean_abs_logp_diff")) for h in rows], **style)
        agree.plot(steps, [_num(h.get("r3/agreement")) for h in rows], **style)
    if all(_num(h.get("r3/mean_abs_logp_diff")) > 0 for rows in runs.values() for h in rows):
        gap.set_yscale("log")
    gap.set(xlabel="optimizer step", ylabel="mean |logp trainer - logp engine|", title="log-prob gap (lower is better)")
    agree.set(xlabel="optimizer step", ylabel="share of rows", title="router agreement with the engine")
    for ax in (gap, agree):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return path


def summary(runs: dict[bool, list[dict[str, Any]]]) -> list[str]:
    """Both arms over their steps: the share of rows that ran the engine's experts and the log-prob gap, and what
    the numbers say (computed from them, never assumed)."""
    on, off = runs[True], runs[False]
    followed_on = min(_num(h.get("r3/applied_share_min_layer")) for h in on)
    followed_off = sum(_num(h.get("r3/agreement")) for h in off) / len(off)  # its router's own picks
    gap_on = sum(_num(h.get("r3/mean_abs_logp_diff")) for h in on) / len(on)
    gap_off = sum(_num(h.get("r3/mean_abs_logp_diff")) for h in off) / len(off)
    title = f"summary over {len(on)} steps per arm"
    followed = "rows that ran the engine's experts"
    gap = "mean |logp trainer - logp engine| (nat)"
    lines = [
        f"{title:<42}{ARMS[True]:>14}{ARMS[False]:>14}",
        f"{followed:<42}{followed_on:>14.1%}{followed_off:>14.1%}",
        f"{gap:<42}{gap_on:>14.3g}{gap_off:>14.3g}",
    ]
    ratio = f"{gap_on / gap_off:.2f}x the gap without" if gap_off > 0 else "the gap without: 0"
    lines += [
        f"replay ran the engine's experts on every row; without it {1.0 - followed_off:.1%} of rows ran others.",
        f"The gap with replay was {ratio}: on this random tiny model a changed expert moves the log-probs",
        "little, so most of the gap is bf16 arithmetic in both arms, and after step 1 the arms train on",
        "different rollouts (benchmarks/r3_effect.py measures R3's effect paired).",
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
        help="PNG of the gap and agreement per step ('' = none); the numbers go next to it as .json",
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
    head = ["r3", "step", "loss", "reward"] + [c.removeprefix("r3/") for c in COLUMNS]
    print(" | ".join(f"{h:>20}" for h in head))
    for on, rows in runs.items():
        for h in rows:
            vals = [("on" if on else "off"), h.get("step"), h.get("loss"), h.get("reward")] + [
                h.get(c) for c in COLUMNS
            ]
            print(" | ".join(f"{v:>20.4g}" if isinstance(v, float) else f"{str(v):>20}" for v in vals))
    print()
    print("\n".join(summary(runs)))
    if args.plot:
        png = Path(args.plot)
        data = metrics(runs, bf16=not args.fp32)
        png.parent.mkdir(parents=True, exist_ok=True)
        png.with_suffix(".json").write_text(json.dumps(data, indent=1, default=float))
        title = f"TRL GRPO, tiny MoE: {data['trainer_dtype']} trainer vs fp32 vLLM engine, weight sync every step"
        print(f"plot: {plot(runs, png, title=title)} (numbers: {png.with_suffix('.json')})")
    ok = all(h.get("r3/applied_share_min_layer") == 1.0 for h in runs[True])
    print("replay reached the experts on every MoE layer in every step:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
