"""Stand-in for the GPU half of SGLang 0.5.23's weight routes; the scheduler half is SGLang's own code.

What a real scheduler does with ``/update_weights_from_disk``, ``/flush_cache`` and ``/weights_checker`` requests
runs here as SGLang wrote it, routed by the request types the scheduler's dispatcher maps to them
(``sglang/srt/managers/scheduler.py``):

* ``UpdateWeightFromDiskReqInput`` and ``CheckWeightsReqInput``: ``SchedulerWeightUpdaterManager.update_weights_from_disk``
  / ``.check_weights`` (``scheduler_components/weight_updater.py``: the runners' loop, the weight-version record,
  the flush after an update, the merge of the runners' checksums, the per-rank payload);
* ``FlushCacheReqInput``: ``SchedulerFlushWrapper.handle`` (``scheduler_components/flush_wrapper.py``);
* the per-tensor hashing: SGLang's ``WeightChecker`` (``sglang/srt/utils/weight_checker.py``), called as
  ``ModelRunner.check_weights`` calls it, over the runner's model.

Stood in for: the model runner (its model: the tiny MoE in transformers on CPU; its loader: the saved checkpoint
copied into that model in place, with a fault planted for the next reload: ``keep`` a tensor, ``perturb`` one,
``noop``), the radix cache's flush (nothing is cached), and the tensor-parallel group (one process: the caller
starts a single-process gloo group, a one-GPU scheduler's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.planted_reload import reload_with_fault

__all__ = ["StandInWeights"]


class StandInRunner:
    """The model runner's weight side: a CPU copy of the model, its in-place loader and its weight checker."""

    def __init__(self, model_dir: Path) -> None:
        import transformers
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.utils.weight_checker import WeightChecker

        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.fault: tuple[str, str] | None = None
        self.sessions: list[str] = []  # begin/end calls SGLang's manager made on this runner
        self.weight_updater = self  # ModelRunner.weight_updater.update_weights_from_disk(...)
        with get_parallel().override(tp_rank=0, pp_rank=0, dp_rank=0):  # the placement of a one-GPU scheduler
            self.checker = WeightChecker(get_model=lambda: self.model)

    def weight_update_runners(self) -> list[tuple[str, Any]]:
        """The tp worker's runners (the target model only)."""
        return [("target", self)]

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None,
        weight_name_filter: Any = None,
        recapture_cuda_graph: bool = False,
    ) -> tuple[bool, str]:
        """Copy every parameter of the checkpoint at ``model_path`` into the model, with the planted fault, if any."""
        fault, self.fault = self.fault, None
        reload_with_fault(self.model, model_path, fault)
        return True, "Succeeded to update model weights."

    def begin_weight_update(self) -> None:
        """A session opened: 0.5.23's runner restores in-place-packed weights (nothing is packed on CPU)."""
        self.sessions.append("begin")

    def end_weight_update(self, *, run_post_load: bool) -> None:
        """The session closed: 0.5.23's runner runs post_load_weights only when no load ran in it (P2P/RDMA)."""
        self.sessions.append(f"end(run_post_load={run_post_load})")

    def check_weights(
        self, action: str, allow_quant_error: bool = False, skip_tensor_list: list[str] | None = None, *, role: str
    ) -> Any:
        """What ``ModelRunner.check_weights`` does: its WeightChecker handles the action."""
        return self.checker.handle(
            action=action, allow_quant_error=allow_quant_error, skip_tensor_list=skip_tensor_list, role=role
        )


class StandInWeights:
    """Answers a scheduler's weight-route requests through SGLang's scheduler-side code over :class:`StandInRunner`."""

    def __init__(self, model_dir: Path) -> None:
        from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

        self.runner = StandInRunner(model_dir)
        self.versions: list[str | None] = []  # weight versions the scheduler recorded
        self.flush_ok = True  # False: the scheduler's flush is refused (requests running or queued)
        # SGLang's manager, its fields as the scheduler sets them (``tp_cpu_group``: the default group, one process)
        mgr = SchedulerWeightUpdaterManager.__new__(SchedulerWeightUpdaterManager)
        fields = {
            "tp_worker": self.runner,
            "draft_worker": None,
            "memory_saver_adapter": None,
            "flush_cache": self._flush,
            "is_fully_idle": lambda: True,
            "scheduler": self,
            "metrics_collector": None,
            "offload_tags": set(),
            "stashed_model_static_state": None,
            "_session": None,
            "tp_cpu_group": None,
        }
        for name, value in fields.items():
            setattr(mgr, name, value)
        self.manager = mgr
        self.flusher = SchedulerFlushWrapper(
            flush_cache=self._flush, is_fully_idle=lambda: True, send_output=lambda out, req: None
        )

    def _flush(self, empty_cache: bool = False) -> bool:
        """The radix cache's flush: nothing is cached; it succeeds unless a test set ``flush_ok`` False (what the
        scheduler's flush answers while requests are still running or queued)."""
        return self.flush_ok

    def record_weight_version_change(self, new_version: str | None = None) -> None:
        """The scheduler's weight-version record (called by SGLang's manager after a successful update)."""
        self.versions.append(new_version)

    def plant(self, kind: str, tensor: str = "") -> None:
        """A fault for the next reload: ``keep`` / ``perturb`` ``tensor``, or ``noop``."""
        assert kind in ("keep", "perturb", "noop"), kind
        self.runner.fault = (kind, tensor)

    def answer(self, obj: Any) -> Any | None:
        """The scheduler's reply to ``obj`` when it is a weight-route request, else None."""
        from sglang.srt.managers import io_struct

        if isinstance(obj, io_struct.UpdateWeightFromDiskReqInput):
            return self.manager.update_weights_from_disk(obj)
        if isinstance(obj, io_struct.CheckWeightsReqInput):
            return self.manager.check_weights(obj)
        if isinstance(obj, io_struct.FlushCacheReqInput):
            return self.flusher.handle(obj)
        if isinstance(obj, getattr(io_struct, "BeginWeightUpdateReqInput", ())):  # 0.5.23's session
            return self.manager.begin_weight_update(obj)
        if isinstance(obj, getattr(io_struct, "EndWeightUpdateReqInput", ())):
            return self.manager.end_weight_update(obj)
        return None
