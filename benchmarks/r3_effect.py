"""R3 end to end, measured: a real vLLM CPU server rolls out, a transformers "trainer" recomputes log-probs.

    .venv/bin/python benchmarks/r3_effect.py [--num-prompts 16] [--max-new-tokens 32]

1. Builds a tiny random Qwen3-MoE (rr_server.demo.tiny_moe: 4 layers, 32 experts, top-4, hidden 64, router gates
   spread by the builder), scales ``lm_head`` by ``--lm-head-scale`` (default 8) so next-token
   distributions are not near-uniform, and the routed experts' weights by ``--expert-scale`` (default 4) so
   that which experts run changes the logits (at the builder's init it barely does).
2. Serves it with ``rr-server launch vllm`` (CPU, fp32, eager) and samples (temperature 1) through
   ``RoutedExpertsClient`` with ``return_logprob`` and routing.
3. The trainer is the same checkpoint in transformers, at three settings: the same weights (fp32); weights
   one Adam step (lr ``--lr``) away, as a stale rollout policy in async RL; and bf16.
4. For each it prints, over response tokens, the R3 metrics (rr_client.trainer.metrics) without replay and with
   ``replay_routing`` of the rollout's routing, and the routing agreement of the trainer's own router with
   the rollout's choice; the last column repeats mean|d| and k3 over the response tokens right after a
   position where the trainer's own router disagrees with the rollout in some MoE layer (without replay).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rr_client import RoutedExpertsClient
from rr_client.core.agreement import set_matches
from rr_client.trainer.metrics import r3_metrics, routing_agreement, token_logprobs
from rr_client.trainer.replay import record_routing, replay_routing
from rr_server.demo.quickstart import DEFAULT_PROMPTS
from rr_server.demo.tiny_moe import build_tiny_moe
from rr_server.launch.process import free_port, stop_process_group, wait_healthy

PROMPTS = DEFAULT_PROMPTS  # the demo's prompts


def build_model(out: Path, lm_head_scale: float, expert_scale: float) -> Path:
    """tiny_moe checkpoint, then a copy with lm_head and the routed experts' weights scaled (same tokenizer).

    At the builder's init (std 0.02, expert width 16) the experts add almost nothing to the residual stream,
    so which experts run barely changes the logits; scaling both expert matrices by s scales their output
    by ~s^3, so routing matters to the output, as in a trained model.
    """
    import transformers

    base = build_tiny_moe(out / "base", arch="qwen3_moe", num_layers=4, num_experts=32, topk=4, hidden=64, seed=0)
    scaled = out / f"lm_head_x{lm_head_scale:g}_experts_x{expert_scale:g}"
    if not (scaled / "model.safetensors").exists():
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
            for name, param in model.named_parameters():
                if ".mlp.experts." in name:
                    param.mul_(expert_scale)
        model.save_pretrained(scaled)
        transformers.AutoTokenizer.from_pretrained(base).save_pretrained(scaled)
    return scaled


def launch(model_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "rr_server", "launch", "vllm", "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--max-model-len", "512", "--served-model-name", "tiny-moe", "--seed", "0"
    ]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


async def rollout(base_url: str, prompts: list[list[int]], max_new_tokens: int, seed: int) -> Any:
    async with RoutedExpertsClient(base_url, timeout=300) as client:
        return await client.generate(
            prompts, {"max_new_tokens": max_new_tokens, "temperature": 1.0, "seed": seed}, return_logprob=True
        )


def rollout_logprobs(batch: Any, t: Any) -> torch.Tensor:
    """The engine's sampled-token log-probs, placed like ``input_ids`` (right padding)."""
    out = torch.zeros(t.input_ids.shape, dtype=torch.float64)
    for i, r in enumerate(batch.results):
        lps = r.meta.get("output_token_logprobs")
        if lps is None or len(lps) != len(r.output_ids):
            raise RuntimeError(f"sample {i}: no per-token logprobs in the reply")
        for j, (lp, tid, _) in enumerate(lps):
            if tid != r.output_ids[j]:
                raise RuntimeError(f"sample {i}: logprob token {tid} != output token {r.output_ids[j]}")
            out[i, len(r.prompt_ids) + j] = lp
    return out


def trainer_variants(model_dir: Path, t: Any, lr: float) -> list[tuple[str, Any]]:
    import transformers

    def load() -> Any:
        m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return m.eval()

    same = load()
    stale = load()
    stale.train()
    opt = torch.optim.Adam(stale.parameters(), lr=lr)
    logits = stale(t.input_ids, attention_mask=t.attention_mask).logits
    lp = token_logprobs(logits, t.input_ids)
    loss = -(lp * t.response_mask).sum() / t.response_mask.sum()  # one policy-gradient-like step on the rollout
    loss.backward()
    opt.step()
    stale.eval()
    bf16 = load().to(torch.bfloat16)
    return [("same weights, fp32", same), (f"one Adam step away (lr {lr:g})", stale), ("same weights, bf16", bf16)]


