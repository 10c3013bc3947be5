"""Tiny random MoE checkpoints + local BPE tokenizer, and transformers' reference routing.

Used by the demo, the end-to-end tests and the benchmarks so that no hub access is ever
needed: everything is built locally, deterministically from a seed, in a few seconds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ARCHS",
    "build_tiny_moe",
    "moe_layer_indices",
    "load_model",
    "reference_routing",
]

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
_DONE_MARKER = "rr_tiny_moe.json"
_SPECIAL = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
# ChatML, so the OpenAI chat endpoint runs the model's own template (one turn per message, tool turns included).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A small, varied local corpus so the byte-level BPE learns some merges (no downloads).
_CORPUS_SEED = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts per layer.",
    "Rollout routing replay records the experts chosen during inference.",
    "Reinforcement learning trainers replay the routing in their forward pass.",
    "def forward(self, hidden_states): return self.experts(hidden_states)",
    "Once upon a time there was a tiny model that lived on a CPU.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Hello, world! How are you today? I am fine, thank you.",
    "SGLang and vLLM are inference engines; both can return routed experts.",
    "import numpy as np; x = np.zeros((4, 8), dtype=np.uint8)",
]


def _corpus() -> list[str]:
    """Deterministic training text for the tokenizer: the seed lines, shuffled and joined."""
    rng = np.random.default_rng(1234)
    lines: list[str] = []
    for _ in range(200):
        idx = rng.permutation(len(_CORPUS_SEED))[:3]
        lines.append(" ".join(_CORPUS_SEED[i] for i in idx))
    return lines


def _build_tokenizer(vocab_size: int = 450) -> Any:
    """Train a byte-level BPE tokenizer locally and wrap it as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|pad|>",
        unk_token=None,
        model_max_length=2048,
        chat_template=CHAT_TEMPLATE,
    )


def _make_config(
    arch: str,
    *,
    vocab_size: int,
    eos_id: int,
    pad_id: int,
    num_layers: int,
    num_experts: int,
    topk: int,
    mlp_only_layers: Sequence[int],
    hidden: int,
) -> Any:
    """Return a transformers config for the given tiny architecture."""
    import transformers

    heads = max(1, hidden // 32)  # head_dim 32: supported by vLLM's CPU attention
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        num_experts_per_tok=topk,
        dtype="float32",
    )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=32,
            intermediate_size=2 * hidden,
            moe_intermediate_size=max(16, hidden // 4),
            num_experts=num_experts,
            decoder_sparse_step=1,
            mlp_only_layers=list(mlp_only_layers),
            norm_topk_prob=True,
        )
    if mlp_only_layers:
        raise ValueError(f"mlp_only_layers is only supported for qwen3_moe/qwen2_moe, not {arch}")
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=2 * hidden,
            moe_intermediate_size=max(16, hidden // 4),
            shared_expert_intermediate_size=max(16, hidden // 2),
            num_experts=num_experts,
            decoder_sparse_step=1,
            norm_topk_prob=False,
        )
    if arch == "mixtral":
        return transformers.MixtralConfig(
            **common, head_dim=32, intermediate_size=max(16, hidden // 4), num_local_experts=num_experts
        )
    if arch == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=max(16, hidden // 4), num_experts=num_experts)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _is_complete(out: Path, spec: dict[str, Any]) -> bool:
    """True when out_dir holds a finished build of exactly this spec."""
    marker = out / _DONE_MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == spec
    except (OSError, ValueError):
        return False


def build_tiny_moe(
    out_dir: str | os.PathLike[str],
    *,
    arch: str = "qwen3_moe",
    num_layers: int = 2,
    num_experts: int = 8,
    topk: int = 2,
    mlp_only_layers: Sequence[int] = (),
    hidden: int = 128,
    seed: int = 0,
) -> Path:
    """Build (or reuse) a random tiny MoE checkpoint with a local tokenizer; return its dir."""
    out = Path(out_dir)
    spec = dict(
        arch=arch,
        num_layers=num_layers,
        num_experts=num_experts,
        topk=topk,
        mlp_only_layers=sorted(int(i) for i in mlp_only_layers),
        hidden=hidden,
        seed=seed,
        version=3,
    )
    if _is_complete(out, spec):
        return out
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()
    tokenizer = _build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|pad|>")
    dims = {k: spec[k] for k in ("num_layers", "num_experts", "topk", "mlp_only_layers", "hidden")}
    cfg = _make_config(arch, vocab_size=len(tokenizer), eos_id=eos_id, pad_id=pad_id, **dims)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _spread_router_weights(model, seed)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for f in out.iterdir():  # the weights are written 0600; readable by all, so a container's user can load them
        f.chmod(f.stat().st_mode | 0o444)
    (out / _DONE_MARKER).write_text(json.dumps(spec))
    return out


def _spread_router_weights(model: Any, seed: int) -> None:
    """Give router gates a large scale so top-k choices have clear margins (no float ties)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    num_experts = _num_experts(model.config)
    with torch.no_grad():
        for _name, param in model.named_parameters():
            if param.dim() == 2 and param.shape[0] == num_experts and param.shape[1] == model.config.hidden_size:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


def _num_experts(cfg: Any) -> int:
    """Routed-expert count of an HF config, whatever the arch calls it."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        val = getattr(cfg, key, None)
        if val:
            return int(val)
    raise ValueError("config has no routed-expert count")


def moe_layer_indices(cfg: Any) -> list[int]:
    """Indices of decoder layers that have a router (Qwen2/3-MoE rules; else all layers)."""
    n = int(cfg.num_hidden_layers)
    mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return [i for i in range(n) if i not in mlp_only and (i + 1) % step == 0]


_MODEL_CACHE: dict[str, Any] = {}


def load_model(model_dir: str | os.PathLike[str]) -> Any:
    """Load (once per process) a tiny checkpoint in float32 eval mode."""
    import torch
    import transformers

    key = str(Path(model_dir).resolve())
    if key not in _MODEL_CACHE:
        transformers.utils.logging.disable_progress_bar()
        model = transformers.AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
        model.eval()
        _MODEL_CACHE[key] = model
    return _MODEL_CACHE[key]


def reference_routing(model_dir: str | os.PathLike[str], token_ids: Sequence[int]) -> np.ndarray:
    """Transformers' router top-k ids, shape (tokens, num_hidden_layers, topk); dense layers 0.

    The reference top-k (:func:`rr_client.trainer.router_reference.router_topk`) on the cached float32 CPU model.
    """
    from rr_client.trainer.router_reference import router_forward, router_topk

    model = load_model(model_dir)
    cfg = model.config
    _, logits = router_forward(model, token_ids, moe_layer_indices(cfg))
    return router_topk(logits, int(cfg.num_hidden_layers), int(cfg.num_experts_per_tok))


if __name__ == "__main__":  # pragma: no cover - manual helper
    import sys

    print(build_tiny_moe(sys.argv[1] if len(sys.argv) > 1 else ".cache/tiny-qwen3-moe"))
