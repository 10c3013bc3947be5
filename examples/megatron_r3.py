"""R3 in a Megatron-core training loop: rollouts with routing from an rr server, replayed by Megatron's own RouterReplay.

Rank 0 generates with :class:`rr_client.RoutedExpertsClient` and hands the padded batch to every rank (a trainer's
controller does this; with ``by_reference=True`` each rank would resolve its own rows). Each rank builds its
``GPTModel`` chunk (local spec; your checkpoint in a real run), and a :class:`rr_client.trainer.ReplaySession` over
Megatron's ``RouterReplay`` (:class:`rr_client.integrations.megatron.MegatronSession`) feeds each micro-batch's rows to
this rank's routers *inside* ``forward_step_func``, so Megatron's schedules (``get_forward_backward_func``: no pipelining at PP=1, 1F1B at PP=2)
replay the right rows in every forward and every recompute; ``flush()`` ends the step and returns the same ``r3/``
keys as on the Hugging Face path (the audit, the log-prob gap to the engine, the stale-rows counts). Every stage
needs the routing of each micro-batch (its routers replay their own layers), not only the first and last.

The stale-rows policy runs where the rows enter (``open_replay``), on the provenance ``to_tensors`` keeps per sample:
a sample the server says was recomputed across a weight update is refused (``StaleRoutingError``, the default); with
``--stale-rows mask`` it runs on pad rows (Megatron replays every token) and ``drop_samples`` takes it out of the
loss; ``--stale-rows off`` turns the policy off on purpose.

    rr-server launch vllm --model <moe checkpoint> --port 8000 ...
    torchrun --nproc-per-node 2 examples/megatron_r3.py --url http://127.0.0.1:8000 --model-path <checkpoint> --pp 2

Without a GPU it runs on the CPU over gloo, with the stand-ins :func:`cpu_stand_ins` names (Megatron's CUDA device,
RNG and token counter pointed at the CPU; none touches routing or replay).

The model here is built fresh with the checkpoint's MoE shape (layers, experts, top-k, dense layers), so the routers'
own choice disagrees with the engine's (``r3/agreement`` low) while ``r3/applied_share`` is 1.0: every router chose
the rollout's experts. A stand-in objective (the completions' negative log-likelihood) takes the place of yours.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rr_client import RoutedExpertsClient, RoutingTensors
from rr_client.trainer import keys
from rr_client.trainer.provenance import drop_samples

PROMPTS = [[1, 5, 9, 13], [2, 6, 10, 14, 18], [3, 7, 11], [4, 8, 12, 16]]


def rollout(url: str, max_new_tokens: int, seq_len: int) -> RoutingTensors:
    """Rank 0's rollout, padded on the right to ``seq_len`` tokens (Megatron's pipeline wants one fixed length)."""

    async def go() -> RoutingTensors:
        async with RoutedExpertsClient(url) as client:
            batch = await client.generate(
                PROMPTS, {"max_new_tokens": max_new_tokens, "temperature": 1.0}, return_logprob=True
            )
            return batch.to_tensors(pad_side="right", pad_to=seq_len)

    return asyncio.run(go())


def moe_shape(model_path: str) -> dict[str, Any]:
    """Layers, experts, top-k and dense layers of a Qwen3-MoE-style checkpoint's config.json."""
    cfg = json.loads(Path(model_path, "config.json").read_text())
    n = int(cfg["num_hidden_layers"])
    dense = set(cfg.get("mlp_only_layers") or [])
    return {
        "num_layers": n,
        "moe_layer_freq": [0 if i in dense else 1 for i in range(n)],
        "num_moe_experts": int(cfg.get("num_experts") or cfg["num_local_experts"]),
        "moe_router_topk": int(cfg["num_experts_per_tok"]),
        "vocab": int(cfg["vocab_size"]),
    }


def build_model(shape: dict[str, Any], pp: int) -> Any:
    """This rank's GPTModel chunk with the checkpoint's MoE shape, routing replay on, full recompute."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    n = shape["num_layers"]
    config = TransformerConfig(
        num_layers=n,
        hidden_size=32,
        num_attention_heads=2,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=32,
        num_moe_experts=shape["num_moe_experts"],
        moe_router_topk=shape["moe_router_topk"],
        moe_layer_freq=shape["moe_layer_freq"],
        moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        moe_enable_routing_replay=True,  # replay: Megatron's RouterReplay
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        pipeline_model_parallel_size=pp,
        num_layers_in_first_pipeline_stage=(n + 1) // 2 if pp == 2 else None,
        num_layers_in_last_pipeline_stage=n - (n + 1) // 2 if pp == 2 else None,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,
        variable_seq_lengths=False,
        params_dtype=torch.float32,
        use_cpu_initialization=not torch.cuda.is_available(),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=shape["vocab"],
        max_sequence_length=1024,
        position_embedding_type="learned_absolute",
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    return model.to("cuda" if torch.cuda.is_available() else "cpu").train()


def micro_batches(rt: RoutingTensors, size: int) -> list[RoutingTensors]:
    """``rt`` split into micro-batches of ``size`` samples (every per-sample tensor, and the samples' provenance,
    cut the same way)."""
    cut = {f.name for f in dataclasses.fields(rt) if isinstance(getattr(rt, f.name), torch.Tensor)}
    if rt.provenance is not None:
        cut.add("provenance")
    return [
        dataclasses.replace(rt, **{n: getattr(rt, n)[i : i + size] for n in cut})
        for i in range(0, rt.input_ids.shape[0], size)
    ]


def cpu_stand_ins() -> None:
    """Without CUDA, point what megatron-core 0.16 puts on "the GPU" at the CPU (as tests/megatron/harness.py does):
    ``torch.cuda.current_device``, the CUDA RNG state that recompute saves and restores, the RNG tracker's states,
    the schedules' token counter, and Transformer Engine's GEMM name the router looks up. Idempotent."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    if getattr(schedules, "_rr_cpu", False):
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    zeros = torch.zeros

    class CpuTorch:  # the schedules' torch, with zeros(device="cuda") on the CPU
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            return zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    schedules.torch = CpuTorch()
    schedules._rr_cpu = True


