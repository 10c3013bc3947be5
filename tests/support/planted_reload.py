"""The stand-ins' weight reload with a loader fault planted on purpose (vLLM's stand-in executor, SGLang's stand-in
model runner): what a buggy loader does, so rr's check of the engines' own weight checksums can be seen to fail."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Fault", "reload_with_fault"]

Fault = tuple[str, str]  # (kind, tensor): ``keep`` that tensor's old value, ``perturb`` it (+1e-3), or ``noop``


def reload_with_fault(model: torch.nn.Module, path: Any, fault: Fault | None) -> None:
    """Copy every parameter of the checkpoint at ``path`` into ``model`` in place, except as ``fault`` says:
    ``noop`` loads nothing, ``keep`` skips one tensor, ``perturb`` loads one tensor off by 1e-3."""
    import transformers

    if fault is not None and fault[0] == "noop":
        return
    new = dict(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if fault == ("keep", name):
                continue
            p.copy_(new[name])
            if fault == ("perturb", name):
                p.add_(1e-3)
