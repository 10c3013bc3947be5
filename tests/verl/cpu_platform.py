"""A CPU platform for verl (test-only): verl 0.9.1 registers only CUDA, ROCm and NPU platforms.

Named as a stand-in: it replaces only the accelerator (device name ``cpu``, collectives over gloo) so that
verl's real FSDP engine code runs on this GPU-less machine. Nothing in it touches the model, the data path
or the replay; it is installed with :func:`install` before verl's first ``get_platform()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch


def _cpu_module() -> ModuleType:
    """``torch.cpu``, given the memory counters verl reads from its device module where it lacks them (zero: no
    device memory). verl itself special-cases ``torch.cpu`` (its flops counter), so it stays that module."""
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda *a, **k: 0)
    if not hasattr(torch.cpu, "mem_get_info"):
        torch.cpu.mem_get_info = lambda *a, **k: (0, 0)  # type: ignore[attr-defined]
    if not hasattr(torch.cpu, "reset_peak_memory_stats"):
        torch.cpu.reset_peak_memory_stats = lambda *a, **k: None  # type: ignore[attr-defined]
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda *a, **k: None  # type: ignore[attr-defined]
    return torch.cpu


def install() -> None:
    """Register and select the CPU platform (idempotent)."""
    from verl.plugin.platform import platform_manager as pm
    from verl.plugin.platform.platform_base import PlatformBase

    if isinstance(pm._current_platform, PlatformBase) and pm._current_platform.device_name == "cpu":
        return

    class PlatformCPU(PlatformBase):
        """The host CPU as verl's accelerator (tests only)."""

        device_name = "cpu"  # type: ignore[assignment]
        vendor_name = "cpu"  # type: ignore[assignment]

        @property
        def device_module(self) -> ModuleType:
            return _cpu_module()

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    if pm.PlatformRegistry.get("cpu") is None:
        pm.PlatformRegistry.register(platform="cpu")(PlatformCPU)
    pm.set_platform(PlatformCPU())
