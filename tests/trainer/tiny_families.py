"""A tiny random model of any MoE family of the installed transformers (5.10 or 5.24), built from its config class
(no hub download)."""

from __future__ import annotations

from typing import Any

import torch

from rr_client.trainer.replay import survey

from .tiny_models import ARCHS, tiny_config

VOCAB = 64
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=48,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_experts=8,
    num_local_experts=8,
    n_routed_experts=8,
    moe_num_experts=8,
    num_experts_per_tok=2,
    moe_topk=2,
    top_k_experts=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    n_group=2,
    topk_group=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    first_k_dense_replace=1,
    n_shared_experts=1,
    expert_intermediate_size=16,
    sliding_window=8,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
OVERRIDES: dict[str, dict[str, Any]] = {
    "beam": dict(mlp_layer_types=["dense", "sparse", "sparse"]),
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe", "moe"]),  # one hash-routed layer, left to the model
    "mimo_v2_flash": dict(num_key_value_heads=1),
    "glm_moe_dsa": dict(mlp_layer_types=["dense", "sparse", "sparse"]),  # 5.10 ignores first_k_dense_replace
    # 5.24: GLM-5-next's DSA layers need NoPE MLA and one KV head per head; every layer indexed (its default keeps
    # layer 3 of 4 only, and linear attention needs kernels), pools of one token
    "glm5_next": dict(
        qk_rope_head_dim=0,
        qk_nope_head_dim=16,
        index_kpool=1,
        layer_types=["indexed_attention"] * 3,
        mlp_layer_types=["dense", "sparse", "sparse"],
    ),
    # 5.24: mrope sections must sum to qk_rope_head_dim // 2
    "hy_v4_vl": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}),
    # 5.24 (refused): layer 1 looped twice per forward; a small head and sliding-window attention
    "inkling2_loop": dict(
        unpadded_vocab_size=VOCAB,
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=2,
        loop_num_passes=2,
        loop_gate_rank=8,
        swa_num_attention_heads=2,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        d_rel=4,
        sliding_window_size=8,
        rel_extent=16,
    ),
}


def tiny_family_config(model_type: str) -> Any:
    if model_type in ARCHS:
        return tiny_config(model_type)
    from transformers import CONFIG_MAPPING

    key = model_type + "_text" if model_type + "_text" in CONFIG_MAPPING else model_type
    cls = CONFIG_MAPPING[key]
    base = cls()
    kw = {k: v for k, v in TINY.items() if hasattr(base, k)}
    return cls(**{**kw, **OVERRIDES.get(model_type, {})})


def tiny_family_raw(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """The family's tiny model as transformers builds it (random init, in ``dtype``: transformers keeps the
    modules a family names in float32), before rr looks at its routers."""
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_family_config(model_type)
    for k, v in overrides.items():  # e.g. a vocabulary as large as a test tokenizer's
        setattr(cfg, k, v)
    cfg._attn_implementation = "eager"
    try:
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    except ValueError:
        return transformers.AutoModel.from_config(cfg, dtype=dtype)


def tiny_family_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    model = tiny_family_raw(model_type, seed, dtype, **overrides)
    g = torch.Generator().manual_seed(seed + 1)
    routers, left = survey(model)
    with torch.no_grad():
        for r in routers:  # spread routers so choices have clear margins
            for p in r.module.parameters():
                if p.dim() == 2 and p.shape[0] in (r.num_experts, r.num_experts + 1):
                    p.copy_(torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
            elif name.endswith("tid2eid"):  # hash layers: distinct experts per token
                e = int(model.config.get_text_config().num_local_experts)
                b.copy_(torch.stack([torch.randperm(e, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))
    model.eval()
    return model


def forward(model: Any, x: torch.Tensor) -> torch.Tensor:
    out = model(x, use_cache=False)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