def measure(model: Any, t: Any, lp_rollout: torch.Tensor, moe_layers: list[int]) -> dict[str, Any]:
    mask = t.response_mask.bool()
    with torch.no_grad():
        with record_routing(model) as rec:
            free = token_logprobs(model(t.input_ids, attention_mask=t.attention_mask).logits, t.input_ids)
        with replay_routing(model, t):
            replayed = token_logprobs(model(t.input_ids, attention_mask=t.attention_mask).logits, t.input_ids)
    rows = t.routed_experts_mask & mask  # response tokens whose routing the rollout recorded
    agree = routing_agreement(rec.routed_experts, t.routed_experts, rows, layers=moe_layers)
    # response tokens whose own routing differs from the rollout's in some MoE layer *before* the token
    # (a flip at position p changes the log-prob of tokens p+1..; here: any flip at the previous position)
    same = torch.from_numpy(set_matches(rec.routed_experts, t.routed_experts, layers=moe_layers))  # [B, T, MoE]
    flip_prev = ~same.all(-1) & t.routed_experts_mask
    flipped = torch.zeros_like(mask)
    flipped[:, 1:] = flip_prev[:, :-1]
    flipped &= mask
    out = {
        "no replay": r3_metrics(free, lp_rollout, mask, routing_agreement=agree),
        "replay": r3_metrics(replayed, lp_rollout, mask, routing_agreement=1.0),
    }
    if flipped.any():
        out["no replay, flipped"] = r3_metrics(free, lp_rollout, flipped)
        out["replay, flipped"] = r3_metrics(replayed, lp_rollout, flipped)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default=".cache/r3-effect")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lm-head-scale", type=float, default=8.0)
    p.add_argument("--expert-scale", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-url", default=None, help="an already running rr vLLM server serving the same model")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    model_dir = build_model(Path(args.work_dir), args.lm_head_scale, args.expert_scale)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(args.num_prompts)]
    proc = None
    base_url = args.base_url
    log = Path(tempfile.gettempdir()) / f"rr-r3-effect-{os.getpid()}.log"
    try:
        if base_url is None:
            port = free_port()
            base_url = f"http://127.0.0.1:{port}"
            proc = launch(model_dir, port, log)
            wait_healthy(base_url, proc, log, 600)
            print(f"vLLM (rr-server launch vllm) healthy at {base_url} after {time.perf_counter() - t0:.0f}s")
        batch = asyncio.run(rollout(base_url, prompts, args.max_new_tokens, args.seed))
    finally:
        if proc is not None:
            stop_process_group(proc)
    info = batch.info
    t = batch.to_tensors(pad_side="right")  # right padding: HF positions need no position_ids
    lp_rollout = rollout_logprobs(batch, t)
    n_resp = int(t.response_mask.sum())
    print(
        f"model: tiny Qwen3-MoE, {info.num_hidden_layers} layers, {info.num_experts} experts, top-{info.topk}, "
        f"hidden 64, lm_head x{args.lm_head_scale:g}, expert weights x{args.expert_scale:g}; rollout: {len(batch)} samples, {n_resp} response tokens, "
        f"vLLM {info.engine_version} fp32, temperature 1"
    )
    head = (
        "| trainer | replay | routing agreement | mean abs d | mean d^2 | k3 KL | frac abs d > ln2 "
        "| frac abs d > ln5 | after a flip: tokens / mean abs d / k3 |"
    )
    print()
    print(head)
    print("|" + "---|" * 9)
    for name, model in trainer_variants(model_dir, t, args.lr):
        res = measure(model, t, lp_rollout, list(info.moe_layers))
        flips = res.get("no replay, flipped")
        for mode in ("no replay", "replay"):
            m = res[mode]
            agree = f"{100 * m.routing_agreement:.2f}%" if mode == "no replay" else "(replayed)"
            fm = res.get(f"{mode}, flipped")
            on_flips = f"{fm.tokens} / {fm.mean_abs_diff:.2e} / {fm.k3_kl:.2e}" if fm else "0 / - / -"
            print(
                f"| {name} | {mode} | {agree} | {m.mean_abs_diff:.2e} | {m.mean_sq_diff:.2e} | {m.k3_kl:.2e} "
                f"| {m.frac_gt_ln2:.4f} | {m.frac_gt_ln5:.4f} | {on_flips} |"
            )
        del flips
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