def seed(value: int) -> None:
    """Megatron's model-parallel RNG: its own seeding on a GPU, CPU generator states in its tracker without one."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(value)
        return
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    for i, name in enumerate(
        (
            mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
            mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
            mrandom._DATA_PARALLEL_RNG_TRACKER_NAME,
        )
    ):
        tracker.states_[name] = torch.Generator().manual_seed(value + 2718 * (i + 1)).get_state()
        tracker.seeds_.add(value + 2718 * (i + 1))
    tracker._is_initialized = True
    torch.manual_seed(value)


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model-path", required=True, help="the served checkpoint (its config gives the MoE shape)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages: 1 = no pipelining, 2 = 1F1B")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument(
        "--stale-rows",
        choices=["refuse", "mask", "off"],
        default="refuse",
        help="samples recomputed across a weight update: refused, masked (out of the loss) or kept",
    )
    args = ap.parse_args(argv)

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rr_client.integrations.megatron import MegatronSession

    if not torch.cuda.is_available():
        cpu_stand_ins()
    if not dist.is_initialized():  # torchrun's environment
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(pipeline_model_parallel_size=args.pp)
        seed(1234)
    model = build_model(moe_shape(args.model_path), args.pp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # audit every step here (the default is every 10th); the stale-rows policy runs in open_replay
    session = MegatronSession([model], audit_every=1, stale_rows=args.stale_rows)
    device = next(model.parameters()).device
    history = []
    mask = torch.triu(torch.ones(1, 1, args.seq_len, args.seq_len, dtype=torch.bool, device=device), 1)
    position_ids = torch.arange(args.seq_len, device=device).expand(args.micro_batch, -1)

    # ---------------------------------------------------------------- the loop
    for step in range(args.steps):
        box = [rollout(args.url, args.seq_len // 2, args.seq_len) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)  # every rank (every pipeline stage) gets the routing
        batches = micro_batches(box[0], args.micro_batch)

        def forward_step(data: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
            """One micro-batch: the stale-rows policy and its rows into this chunk's routers, then the forward."""
            mb = next(data)
            check = session.open_replay(mb, chunk=chunk)  # before the forward: 1F1B runs fwd and bwd out of step
            tokens = mb.input_ids.to(device)
            labels = torch.roll(tokens, -1, dims=1)  # position t predicts token t + 1
            # a sample the policy masked ran on pad rows (Megatron replays every token): out of the loss
            weight = drop_samples(torch.roll(mb.response_mask, -1, dims=1), check.replay).to(device).float()

            def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                logps = torch.roll(-per_token.detach(), 1, dims=1)  # token t's log-prob at t (last stage)
                session.add_gap(logps, mb, mb.response_mask.bool().to(device), temperature=1.0)
                loss = (per_token.float() * weight).sum() / weight.sum().clamp(min=1)
                return loss, {"nll": loss.detach()}

            return chunk(tokens, position_ids, mask, labels=labels), loss_func

        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=args.seq_len,
            micro_batch_size=args.micro_batch,
            forward_only=False,
        )
        metrics = session.flush()  # ends Megatron's step (every router cleared); the audit's verdicts raise here
        optimizer.step()
        optimizer.zero_grad()
        nll = sum(float(x["nll"]) for x in losses) / len(losses) if losses else float("nan")  # last stage only
        history.append({"step": step, "rank": dist.get_rank(), "nll": nll, **metrics})
        # the loss and the log-prob gap exist on the last pipeline stage only (the one with the output layer)
        tail = (
            f"nll {nll:.3f}  |logp gap| {metrics[keys.MEAN_ABS_LOGP_DIFF]:.2e}  "
            if losses and keys.MEAN_ABS_LOGP_DIFF in metrics
            else "(no loss on this pipeline stage)  "
        )
        line = (
            f"rank {dist.get_rank()} step {step}: applied {metrics[keys.APPLIED_SHARE]:.3f}  agreement "
            f"{metrics[keys.AGREEMENT]:.3f}  replayed rows {metrics[keys.REPLAYED_ROWS]:.0f}  {tail}"
            f"stale masked {metrics[keys.STALE_MASKED]:.0f}\n"
        )
        sys.stdout.write(line)  # one write with its newline: the ranks share torchrun's stdout, lines stay whole
        sys.stdout.flush()
    # ---------------------------------------------------------------- end of the loop
    session.detach()
    return history


if __name__ == "__main__":
    main()
