"""verl 0.9.1's own Megatron engine on this CPU: its ``ActorRolloutRefWorker`` with ``actor.strategy=megatron``.

- :func:`install_stand_ins` applies the CPU stand-ins (each named in tests/verl_megatron/test_engine_replay.py's
  docstring) on top of tests/megatron/harness.py's :func:`~tests.megatron.harness.patch_cpu`;
  :func:`remove_stand_ins` undoes all of them.
- :func:`ppo_config` is verl's generated Megatron PPO config (``_generated_ppo_megatron_trainer.yaml``) for the tiny
  Qwen3-MoE, TP = PP = 1, one gloo rank, ``router_replay.mode`` as asked.
- :class:`MoeSeen` hooks megatron-core's own ``TopKRouter`` (its ``routing_map`` output, what the token dispatcher
  permutes with) and ``SequentialMLP`` experts (``tokens_per_expert`` they received): independent of verl's replay.

The worker, the agent-loop batch and the trainer's old-log-prob step are tests/verl/harness.py's.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from tests.megatron import harness as mh

_INSTALLED: list[bool] = []


def _local_layer_spec(self: Any, vp_stage: int | None = None) -> Any:
    """Stand-in for mbridge's ``LLMBridge._get_transformer_layer_spec``: megatron-core's local spec (RMSNorm)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(
        self.config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
    )


_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc\d)\.weight$")


def _te_name(name: str) -> str:
    """A local-spec parameter name as mbridge's TE-spec tables spell it (the HF names follow from those)."""
    name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
    return _LOCAL_EXPERT.sub(r".mlp.experts.\2.weight\1", name)


def _causal_mask_attention(original: Any) -> Any:
    """Stand-in around the local ``DotProductAttention.forward`` for the masks Transformer Engine's attention
    reads itself: verl's packed (thd) batch, ``packed_seq_params`` -> block-diagonal causal mask over the packed
    sequences; verl's padded (bshd) ``[b, s]`` keep-mask -> causal + key padding. ``True`` = masked out."""

    def forward(
        self: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> Any:
        if packed_seq_params is not None and query.dim() == 3:  # thd: [t, heads, dim] with b = 1 squeezed
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        s = query.shape[0]
        causal = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            if int(cu[-1]) != s:  # context parallel: this rank holds 1/cp of every padded sample (attends within it)
                cu = cu * s // int(cu[-1])
            seg = torch.zeros(s, dtype=torch.long, device=query.device)
            seg[cu[1:-1].long()] = 1
            seg = seg.cumsum(0)
            attention_mask = ~(causal & (seg[:, None] == seg[None, :]))[None, None]
        elif attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = ~(causal[None] & attention_mask.bool()[:, None, :])[:, None]
        return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias, None)

    return forward


def install_stand_ins() -> None:
    """tests/megatron's CPU patches, then this engine's own stand-ins (idempotent; undone by remove_stand_ins)."""
    if _INSTALLED:
        return
    mh.patch_cpu()  # current_device, CUDA RNG -> CPU RNG, te_general_gemm, schedules' zeros on "cuda"
    from mbridge.core.bridge import Bridge
    from mbridge.core.llm_bridge import LLMBridge
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    # verl's set_random_seed seeds the CUDA RNG tracker when its platform reports a device: CPU states instead
    mh._patch(tensor_parallel, "model_parallel_cuda_manual_seed", lambda seed, *a, **k: mh.seed_rng_tracker(seed))
    # mbridge's get_model moves each chunk to torch.cuda.current_device() ("cpu" under patch_cpu)
    module_cuda = torch.nn.Module.cuda
    mh._patch(torch.nn.Module, "cuda", lambda self, device=None: self if device == "cpu" else module_cuda(self, device))
    # mbridge builds the Transformer Engine spec only; the local spec instead, and its weight names mapped
    mh._patch(LLMBridge, "_get_transformer_layer_spec", _local_layer_spec)
    to_hf = Bridge._weight_name_mapping_mcore_to_hf
    mh._patch(Bridge, "_weight_name_mapping_mcore_to_hf", lambda self, name: to_hf(self, _te_name(name)))
    mh._patch(DotProductAttention, "forward", _causal_mask_attention(DotProductAttention.forward))
    # the CPU RNG is the "CUDA" RNG here: megatron's tracker warns on every fork that it changed
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _INSTALLED.append(True)


