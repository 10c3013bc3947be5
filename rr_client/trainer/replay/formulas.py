"""Gate-weight formulas of transformers 5.24's MoE routers, recomputed for replayed expert ids.

Each formula takes ``(router module, the router's first output, ids [N, K])`` and returns the weights the
router would have returned had it chosen ``ids``; the caller casts them to the dtype of the router's own
weights. At every replayed forward the formula is first applied to the router's *own* ids and compared with
the router's own weights bit for bit (``check_formula``), so a formula that does not match its router is
refused, never used approximately.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

WeightFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


__all__ = [
    "WeightFn",
    "SUPPORTED_ROUTERS",
    "HASH_ROUTERS",
    "softmax_gather",
    "sigmoid_gather",
    "chosen_softmax",
    "cohere2",
    "ernie",
    "gemma4",
]


def _flag(module: nn.Module, norm: bool | str) -> bool:
    return bool(getattr(module, norm)) if isinstance(norm, str) else norm


def _scaled(module: nn.Module, w: torch.Tensor, scale: str | None) -> torch.Tensor:
    return w if scale is None else w * getattr(module, scale)


def softmax_gather(
    norm: bool | str = "norm_topk_prob", *, native: bool = False, scale: str | None = None, eps: float = 0.0
) -> WeightFn:
    """softmax over all experts (fp32, or in the logits' dtype with ``native``) -> gather -> renorm -> x scale."""

    def fn(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        p = logits.softmax(-1) if native else torch.softmax(logits, dim=-1, dtype=torch.float)
        w = p.gather(1, ids)
        if _flag(module, norm):
            w = w / (w.sum(dim=-1, keepdim=True) + eps) if eps else w / w.sum(dim=-1, keepdim=True)
        return _scaled(module, w, scale)

    return fn


def sigmoid_gather(
    norm: bool | str = "norm_topk_prob",
    *,
    eps: float | str = 0.0,
    scale: str | None = None,
    upcast: bool = False,
    score_fn: str | None = None,
    type_as_logits: bool = False,
) -> WeightFn:
    """sigmoid (or the router's ``score_fn``) at the ids (a bias only chooses) -> renorm (+eps) -> x scale."""

    def fn(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = logits.float() if upcast else logits
        s = getattr(module, score_fn)(x) if score_fn else x.sigmoid()
        w = s.gather(1, ids)
        if type_as_logits:
            w = w.type_as(logits)
        if _flag(module, norm):
            e = getattr(module, eps) if isinstance(eps, str) else eps
            w = w / (w.sum(dim=-1, keepdim=True) + e) if e else w / w.sum(dim=-1, keepdim=True)
        return _scaled(module, w, scale)

    return fn


def chosen_softmax(*, float32: bool = False, same_dtype: bool = False, divide_top_k: bool = False) -> WeightFn:
    """GPT-OSS, Aria, Granite-MoE: logits at the ids -> softmax over the K chosen."""

    def fn(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        v = logits.gather(1, ids)
        if float32:
            w = torch.softmax(v, dim=-1, dtype=torch.float)
        elif same_dtype:
            w = torch.softmax(v, dim=1, dtype=v.dtype)
        else:
            w = torch.softmax(v, dim=-1)
        return w / module.top_k if divide_top_k else w

    return fn


def cohere2(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cohere2-MoE: top-k on raw logits, then softmax (fp32) over the chosen, or sigmoid (+ renorm)."""
    v = logits.gather(1, ids)
    if module.expert_selection_fn == "softmax":
        return torch.softmax(v, dim=1, dtype=torch.float)
    w = torch.sigmoid(v)
    return w / torch.sum(w, dim=-1, keepdim=True) if module.norm_topk_prob else w


def ernie(module: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """ERNIE-4.5-MoE: softmax (fp32) at the ids (moe_statics only chooses) / clamp(sum, min=norm_min)."""
    w = torch.softmax(logits, dim=1, dtype=torch.float).gather(1, ids)
    return w / torch.clamp(w.sum(dim=-1, keepdim=True), min=module.norm_min)


def gemma4(module: nn.Module, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gemma-4: the router returns probabilities; gather -> renorm -> x per_expert_scale[ids]."""
    w = probs.gather(1, ids)
    w = w / w.sum(dim=-1, keepdim=True)
    return w * module.per_expert_scale[ids]


_DS3 = sigmoid_gather("norm_topk_prob", eps=1e-20, scale="routed_scaling_factor")

#: router class -> weight formula, every router rr replays (transformers 5.24).
SUPPORTED_ROUTERS: dict[str, WeightFn] = {
    # softmax -> top-k -> optional renorm
    **dict.fromkeys(
        [
            "Qwen3MoeTopKRouter",
            "Qwen2MoeTopKRouter",
            "Qwen3NextTopKRouter",
            "OlmoeTopKRouter",
            "FlexOlmoTopKRouter",
            "MellumTopKRouter",
            "Qwen4ExpTextTopKRouter",
            "LaraMiniTopKRouter",
            "Qwen3OmniMoeThinkerTextTopKRouter",
            "Qwen3OmniMoeTalkerTextTopKRouter",
        ],
        softmax_gather(),
    ),
    **dict.fromkeys(
        [
            "Qwen3_5MoeTopKRouter",
            "Qwen3VLMoeTextTopKRouter",
            "Qwen3OmniMoeTextTopKRouter",
            "MixtralTopKRouter",
            "MiniMaxTopKRouter",
            "HunYuanMoEV1Gate",
        ],
        softmax_gather(True),
    ),
    "JambaTopKRouter": softmax_gather(False),
    **dict.fromkeys(
        ["DeepseekV2TopkRouter", "DeepseekOcr2TextTopkRouter", "UnlimitedOcrTextTopkRouter", "LongcatFlashTopkRouter"],
        softmax_gather(False, scale="routed_scaling_factor"),
    ),
    "Mistral4TopkRouter": softmax_gather("norm_topk_prob", native=True, eps=1e-20, scale="routed_scaling_factor"),
    "MistralLarge4TextTopkRouter": softmax_gather(True, native=True, eps=1e-20, scale="routed_scaling_factor"),
    "Ernie4_5_MoeTopKRouter": ernie,
    "Ernie4_5_VLMoeMoeTopKRouter": ernie,
    # sigmoid, score-correction bias only for choosing, grouped top-k, renorm, scaling
    **dict.fromkeys(
        [
            "DeepseekV3TopkRouter",
            "DeepseekV32TopkRouter",
            "Glm4MoeTopkRouter",
            "Glm4MoeLiteTopkRouter",
            "Glm4vMoeTextTopkRouter",
            "Glm5NextTextTopkRouter",
            "GlmMoeDsaTopkRouter",
            "AXK1TopkRouter",
            "AXK2TopkRouter",
            "BailingHybridTopkRouter",
            "Dots1TopkRouter",
            "Dots3NoteTextTopkRouter",
            "ExaoneMoeTopkRouter",
            "HYV4TopkRouter",
            "HYV4VLTopkRouter",
            "KimiLinearTopkRouter",
            "MiMoV2FlashTopkRouter",
            "NemotronHTopkRouter",
            "SolarOpenTopkRouter",
        ],
        _DS3,
    ),
    "BeamTopKRouter": sigmoid_gather("norm_topk_prob", eps=1e-20),
    "AfmoeTokenChoiceRouter": sigmoid_gather(True, eps=1e-20, scale="route_scale"),
    **dict.fromkeys(
        ["HYV3TopKRouter", "Dots3NoteVisionTopKRouter"], sigmoid_gather(True, eps=1e-20, scale="router_scaling_factor")
    ),
    **dict.fromkeys(
        ["MiniMaxM2TopKRouter", "MiniMaxM3VLTopKRouter", "Step3p7TopKRouter"], sigmoid_gather(True, upcast=True)
    ),
    "MuseSparkTopkRouter": sigmoid_gather(
        True, eps="norm_topk_prob_eps", scale="routed_scaling_factor", score_fn="scoring_function"
    ),
    **dict.fromkeys(
        ["DeepseekV4TopKRouter", "Inkling2TopKRouter"],
        sigmoid_gather(True, eps=1e-20, scale="routed_scaling_factor", score_fn="score_fn"),
    ),
    "LagunaTopKRouter": sigmoid_gather(True),
    "Lfm2MoeTopKRouter": sigmoid_gather("norm_topk_prob", eps=1e-6, scale="routed_scaling_factor", type_as_logits=True),
    "FlintTopKRouter": sigmoid_gather("norm_topk_prob"),
    "Kolibri1TopKRouter": sigmoid_gather("norm_topk_prob"),
    **dict.fromkeys(["Gemma4TextRouter", "DiffusionGemmaTextRouter"], gemma4),
    # top-k on logits, softmax over the chosen
    "GptOssTopKRouter": chosen_softmax(same_dtype=True),
    "OpenAIPrivacyFilterTopKRouter": chosen_softmax(same_dtype=True, divide_top_k=True),
    "AriaTextTopKRouter": chosen_softmax(),
    **dict.fromkeys(
        ["GraniteMoeTopKRouter", "GraniteMoeSWATopKRouter", "GraniteMoeHybridTopKRouter", "GraniteMoeSharedTopKRouter"],
        chosen_softmax(),
    ),
    "Cohere2MoeTopKRouter": cohere2,
}

#: routers whose choice is a fixed token-id lookup: reported and left to the model, never replayed.
HASH_ROUTERS = frozenset({"DeepseekV4HashRouter"})
