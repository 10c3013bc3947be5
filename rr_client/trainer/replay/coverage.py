"""Which MoE families rr replays at both ends of the declared transformers range, and why the others are refused.

``coverage()`` lists every MoE family (model type) of transformers 5.24 (:data:`HIGHEST`) with its status;
:data:`ABSENT_IN_LOWEST` and :data:`REFUSED_IN_LOWEST` say how transformers 5.10 (:data:`LOWEST`) differs.
``python -m rr_client.trainer.replay.coverage [PATH]`` writes the table (``docs/replay-coverage.md``); a test keeps
that file equal to what this module generates and the family list equal to the installed transformers (either end).

Statuses: ``supported`` (the router's weight formula is in :data:`SUPPORTED_ROUTERS`, checked bit for bit
on sampled forwards (``check_every``), and a tiny random model of the family passes rr's replay tests), ``refused`` (replay
raises :class:`UnsupportedModelError` with the reason). Hash-routed layers (DeepSeek-V4) and routers
outside the decoder's layer list (MTP/draft, vision or talker towers) are reported by the audit and left to
the model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = [
    "LOWEST",
    "HIGHEST",
    "ABSENT_IN_LOWEST",
    "REFUSED_IN_LOWEST",
    "FAMILY_ROUTERS",
    "REFUSED",
    "TESTED",
    "UNTESTED_REASON",
    "NOTES",
    "FP32_GATE",
    "Family",
    "family_status",
    "declared_range",
    "coverage",
    "router_family",
    "lowest_status",
    "installed_moe_families",
    "coverage_markdown",
    "main",
]

#: the two ends of the declared transformers range (pyproject's ``[torch]`` extra) that rr's tests run on:
#: .venvs/verl (scripts/test_transformers_lowest.sh) and .venv (make test-core).
LOWEST, HIGHEST = "5.10.4", "5.24.0"

#: model type -> its router classes (transformers 5.24); every family with a router or an experts block.
FAMILY_ROUTERS: dict[str, tuple[str, ...]] = {
    "afmoe": ("AfmoeTokenChoiceRouter",),
    "aria": ("AriaTextTopKRouter",),
    "axk1": ("AXK1TopkRouter",),
    "axk2": ("AXK2TopkRouter",),
    "bailing_hybrid": ("BailingHybridTopkRouter",),
    "beam": ("BeamTopKRouter",),
    "cohere2_moe": ("Cohere2MoeTopKRouter",),
    "dbrx": ("DbrxRouter",),
    "deepseek_ocr2": ("DeepseekOcr2TextTopkRouter",),
    "deepseek_v2": ("DeepseekV2TopkRouter",),
    "deepseek_v3": ("DeepseekV3TopkRouter",),
    "deepseek_v32": ("DeepseekV32TopkRouter",),
    "deepseek_v4": ("DeepseekV4TopKRouter", "DeepseekV4HashRouter"),
    "diffusion_gemma": ("DiffusionGemmaTextRouter",),
    "doge": (),
    "dots1": ("Dots1TopkRouter",),
    "dots3_note": ("Dots3NoteTextTopkRouter", "Dots3NoteVisionTopKRouter"),
    "ernie4_5_moe": ("Ernie4_5_MoeTopKRouter",),
    "ernie4_5_vl_moe": ("Ernie4_5_VLMoeMoeTopKRouter",),
    "exaone_moe": ("ExaoneMoeTopkRouter",),
    "flex_olmo": ("FlexOlmoTopKRouter",),
    "flint": ("FlintTopKRouter",),
    "gemma4": ("Gemma4TextRouter",),
    "glm4_moe": ("Glm4MoeTopkRouter",),
    "glm4_moe_lite": ("Glm4MoeLiteTopkRouter",),
    "glm4v_moe": ("Glm4vMoeTextTopkRouter",),
    "glm5_next": ("Glm5NextTextTopkRouter",),
    "glm_moe_dsa": ("GlmMoeDsaTopkRouter",),
    "gpt_oss": ("GptOssTopKRouter",),
    "granite_docling": (),
    "granitemoe": ("GraniteMoeTopKRouter",),
    "granitemoe_swa": ("GraniteMoeSWATopKRouter",),
    "granitemoehybrid": ("GraniteMoeHybridTopKRouter",),
    "granitemoeshared": ("GraniteMoeSharedTopKRouter",),
    "hunyuan_v1_moe": ("HunYuanMoEV1Gate",),
    "hy_v3": ("HYV3TopKRouter",),
    "hy_v4": ("HYV4TopkRouter",),
    "hy_v4_vl": ("HYV4VLTopkRouter",),
    "inkling": ("InklingTopkRouter",),
    "inkling2": ("Inkling2TopKRouter",),
    "inkling2_loop": ("Inkling2LoopTopKRouter",),
    "jamba": ("JambaTopKRouter",),
    "jetmoe": ("JetMoeTopKGating",),
    "kimi_linear": ("KimiLinearTopkRouter",),
    "kolibri1": ("Kolibri1TopKRouter",),
    "laguna": ("LagunaTopKRouter",),
    "lara_mini": ("LaraMiniTopKRouter",),
    "lfm2_moe": ("Lfm2MoeTopKRouter",),
    "llama4": ("Llama4Router",),
    "longcat_flash": ("LongcatFlashTopkRouter",),
    "mellum": ("MellumTopKRouter",),
    "mimo_v2_flash": ("MiMoV2FlashTopkRouter",),
    "minimax": ("MiniMaxTopKRouter",),
    "minimax_m2": ("MiniMaxM2TopKRouter",),
    "minimax_m3_vl": ("MiniMaxM3VLTopKRouter",),
    "mistral4": ("Mistral4TopkRouter",),
    "mistral_large4": ("MistralLarge4TextTopkRouter",),
    "mixtral": ("MixtralTopKRouter",),
    "muse_spark": ("MuseSparkTopkRouter",),
    "nemotron_h": ("NemotronHTopkRouter",),
    "nllb_moe": ("NllbMoeTop2Router",),
    "olmoe": ("OlmoeTopKRouter",),
    "openai_privacy_filter": ("OpenAIPrivacyFilterTopKRouter",),
    "phimoe": ("PhimoeTopKRouter",),
    "qwen2_moe": ("Qwen2MoeTopKRouter",),
    "qwen3_5_moe": ("Qwen3_5MoeTopKRouter",),
    "qwen3_moe": ("Qwen3MoeTopKRouter",),
    "qwen3_next": ("Qwen3NextTopKRouter",),
    "qwen3_omni_moe": (
        "Qwen3OmniMoeTextTopKRouter",
        "Qwen3OmniMoeThinkerTextTopKRouter",
        "Qwen3OmniMoeTalkerTextTopKRouter",
    ),
    "qwen3_vl_moe": ("Qwen3VLMoeTextTopKRouter",),
    "qwen4_exp": ("Qwen4ExpTextTopKRouter",),
    "solar_open": ("SolarOpenTopkRouter",),
    "step3p7": ("Step3p7TopKRouter",),
    "switch_transformers": ("SwitchTransformersTop1Router",),
    "unlimited_ocr": ("UnlimitedOcrTextTopkRouter",),
    "zaya": ("ZayaRouter",),
}

#: families refused for a reason in the architecture (the router cannot be replayed exactly).
REFUSED: dict[str, str] = {
    "dbrx": "DbrxRouter returns logits only and DbrxFFN.route_tokens_to_experts picks the top-k inside the block "
    "(p-norm renormalised); rr hooks router outputs, so it cannot force ids here. Replay with Megatron, or "
    "patch route_tokens_to_experts",
    "jetmoe": "JetMoeTopKGating returns an expert-sorted dispatch (index_sorted_experts, batch_index, batch_gates, "
    "expert_size), not per-token ids, and its attention (MoA) is routed too",
    "llama4": "Llama4Router returns dense sigmoid scores over every expert (-inf outside the top-k); no top-k ids "
    "reach Llama4TextMoe, which runs every expert on the scores. Not replayable through the router hook",
    "phimoe": "PhimoeTopKRouter's sparsemixer weights depend on the top-1 choice through masked second softmaxes "
    "and, in training, on random jitter: they cannot be recomputed bit for bit for replayed ids",
    "nllb_moe": "encoder-decoder with expert-capacity routing (tokens over capacity are dropped): not a per-token "
    "top-k of a decoder LM",
    "switch_transformers": "encoder-decoder, top-1 with expert capacity (tokens over capacity are dropped): not a "
    "per-token top-k of a decoder LM",
    "zaya": "ZayaRouter has a skip expert (num_experts + 1 classes; skipped slots are rewritten to expert 0 with "
    "weight 0) and carries router state between layers: rr's [L, K] rows cannot express the skip",
    "inkling2_loop": "its looped decoder layers (loop_layer_index_start..loop_layer_index_end) run loop_num_passes "
    "times per forward, each pass routing its own input through the same Inkling2LoopTopKRouter: "
    "rr's rows hold one [K] choice per token and decoder layer, so they cannot say which experts each "
    "pass chose (replaying one row in every pass would force the wrong experts on the later passes)",
    "inkling": "InklingTopkRouter normalises the routed and the shared experts' weights jointly and returns a "
    "4-tuple (shared gammas): no formula in rr for it yet",
    "doge": "DogeCDMoE routes with product keys inside the block (no router module, no top-k over experts rows)",
    "granite_docling": "not a token MoE: its DensityRouter picks a vision connector path per image",
    "diffusion_gemma": "a diffusion (bidirectional) LM, not a causal decoder whose rollout rows rr replays",
    "openai_privacy_filter": "a bidirectional token classifier, not a causal decoder LM with rollouts",
}

#: families whose replay rr's tests run on a tiny random model (tests/trainer/test_replay_families.py).
TESTED: frozenset[str] = frozenset(
    {
        "afmoe",
        "aria",
        "axk2",
        "bailing_hybrid",
        "beam",
        "cohere2_moe",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "deepseek_v4",
        "dots1",
        "ernie4_5_moe",
        "exaone_moe",
        "flex_olmo",
        "flint",
        "glm4_moe",
        "glm4_moe_lite",
        "glm5_next",
        "glm_moe_dsa",
        "gpt_oss",
        "granitemoe",
        "granitemoe_swa",
        "granitemoeshared",
        "hunyuan_v1_moe",
        "hy_v3",
        "hy_v4",
        "hy_v4_vl",
        "inkling2",
        "jamba",
        "kimi_linear",
        "kolibri1",
        "laguna",
        "lara_mini",
        "mellum",
        "mimo_v2_flash",
        "minimax",
        "minimax_m2",
        "minimax_m3_vl",
        "mistral4",
        "mistral_large4",
        "mixtral",
        "muse_spark",
        "nemotron_h",
        "olmoe",
        "qwen2_moe",
        "qwen3_5_moe",
        "qwen3_moe",
        "qwen3_next",
        "qwen3_vl_moe",
        "qwen4_exp",
        "solar_open",
    }
)

#: families of transformers 5.24 that transformers 5.10 does not have (nothing to replay there).
ABSENT_IN_LOWEST: frozenset[str] = frozenset(
    {
        "axk1",
        "axk2",
        "bailing_hybrid",
        "beam",
        "deepseek_v32",
        "diffusion_gemma",
        "dots3_note",
        "flint",
        "glm5_next",
        "granite_docling",
        "granitemoe_swa",
        "hy_v4",
        "hy_v4_vl",
        "inkling",
        "inkling2",
        "inkling2_loop",
        "kimi_linear",
        "kolibri1",
        "lara_mini",
        "mimo_v2_flash",
        "minimax_m3_vl",
        "mistral_large4",
        "muse_spark",
        "qwen4_exp",
        "step3p7",
        "unlimited_ocr",
        "zaya",
    }
)

_LOGITS_ONLY = (
    "on transformers 5.10 the router returns logits only and the MoE block picks the top-k "
    "(route_tokens_to_experts): nothing for rr's router hook to replace"
)
_NO_ROUTER = (
    "on transformers 5.10 there is no router module: the block's gate is a plain Linear and the block "
    "picks the top-k (route_tokens_to_experts)"
)
#: supported families (5.24) that replay raises :class:`UnsupportedModelError` for on transformers 5.10, naming
#: the installed release: their router there has another shape (survey detects it; this table is for the doc).
REFUSED_IN_LOWEST: dict[str, str] = {
    **dict.fromkeys(
        [
            "deepseek_v3",
            "dots1",
            "exaone_moe",
            "glm4_moe",
            "glm4_moe_lite",
            "glm_moe_dsa",
            "hunyuan_v1_moe",
            "mistral4",
            "nemotron_h",
            "solar_open",
        ],
        _LOGITS_ONLY,
    ),
    **dict.fromkeys(["aria", "deepseek_v2", "jamba"], _NO_ROUTER),
    **dict.fromkeys(
        ["granitemoe", "granitemoeshared"],
        "on transformers 5.10 the router is GraniteMoeTopKGating, which returns an expert-sorted "
        "dispatch (as JetMoe's), not per-token ids",
    ),
}

#: supported families whose router weight transformers 5.24 keeps in float32 when the model is built in bfloat16
#: (``_keep_in_fp32_modules_strict``, or a float32 weight the router declares; the router upcasts the hidden
#: states): their gates come from float32 logits whatever the model's dtype. tests/trainer/test_replay_families.py
#: checks this list against the installed release and replays each of them on a bfloat16 model bit for bit.
FP32_GATE: frozenset[str] = frozenset(
    {
        "axk2",
        "bailing_hybrid",
        "beam",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "dots1",
        "ernie4_5_moe",
        "exaone_moe",
        "flint",
        "glm4_moe",
        "glm4_moe_lite",
        "glm5_next",
        "glm_moe_dsa",
        "hunyuan_v1_moe",
        "hy_v3",
        "hy_v4",
        "hy_v4_vl",
        "inkling2",
        "kimi_linear",
        "mimo_v2_flash",
        "mistral_large4",
        "muse_spark",
        "nemotron_h",
        "solar_open",
    }
)

UNTESTED_REASON = (
    "the router's weight formula is in rr but no tiny {family} model has passed rr's replay tests "
    "yet (its tiny config does not build in rr's test harness: multimodal, MLA or per-layer configs); pass allow_untested=True to replay it (the bit-"
    "for-bit formula check still runs, as for every family)"
)

NOTES: dict[str, str] = {
    "deepseek_v4": "hash-routed layers (DeepseekV4HashRouter: tid2eid lookup) are reported and left to the model",
}


@dataclass(frozen=True)
class Family:
    model_type: str
    routers: tuple[str, ...]
    status: str  # "supported" | "refused"
    reason: str


def family_status(model_type: str) -> Family:
    routers = FAMILY_ROUTERS.get(model_type, ())
    if model_type in REFUSED:
        return Family(model_type, routers, "refused", REFUSED[model_type])
    if model_type in TESTED:
        return Family(model_type, routers, "supported", NOTES.get(model_type, ""))
    if model_type in FAMILY_ROUTERS:
        return Family(model_type, routers, "refused", UNTESTED_REASON.format(family=model_type))
    return Family(model_type, routers, "refused", f"{model_type} is not a MoE family rr knows (transformers {HIGHEST})")


def declared_range() -> str:
    """The transformers requirement of pyproject's ``[torch]`` extra: from :data:`LOWEST`'s minor to past
    :data:`HIGHEST`'s (``>=5.10,<5.25``)."""
    lo, hi = LOWEST.split("."), HIGHEST.split(".")
    return f">={lo[0]}.{lo[1]},<{hi[0]}.{int(hi[1]) + 1}"