def remove_stand_ins() -> None:
    """Undo every patch (tests/megatron's too) and Megatron's parallel state; the process group stays."""
    from megatron.core import parallel_state

    mh.new_model_state()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    mh.unpatch_cpu()
    _INSTALLED.clear()


# transformer-config overrides verl passes to mbridge (override_transformer_config): what runs without TE / CUDA
CPU_TRANSFORMER_OVERRIDES: dict[str, Any] = {
    "attention_backend": "local",  # verl's default "flash" needs TE
    "moe_grouped_gemm": False,  # mbridge's Qwen3-MoE default: TE's grouped GEMM -> local SequentialMLP
    "moe_token_dispatcher_type": "allgather",  # alltoall makes a torch.cuda.Stream at build
    "variable_seq_lengths": False,  # allgather refuses it; only PP p2p shapes read it (PP = 1 here)
    "persist_layer_norm": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
}


def ppo_config(model_dir: Path, *, mode: str = "R3", micro_batch: int = 2) -> Any:
    """verl's generated Megatron PPO config for a tiny CPU run: forward-only actor (no optimizer), bf16."""
    import verl
    from omegaconf import OmegaConf

    from tests.verl.harness import PROMPT_LEN, RESPONSE_LEN

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_megatron_trainer.yaml")
    a = cfg.actor_rollout_ref
    a.model.path = str(model_dir)
    a.model.use_remove_padding = True  # verl's R3 packs the rows thd-style whatever the layout (see test docstring)
    a.actor.strategy = "megatron"
    m = a.actor.megatron
    m.dtype = "bfloat16"  # McoreEngineConfig accepts bfloat16/float16 only
    m.vanilla_mbridge = True  # mbridge; Megatron-Bridge (the default) is not installed
    m.sequence_parallel = False
    m.use_distributed_optimizer = False
    m.forward_only = True  # megatron's Float16Optimizer puts its scale on device="cuda"
    m.router_replay.mode = mode
    OmegaConf.set_struct(m.override_transformer_config, False)
    m.override_transformer_config.update(CPU_TRANSFORMER_OVERRIDES)
    a.actor.use_torch_compile = False
    a.actor.ppo_mini_batch_size, a.actor.ppo_micro_batch_size_per_gpu = 4, micro_batch
    a.rollout.log_prob_micro_batch_size_per_gpu = micro_batch
    a.rollout.n = 1
    a.rollout.prompt_length, a.rollout.response_length = PROMPT_LEN, RESPONSE_LEN
    a.rollout.name = "vllm"
    a.rollout.enable_rollout_routing_replay = mode == "R3"
    return cfg


def take_targets(model: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """Every router's current replay targets and mask (bool), by ``layer_number`` (copies), then cleared: what a
    feeder left on verl's ``RouterReplay`` objects, for comparing two feeders on the same call."""
    out = {}
    for m in model.modules():
        rep = getattr(m, "router_replay", None)
        if type(m).__name__ == "TopKRouter" and rep is not None and rep.target_topk_idx is not None:
            mask = rep.target_replay_mask
            out[int(m.layer_number)] = (rep.target_topk_idx.clone(), None if mask is None else mask.clone().bool())
            rep.clear_indices()
    return out


class MoeSeen:
    """Per MoE layer (``layer_number``, 1-based), every forward's ``routing_map`` ``[tokens, experts]`` from the
    router's output, and the ``tokens_per_expert`` the experts module was handed."""

    def __init__(self, model: Any) -> None:
        from megatron.core.transformer.moe.experts import SequentialMLP
        from megatron.core.transformer.moe.router import TopKRouter

        self.maps: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.counts: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._handles = []
        for name, mod in model.named_modules():
            if isinstance(mod, TopKRouter):
                self._handles.append(mod.register_forward_hook(self._router_hook))
            elif isinstance(mod, SequentialMLP):
                layer = int(name.split("layers.")[1].split(".")[0]) + 1
                self._handles.append(mod.register_forward_pre_hook(lambda m, a, _l=layer: self._experts_hook(_l, a)))

    def _router_hook(self, router: Any, _args: Any, output: Any) -> None:
        self.maps[int(router.layer_number)].append(output[1].detach().to("cpu", torch.bool).clone())

    def _experts_hook(self, layer: int, args: tuple[Any, ...]) -> None:
        self.counts[layer].append(torch.as_tensor(args[1]).detach().to("cpu").clone())

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
