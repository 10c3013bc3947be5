"""What the tests' tiny checkpoints share (tests/sglang/deepseek_v4.py, deepseek_v32.py, tests/vllm/tiny_mtp.py): the
tokenizer files copied from another checkpoint, the model type a folder holds, and the model loaded once per folder
(float32, eager attention: the reference the tests compare with)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

__all__ = ["copy_tokenizer", "model_type", "load_eager"]

_MODELS: dict[str, Any] = {}
_TOKENIZER_FILES = ("special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


def copy_tokenizer(tokenizer_from: Path, out: Path) -> None:
    """The tokenizer files of ``tokenizer_from`` into ``out``."""
    for f in Path(tokenizer_from).iterdir():
        if "token" in f.name or f.name in _TOKENIZER_FILES:
            shutil.copy(f, out / f.name)


def model_type(model_dir: Path) -> str | None:
    """``model_type`` of the checkpoint's ``config.json``."""
    return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")


def load_eager(model_dir: Path) -> Any:
    """The checkpoint as transformers loads it (float32, eager attention, eval), once per folder."""
    key = str(model_dir)
    if key not in _MODELS:
        import torch
        import transformers

        _MODELS[key] = transformers.AutoModelForCausalLM.from_pretrained(
            key, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    return _MODELS[key]
