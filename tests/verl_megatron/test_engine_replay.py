"""verl 0.9.1's own Megatron engine replaying R3 rows on this CPU (issue 45), rr's feeder in its feeder's place.

verl's ``ActorRolloutRefWorker`` (``actor.strategy=megatron``, verl's generated Megatron PPO config) builds
``MegatronEngineWithLMHead`` from verl's ``EngineRegistry``; mbridge builds megatron-core 0.16.1's ``GPTModel`` for
a tiny Qwen3-MoE and loads its HF weights; TP = PP = CP = EP = 1 on one gloo rank. ``RayPPOTrainer.
_compute_old_log_prob`` runs the worker's ``compute_log_prob`` on a batch laid out by verl's agent loop
(``routed_experts`` rows under each token), verl's forward step calls its ``align_r3_router_replay_data`` /
``build_r3_replay_mask`` and ``set_router_replay_data`` (rr's feeder: test_rr_feeder.py) and its patched
``TopKRouter.routing`` replays. Which experts
ran is read from megatron-core's own router output (``routing_map``) and the experts' ``tokens_per_expert``.

Stand-ins (what and why), all test-side, none on the routing or replay path:
- tests/verl/cpu_platform.py: verl's accelerator as the CPU (device "cpu", gloo); one gloo rank, no Ray.
- tests/megatron/harness.py ``patch_cpu``: ``torch.cuda.current_device`` -> "cpu"; megatron's CUDA RNG get/set ->
  the CPU RNG; ``moe_utils.te_general_gemm = None`` (0.16.1 names TE's GEMM); the schedules' ``torch.zeros(device=
  "cuda")`` on the CPU (and its CP / SP attention and norm stand-ins, inert at CP = 1, SP off).
- ``tensor_parallel.model_parallel_cuda_manual_seed`` -> CPU RNG states in megatron's tracker: verl's
  ``set_random_seed`` (engine/megatron/utils.py:35) calls it since the CPU platform reports one device, and
  ``CudaRNGStatesTracker.add`` (tensor_parallel/random.py:235) calls ``torch.cuda.get_rng_state``.
- ``torch.nn.Module.cuda("cpu")`` a no-op: mbridge's ``get_model`` (mbridge/core/util.py:151) moves every chunk to
  ``torch.cuda.current_device()``.
- mbridge's ``LLMBridge._get_transformer_layer_spec`` -> megatron-core's local spec: mbridge hard-codes
  ``use_transformer_engine=True`` (mbridge/core/llm_bridge.py:149), which without TE fails at
  megatron/core/models/gpt/gpt_layer_specs.py:527 (``NameError: TENorm``). Its HF-name table is TE-spelled, so
  local names are mapped onto it (``input_layernorm`` -> ``linear_qkv.layer_norm_weight``, ``local_experts.i.
  linear_fcN.weight`` -> ``linear_fcN.weight{i}``).
- ``DotProductAttention.forward`` (local attention) given the mask TE's attention builds itself: verl's packed
  ``packed_seq_params`` is refused by it (transformer/dot_product_attention.py:153) -> a block-diagonal causal mask.
- transformer-config overrides through verl's own ``override_transformer_config``
  (harness.CPU_TRANSFORMER_OVERRIDES): local attention backend, ``moe_grouped_gemm=False`` (SequentialMLP), the
  allgather dispatcher (alltoall makes a ``torch.cuda.Stream``, moe/token_dispatcher.py:445) with
  ``variable_seq_lengths=False`` (allgather refuses it, transformer_config.py:1829; read only by PP p2p), fusions off.
- ``megatron.forward_only=True``: the actor has no optimizer (megatron's ``Float16OptimizerWithFloat16Params`` puts
  ``_scale_one`` on ``device="cuda"``, optimizer/optimizer.py:485), so ``update_actor`` is not run here.
- bf16, not fp32: verl's ``McoreEngineConfig`` refuses fp32 (verl/workers/config/engine.py:218). The experts that
  ran are compared exactly, which bf16 does not affect.
- The model: every layer MoE, since mbridge's Qwen3-MoE bridge has no ``mlp_only_layers`` (no dense-layer mapping).

Found on the way (verl, not stand-ins): R3 needs ``use_remove_padding=True``: ``set_router_replay_data`` packs the
rows thd-style (utils/megatron/router_replay_utils.py:480-503) while the padded path forwards ``[b, s]``, so the
router refuses (router_replay_patch.py:130, "scores=(40, 8), targets=(25, 2)").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.verl import harness as vh
from tests.verl_megatron import harness as h

LAYERS, TOPK, EXPERTS = 2, 2, 8
# (prompt, response) lengths: full-width, short, single-token response, mid-size; micro-batches of 2 in this order
SHAPES = [(12, 8), (3, 2), (5, 1), (7, 6)]
MICRO = 2


def sample_tokens(seed: int) -> list[tuple[list[int], list[int]]]:
    g = np.random.default_rng(seed)
    return [(g.integers(5, 60, p).tolist(), g.integers(5, 60, r).tolist()) for p, r in SHAPES]


def random_rows(n: int, seed: int) -> np.ndarray:
    """``[n, LAYERS, TOPK]`` distinct random experts per token and layer."""
    g = np.random.default_rng(seed)
    return np.stack([np.stack([g.choice(EXPERTS, TOPK, replace=False) for _ in range(LAYERS)]) for _ in range(n)])


def batch_of(tokenizer: Any, toks: list[tuple[list[int], list[int]]], rows: list[np.ndarray] | None) -> Any:
    return vh.agent_loop_batch(
        tokenizer,
        [
            dict(prompt_ids=p, response_ids=r, routed_experts=None if rows is None else rows[i])
            for i, (p, r) in enumerate(toks)
        ],
    )


def per_sample(maps: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
    """Split each micro-batch's packed ``[tokens, experts]`` map back per sample (verl keeps batch order)."""
    out = []
    for mb, m in enumerate(maps):
        ls = lengths[mb * MICRO : (mb + 1) * MICRO]
        assert m.shape[0] == sum(ls), f"micro-batch {mb}: {m.shape[0]} routed tokens for samples of {ls}"
        out.extend(m.split(ls))
    return out


