"""Cost of routing replay: forward+backward of a random MoE with and without ``replay_routing`` / ``record_routing``.

Two tables. **Time** (median of interleaved reps, so drift hits every mode alike): no replay; replay with the
sampled formula check on (default ``check_every``); with it off; with the audit; ``record_routing`` against a
plain forward. **Ops, host syncs and cross-device copies** inside the forward+backward
(``rr_client.trainer.replay.cost``), plus the block's opening and exit: what a GPU pays in kernel launches, stalls
and transfers. The ops are the same on every device; copies exist only where rows and model live apart (on a
CPU-only run there are none: ``tests/trainer/test_replay_cost.py`` counts them on fake CUDA tensors).

Shapes: ``small`` (CPU, default), and the per-layer shapes of production models for a GPU: ``qwen3-30b-a3b``
(hidden 2048, 128 experts top-8, 8 layers, 4 x 2048 tokens), ``qwen3-235b-a22b`` (hidden 4096, 128 experts top-8,
4 layers, 2 x 2048), ``deepseek-v3-router`` (sigmoid + bias, 8 groups, 256 experts top-8). bf16 on CUDA, fp32 on
the CPU.

    python benchmarks/replay_overhead.py --shape small --reps 5
    python benchmarks/replay_overhead.py --shape all          # on a GPU
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch
import transformers

from rr_client.trainer.replay import find_routers, record_routing, replay_routing
from rr_client.trainer.replay.cost import count_ops

SHAPES: dict[str, dict[str, Any]] = {
    # arch, layers, hidden, experts, top-k, moe_intermediate, batch, seq
    "small": dict(arch="qwen3", layers=8, hidden=256, experts=64, topk=8, inter=64, batch=2, seq=128),
    "qwen3-30b-a3b": dict(arch="qwen3", layers=8, hidden=2048, experts=128, topk=8, inter=768, batch=4, seq=2048),
    "qwen3-235b-a22b": dict(arch="qwen3", layers=4, hidden=4096, experts=128, topk=8, inter=1536, batch=2, seq=2048),
    "deepseek-v3-router": dict(
        arch="deepseek_v3", layers=4, hidden=2048, experts=256, topk=8, inter=256, batch=2, seq=2048
    ),
}
GPU_SHAPES = ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3-router"]


def build(s: dict[str, Any], device: str, dtype: torch.dtype) -> transformers.PreTrainedModel:
    common = dict(
        vocab_size=1024,
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        num_experts_per_tok=s["topk"],
        moe_intermediate_size=s["inter"],
        intermediate_size=2 * s["hidden"],
    )
    if s["arch"] == "qwen3":
        cfg = transformers.Qwen3MoeConfig(
            **common, num_key_value_heads=4, head_dim=128, num_experts=s["experts"], norm_topk_prob=True
        )
    else:
        cfg = transformers.DeepseekV3Config(
            **common,
            num_key_value_heads=16,
            n_routed_experts=s["experts"],
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=None,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
        )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).train()


def op_table(model: Any, x: torch.Tensor, routing: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Ops and host syncs per MoE layer inside forward+backward, and the block's opening and exit."""
    n_moe = len(find_routers(model))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).logits.float().logsumexp(-1).mean().backward()

    step()
    with count_ops() as base:
        step()
    rows = []
    modes: list[tuple[str, Any]] = [
        ("replay, check not sampled", lambda: replay_routing(model, routing, mask, check_formula=False)),
        ("replay, check sampled", lambda: replay_routing(model, routing, mask, check_every=1)),
        ("replay + audit", lambda: replay_routing(model, routing, mask, check_formula=False, audit=True)),
        ("record_routing", lambda: record_routing(model)),
    ]
    for name, make in modes:
        ctx = make()
        with count_ops() as opening:
            ctx.__enter__()
        with count_ops() as inside:
            step()
        with count_ops() as closing:
            ctx.__exit__(None, None, None)
        rows.append(
            f"| {name} | {(inside.ops - base.ops) / n_moe:.1f} | {(inside.syncs - base.syncs) / n_moe:.1f} "
            f"| {inside.copies - base.copies} | {opening.ops} / {opening.syncs} / {opening.copies} "
            f"| {closing.ops} / {closing.syncs} / {closing.copies} |"
        )
    return [
        f"MoE layers: {n_moe}; the model's own forward+backward: {base.ops} ops, {base.syncs} syncs, "
        f"{base.copies} cross-device copies",
        "| mode | ops / MoE layer | syncs / MoE layer | copies inside | opening: ops / syncs / copies "
        "| exit: ops / syncs / copies |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def bench(shape: str, device: str, dtype: torch.dtype, reps: int) -> None:
    s = SHAPES[shape]
    model = build(s, device, dtype)
    x = torch.randint(0, 1024, (s["batch"], s["seq"]), device=device)
    with torch.no_grad(), record_routing(model) as rec:
        model(x)
    routing = rec.routed_experts.to(torch.int16)  # the rollout's choice, as a trainer holds it: on the CPU
    mask = torch.ones(s["batch"], s["seq"], dtype=torch.bool)
    mask[:, -1] = False  # the last token has no routing
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).logits.float().logsumexp(-1).mean().backward()

    def run(mode: str) -> float:
        sync()
        t = time.perf_counter()
        if mode == "no replay":
            step()
        elif mode == "forward":
            with torch.no_grad():
                model(x)
        elif mode == "record_routing forward":
            with torch.no_grad(), record_routing(model):
                model(x)
        else:
            with replay_routing(
                model, routing, mask, check_formula=mode != "replay, check off", audit=mode == "replay + audit"
            ):
                step()
        sync()
        return time.perf_counter() - t

    modes = [
        "no replay",
        "replay, check on",
        "replay, check off",
        "replay + audit",
        "forward",
        "record_routing forward",
    ]
    for m in modes:  # warm-up
        run(m)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(reps):
        for m in modes:
            times[m].append(run(m))
    med = {m: statistics.median(v) for m, v in times.items()}
    dev = (
        torch.cuda.get_device_name()
        if device.startswith("cuda")
        else f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    )
    print(
        f"\n### {shape}: {s['arch']}, {s['layers']} MoE layers, hidden {s['hidden']}, {s['experts']} experts, "
        f"top-{s['topk']}, {s['batch']} x {s['seq']} tokens, {str(dtype).replace('torch.', '')}; device {dev}; "
        f"median of {reps} interleaved reps; torch {torch.__version__}, transformers {transformers.__version__}"
    )
    print("| mode | median s | ratio |")
    print("|---|---|---|")
    for m in modes:
        ref = med["forward"] if m.endswith("forward") else med["no replay"]
        print(f"| {m} | {med[m]:.4f} | {med[m] / ref:.3f} |")
    print()
    print("\n".join(op_table(model, x, routing, mask)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=[*SHAPES, "all"], default="small")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    for shape in GPU_SHAPES if a.shape == "all" else [a.shape]:
        bench(shape, a.device, dtype, a.reps)


if __name__ == "__main__":
    main()