def coverage() -> list[Family]:
    """Every MoE family of transformers 5.24 (:data:`HIGHEST`), with its status and reason there, by model type."""
    return [family_status(mt) for mt in sorted(FAMILY_ROUTERS)]


def lowest_status(model_type: str) -> str:
    """The family on transformers 5.10 (:data:`LOWEST`): "absent", "refused" or "supported" (as on 5.24)."""
    if model_type in ABSENT_IN_LOWEST:
        return "absent"
    if model_type in REFUSED_IN_LOWEST or family_status(model_type).status == "refused":
        return "refused"
    return "supported"


def router_family(router_class: str) -> str | None:
    for mt, classes in FAMILY_ROUTERS.items():
        if router_class in classes:
            return mt
    return None


def installed_moe_families() -> list[str]:
    """MoE families of the installed transformers: a modeling file with a router class or an experts block."""
    import os
    import re

    import transformers

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    pat = re.compile(
        r"TopKRouter|TopkRouter|Router\(nn\.Module\)|use_experts_implementation|"
        r"class \w*(?:Experts|SparseMoe|MoeBlock|MoE)\w*\("
    )
    out = []
    for mt in sorted(os.listdir(root)):
        path = os.path.join(root, mt, f"modeling_{mt}.py")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                if pat.search(f.read()):
                    out.append(mt)
    return out