@pytest.fixture(scope="module")
def workers(megatron_verl_process: None, model_dir: Any) -> dict[str, Any]:
    """verl Megatron actor workers built on first use, by router_replay.mode."""

    class _Workers(dict):  # type: ignore[type-arg]
        def __missing__(self, mode: str) -> Any:
            cfg = h.ppo_config(model_dir, mode=mode)
            self[mode] = (cfg, vh.actor_worker(cfg))
            return self[mode]

    return _Workers()


def run_log_prob(cfg: Any, worker: Any, batch: Any) -> tuple[Any, h.MoeSeen]:
    seen = h.MoeSeen(worker.actor.engine.module[0])
    try:
        old = vh.compute_log_prob(vh.trainer(cfg, worker), batch)
    finally:
        seen.remove()
    return old, seen


def test_verls_megatron_engine_runs_exactly_the_rows_given(workers: Any, tokenizer: Any) -> None:
    cfg, w = workers["R3"]
    assert type(w.actor.engine).__name__ == "MegatronEngineWithLMHead"  # verl's own engine, from its registry
    toks = sample_tokens(2)
    lengths = [len(p) + len(r) for p, r in toks]
    rows = [random_rows(n - 1, seed=i) for i, n in enumerate(lengths)]  # rollout rows: none for the last token
    old, seen = run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))
    lp = old.batch["old_log_probs"]
    assert lp.shape == (len(SHAPES), vh.RESPONSE_LEN) and torch.isfinite(lp).all()
    assert sorted(seen.maps) == [1, 2]
    checked = 0
    for layer, maps in seen.maps.items():
        assert len(maps) == len(SHAPES) // MICRO  # one forward per micro-batch, no recompute (forward only)
        for m, counts in zip(maps, seen.counts[layer], strict=True):  # what the experts were handed
            assert torch.equal(counts.to(torch.int64), m.sum(dim=0).to(torch.int64))
        for i, got in enumerate(per_sample(maps, lengths)):
            want = torch.zeros(lengths[i] - 1, EXPERTS, dtype=torch.bool)
            want.scatter_(1, torch.as_tensor(rows[i][:, layer - 1], dtype=torch.int64), True)
            bad = (got[:-1] != want).any(dim=1).nonzero().flatten().tolist()
            assert not bad, f"sample {i} layer {layer}: tokens {bad} ran other experts than their rows"
            assert int(got[-1].sum()) == TOPK  # the last token (no row) is routed by the model itself
            checked += want.shape[0]
    assert checked == sum(n - 1 for n in lengths) * LAYERS
    cfg0, w0 = workers["disabled"]  # the same batch without replay: the model's own routing differs from the rows
    native, seen0 = run_log_prob(cfg0, w0, batch_of(tokenizer, toks, None))
    differ = sum(
        int((a != b).any(dim=1).sum()) for layer in (1, 2) for a, b in zip(seen0.maps[layer], seen.maps[layer])
    )
    assert differ > checked // 2
    assert not torch.equal(native.batch["old_log_probs"], lp)


def test_replaying_the_models_own_routing_reproduces_its_log_probs(
    workers: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's native routing (replay disabled), replayed as rows through verl's R3 path: same experts, same
    log-probs, and rr's audit finds the routers' own choice agreeing with every replayed row. Checks the agent-loop
    row layout lines up with verl's packing token for token."""
    monkeypatch.setenv("RR_AUDIT_EVERY", "1")
    toks = sample_tokens(3)
    lengths = [len(p) + len(r) for p, r in toks]
    cfg0, w0 = workers["disabled"]
    native, seen0 = run_log_prob(cfg0, w0, batch_of(tokenizer, toks, None))
    own = {layer: per_sample(maps, lengths) for layer, maps in seen0.maps.items()}
    rows = [
        np.stack([np.stack([own[layer][i][t].nonzero().flatten().numpy() for layer in (1, 2)]) for t in range(n - 1)])
        for i, n in enumerate(lengths)
    ]
    cfg, w = workers["R3"]
    replayed, seen = run_log_prob(cfg, w, batch_of(tokenizer, toks, rows))
    for layer in (1, 2):
        for a, b in zip(seen.maps[layer], seen0.maps[layer], strict=True):
            assert torch.equal(a, b)
    assert torch.equal(replayed.batch["old_log_probs"], native.batch["old_log_probs"])
    met = w.actor.engine.rr_last_metrics
    assert met["r3/agreement"] == 1.0 and met["r3/applied_share"] == 1.0
