"""Cost of routing replay: forward+backward of a random Qwen3-MoE with and without ``replay_routing``.

Modes, interleaved in one run (round-robin, so drift hits every mode alike): no replay; replay with the
bit-for-bit formula check on; replay with it off; replay with the check and the audit on. Prints the median
time per step and the ratio to no replay. ``--shape small`` (default, fits a CPU in a minute) or
``realistic`` (48 MoE layers at hidden 1024, 64 experts, top-8, 4 x 512 tokens; for a GPU). Runs on CUDA
when available (``--device``).

    python benchmarks/replay_overhead.py --shape small --reps 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import transformers

from rr_client.replay import record_routing, replay_routing

SHAPES = {
    # layers, hidden, experts, top-k, moe_intermediate, batch, seq
    "small": dict(layers=8, hidden=256, experts=64, topk=8, inter=64, batch=2, seq=128),
    "medium": dict(layers=16, hidden=512, experts=64, topk=8, inter=128, batch=2, seq=256),
    "realistic": dict(layers=48, hidden=1024, experts=64, topk=8, inter=256, batch=4, seq=512),
    # the router shape (48 routers at hidden 1024, 64 experts, top-8, 4 x 512 tokens) with thin experts, so it
    # fits 24 GiB on a CPU; the experts' share of the step shrinks, so the replay ratio is an upper bound
    "routers48": dict(layers=48, hidden=1024, experts=64, topk=8, inter=32, batch=4, seq=512),
}


def build(s: dict, device: str, dtype: torch.dtype) -> transformers.PreTrainedModel:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=8,
        num_key_value_heads=2, head_dim=s["hidden"] // 8, intermediate_size=2 * s["hidden"],
        moe_intermediate_size=s["inter"], num_experts=s["experts"], num_experts_per_tok=s["topk"],
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).train()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    a = ap.parse_args()
    s = SHAPES[a.shape]
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    model = build(s, a.device, dtype)
    x = torch.randint(0, 1024, (s["batch"], s["seq"]), device=a.device)
    with torch.no_grad(), record_routing(model) as rec:
        model(x)
    routing = rec.routed_experts.to(torch.int16)  # the rollout's choice, as a trainer holds it

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).logits.float().logsumexp(-1).mean().backward()

    def run(mode: str) -> float:
        sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
        sync()
        t = time.perf_counter()
        if mode == "no replay":
            step()
        else:
            with replay_routing(model, routing, check_formula=mode != "replay, check off",
                                audit=mode == "replay + audit"):
                step()
        sync()
        return time.perf_counter() - t

    modes = ["no replay", "replay, check on", "replay, check off", "replay + audit"]
    for m in modes:  # warm-up
        run(m)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(a.reps):
        for m in modes:
            times[m].append(run(m))
    base = statistics.median(times["no replay"])
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"{platform.processor() or 'cpu'}, " \
          f"{torch.get_num_threads()} threads"
    print(f"shape {a.shape}: {s['layers']} MoE layers, hidden {s['hidden']}, {s['experts']} experts, top-{s['topk']}, "
          f"{s['batch']} x {s['seq']} tokens, {str(dtype).replace('torch.', '')}, forward+backward; device {dev}; "
          f"median of {a.reps} interleaved reps; torch {torch.__version__}, transformers {transformers.__version__}")
    print("| mode | median s/step | ratio to no replay |")
    print("|---|---|---|")
    for m in modes:
        med = statistics.median(times[m])
        print(f"| {m} | {med:.4f} | {med / base:.3f} |")


if __name__ == "__main__":
    main()
