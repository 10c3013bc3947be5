"""Tiny random MoE models of each supported architecture (transformers 5.x), built in memory in well under a second.

``ARCHS`` is what replays on the installed transformers: on 5.10 (the low end of the declared range) DeepSeek-V3's
router returns logits only and rr refuses it (tests/trainer/test_replay_families.py checks that refusal)."""

from __future__ import annotations

from typing import Any

import torch

ALL_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")


def _archs() -> tuple[str, ...]:
    from importlib.metadata import version

    from rr_client.trainer.replay.coverage import LOWEST, REFUSED_IN_LOWEST

    at_lowest = version("transformers").split(".")[:2] == LOWEST.split(".")[:2]
    return tuple(a for a in ALL_ARCHS if not (at_lowest and a in REFUSED_IN_LOWEST))


ARCHS = _archs()
VOCAB, HIDDEN, LAYERS, EXPERTS, TOPK = 64, 32, 3, 8, 2


def tiny_config(arch: str) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts_per_tok=TOPK,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=16,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=EXPERTS,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        )
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_experts=EXPERTS,
            norm_topk_prob=False,
        )
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, head_dim=16, intermediate_size=16, num_local_experts=EXPERTS)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=16, num_experts=EXPERTS)
    if arch == "deepseek_v3":
        common["num_key_value_heads"] = 2  # MLA: as many KV heads as query heads
        return transformers.DeepseekV3Config(
            **common,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=EXPERTS,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        )
    if arch == "gpt_oss":
        return transformers.GptOssConfig(
            **common, head_dim=16, intermediate_size=16, num_local_experts=EXPERTS, sliding_window=8
        )
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0) -> Any:
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # spread routers (and DeepSeek's correction bias) so choices have clear margins
            if name.endswith(("gate.weight", "router.weight")) and p.shape[0] == EXPERTS:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("router.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    model.eval()
    return model


def moe_layers(arch: str) -> list[int]:
    return {"qwen3_moe": [0, 2], "deepseek_v3": [1, 2]}.get(arch, list(range(LAYERS)))
