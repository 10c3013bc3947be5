"""Each engine's routes for reloading weights from disk: one table, read by the weight sync
(:mod:`rr_client.integrations.weight_sync`) and the doctor's weight-update probe. Torch- and httpx-free (core)."""

from __future__ import annotations

__all__ = ["ENGINE_ROUTES"]

# engine -> (reload route, how its JSON body names the folder, cache-reset route)
ENGINE_ROUTES: dict[str, tuple[str, str, str]] = {
    "vllm": ("/collective_rpc", "weights_path", "/reset_prefix_cache"),
    "sglang": ("/update_weights_from_disk", "model_path", "/flush_cache"),
}
