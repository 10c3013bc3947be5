"""Read routing dimensions and MoE layer indices from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["load_config", "moe_layers_from_config", "hash_layers_from_config", "routing_dims_from_config"]

_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")


def load_config(path: str | Path) -> dict[str, Any]:
    """Load ``config.json`` from a file or a checkpoint directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    with open(p) as f:
        cfg: dict[str, Any] = json.load(f)
    return cfg


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """Multimodal configs keep the language model under ``text_config``."""
    inner = cfg.get("text_config")
    return inner if isinstance(inner, Mapping) and "num_hidden_layers" in inner else cfg


def _first(cfg: Mapping[str, Any], keys: tuple[str, ...], what: str) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and v > 0:
            return v
    raise KeyError(f"config has no {what} (looked for {', '.join(keys)})")


def routing_dims_from_config(cfg: Mapping[str, Any]) -> tuple[int, int, int]:
    """Return ``(num_hidden_layers, num_experts, topk)``: the engines' per-token routing shape and id range."""
    c = _text_config(cfg)
    layers = _first(c, ("num_hidden_layers", "num_layers", "n_layer"), "layer count")
    return layers, _first(c, _EXPERT_KEYS, "expert count"), _first(c, _TOPK_KEYS, "top-k")


def hash_layers_from_config(cfg: Mapping[str, Any]) -> list[int]:
    """Hash-routed MoE layers (DeepSeek-V4): experts picked by a frozen token-id table, not by a learned router.

    ``mlp_layer_types`` entries ``hash_moe``, or a legacy ``num_hash_layers`` (the first N layers, as transformers'
    ``DeepseekV4Config`` reads it; its default of 3 applies to ``deepseek_v4`` configs that state neither).
    """
    c = _text_config(cfg)
    n = routing_dims_from_config(c)[0]
    types = c.get("mlp_layer_types")
    if isinstance(types, list) and types:
        return [i for i, t in enumerate(types[:n]) if str(t).lower() == "hash_moe"]
    count = c.get("num_hash_layers")
    if count is None and c.get("model_type") == "deepseek_v4":
        count = 3
    return list(range(min(n, int(count)))) if isinstance(count, int) and count > 0 else []


def moe_layers_from_config(cfg: Mapping[str, Any]) -> list[int]:
    """Indices of the layers that route to experts with a learned router; the engines give the others all-zero rows.

    Understands DeepSeek's ``first_k_dense_replace`` + ``moe_layer_freq``, Qwen2/3-MoE's
    ``decoder_sparse_step`` + ``mlp_only_layers``, and explicit ``mlp_layer_types``/``moe_layers`` lists. Hash-routed
    layers (:func:`hash_layers_from_config`) are not among them: :class:`rr_client.RRInfo` adds them where the engine
    captures them.
    """
    hashed = set(hash_layers_from_config(cfg))
    return [i for i in _learned_or_all(cfg) if i not in hashed]


def _learned_or_all(cfg: Mapping[str, Any]) -> list[int]:
    c = _text_config(cfg)
    n = routing_dims_from_config(c)[0]
    types = c.get("mlp_layer_types")
    if isinstance(types, list) and len(types) == n:
        return [i for i, t in enumerate(types) if str(t).lower() in ("sparse", "moe")]
    if c.get("model_type") == "deepseek_v4":  # every layer is MoE (hash or learned); SGLang's V3-based config
        return list(range(n))  # object carries V3's first_k_dense_replace default, which V4 lacks
    explicit = c.get("moe_layers")
    if isinstance(explicit, list) and all(isinstance(i, int) for i in explicit):
        return sorted(i for i in explicit if 0 <= i < n)
    if "first_k_dense_replace" in c or "moe_layer_freq" in c and isinstance(c.get("moe_layer_freq"), int):
        first = int(c.get("first_k_dense_replace") or 0)
        freq = int(c.get("moe_layer_freq") or 1)
        return [i for i in range(n) if i >= first and i % freq == 0]
    if isinstance(c.get("moe_layer_freq"), list):  # e.g. [1, 0, 1, ...] per layer
        freqs = c["moe_layer_freq"]
        return [i for i in range(n) if i < len(freqs) and freqs[i]]
    step = int(c.get("decoder_sparse_step") or 1)
    dense_only = set(c.get("mlp_only_layers") or ())
    return [i for i in range(n) if i not in dense_only and (i + 1) % step == 0]