def coverage_markdown() -> str:
    fams = coverage()
    n_sup = sum(f.status == "supported" for f in fams)
    low = {f.model_type: lowest_status(f.model_type) for f in fams}
    n_low = sum(v == "supported" for v in low.values())
    n_absent = sum(v == "absent" for v in low.values())
    lines = [
        f"# Routing replay coverage (transformers {LOWEST} and {HIGHEST})",
        "",
        "Generated by `python -m rr_client.trainer.replay.coverage` from `rr_client/trainer/replay/coverage.py` and",
        "`rr_client/trainer/replay/formulas.py`; `tests/trainer/test_replay_families.py` keeps this file equal to the code",
        "and runs every supported family on a tiny random model (own choice reproduces the logits exactly, other",
        "ids run exactly those experts, router gradients are non-zero, gradient checkpointing gives identical",
        "gradients, the audit reports 100%).",
        "",
        f"The declared range (`[torch]`: transformers `{declared_range()}`) is tested at both ends: {HIGHEST} (`.venv`,",
        f"`make test-core`) and {LOWEST} (`.venvs/verl`, `scripts/test_transformers_lowest.sh`). On each, the family",
        "tests run every family supported there and check every family refused there is refused naming the installed",
        "release;",
        f"a family absent from {LOWEST} is skipped there with that reason. A router's expert count and top-k are",
        "read from the router that is installed (its attributes, its weight's rows, its block, the config).",
        "",
        f"{len(fams)} MoE families (transformers {HIGHEST}): {n_sup} supported, {len(fams) - n_sup} refused. On",
        f"transformers {LOWEST}: {n_low} supported, {n_absent} absent, {len(fams) - n_low - n_absent} refused (the",
        f"5.10 column). Replaying a refused family raises `UnsupportedModelError` with the reason below (at {LOWEST},",
        "naming the installed release). Hash-routed layers and routers outside the decoder's layer list (MTP/draft",
        "layers, vision or talker towers) are reported by the audit and left to the model.",
        "",
        f"{len(FP32_GATE)} supported families keep their router weight in float32 on transformers {HIGHEST} (note",
        '"fp32 gate"): loaded in bfloat16, the router still computes its logits and gates in float32. The family',
        "tests also replay each of them on a bfloat16 model (own choice bit for bit, the formula check at every",
        "forward, other ids at the experts) and check the list against the installed release.",
        "",
        f"| family (model_type) | router classes | status ({HIGHEST}) | {LOWEST} | reason / note |",
        "|---|---|---|---|---|",
    ]
    for f in fams:
        routers = ", ".join(f"`{r}`" for r in f.routers) or "-"
        reason = f.reason
        if f.model_type in REFUSED_IN_LOWEST:
            reason = (reason + "; " if reason else "") + REFUSED_IN_LOWEST[f.model_type]
        if f.model_type in FP32_GATE:
            reason = (reason + "; " if reason else "") + f"fp32 gate ({HIGHEST})"
        lines.append(f"| `{f.model_type}` | {routers} | {f.status} | {low[f.model_type]} | {reason or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else "docs/replay-coverage.md"
    with open(path, "w", encoding="utf-8") as f:
        f.write(coverage_markdown())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
