"""Where each vLLM keeps what rr reads: the capture setting moved in 0.31 (AuxOutput connector)."""

from __future__ import annotations

from typing import Any

__all__ = ["routing_enabled"]


def routing_enabled(engine_client: Any) -> bool:
    """Whether vLLM runs with ``--enable-return-routed-experts``.

    0.31 - 0.33: ``vllm_config.aux_output_config.enable_return_routed_experts`` (``model_config`` no longer
    has it); 0.22 - 0.30: ``model_config.enable_return_routed_experts``.
    """
    vllm_config = getattr(engine_client, "vllm_config", None)
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None:
        return bool(getattr(aux, "enable_return_routed_experts", False))
    return bool(getattr(getattr(engine_client, "model_config", None), "enable_return_routed_experts", False))
