"""vLLM 0.30 on CPU: make ``reload_weights`` (the weight sync of RL trainers) re-pack the MoE experts.

Found by rr: on a weight update ``UnquantizedFusedMoEMethod`` skips the CPU experts' prepack ("setup moe kernel
only on the first call"), so after ``/collective_rpc reload_weights`` the CPU kernel runs on unpacked weights
and the engine serves wrong experts (and wrong routing); vLLM only logs that the expert weights "were not
loaded". rr wraps the worker's ``reload_weights`` to re-run that prepack on every CPU MoE layer afterwards.
Installed in the engine process by :func:`rr_patches.vllm.plugin.register` on the versions whose facts say
so (:attr:`rr_server.serving.engines.base.ReleaseFacts.cpu_reload_unpacked_experts`); re-entrant.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from rr_client.core.patching import wrap_once

__all__ = ["install", "repack_cpu_experts"]

logger = logging.getLogger("rr.vllm")


def repack_cpu_experts(model: Any) -> int:
    """Re-run the CPU experts' prepack on every MoE layer of ``model`` that has its kernel; return how many."""
    done = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
        if kernel is None or backend != "CPU":
            continue
        kernel.fused_experts.process_weights_after_loading(module)
        done += 1
    return done


def _repacking(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``reload_weights`` that re-packs the CPU experts after vLLM's own reload."""

    @functools.wraps(orig)
    def reload_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        n = repack_cpu_experts(self.model_runner.get_model())
        if n:
            logger.info("rr: re-packed the CPU experts of %d MoE layers after reload_weights", n)
        return out

    return reload_weights


def install() -> bool:
    """Wrap ``Worker.reload_weights`` once (the CPU worker inherits it); False when this vLLM has no such method."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception:  # noqa: BLE001 - a layout this fix does not know: leave vLLM alone
        return False
    if getattr(Worker, "reload_weights", None) is None:
        return False
    wrap_once(Worker, "reload_weights", _repacking, what="vLLM")
    return True
